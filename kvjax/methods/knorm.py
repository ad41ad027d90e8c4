"""`knorm`: "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" (Devoto et al.,
2024).

The paper observes that keys with a **low** L2 norm receive high attention, so a key's score is
`-||k||_2` (Section 3) and each KV head keeps the `budget` lowest-norm keys after prefill. No
queries or attention weights are needed (it works with any attention kernel), no tokens are
protected, and nothing is evicted during decoding (as kvpress's `KnormPress`).

`skip_layers` (default 0) leaves the first layers uncompressed, as the L2-norm variant in LagKV's
ablation does for layers 0 and 1. Memory: a skipped layer is allocated at the prompt, the others at the budget
(`layer_capacities`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.methods.base import Step
from kvjax.methods.common import stored_tokens
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.scoring import key_norm_scores
from kvjax.validation import check_int

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class KNorm(ScoringMethod):
    """Keep the lowest key norms; `skip_layers` first layers uncompressed (default 0)."""

    name = "knorm"

    skip_layers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "skip_layers", self.skip_layers, 0)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        return -key_norm_scores(kvc.keys(cache), kvc.stored_mask(cache))

    def layer_budget(self, cache: KVCache, step: Step) -> Array:
        if self.skip_layers == 0:
            return step.budget
        return jnp.where(step.layer < self.skip_layers, stored_tokens(cache), step.budget)

    def max_layer_budget(self, prompt_len: int) -> int:
        return prompt_len if self.skip_layers > 0 else self.prompt_budget(prompt_len)

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...] | None:
        """The first `skip_layers` layers at the prompt, the others at the budget; None when none is skipped."""
        if self.skip_layers == 0:
            return None
        return tuple((prompt_len if layer < self.skip_layers else self.prompt_budget(prompt_len)) + max_new_tokens
                     for layer in range(num_layers))
