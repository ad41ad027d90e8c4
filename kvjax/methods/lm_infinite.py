"""`lm_infinite`: LM-Infinite, "Zero-Shot Extreme Length Generalization for Large Language Models"
(Han et al., NAACL 2024): Lambda-shaped attention with a distance ceiling.

Each query attends two branches of one softmax: the `n_global` leading tokens and a local window of
the `n_local` most recent tokens (itself included). Relative distances are capped: a key further
than `max_distance` from the query is seen at distance `max_distance`, so the far-away global
tokens never show RoPE angles the model has not been trained on. Everything else is never attended
again, so it is evicted: the cache holds `budget = n_global + n_local` tokens (capacity `budget + 1`,
the newest token enters before the oldest local one leaves), like `streaming_llm`. A ratio budget at most
`n_global` (a short prompt's) keeps `budget - 1` global tokens and a local window of one.

Distance cap, in a cache of post-RoPE keys: before the query at position `r` attends, every global
key at original position `p` is rotated (`rope.rotate_by`) to position `max(p, r - max_distance)`.
Its rotation is always taken from a clean copy kept in `state["sink_k"]` (the key at its original
position), so a long generation does not accumulate bf16 rounding step after step
(`state["rot_ref"]` is the query position the cache is rotated for). Local keys are within
`n_local - 1 <= max_distance` and keep their exact positions. The global tokens occupy the first
slots of every head (prefill keeps slots in position order and decode never evicts them), which is
where the copy is read.

Defaults follow the LM-Infinite baseline ActQKV compares against (numbers from InfLLM's setup):
InfLLM's `infinite-lm` configs keep `n_init = 128` global tokens, and its implementation rotates
every global key as if it sat `n_local - 1` before the query (the query at a fixed position, the keys
un-rotated): `max_distance=None` means `n_local - 1`, which is exactly `min(r - p, n_local - 1)`.
The paper's own ceiling is the pre-training length; pass it as `max_distance` (it must be at least
`n_local - 1`). The optional top-k middle tokens of later versions are not implemented.

Prefill attends the whole chunk as the runtime does (the first generated token comes from an
uncompressed prefill, as the other methods); the cache is then cut to global + local and rotated for
the next query. With `chunk_size <= n_local`, each chunk sees the global tokens (capped) and the
local window, close to the paper's Lambda-shaped prefill.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Method, Step, last_position
from kvjax.methods.common import cache_limit, oldest_slot, rolling_capacity
from kvjax.methods.registry import register
from kvjax.rope import rotate_by
from kvjax.validation import check_int

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class LMInfinite(Method):
    """`n_global` (128) leading tokens + a local window of `budget - n_global`, global keys seen at
    distance at most `max_distance` (default `n_local - 1`)."""

    name = "lm_infinite"

    n_global: int = 128
    max_distance: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.compresses:
            raise ConfigError(f"{self.name}: needs budget= (n_global + n_local tokens) or compression_ratio=")
        check_int(self.name, "n_global", self.n_global, 0)
        if self.max_distance is not None:
            check_int(self.name, "max_distance", self.max_distance, 1)
        if self.budget is not None:
            if self.budget <= self.n_global:
                raise ConfigError(
                    f"{self.name}: budget={self.budget} must exceed n_global={self.n_global} "
                    "(the budget counts the global tokens; the local window would be empty): pass a smaller "
                    "n_global (e.g. n_global=4) for small budgets"
                )
            n_local = self.budget - self.n_global
            if self.max_distance is not None and self.max_distance < n_local - 1:
                raise ConfigError(
                    f"{self.name}: max_distance={self.max_distance} must be at least n_local - 1 = {n_local - 1} "
                    f"(n_local = budget - n_global): local keys keep their exact distances"
                )

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return rolling_capacity(self, prompt_len, max_new_tokens)

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Array]:
        if self.n_global == 0:
            return {}
        sinks = min(self.n_global, spec.capacity)
        return {
            "sink_k": jnp.zeros((spec.batch, spec.kv_heads, sinks, spec.head_dim), spec.dtype),
            "rot_ref": jnp.full((spec.batch, spec.kv_heads), -1, jnp.int32),
        }

    def n_global_kept(self, limit: Array) -> Array:
        """Global tokens kept under a cache limit: `n_global`, less where a small ratio budget leaves no room for
        one local token (the limit counts both)."""
        return jnp.minimum(self.n_global, jnp.maximum(limit - 1, 0))

    def n_local(self, limit: Array) -> Array:
        return jnp.maximum(limit - self.n_global_kept(limit), 1)

    def ceiling(self, limit: Array) -> Array:
        """The distance cap for a cache limit (at least `n_local - 1`)."""
        local = self.n_local(limit) - 1
        return local if self.max_distance is None else jnp.maximum(self.max_distance, local)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        limit = cache_limit(self, step)[:, None]  # [B, 1]
        newest = last_position(cache)  # [B, K]
        keep = (cache.pos < self.n_global_kept(limit)[..., None]) | \
            (cache.pos > (newest - self.n_local(limit))[..., None])
        cache = kvc.keep_where(cache, keep, step.capacity)
        return self._cap_distance(cache, newest + 1, limit, step)

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        limit = cache_limit(self, step)[:, None]
        local = kvc.stored_mask(cache) & (cache.pos >= self.n_global_kept(limit)[..., None])
        oldest = oldest_slot(cache, local)
        cache = kvc.evict(cache, oldest, where=(cache.length > limit) & jnp.any(local, axis=-1))
        query = jnp.broadcast_to(step.positions[:, :1], cache.length.shape)
        return self._cap_distance(cache, query, limit, step)

    def _cap_distance(self, cache: KVCache, query: Array, limit: Array, step: Step) -> KVCache:
        """Rotates the global keys in the first slots for a query at `query` `[B, K]`."""
        if self.n_global == 0:
            return cache
        # The clean copies were sized at the prefill's capacity; question tokens appended after compression
        # (`kvc.extend`) widen the cache but not this state. Only a cache below `n_global` slots (a budget under
        # n_global) has global slots past it, and those hold the newest tokens, which the ceiling has not moved.
        g = min(self.n_global, cache.capacity, cache.state["sink_k"].shape[2] if "sink_k" in cache.state else
                cache.capacity)
        b, kv = cache.length.shape
        keys, pos = kvc.keys(cache)[:, :, :g], cache.pos[:, :, :g]
        held = jnp.arange(g) < cache.length[..., None]
        is_global = (pos >= 0) & (pos < self.n_global_kept(limit)[..., None]) & held
        ceiling = self.ceiling(limit)  # [B, 1]
        ref = cache.state.get("rot_ref", jnp.full((b, kv), -1, jnp.int32))
        clean = cache.state.get("sink_k", jnp.zeros_like(keys))
        # A key is still at its original rotation until the ceiling first moved it.
        unmoved = is_global & (pos >= (ref - ceiling)[..., None])
        clean = jnp.where(unmoved[..., None], keys, clean)
        shift = jnp.where(is_global, jnp.maximum((query - ceiling)[..., None] - pos, 0), 0)
        rotated = jnp.where(is_global[..., None], rotate_by(clean, shift, step.inv_freq), keys)
        all_keys = kvc.keys(cache)
        k = jax.lax.dynamic_update_slice_in_dim(all_keys, rotated.astype(all_keys.dtype), 0, axis=2)
        cache = kvc.with_keys(cache, k)  # a quantized cache requantizes only what moved
        return cache.replace(state={**cache.state, "sink_k": clean, "rot_ref": query.astype(jnp.int32)})
