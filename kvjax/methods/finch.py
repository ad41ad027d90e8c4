"""`finch`: Finch, "Prompt-guided Key-Value Cache Compression for Large Language Models" (Corallo & Papotti,
TACL 2024; kvpress's `FinchPress`).

The prompt ends with the question; the question's attention picks which key-value pairs of the context to keep.
Per layer and KV head, after the prompt has attended:

1. Scores: each question row's causal softmax (float32) over every key, multiplied by the number of keys the row
   sees (the normalisation of the causal mask: a later row spreads the same mass over more keys, `normalize`),
   averaged over the question rows, then over the GQA group (`group_reduce`, mean as kvpress).
2. Selection: the question's own pairs are always kept and count against the budget; the rest goes to the best
   scores (ties: lower position). With `chunk_length`, the context (the prompt before the question) is cut into
   segments of that many positions, and a segment of `size` pairs keeps its best `floor(size * (budget - w) /
   (n - w))` (`w` question tokens of `n`): the paper's fixed share per chunk of the text, as it processes the
   text chunk by chunk. kvjax scores every segment from one forward, as kvpress does; kvpress's segments also
   hold the question, which fills its segment's quota first (and may crowd out its own tokens there).
3. RoPE re-rotation (`rerotate`, on as in kvpress): the kept keys are moved to contiguous positions ending just
   before the first new token (`key_rerotation.pack_positions`), so the compressed context reads as one text.

The question: kvjax does not mark where it starts. The last `window_size` prompt tokens are the question (kvpress
finds it with a delimiter token). Feed the question inside the prompt (the eval's `--query_aware`, or append it
to `input_ids`) and set `window_size` to its token count; the default 32 is SnapKV's observation window, what a
question plus a chat template's closing typically spans. An example whose budget is below the window keeps only
its last `budget` tokens.

Not ported: the paper's sequential pass that feeds the question after every chunk of the text and attends later
chunks to the already compressed cache (kvjax's `chunk_size=` prefill compresses each chunk with the chunk's
own last tokens as the window instead, as every scoring method does).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step, last_position
from kvjax.methods.common import pack_positions
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.scoring import GROUP_REDUCE, window_scores
from kvjax.ops.select import protect_regions
from kvjax.validation import check_choice, check_int

Array = jax.Array


def _row_quota_keep(scores: Array, cand: Array, pos: Array, budget: Array, total: Array, segment: int) -> Array:
    """One head's `segment_quota_keep` (`[C]` rows, `budget` and `total` scalars)."""
    c = scores.shape[0]
    seg = jnp.where(cand, pos // segment, jnp.iinfo(jnp.int32).max)
    slot = jnp.arange(c, dtype=jnp.int32)
    s_seg, _, _, s_slot = jax.lax.sort((seg, -scores, pos, slot), num_keys=3)  # by segment, best score, position
    index = jnp.arange(c, dtype=jnp.int32)
    opens = jnp.concatenate([jnp.ones((1,), bool), s_seg[1:] != s_seg[:-1]])
    dense = jnp.cumsum(opens.astype(jnp.int32)) - 1  # the segment's rank among the head's segments
    within = index - jax.lax.cummax(jnp.where(opens, index, 0))
    valid = s_seg != jnp.iinfo(jnp.int32).max
    size = jax.ops.segment_sum(valid.astype(jnp.int32), dense, num_segments=c)[dense]
    quota = size * budget // jnp.maximum(total, 1)
    return jnp.zeros((c,), bool).at[s_slot].set(valid & (within < quota))


def segment_quota_keep(scores: Array, cand: Array, pos: Array, budget: Array, segment: int) -> Array:
    """`[B, K, C]` bool: the candidate slots (`cand`) cut into segments of `segment` positions; a segment holding
    `size` candidates keeps its best `floor(size * budget / candidates)` by score (ties: lower position), so at
    most `budget` `[B, K]` in all."""
    total = jnp.sum(cand, axis=-1).astype(jnp.int32)
    budget = jnp.minimum(jnp.maximum(budget, 0), total)
    return jax.vmap(jax.vmap(functools.partial(_row_quota_keep, segment=segment)))(scores, cand, pos, budget, total)


@register
@dataclasses.dataclass(frozen=True)
class Finch(ScoringMethod):
    """The question's normalised attention, top-k, re-rotated: `window_size` 32 (the question's tokens),
    `normalize` True, `chunk_length` None (one selection over the prompt), `rerotate` True."""

    name = "finch"

    window_size: int = 32
    normalize: bool = True
    chunk_length: int | None = None
    rerotate: bool = True
    group_reduce: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "window_size", self.window_size, 1)
        if self.chunk_length is not None:
            check_int(self.name, "chunk_length", self.chunk_length, 1)
        for flag in ("normalize", "rerotate"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{self.name}: {flag} must be True or False, got {getattr(self, flag)!r}")
        check_choice(self.name, "group_reduce", self.group_reduce, tuple(g for g in GROUP_REDUCE if g))
        if self.budget is not None and self.window_size >= self.budget:
            raise ConfigError(
                f"{self.name}: window_size={self.window_size} must be smaller than budget={self.budget} "
                "(the budget counts the question)"
            )

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array:
        return protect_regions(cache, recent=jnp.minimum(self.window_size, budget), last=False)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        return window_scores(
            q, step.positions, kvc.keys(cache), cache.pos, kvc.stored_mask(cache), window=self.window_size,
            row_reduce="mean", group_reduce=self.group_reduce, weight_visible=self.normalize,
        )

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        seen = jnp.max(last_position(cache), axis=-1) + 1
        if self.chunk_length is None:
            out = super().prefill(cache, q, step)
        else:
            budget = self.layer_budget(cache, step)
            protect = self.protected(cache, budget, step)
            scores = self.scores(cache, q, step, protect)
            cand = kvc.stored_mask(cache) & ~protect
            room = budget[:, None] - jnp.sum(protect, axis=-1).astype(jnp.int32)  # [B, K] after the question
            keep = segment_quota_keep(scores, cand, cache.pos, room, self.chunk_length)
            out = kvc.keep_where(cache, keep | protect, step.capacity)
        if self.rerotate and step.final_chunk:
            out = pack_positions(out, seen, step.inv_freq)
        return out


__all__ = ["Finch", "segment_quota_keep"]
