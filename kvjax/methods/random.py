"""`random`: uniform random eviction, the floor every comparison table needs.

Each stored token gets a uniform score hashed from `(seed, layer, KV head, original position)`
(a counter-based hash, `token_uniform`), and each KV head keeps its `budget` best after
prefill. The draw does not depend on the batch, the slot or the chunking, so a run is
deterministic per seed and `vmap` over the batch equals a loop. Optional `sink_size` first
tokens and `window_size` most recent tokens are always kept (counted in the budget; a smaller budget keeps the
window first, then sinks, as `nacl`); both default to 0 (pure uniform eviction). Nothing is evicted during decoding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.common import token_uniform
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.select import protect_regions
from kvjax.validation import check_int

Array = jax.Array


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
        window = jnp.minimum(self.window_size, budget)  # never more than the budget (a small ratio budget), as nacl
        return protect_regions(cache, sink=jnp.minimum(self.sink_size, budget - window), recent=window, last=False)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        return token_uniform(self.seed, step.layer, cache.pos)
