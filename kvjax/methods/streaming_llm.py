"""`streaming_llm`: attention sinks plus a rolling recent window (Xiao et al., 2023).

Keeps the first `sink_size` tokens and the most recent `budget - sink_size`, both after prefill and
at every decode step (the oldest non-sink token is evicted when the new one arrives). A ratio budget at most
`sink_size` (a short prompt's) keeps `budget - 1` sinks and the newest token: never more than the budget.

Positions are absolute by default (kvpress's convention: kept keys keep their RoPE position). With
`rerotate=True` the sinks are re-rotated so the cache looks contiguous to the query, as in the
StreamingLLM paper: the window already ends at the query, so only the sinks move, to the positions
just before the window's first token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Method, Step, last_position
from kvjax.methods.capabilities import AttentionObserver, InPlaceEviction, QueryHeadMask
from kvjax.methods.common import oldest_slot
from kvjax.methods.registry import register

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class StreamingLLM(Method, InPlaceEviction):
    """Sinks + recent window; `budget` (tokens) or `compression_ratio`, `sink_size` = 4."""

    name = "streaming_llm"

    sink_size: int = 4
    rerotate: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.compresses:
            raise ConfigError("streaming_llm: needs budget= (tokens) or compression_ratio=")
        if self.sink_size < 0:
            raise ConfigError(f"streaming_llm: sink_size must be >= 0, got {self.sink_size}")
        if self.budget is not None and self.budget <= self.sink_size:
            raise ConfigError(
                f"streaming_llm: budget={self.budget} must exceed sink_size={self.sink_size} "
                "(the recent window would be empty)"
            )

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        # The cache never holds more than the budget (a short prompt grows into it while decoding),
        # plus one slot for the token that arrives before the oldest one is evicted.
        if self.budget is not None:
            return min(self.budget, prompt_len + max_new_tokens) + 1
        return self.prompt_budget(prompt_len) + 1

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Array]:
        return {"sink_shift": jnp.zeros((spec.batch, spec.kv_heads), jnp.int32)} if self.rerotate else {}

    def _limit(self, step: Step) -> Array:
        """`[B]` tokens kept: the fixed budget (capped by the capacity), or the example's ratio budget."""
        if self.budget is not None:
            return jnp.full_like(step.budget, min(self.budget, step.capacity - 1))
        return step.budget

    def _sinks(self, step: Step) -> Array:
        """`[B, 1]` sinks kept: `sink_size`, less where a small ratio budget leaves no room for one recent token."""
        return jnp.minimum(self.sink_size, jnp.maximum(self._limit(step) - 1, 0))[:, None]

    def _window(self, step: Step) -> Array:
        return jnp.maximum(self._limit(step)[:, None] - self._sinks(step), 1)  # [B, 1]

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        newest = last_position(cache)
        keep = (cache.pos < self._sinks(step)[..., None]) | (cache.pos > (newest - self._window(step))[..., None])
        cache = kvc.keep_where(cache, keep, step.capacity)
        return self._rerotate(cache, step)

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        oldest, over = self.decode_eviction(cache, step)
        return self._rerotate(kvc.evict(cache, oldest, where=over), step)

    @property
    def evicts_in_place(self) -> bool:
        # Without re-rotation a step is: append, then evict the oldest non-sink token (a ring over the window).
        plain = type(self).decode is StreamingLLM.decode and not isinstance(self, QueryHeadMask | AttentionObserver)
        return plain and not self.rerotate

    def decode_eviction(self, cache: KVCache, step: Step) -> tuple[Array, Array]:
        """The oldest non-sink token, on heads holding more than the budget."""
        over = cache.length > self._limit(step)[:, None]
        return oldest_slot(cache, kvc.stored_mask(cache) & (cache.pos >= self._sinks(step)[..., None])), over

    def _rerotate(self, cache: KVCache, step: Step) -> KVCache:
        if not self.rerotate:
            return cache
        # Window tokens sit just before the query already; sinks move to just before the window.
        stored = kvc.stored_mask(cache)
        sinks = self._sinks(step)  # [B, 1]
        big = jnp.iinfo(jnp.int32).max
        window_start = jnp.min(jnp.where(stored & (cache.pos >= sinks[..., None]), cache.pos, big), axis=-1)
        window_start = jnp.where(window_start == big, sinks, window_start)  # [B, K]
        target_shift = window_start - sinks
        delta = target_shift - cache.state["sink_shift"]
        is_sink = (cache.pos >= 0) & (cache.pos < sinks[..., None])
        cache = kvc.rerotate(cache, jnp.where(is_sink, delta[..., None], 0), step.inv_freq)
        return cache.replace(state={**cache.state, "sink_shift": target_shift})
