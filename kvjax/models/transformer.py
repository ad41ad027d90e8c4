"""The plain forward of the decoder (no cache): full-sequence logits, for parity with Hugging Face and training.

The families (Llama 2/3/3.x, Mistral, Qwen2/2.5) differ only in config flags handled by the one decoder block
(`kvjax.models.block`): q/k/v biases (Qwen2), o / MLP biases (Llama `attention_bias` / `mlp_bias`), tied
embeddings, sliding window (Mistral v0.1), RoPE scaling. Generation with a compressed cache composes the same
block with the runtime's per-layer cache step (`kvjax.runtime.forward`).
"""

from __future__ import annotations

from typing import Any

import jax

from kvjax.models import block

Array = jax.Array


def forward(
    config: Any, weights: dict, rope: tuple[Array, float], tokens: Array, positions: Array, attention: Any = None,
) -> Array:
    """Full-sequence logits `[B, T, V]` (float32) with causal attention and no cache.

    `attention(q, k, v, valid)` (`q` `[B, T, N, H]`, `k`/`v` `[B, T, K, H]`, `valid` `[B, T]`) replaces the
    blockwise prefill attention (training uses a tiled one that is cheaper to differentiate).
    """
    valid = positions >= 0

    def attend(q: Array, k: Array, v: Array) -> tuple[Array, None]:
        if attention is not None:
            return attention(q, k, v, valid), None
        return block.self_attention(q, k, v, positions, sliding_window=config.sliding_window), None

    x = block.embed(weights, tokens)
    for lw in weights["layers"]:
        x, _ = block.decoder_block(config, lw, x, positions, rope, attend)
    return block.logits(config, weights, x)
