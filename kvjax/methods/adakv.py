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
(re-running it on a compressed cache, as chunked prefill does, keeps the cache). Both count the safeguard
after the protected tokens; kvpress's AdaKVPress keeps `alpha * B` tokens a head with the protected ones
among them, a smaller safeguard: `safeguard="kvpress"` (default "candidates").

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

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.common import head_cap
from kvjax.methods.registry import register
from kvjax.methods.scorer import Scored, score_layer
from kvjax.methods.wrapper import Wrapper
from kvjax.ops.gather import keep_top
from kvjax.ops.select import adaptive_head_budgets
from kvjax.validation import check_choice, check_number, check_ratio

Array = jax.Array

#: Where Ada-KV's safeguard is counted: after the protected tokens (the authors' code) or with them (kvpress).
SAFEGUARDS = ("candidates", "kvpress")


@register
@dataclasses.dataclass(frozen=True)
class AdaKV(Wrapper):
    """Head-adaptive budgets over a scoring method: `base` ("snapkv"), `floor` (alpha, 0.2),
    `max_head_share` (2.0, per-head cap in units of the budget), `safeguard` ("candidates": `alpha * (B - W)`
    after the `W` protected tokens; "kvpress": `alpha * B` with them), `base_args` (the base's
    hyperparameters as a dict)."""

    name = "adakv"

    base: str = "snapkv"
    floor: float = 0.2
    max_head_share: float = 2.0
    safeguard: str = "candidates"
    base_args: Any = ()

    def check_own_hyperparameters(self) -> None:
        if not self.compresses:
            raise ConfigError(f"{self.name}: needs budget= (tokens) or compression_ratio=")
        check_ratio(self.name, "floor (alpha)", self.floor)
        check_number(self.name, "max_head_share", self.max_head_share, 1)
        check_choice(self.name, "safeguard", self.safeguard, SAFEGUARDS)

    def head_capacity(self, prompt_len: int) -> int:
        """Static per-head slots for the prompt: `min(ceil(max layer budget * share), prompt_len)`."""
        return min(head_cap(self.inner.max_layer_budget(prompt_len), self.max_head_share), prompt_len)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.head_capacity(prompt_len) + max_new_tokens

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...] | None:
        """Over a base with per-layer sizes (Ada-Pyramid: `base="pyramidkv"`), each layer's head cap over the most
        that layer keeps: a head keeps at most `min(seen, ceil(layer budget * share))`, and `head_cap` grows with
        the budget. None over a base with one size."""
        kept = self.inner.layer_capacities(prompt_len, 0, num_layers)
        if kept is None:
            return None
        return tuple(min(head_cap(k, self.max_head_share), prompt_len) + max_new_tokens for k in kept)

    def head_budgets(self, scored: Scored, step: Step) -> Array:
        """`[B, K]` int32 slots each head keeps: the layer's budget shared over its heads by the base's scores."""
        return adaptive_head_budgets(
            scored.scores, kvc.stored_mask(scored.cache), scored.budget,
            head_cap=head_cap(scored.budget, self.max_head_share), floor=float(self.floor), protect=scored.protect,
            positions=scored.cache.pos, max_head_cap=step.capacity, guard_counts_protected=self.safeguard == "kvpress",
        )

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        scored = score_layer(self.inner, cache, q, step)
        return keep_top(scored.cache, scored.scores, self.head_budgets(scored, step), capacity=step.capacity,
                        protect=scored.protect)


__all__ = ["AdaKV"]
