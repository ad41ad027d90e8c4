"""`entropy_gated_chunkkv`: ChunkKV whose chunks are gated by the entropy of their token scores (kvpress 0.5.5's
`EntropyGatedChunkKVPress`, after Liu et al., *ChunkKV*, 2025, arXiv 2502.00299), around any scoring method
(`base`, default SnapKV).

ChunkKV keeps or drops whole chunks. A chunk that ranks high because of one token then spends `chunk_size` slots
on that token. The gate tells such chunks apart by how evenly the chunk's score is spread over its tokens. Per
layer, after the prompt has attended, with `s_j` the base's score of position `j` summed over the KV heads:

1. Chunks: positions `[i * c, (i + 1) * c)` (`c = chunk_size`, 10), aligned at position 0; the last may be partial.
   A chunk's score is the mean `m_i` of its `s_j`; its entropy is the normalised Shannon entropy of its scores
   as a distribution, after rebasing a chunk that holds a negative score at its minimum:
   `x_j = s_j - min(0, min_chunk s)`, `p_j = x_j / (sum_chunk x + eps)`,
   `H_i = clip(-sum_chunk p_j log(p_j + eps) / log(n_i), 0, 1)` with `n_i` the chunk's tokens and `eps = 1e-8`
   (`H_i = 0` for a one-token chunk).
2. Gate: a chunk with `m_i >= median(m)` and `H_i < median(H)` (medians over the layer's chunks; the lower middle
   value for an even count, as `torch.median`) is important but spiky and may keep only its best
   `low_entropy_chunk_length` (4) tokens; every other chunk may keep all of its tokens.
3. Greedy pass: chunks in decreasing `m_i` (ties: lower position) each take `min(allowance, budget left)` tokens,
   the best of the chunk by `s_j` (ties: lower position): a cumulative sum over the sorted allowances, no loop.
4. Top-up: what the gate freed and no chunk took goes to the best remaining tokens (a top-k over them), so exactly
   the budget is kept (kvpress counts `int(n * (1 - ratio))` tokens, as kvjax's `compression_ratio=`; kvpress's
   plain ChunkKV counts chunks instead). Every KV head keeps the same positions.

The base's protected tokens (SnapKV's window) are kept and count against the budget, as in `chunkkv`. They still
take part in the chunks' statistics (the medians, the chunk holding the window's first tokens) with the score
kvpress's SnapKV gives its window: the example's largest unprotected score plus one, in every head. The passes
then run over the unprotected tokens with what the protected ones leave (a chunk's allowance less its protected
tokens). kvpress's window chunks rank first and are kept whole too, but its window is not kept apart: when the
window does not start on a chunk boundary, the chunk holding its first tokens ranks high and, its score being
mostly the window's equal scores, is often spiky; kvpress then keeps only `low_entropy_chunk_length` of its tokens
and drops the other window tokens (torch's `topk` picks which among the equal ones). The default
`protected_tokens="kvpress"` does the same (protected tokens chosen as any other, ties to the lower position): the
press has no paper, so kvpress's code is its official form. `"kept"` keeps them all, as `chunkkv` does.

Defaults are kvpress's: `chunk_size=10` (its `chunk_length`; `chunkkv`'s default is the
paper's 10, kvpress's ChunkKV 20), `low_entropy_chunk_length=4`, SnapKV as the base (kvpress's SnapKV window is 64,
kvjax's 32: give `base_args={"window_size": 64}` for kvpress's). Where kvjax differs besides the window:

* Per example: kvpress decides from batch element 0 for the whole batch; kvjax decides for each example from its
  own scores and length (a batch equals a loop over its examples).
* Ties (equal chunk means, equal token scores) go to the lower position; torch's sorts leave them unspecified.
* Chunked prefill (`chunk_size=` of `generate`, not this method's): each prefill chunk compresses everything seen
  so far to the budget, as every scoring method does; chunks are still `position // c`, so a chunk cut by an
  earlier compression is a partial chunk, its entropy normalised by its own token count.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.chunkkv import ChunkKV
from kvjax.methods.common import ranked_chunks
from kvjax.methods.registry import register
from kvjax.methods.scorer import score_layer
from kvjax.validation import check_choice, check_int

Array = jax.Array

#: `protected_tokens`: the base's protected tokens competing in their chunks (kvpress, the default), or kept apart.
PROTECTED_TOKENS = ("kvpress", "kept")

#: kvpress's guard against `0 / 0` and `log 0` in the chunk entropy.
EPSILON = 1e-8

def _lower_median(x: Array, valid: Array) -> Array:
    """The lower middle value of `x` over `valid` (`torch.median`'s convention for an even count)."""
    n = jnp.sum(valid.astype(jnp.int32))
    ordered = jnp.sort(jnp.where(valid, x, jnp.inf))
    return ordered[jnp.maximum((n - 1) // 2, 0)]


def _rank_within(group: Array, keys: tuple[Array, ...]) -> Array:
    """`[C]` int32: each slot's rank inside its `group` (dense ids) when the group's slots are sorted by `keys`
    (ascending, lexicographic; the slot index breaks what remains tied)."""
    c = group.shape[0]
    slot = jnp.arange(c, dtype=jnp.int32)
    s_group, *_, s_slot = jax.lax.sort((group, *keys, slot), num_keys=len(keys) + 2)
    count = jax.ops.segment_sum(jnp.ones((c,), jnp.int32), group, num_segments=c)
    start = jnp.cumsum(count) - count
    return jnp.zeros((c,), jnp.int32).at[s_slot].set(slot - start[s_group])


def gated_chunk_keep_row(scores: Array, cand: Array, protect: Array, pos: Array, avail: Array, chunk: int,
                         low: int, keep_protected: bool = True) -> Array:
    """One example's kept slots `[C]` bool: `scores` `[K, C]` float32 per-head base scores, `cand` / `protect` `[C]`
    bool the unprotected / protected stored slots, `pos` `[C]` positions, `chunk` / `low` the chunk length and the
    spiky chunks' allowance. `keep_protected`: the protected slots are kept apart (the result marks candidates
    only) and `avail` is the budget they leave; else they compete in their chunks as kvpress's window does and
    `avail` is the whole budget."""
    c = cand.shape[0]
    member = cand | protect
    # The protected slots score as kvpress's SnapKV window: the largest unprotected score + 1, in every head.
    top = jnp.max(jnp.where(cand[None], scores, -jnp.inf))
    top = jnp.where(jnp.any(cand), top, 0.0)
    per_head = jnp.where(cand[None], scores, jnp.where(protect[None], top + 1.0, 0.0))
    total = jnp.where(member, jnp.sum(per_head, axis=0), 0.0)

    dense, size, mean, order = ranked_chunks(member, total, pos, chunk)  # order: by decreasing mean
    seg = dict(segment_ids=dense, num_segments=c)
    valid = size > 0
    # Entropy of the chunk's scores as a distribution (rebased at a negative minimum), normalised by log(size).
    low_score = jax.ops.segment_min(jnp.where(member, total, jnp.inf), **seg)
    x = jnp.where(member, total - jnp.minimum(low_score, 0.0)[dense], 0.0)
    p = x / (jax.ops.segment_sum(x, **seg)[dense] + EPSILON)
    h = -jax.ops.segment_sum(jnp.where(member, p * jnp.log(p + EPSILON), 0.0), **seg)
    norm = jnp.log(jnp.maximum(size, 2).astype(jnp.float32))
    entropy = jnp.where(size > 1, jnp.clip(h / norm, 0.0, 1.0), 0.0)

    # The gate: important (mean at or above the median) and spiky (entropy below the median).
    spiky = valid & (mean >= _lower_median(mean, valid)) & (entropy < _lower_median(entropy, valid))
    allowance = jnp.where(spiky, jnp.minimum(size, low), size)
    n_protected = jax.ops.segment_sum(protect.astype(jnp.int32), **seg)
    if not keep_protected:  # the protected slots are chosen as any other
        cand, n_protected = member, jnp.zeros_like(n_protected)
    cand_allowance = jnp.where(valid, jnp.maximum(allowance - n_protected, 0), 0)

    # Greedy pass: chunks by decreasing mean (ties: lower position), each takes min(allowance, budget left).
    wants = cand_allowance[order]
    taken = jnp.clip(avail - (jnp.cumsum(wants) - wants), 0, wants)
    take = jnp.zeros((c,), jnp.int32).at[order].set(taken)
    # Per token: a chunk's best candidates by score (ties: lower position).
    rank = _rank_within(dense, ((~cand).astype(jnp.int32), -total, pos))
    keep = cand & (rank < take[dense])

    # Top-up: the budget the gate freed goes to the best candidates left.
    left = jnp.maximum(avail - jnp.sum(take), 0)
    rest = cand & ~keep
    rank_rest = _rank_within(jnp.zeros((c,), jnp.int32), ((~rest).astype(jnp.int32), -total, pos))
    return keep | (rest & (rank_rest < left))


def gated_chunk_keep(scores: Array, cand: Array, protect: Array, pos: Array, avail: Array, chunk: int,
                     low: int, keep_protected: bool = True) -> Array:
    """`[B, K, C]` bool kept slots, the same positions in every head (`gated_chunk_keep_row` per example). Every
    head must hold the same positions in the same slots, as for `chunkkv`."""
    row = jax.vmap(lambda s, m, g, p, a: gated_chunk_keep_row(s, m, g, p, a, chunk, low, keep_protected))
    keep = row(scores, cand[:, 0], protect[:, 0], pos[:, 0], avail)
    return jnp.broadcast_to(keep[:, None], cand.shape) & (cand | protect)


@register
@dataclasses.dataclass(frozen=True)
class EntropyGatedChunkKV(ChunkKV):
    """ChunkKV over chunks of `chunk_size` (10) positions where important but spiky chunks keep only their best
    `low_entropy_chunk_length` (4) tokens and the budget they free goes to further chunks (`base`, "snapkv")."""

    name = "entropy_gated_chunkkv"

    low_entropy_chunk_length: int = 4
    protected_tokens: str = "kvpress"

    def check_own_hyperparameters(self) -> None:
        super().check_own_hyperparameters()
        check_int(self.name, "low_entropy_chunk_length", self.low_entropy_chunk_length, 1)
        check_choice(self.name, "protected_tokens", self.protected_tokens, PROTECTED_TOKENS)
        if self.low_entropy_chunk_length >= self.chunk_size:
            raise ConfigError(f"{self.name}: low_entropy_chunk_length={self.low_entropy_chunk_length} must be "
                              f"smaller than chunk_size={self.chunk_size}")

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        scored = score_layer(self, cache, q, step)
        cache = scored.cache
        stored = kvc.stored_mask(cache)
        protect = jnp.zeros_like(stored) if scored.protect is None else scored.protect & stored
        kept_apart = self.protected_tokens == "kept"
        avail = scored.budget - jnp.sum(protect[:, 0], axis=-1) if kept_apart else scored.budget
        keep = gated_chunk_keep(scored.scores.astype(jnp.float32), stored & ~protect, protect, cache.pos,
                                jnp.maximum(avail, 0), self.chunk_size, self.low_entropy_chunk_length, kept_apart)
        return kvc.keep_where(cache, keep | (protect & kept_apart), step.capacity)


__all__ = ["EntropyGatedChunkKV", "gated_chunk_keep", "gated_chunk_keep_row"]
