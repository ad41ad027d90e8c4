"""`finch`: Finch, "Prompt-guided Key-Value Cache Compression for Large Language Models" (Corallo & Papotti,
TACL 2024; kvpress's `FinchPress`).

The prompt ends with the question; the question's attention picks which key-value pairs of the context to keep.
Per layer and KV head, after the prompt has attended:

1. Scores: each question row's causal softmax (float32) over every key, multiplied by the number of keys the row
   sees (the normalisation of the causal mask: a later row spreads the same mass over more keys, `normalize`),
   averaged over the question rows, then over the GQA group (`group_reduce`, mean as kvpress).
2. Selection: the question's own pairs are always kept and count against the budget; the rest goes to the best
   scores (ties: lower position). With `chunk_length`, the context is cut into segments of that many positions
   and each keeps `floor(length * budget / n)` pairs by the same scores (the question's pairs fill their segment's
   quota first): the per-chunk quota of the paper, which processes the text chunk by chunk (kvpress's chunked
   form; kvjax scores every chunk from one forward, as kvpress does).
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
from kvjax.methods.key_rerotation import pack_positions
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod, check_choice, check_int, stored_tokens
from kvjax.ops.gather import keep_top
from kvjax.ops.scoring import GROUP_REDUCE, window_scores
from kvjax.ops.select import protect_regions

Array = jax.Array


def _row_quota_keep(scores: Array, stored: Array, protect: Array, pos: Array, fraction: Array,
                    segment: int) -> Array:
    """One head's `segment_quota_keep` (`[C]` rows, `fraction` a scalar)."""
    c = scores.shape[0]
    seg = jnp.where(stored, pos // segment, jnp.iinfo(jnp.int32).max)
    slot = jnp.arange(c, dtype=jnp.int32)
    # Sorted by segment, protected first, then best score, then lower position.
    s_seg, _, _, s_prot, s_slot = jax.lax.sort(
        (seg, (~protect).astype(jnp.int32), -scores, protect, slot), num_keys=4)
    index = jnp.arange(c, dtype=jnp.int32)
    opens = jnp.concatenate([jnp.ones((1,), bool), s_seg[1:] != s_seg[:-1]])
    dense = jnp.cumsum(opens.astype(jnp.int32)) - 1  # the segment's rank among the head's segments
    within = index - jax.lax.cummax(jnp.where(opens, index, 0))
    valid = s_seg != jnp.iinfo(jnp.int32).max
    size = jax.ops.segment_sum(valid.astype(jnp.int32), dense, num_segments=c)[dense]
    quota = jnp.floor(size.astype(jnp.float32) * fraction).astype(jnp.int32)
    kept = valid & (s_prot | (within < quota))
    return jnp.zeros((c,), bool).at[s_slot].set(kept)


def segment_quota_keep(scores: Array, stored: Array, protect: Array, pos: Array, fraction: Array,
                       segment: int) -> Array:
    """`[B, K, C]` bool: per segment of `segment` positions, the best `floor(size * fraction)` slots by score
    (`fraction` `[B]`; protected slots first and always, ties: lower position)."""
    fraction = jnp.broadcast_to(fraction[:, None], scores.shape[:2])
    row = functools.partial(_row_quota_keep, segment=segment)
    return jax.vmap(jax.vmap(row))(scores, stored, protect, pos, fraction)


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
            if self.chunk_length <= self.window_size:
                raise ConfigError(f"{self.name}: chunk_length={self.chunk_length} must exceed window_size="
                                  f"{self.window_size} (the question fills its segment's quota first)")
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
            stored = kvc.stored_mask(cache)
            fraction = budget.astype(jnp.float32) / jnp.maximum(stored_tokens(cache), 1).astype(jnp.float32)
            keep = segment_quota_keep(scores, stored, protect, cache.pos, jnp.minimum(fraction, 1.0),
                                      self.chunk_length)
            kept = jnp.sum(keep, axis=-1).astype(jnp.int32)
            out = keep_top(cache, jnp.where(keep, scores, -jnp.inf), kept, capacity=step.capacity, protect=protect)
        if self.rerotate and step.final_chunk:
            out = pack_positions(out, seen, step.inv_freq)
        return out


__all__ = ["Finch", "segment_quota_keep"]
