"""`dms`: threshold eviction after Dynamic Memory Sparsification ("Inference-Time Hyper-Scaling with KV Cache
Compression", Łańcucki et al., 2025, arXiv 2506.05345;
kvpress's `DMSPress`), as a wrapper around any scoring method (`base`, default `kvzap`, the pairing KVzap
publishes).

DMS decides per pair, not per budget: a pair is evicted once it leaves a sliding window of the most recent
`sliding_window_size` tokens (128) if its score is below `threshold`; every other pair stays. Each KV head keeps
as many pairs as pass, so heads hold different lengths and the compression ratio follows the content. As in
kvpress (the dense-prefill form without DMS's trained evictors), each pair is scored once, when it enters the
cache (the base's `scores` over the layer, read at the new slots) and that score is kept with the pair in
`cache.score`; at prefill every prompt pair outside the window is judged at once, and with `decoding=True` (kvpress:
False) each decode step judges the one pair that leaves the window, `sliding_window_size` positions before the new
token, and evicts it in place (`kvjax.cache.evict`). The base's own protected slots (windows, sinks) play no part:
DMS's window is the only protection.

Storage: the per-head counts are stored, not masked. Each head's kept pairs are compacted to the front of its
slots and `length[b, k]` holds its own count (what the attention ops and the ragged decode kernel read), as
`adakv` stores its head budgets. The static capacity is `budget` (or `compression_ratio` of the prompt) plus the
new tokens: a cap no head exceeds (a head with more pairs above the threshold keeps its best-scored ones and its
window). Without a budget the capacity is the whole prompt, since the threshold may keep everything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step, last_position
from kvjax.methods.common import new_slots
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.methods.wrapper import Wrapper
from kvjax.ops import select
from kvjax.ops.gather import keep_top
from kvjax.validation import check_bool, check_int, check_number

Array = jax.Array


def record_entry_scores(inner: ScoringMethod, cache: KVCache, q: Array, step: Step) -> KVCache:
    """The base's scores of the step's new tokens, kept with them in `cache.score` (older slots keep theirs)."""
    cache = inner.before_scoring(cache, q, step)
    scores = inner.scores(cache, q, step, None)
    return cache.replace(score=jnp.where(new_slots(cache, step.positions), scores, cache.score))


@register
@dataclasses.dataclass(frozen=True)
class DMS(Wrapper):
    """Evict pairs scoring below `threshold` once they leave the last `sliding_window_size` (128) tokens:
    `base` ("kvzap"), `base_args`, `threshold` (required), `decoding` (False: prefill only, as kvpress)."""

    name = "dms"
    uses_score = True

    base: str = "kvzap"
    base_args: Any = ()
    threshold: float | None = None
    sliding_window_size: int = 128
    decoding: bool = False

    def check_own_hyperparameters(self) -> None:
        check_number(self.name, "threshold (pairs scoring below it are evicted)", self.threshold)
        check_int(self.name, "sliding_window_size", self.sliding_window_size, 0)
        check_bool(self.name, "decoding", self.decoding)

    def inner_budget(self) -> tuple[int | None, float | None]:
        """The base only scores: it is built keeping everything (its budget plays no part)."""
        return None, 0.0

    def check_base(self, inner: ScoringMethod) -> None:
        if inner.uses_score and type(inner).before_scoring is ScoringMethod.before_scoring:
            raise ConfigError(f"{self.name}: base {self.base!r} keeps its own per-slot scores, which DMS's entry "
                              "scores would overwrite; choose a scorer without them")

    @property
    def decode_appends_only(self) -> bool:
        return not self.decoding

    def in_window(self, cache: KVCache, newest: Array) -> Array:
        """`[B, K, C]` stored slots within `sliding_window_size` positions of `newest` (`[B, K]`, inclusive)."""
        return kvc.stored_mask(cache) & (cache.pos > newest[..., None] - self.sliding_window_size)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        cache = record_entry_scores(self.inner, cache, q, step)
        stored = kvc.stored_mask(cache)
        window = self.in_window(cache, last_position(cache))
        keep = stored & (window | (cache.score >= self.threshold))
        count = jnp.sum(keep, axis=-1).astype(jnp.int32)  # [B, K]: each head's own length
        per_head = jnp.minimum(count, jnp.minimum(step.budget[:, None], step.capacity))
        ranked = jnp.where(keep, cache.score, jnp.finfo(jnp.float32).min)
        return keep_top(cache, ranked, per_head, capacity=step.capacity, protect=window)

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        cache = record_entry_scores(self.inner, cache, q, step)
        if not self.decoding:
            return cache
        newest = step.positions[:, 0]  # [B]
        leaving = kvc.stored_mask(cache) & (cache.pos == (newest - self.sliding_window_size)[:, None, None])
        drop = leaving & (cache.score < self.threshold) & (newest >= 0)[:, None, None]
        slot = select.argmax(drop)
        return kvc.evict(cache, slot, jnp.any(drop, axis=-1))


__all__ = ["DMS", "record_entry_scores"]
