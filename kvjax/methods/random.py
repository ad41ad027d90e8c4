"""`random`: uniform random eviction, the floor every comparison table needs.

Each stored token gets a uniform score hashed from `(seed, layer, KV head, original position)`
(a counter-based hash, `token_uniform`), and each KV head keeps its `budget` best after
prefill. The draw does not depend on the batch, the slot or the chunking, so a run is
deterministic per seed and `vmap` over the batch equals a loop. Optional `sink_size` first
tokens and `window_size` most recent tokens are always kept (counted in the budget); both default
to 0 (pure uniform eviction). Nothing is evicted during decoding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod, check_int
from kvjax.ops.select import protect_regions

Array = jax.Array


def _mix(x: Array) -> Array:
    """MurmurHash3's 32-bit finaliser: a bijective avalanche of a uint32."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def token_uniform(seed: int, layer: Array, positions: Array) -> Array:
    """`[B, K, C]` float32 uniforms in [0, 1) hashed from (seed, layer, KV head, position).

    A counter-based hash (chained MurmurHash3 finalisers), so the draw of a token depends on
    nothing else: not the batch, the slot, nor the chunking.
    """
    heads = jnp.arange(positions.shape[1], dtype=jnp.uint32)[None, :, None]
    h = _mix(jnp.uint32(seed & 0xFFFFFFFF) ^ jnp.uint32(0x9E3779B9))
    h = _mix(h ^ jnp.asarray(layer).astype(jnp.uint32))
    h = _mix(h ^ heads)
    h = _mix(h ^ jnp.maximum(positions, 0).astype(jnp.uint32))
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


@register
@dataclasses.dataclass(frozen=True)
class RandomEviction(ScoringMethod):
    """Seeded uniform eviction; optional sinks / recent window (`sink_size`, `window_size`)."""

    name = "random"

    seed: int = 0
    sink_size: int = 0
    window_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "seed", self.seed, 0)
        check_int(self.name, "sink_size", self.sink_size, 0)
        check_int(self.name, "window_size", self.window_size, 0)
        if self.budget is not None and self.sink_size + self.window_size >= self.budget:
            raise ConfigError(
                f"{self.name}: sink_size + window_size = {self.sink_size + self.window_size} must be "
                f"smaller than budget={self.budget}"
            )

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array | None:
        if self.sink_size == 0 and self.window_size == 0:
            return None
        return protect_regions(cache, sink=self.sink_size, recent=self.window_size, last=False)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        return token_uniform(self.seed, step.layer, cache.pos)
