"""`ScoringMethod`: the shared shape of one-shot eviction methods (SnapKV, PyramidKV, Knorm, ...).

After a prefill chunk has attended, every stored slot of the layer gets a score (higher = keep);
the method's protected slots (observation window, sinks) are always kept and count against the
budget; the rest of the budget goes to the best scores (ties: lower position), and the cache is
compacted into its budget-sized capacity. Decode keeps every new token (capacity = largest layer
budget + `max_new_tokens`), as the papers do.

A subclass supplies `scores` and, when it needs them, `protected` and `layer_budget`. Splitting
the hook this way lets wrappers such as `adakv` reuse any scorer with a different selection.

Chunked prefill: the hook runs after every chunk, so each chunk compresses everything seen so far
to the budget (scores from that chunk's queries). With one chunk (the default) this is exactly the
one-shot method of the papers. An example whose prompt ended in an earlier chunk has no queries in
a later one; it already fits its budget, so its cache is left as it is. Slots stay in position
order, so pooling along the slot axis (SnapKV) pools neighbouring kept tokens, which after an
earlier chunk's compression are no longer contiguous positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Method, Step
from kvjax.ops.gather import keep_top

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ScoringMethod(Method):
    """Base class: score, protect, keep the top `layer_budget` slots per KV head at prefill."""

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
        cache = self.before_scoring(cache, q, step)
        budget = self.layer_budget(cache, step)
        protect = self.protected(cache, budget, step)
        scores = self.scores(cache, q, step, protect)
        return keep_top(cache, scores, budget, capacity=step.capacity, protect=protect)


def stored_tokens(cache: KVCache) -> Array:
    """`[B]` int32 tokens held per example (the largest head length)."""
    return jnp.max(cache.length, axis=-1).astype(jnp.int32)


def check_int(method: str, name: str, value: object, minimum: int) -> None:
    """Raises a ConfigError naming `name` unless `value` is an int >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{method}: {name} must be an integer >= {minimum}, got {value!r}")


def check_choice(method: str, name: str, value: object, choices: tuple) -> None:
    """Raises a ConfigError naming `name` unless `value` is one of `choices`."""
    if value not in choices:
        raise ConfigError(f"{method}: {name} must be one of {list(choices)}, got {value!r}")


__all__ = ["ScoringMethod", "check_choice", "check_int", "stored_tokens"]
