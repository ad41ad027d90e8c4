"""A tiny random kvjax model for runtime and method tests (no torch needed)."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from kvjax.models.config import ModelConfig, RopeConfig
from kvjax.models.model import DecoderLM


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0), max_position_embeddings=4096, eos_token_ids=(),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@functools.lru_cache(maxsize=8)
def tiny_model(seed: int = 0, dtype=jnp.float32, **overrides) -> DecoderLM:
    # A larger init scale than 0.02 makes attention non-uniform, so eviction changes outputs.
    return DecoderLM.random(tiny_config(**overrides), seed=seed, dtype=dtype, scale=0.3)
