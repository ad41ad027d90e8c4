"""`ScoringMethod`: the shared shape of one-shot eviction methods (SnapKV, PyramidKV, Knorm, ...).

After a prefill chunk has attended, every stored slot of the layer gets a score (higher = keep);
the method's protected slots (observation window, sinks) are always kept and count against the
budget; the rest of the budget goes to the best scores (ties: lower position), and the cache is
compacted into its budget-sized capacity. Decode keeps every new token (capacity = largest layer
budget + `max_new_tokens`), as the papers do.

A subclass supplies `scores` and, when it needs them, `protected` and `layer_budget`. Splitting
the hook this way lets wrappers such as `adakv` reuse any scorer with a different selection: every
selection (this class's top-k, Ada-KV's head budgets, ChunkKV's chunks, CriticalKV's two stages) starts
from `score_layer`, the one pass `before_scoring -> layer_budget -> protected -> scores`.

Chunked prefill: the hook runs after every chunk, so each chunk compresses everything seen so far
to the budget (scores from that chunk's queries). With one chunk (the default) this is exactly the
one-shot method of the papers. An example whose prompt ended in an earlier chunk has no queries in
a later one; it already fits its budget, so its cache is left as it is. Slots stay in position
order, so pooling along the slot axis (SnapKV) pools neighbouring kept tokens, which after an
earlier chunk's compression are no longer contiguous positions.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax

from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Method, Step
from kvjax.ops.gather import keep_top

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ScoringMethod(Method):
    """Base class: score, protect, keep the top `layer_budget` slots per KV head at prefill."""

    #: Whether `scores` reads the query row of every slot (query row `j` is slot `j`'s token: Compactor's chunked
    #: non-causal attention), not only the latest rows by position (SnapKV's window); `block` refuses such a base.
    reads_every_query_row: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.compresses:
            raise ConfigError(f"{self.name}: needs budget= (tokens) or compression_ratio=")

    # ---- what a subclass defines -------------------------------------------------------------
    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        """`[B, K, C]` float32 importance of each slot (only stored, unprotected slots matter)."""
        raise NotImplementedError

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array | None:
        """`[B, K, C]` bool slots always kept (counted in `budget`), or None."""
        return None

    def layer_budget(self, cache: KVCache, step: Step) -> Array:
        """`[B]` int32 slots per KV head this layer keeps (default: the example's budget)."""
        return step.budget

    def max_layer_budget(self, prompt_len: int) -> int:
        """Static upper bound of `layer_budget` over layers and examples (sizes the cache)."""
        return self.prompt_budget(prompt_len)

    def before_scoring(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """The cache the scores read, after the chunk attended (default: as is). A scorer with running statistics
        in `cache.state` (ExpectedAttention) updates them here; wrappers call it before `scores` too."""
        return cache

    # ---- the protocol --------------------------------------------------------------------------
    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.max_layer_budget(prompt_len) + max_new_tokens

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        s = score_layer(self, cache, q, step)
        return keep_top(s.cache, s.scores, s.budget, capacity=step.capacity, protect=s.protect)


class Scored(NamedTuple):
    """What a selection starts from (`score_layer`)."""

    cache: KVCache  # after `before_scoring`
    budget: Array  # [B] int32 slots per KV head this layer keeps (`layer_budget`)
    protect: Array | None  # [B, K, C] bool slots always kept, counted in `budget` (`protected`)
    scores: Array  # [B, K, C] float32 importance of each slot (`scores`)


def score_layer(scorer: ScoringMethod, cache: KVCache, q: Array, step: Step) -> Scored:
    """The scoring pass every selection runs first: `before_scoring`, then the layer's budget, the protected
    slots and the scores, each from `scorer` (a wrapper passes itself, or its `inner` to keep the base's budgets)."""
    cache = scorer.before_scoring(cache, q, step)
    budget = scorer.layer_budget(cache, step)
    protect = scorer.protected(cache, budget, step)
    return Scored(cache, budget, protect, scorer.scores(cache, q, step, protect))


__all__ = ["Scored", "ScoringMethod", "score_layer"]
