"""The plain forward of the decoder (no cache): full-sequence logits, for parity with Hugging Face and training.

The families (Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 3, Phi-3 / Phi-4) differ only in config flags
handled by the one decoder block (`kvjax.models.block`): biases, QK-norm, Gemma's norms, embedding scale and
GELU MLP, tied embeddings, sliding windows per layer (Mistral, Phi-3: every layer; Gemma 3: its local layers,
with their own RoPE base), RoPE scaling. Generation with a compressed cache composes the same block with the
runtime's per-layer cache step (`kvjax.runtime.forward`).
"""

from __future__ import annotations

from typing import Any

import jax

from kvjax.models import block

Array = jax.Array


def forward(
    config: Any, weights: dict, rope: Any, tokens: Array, positions: Array, attention: Any = None,
) -> Array:
    """Full-sequence logits `[B, T, V]` (float32) with causal attention and no cache.

    `rope`: `block.Ropes` (or one `(inv_freq, scaling)` pair for every layer). `attention(q, k, v, valid)` (`q`
    `[B, T, N, H]`, `k`/`v` `[B, T, K, H]`, `valid` `[B, T]`) replaces the blockwise prefill attention of the
    layers without a window (training uses a tiled one that is cheaper to differentiate).
    """
    valid = positions >= 0
    x = block.embed(config, weights, tokens)
    for i, lw in enumerate(weights["layers"]):
        window = config.layer_window(i)

        def attend(q: Array, k: Array, v: Array, window: int | None = window) -> tuple[Array, None]:
            if attention is not None and window is None:
                return attention(q, k, v, valid), None
            return block.self_attention(q, k, v, positions, sliding_window=window), None

        x, _ = block.decoder_block(config, lw, x, positions, block.layer_rope(config, rope, i), attend)
    return block.logits(config, weights, x)
