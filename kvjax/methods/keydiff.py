"""`keydiff`: KeyDiff, "Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (Park et al., 2025; kvpress's `KeyDiffPress`).

Keys that point away from the others are the distinctive ones, and the paper finds they are the ones attention
needs. With the anchor `a = (1 / n) sum_j k_j / ||k_j||` (the mean of the unit keys of a KV head, Section 3),
each key scores its dissimilarity `s_i = -cos(k_i, a)` and each KV head keeps its `budget` least similar keys.
No query or attention weight is read (any attention kernel works), nothing is protected, nothing is evicted
during decoding.

The paper compresses block by block as the prompt streams in (the cache never holds more than budget + block);
`block_size=N` does that (the prompt is prefilled in chunks of `N`, each chunk attends the compressed cache and
the cache is brought back to its budget with the anchor of what it then holds). The default `block_size=None`
is kvpress's one-shot `KeyDiffPress` (kvpress runs the paper's form as `BlockPress(KeyDiffPress)`, which
re-scores blocks after an uncompressed forward instead). Keys are compared post-RoPE, as both codes do.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.methods.base import Step
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.validation import check_int

Array = jax.Array


def key_dissimilarity(k: Array, valid: Array) -> Array:
    """`-cos(k_i, a)` `[B, K, C]` float32 with `a` the mean unit key of each head's `valid` slots (0 elsewhere)."""
    kf = k.astype(jnp.float32)
    unit = kf / jnp.maximum(jnp.linalg.norm(kf, axis=-1, keepdims=True), 1e-12)
    count = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1).astype(jnp.float32)
    anchor = jnp.sum(jnp.where(valid[..., None], unit, 0.0), axis=2) / count  # [B, K, H]
    cos = jnp.einsum("bkch,bkh->bkc", unit, anchor) / jnp.maximum(jnp.linalg.norm(anchor, axis=-1), 1e-8)[..., None]
    return jnp.where(valid, -cos, 0.0)


@register
@dataclasses.dataclass(frozen=True)
class KeyDiff(ScoringMethod):
    """Keep the keys least similar to the head's mean unit key; `block_size` (None: one shot, kvpress) streams
    the prompt in blocks as the paper."""

    name = "keydiff"

    block_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size is not None:
            check_int(self.name, "block_size", self.block_size, 1)

    def prefill_window(self) -> int | None:
        return self.block_size

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        return key_dissimilarity(cache.k, kvc.stored_mask(cache))
