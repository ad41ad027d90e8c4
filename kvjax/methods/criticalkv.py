"""`criticalkv` / `criticaladakv`: CriticalKV, "Identify Critical KV Cache in LLM Inference from an Output
Perturbation Perspective" (Feng et al., 2025; kvpress's `CriticalKVPress` / `CriticalAdaKVPress`), as wrappers
over any scoring method (`base`, default SnapKV) and over Ada-KV's head budgets.

Evicting pair `i` perturbs the attention output by about `a_i v_i W_o`, so the paper bounds the perturbation
by `sum_i a_i ||v_i W_o||_1` over the evicted pairs (Section 3): attention weight alone is not enough, a pair
whose value the output projection shrinks matters less. Selection runs in two stages (Algorithm 1):

1. Stage one keeps the best `floor(first_stage_ratio * budget)` pairs by the base score `a_i` alone (the base's
   protected window / sinks among them), which guards against the bound's looseness.
2. Stage two fills the rest of the budget by the output-aware score `(a_i + epsilon) * ||v_i W_o||_1`, the L1
   norm of the value through each query head's slice of `W_o`, averaged over the GQA group.

Defaults are kvpress 0.5.5's (`first_stage_ratio=0.5`, `epsilon=1e-4`; kvpress floors stage one at one pair).
`criticaladakv` first splits the layer budget over heads as `adakv` does (from the base scores; its `safeguard`
too), then runs both stages inside each head with its own budget: stage one keeps
`floor(first_stage_ratio * head budget)` pairs, and never fewer than the head's Ada-KV safeguard (kvpress keeps
the safeguard pairs through both stages too).

`W_o` reaches the hook as `step.out_proj` (`[N, H, D]`): the step API takes the layer's output projection
(`out_proj=`), kvjax's runtime passes it, and a method whose `layer_inputs` name `"out_proj"` refuses to run
without it (`docs/design.md`). The `||v W_o||` pass runs over blocks of slots, so it never holds more than
`[B, N, block, D]`. Combine with a base whose scores are attention weights (SnapKV, ExpectedAttention without
its value norm: `base_args={"use_vnorm": False}`, as kvpress advises).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.adakv import AdaKV
from kvjax.methods.base import Step
from kvjax.methods.registry import register
from kvjax.methods.scorer import score_layer
from kvjax.methods.wrapper import ScorerWrapper
from kvjax.ops.gather import keep_top
from kvjax.ops.scoring import projected_value_norms
from kvjax.ops.select import keep_mask, safeguard_candidates, topk_keep
from kvjax.validation import check_number, check_ratio

Array = jax.Array


def output_aware_selection(cache: KVCache, scores: Array, budget: Array, protect: Array | None, step: Step, *,
                           first_stage_ratio: float, epsilon: float, at_least_one: bool,
                           stage_one_floor: Array | None = None) -> KVCache:
    """CriticalKV's two stages over base `scores` `[B, K, C]` with `budget` per example `[B]` or head `[B, K]`
    (`at_least_one`: stage one keeps one pair even where `first_stage_ratio * budget < 1`; `stage_one_floor`
    `[B, K]`: stage one keeps at least that many, Ada-KV's safeguard)."""
    if step.out_proj is None:
        raise ConfigError("criticalkv: the step carries no output projection (pass out_proj= to the step API)")
    stored = kvc.stored_mask(cache)
    budget = jnp.asarray(budget, jnp.int32)
    first = jnp.floor(budget.astype(jnp.float32) * jnp.float32(first_stage_ratio)).astype(jnp.int32)
    if at_least_one and first_stage_ratio > 0:
        first = jnp.maximum(first, jnp.minimum(budget, 1))
    if stage_one_floor is not None:
        first = jnp.maximum(first, stage_one_floor)
    indices, counts = topk_keep(scores, stored, first, capacity=cache.capacity, protect=protect, positions=cache.pos)
    stage_one = keep_mask(indices, counts, cache.capacity)  # the protected slots come first in these counts
    if protect is not None:
        stage_one |= protect & stored
    norms = jnp.mean(projected_value_norms(cache.v, step.out_proj), axis=2)  # [B, K, C]
    weighted = jnp.where(stored, (scores + epsilon) * norms, 0.0)
    return keep_top(cache, weighted, budget, capacity=step.capacity, protect=stage_one)


@dataclasses.dataclass(frozen=True)
class OutputAware:
    """CriticalKV's hyperparameters and need (the layer's `W_o`), mixed into `criticalkv` and `criticaladakv` before
    their wrapper base: `first_stage_ratio` (0.5), `epsilon` (1e-4)."""

    layer_inputs = frozenset({"out_proj"})

    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4

    def check_own_hyperparameters(self) -> None:
        super().check_own_hyperparameters()
        check_ratio(self.name, "first_stage_ratio", self.first_stage_ratio)
        check_number(self.name, "epsilon", self.epsilon, 0)


@register
@dataclasses.dataclass(frozen=True)
class CriticalKV(OutputAware, ScorerWrapper):
    """Two-stage output-aware selection over a scoring method: `base` ("snapkv"), `base_args`,
    `first_stage_ratio` (0.5), `epsilon` (1e-4)."""

    name = "criticalkv"

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        scored = score_layer(self, cache, q, step)
        return output_aware_selection(scored.cache, scored.scores, scored.budget, scored.protect, step,
                                      first_stage_ratio=self.first_stage_ratio, epsilon=self.epsilon,
                                      at_least_one=True)


@register
@dataclasses.dataclass(frozen=True)
class CriticalAdaKV(OutputAware, AdaKV):
    """Ada-KV's head budgets (from the base scores), then CriticalKV's two stages inside each head:
    `first_stage_ratio` (0.5), `epsilon` (1e-4), and `adakv`'s `base`, `floor`, `max_head_share`, `base_args`."""

    name = "criticaladakv"

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        scored = score_layer(self.inner, cache, q, step)
        return output_aware_selection(scored.cache, scored.scores, self.head_budgets(scored, step), scored.protect,
                                      step, first_stage_ratio=self.first_stage_ratio, epsilon=self.epsilon,
                                      at_least_one=False,
                                      stage_one_floor=self.guarded_pairs(scored.cache, scored.budget, scored.protect))

    def guarded_pairs(self, cache: KVCache, budget: Array, protect: Array | None) -> Array:
        """`[B, K]` pairs each head keeps by its base score alone: the protected ones and Ada-KV's safeguard, as
        `adaptive_head_budgets` counts it (`safeguard_candidates`)."""
        stored = kvc.stored_mask(cache)
        n_prot = jnp.zeros(stored.shape[:2], jnp.int32) if protect is None else jnp.sum(protect & stored, -1)
        return n_prot + safeguard_candidates(jnp.asarray(budget, jnp.int32)[:, None], n_prot, float(self.floor),
                                             counts_protected=self.safeguard == "kvpress")
