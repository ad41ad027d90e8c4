"""`adakv`: Ada-KV, "Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference" (Feng et al., 2024), as a wrapper around any scoring method (`base`, default SnapKV).

Uniform eviction gives every head of a layer the same budget `B`. Ada-KV (Section 4) keeps the
layer's total `K * B` but lets heads compete for it: the best scores across all KV heads of the
layer decide how many slots each head gets, so heads whose attention is concentrated give budget to
heads whose attention is spread. A safeguard `floor` (alpha, 0.2) keeps uniform allocation from
being abandoned entirely: each head first keeps its best `alpha * (B - W)` candidates, then the
rest of the layer's `K * (B - W)` goes to the best remaining candidates across heads (ties: lower
position, then lower head); every head also keeps its `W` protected tokens (SnapKV's window). The
scores are the base method's (SnapKV's pooled window votes carry the same probability mass in every
head, so they compare across heads). `alpha = 1` is the base method itself. The official code
approximates the safeguard by blending the counts of an unguarded top-k, `(1 - alpha) * c + alpha *
(B - W)`; the form here follows the paper's description, keeps the total exact, and is idempotent
(re-running it on a compressed cache, as chunked prefill does, keeps the cache).

Memory, and why this layout. kvpress implements Ada-KV by masking evicted keys in a full-length
cache (no memory saved); the official code and KVCache-Factory use a flattened variable-length
cache with CUDA kernels, batch 1 only. kvjax keeps its `[B, K, C, H]` layout (the attention ops and
the ragged decode kernel take per-head lengths) and sizes it at a static per-head cap:

    C = min(ceil(B * max_head_share), prompt_len) + max_new_tokens

Each head holds its own adaptive count (`length[b, k]`, summing to `K * B` per example and layer);
a head that would exceed the cap is held at the cap and its overflow goes to the next-best tokens of
the other heads (the capped cross-head top-k, which is the best allocation under the cap). With the
default `max_head_share = 2` the cache costs twice a uniform cache of the same budget, and
`prompt_len / (2 * B)` times less than the uncompressed (or masked) cache: for a 32K prompt at
`B = 1024`, 2048 slots per head instead of 32768. `max_head_share = 1` gives the memory of uniform
SnapKV with adaptivity only below the budget; larger shares approach the uncapped algorithm.
Flattening heads into one `[B, K * B]` pool would be exact in memory but needs a head id per slot
and either `K` times the attention compute or a varlen kernel, so it is not the default layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Method, Step
from kvjax.methods.registry import get, method_class, register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.gather import keep_top
from kvjax.ops.select import adaptive_head_budgets

Array = jax.Array


def head_cap(budget: Any, share: float) -> Any:
    """`ceil(budget * share)` in float32, identically on host (static capacity) and in a trace."""
    if isinstance(budget, int | np.integer):
        return int(np.ceil(np.float32(budget) * np.float32(share)))
    return jnp.ceil(budget.astype(jnp.float32) * jnp.float32(share)).astype(jnp.int32)


@register
@dataclasses.dataclass(frozen=True)
class AdaKV(Method):
    """Head-adaptive budgets over a scoring method: `base` ("snapkv"), `floor` (alpha, 0.2),
    `max_head_share` (2.0, per-head cap in units of the budget), `base_args` (the base's
    hyperparameters as a dict)."""

    name = "adakv"

    base: str = "snapkv"
    floor: float = 0.2
    max_head_share: float = 2.0
    base_args: Any = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.compresses:
            raise ConfigError(f"{self.name}: needs budget= (tokens) or compression_ratio=")
        args = self.base_args
        if isinstance(args, dict):
            args = tuple(sorted(args.items()))
        if not isinstance(args, tuple) or not all(isinstance(a, tuple) and len(a) == 2 for a in args):
            raise ConfigError(f"{self.name}: base_args must be a dict of the base's hyperparameters, got {args!r}")
        object.__setattr__(self, "base_args", args)
        if not isinstance(self.floor, int | float) or not 0.0 <= self.floor <= 1.0:
            raise ConfigError(f"{self.name}: floor (alpha) must be in [0, 1], got {self.floor!r}")
        if not isinstance(self.max_head_share, int | float) or self.max_head_share < 1.0:
            raise ConfigError(f"{self.name}: max_head_share must be >= 1, got {self.max_head_share!r}")
        if not isinstance(self.base, str) or not issubclass(method_class(self.base), ScoringMethod):
            raise ConfigError(
                f"{self.name}: base must name a scoring method (e.g. snapkv, pyramidkv, knorm), "
                f"got {self.base!r}"
            )
        given = dict(args)
        for clash in ("budget", "compression_ratio"):
            if clash in given:
                raise ConfigError(f"{self.name}: pass {clash} to adakv itself, not in base_args")
        inner = get(self.base, budget=self.budget, compression_ratio=self.compression_ratio, **given)
        object.__setattr__(self, "_inner", inner)

    @property
    def inner(self) -> ScoringMethod:
        """The wrapped scoring method (built from `base` and `base_args`)."""
        return self._inner  # type: ignore[attr-defined]

    def head_capacity(self, prompt_len: int) -> int:
        """Static per-head slots for the prompt: `min(ceil(max layer budget * share), prompt_len)`."""
        return min(head_cap(self.inner.max_layer_budget(prompt_len), self.max_head_share), prompt_len)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.head_capacity(prompt_len) + max_new_tokens

    def validate(self, prompt_len: int, max_new_tokens: int, max_positions: int) -> None:
        super().validate(prompt_len, max_new_tokens, max_positions)
        self.inner.validate(prompt_len, max_new_tokens, max_positions)

    def init_cache_state(self, spec: Any) -> dict[str, Any]:
        return self.inner.init_cache_state(spec)

    def check_cache_spec(self, spec: Any) -> None:
        self.inner.check_cache_spec(spec)

    def check_model(self, config: Any) -> None:
        self.inner.check_model(config)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        inner = self.inner
        cache = inner.before_scoring(cache, q, step)
        budget = inner.layer_budget(cache, step)
        protect = inner.protected(cache, budget, step)
        scores = inner.scores(cache, q, step, protect)
        per_head = adaptive_head_budgets(
            scores, kvc.stored_mask(cache), budget, head_cap=head_cap(budget, self.max_head_share),
            floor=float(self.floor), protect=protect, positions=cache.pos, max_head_cap=step.capacity,
        )
        return keep_top(cache, scores, per_head, capacity=step.capacity, protect=protect)


__all__ = ["AdaKV", "head_cap"]
