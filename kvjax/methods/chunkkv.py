"""`chunkkv`: ChunkKV, "Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference" (Liu et
al., 2025, arXiv 2502.00299; kvpress's `ChunkKVPress`), around any scoring method (`base`, default SnapKV).

Token-level eviction keeps a subject and drops its verb. ChunkKV keeps whole chunks of `chunk_size` consecutive
positions (10, the paper's default; kvpress uses 20) instead of single tokens. Per layer, after the prompt has
attended:

1. Token scores come from the base method (SnapKV's pooled observation-window votes by default), per KV head.
2. A chunk's score is its tokens' scores summed over the KV heads and averaged over the chunk's tokens (the
   paper sums over the chunk; the average ranks full chunks the same and does not penalise a partial chunk, as
   kvpress). Chunks are aligned at position 0: chunk `i` holds positions `[i * c, (i + 1) * c)`.
3. The base's protected tokens (SnapKV's window) are kept and count against the budget; the best chunks (ties:
   lower position) fill the rest while whole chunks fit, so the cache keeps at most the budget. Every KV head
   keeps the same chunks (the paper's index selection acts on the sequence axis).

kvpress counts chunks instead of tokens (it keeps `int(n_chunks * (1 - ratio))` chunks, the window's chunks among
them, so it can keep up to a chunk less or more than the ratio); kvjax's count is the token budget, exact to
within one chunk.

Left out: the paper's layer-wise index reuse (a layer reusing the kept indices of the layer before it, to skip
its own scoring). It saves compute, not memory, and needs every layer's pre-compression slots to line up, which
kvjax's chunked prefill does not guarantee.

Chunked prefill (`chunk_size=`): each chunk compresses everything seen so far, as every scoring method does;
slots stay in position order, so chunks are still runs of consecutive positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.methods.base import Step
from kvjax.methods.common import ranked_chunks
from kvjax.methods.registry import register
from kvjax.methods.scorer import score_layer
from kvjax.methods.wrapper import ScorerWrapper
from kvjax.validation import check_int

Array = jax.Array

def _row_chunk_keep(total: Array, cand: Array, pos: Array, avail: Array, chunk: int) -> Array:
    """One example's kept candidate slots `[C]`: `total` `[C]` float32 head-summed scores, `cand` `[C]` bool."""
    c = total.shape[0]
    dense, size, _, order = ranked_chunks(cand, total, pos, chunk)
    # A chunk is kept when it and every better one fit.
    before = jnp.cumsum(size[order]) - size[order]  # slots of the better chunks
    fits_sorted = (size[order] > 0) & (before + size[order] <= avail)
    fits = jnp.zeros((c,), bool).at[order].set(fits_sorted)
    return cand & fits[dense]


def chunk_keep(scores: Array, cand: Array, pos: Array, avail: Array, chunk: int) -> Array:
    """`[B, K, C]` bool: the candidate slots (`cand`) of the best whole chunks of `chunk` positions, at most
    `avail` `[B]` slots, the same chunks in every head. Every head must hold the same positions in the same
    slots (a fresh prefill does, and so does a cache this selection compressed)."""
    total = jnp.sum(jnp.where(cand, scores, 0.0), axis=1)  # [B, C]
    row = jax.vmap(lambda t, m, p, a: _row_chunk_keep(t, m, p, a, chunk))
    keep = row(total, cand[:, 0], pos[:, 0], avail)
    return jnp.broadcast_to(keep[:, None], cand.shape) & cand


@register
@dataclasses.dataclass(frozen=True)
class ChunkKV(ScorerWrapper):
    """Whole chunks of `chunk_size` (10) positions, ranked by the base scorer's (`base`, "snapkv") mean score."""

    name = "chunkkv"

    chunk_size: int = 10

    def check_own_hyperparameters(self) -> None:
        check_int(self.name, "chunk_size", self.chunk_size, 1)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        scored = score_layer(self, cache, q, step)
        cache = scored.cache
        stored = kvc.stored_mask(cache)
        protect = jnp.zeros_like(stored) if scored.protect is None else scored.protect & stored
        avail = jnp.maximum(scored.budget - jnp.sum(protect[:, 0], axis=-1), 0)
        keep = chunk_keep(scored.scores.astype(jnp.float32), stored & ~protect, cache.pos, avail, self.chunk_size)
        return kvc.keep_where(cache, keep | protect, step.capacity)


__all__ = ["ChunkKV", "chunk_keep"]
