"""A tiny random kvjax model for runtime and method tests (no torch needed), and helpers to compare its outputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

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


def tiny_gemma3(num_layers: int = 2, window: int = 8, **overrides) -> DecoderLM:
    """A tiny Gemma-3-style model: local layers of window `window` (RoPE base 1e4) then a global one (base 1e6),
    QK-norm, Gemma's norms, GELU MLP, embedding scale, a query scalar other than head_dim."""
    types = ("sliding_attention",) * (num_layers - 1) + ("full_attention",)
    fields = dict(model_type="gemma3_text", num_layers=num_layers, sliding_window=window, layer_types=types,
                  rope=RopeConfig(theta=1e6), rope_local=RopeConfig(theta=1e4), query_pre_attn_scalar=12.0)
    fields.update(overrides)
    return tiny_model(**fields)


def random_prompts(seed: int, lengths: tuple[int, ...], vocab: int = 96) -> list[list[int]]:
    """One random token list per length (ids below the tiny model's vocabulary)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def assert_trees_equal(a, b) -> None:
    """Same pytree structure and every leaf bit for bit."""
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_caches_close(a, b, *, tol: float, name: str = "") -> None:
    """Same structure; integer leaves (positions, lengths, masks) exact, float leaves within `tol`."""
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b, name
    for x, y in zip(leaves_a, leaves_b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=tol, atol=tol, err_msg=name)
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)


def full_disk_during(monkeypatch, owner, name: str, limit: int = 4096) -> None:
    """Files written while `owner.name` runs fail past `limit` bytes as on a full disk: a real EFBIG from the OS (a
    file-size limit, SIGXFSZ ignored), held only during that call."""
    import resource
    import signal

    real = getattr(owner, name)

    def limited(*args, **kwargs):
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            return real(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)

    monkeypatch.setattr(owner, name, limited)


def full_disk_for_safetensors(monkeypatch, limit: int = 4096) -> None:
    """`full_disk_during` for safetensors' file writes (`safetensors.numpy.save_file`)."""
    import safetensors.numpy

    full_disk_during(monkeypatch, safetensors.numpy, "save_file", limit)
