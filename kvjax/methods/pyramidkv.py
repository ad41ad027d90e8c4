"""`pyramidkv`: PyramidKV, "Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(Cai et al., 2024).

SnapKV's scoring and selection (observation window, pooled votes, top-k; see `snapkv`) with a
per-layer budget that shrinks from the bottom layer to the top (Section 3, "pyramidal" allocation):
an arithmetic sequence whose top layer keeps `k_top = base // beta` non-window tokens and whose
bottom layer keeps `k_bottom = 2 * base - k_top`, so the mean over layers is `base`, with
`base = budget - window_size` and `beta = 20` (paper, KVCache-Factory). Every layer also keeps the
observation window, so the mean layer budget equals the global budget.

Edge rules, as KVCache-Factory (per example, from its own prompt length `n`):
* if `k_bottom >= n - window_size` the bottom layer is clamped to `n - window_size` and the top
  layer raised to `2 * base - (n - window_size)`, keeping the mean;
* if `n < 2 * base` every layer uses the uniform budget (plain SnapKV).

Difference: KVCache-Factory steps by `(k_bottom - k_top) // (L - 1)` tokens, so its mean drifts
above the budget; here layer `l` gets `k_bottom - floor(d * l / (L - 1))` in the lower half and the
mirror image `k_top + floor(d * (L - 1 - l) / (L - 1))` in the upper half (`d = k_bottom - k_top`,
even), so the layer budgets sum to exactly `L * base` and decrease monotonically.

Memory: the cache is stacked over layers with one static capacity, so it is allocated at the
**largest** layer budget (`~(2 - 1/beta) * base + window`, about twice the mean) plus
`max_new_tokens`; the per-layer `length` shows each layer's real budget. A stacked cache costs
about twice `snapkv`'s at the same mean budget; the compute of attention follows the lengths.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.methods.base import Step, last_position
from kvjax.methods.registry import register
from kvjax.methods.snapkv import SnapKV
from kvjax.validation import check_int

Array = jax.Array


def pyramid_budgets(budget: Array, seen: Array, *, num_layers: int, window: int, beta: int) -> Array:
    """`[L, B]` int32 per-layer budgets (window included) for per-example budgets and prompt
    lengths `[B]`; the mean over layers equals `budget` exactly."""
    budget = jnp.asarray(budget, jnp.int32)
    seen = jnp.asarray(seen, jnp.int32)
    w = jnp.minimum(window, budget)
    base = budget - w
    top = base // beta
    bottom = 2 * base - top
    clamp = bottom >= seen - w
    bottom = jnp.where(clamp, seen - w, bottom)
    top = jnp.where(clamp, 2 * base - bottom, top)
    if num_layers == 1:
        return (base + w)[None]
    d = bottom - top
    layer = jnp.arange(num_layers, dtype=jnp.int32)[:, None]
    lower = bottom - (d * layer) // (num_layers - 1)
    upper = top + (d * (num_layers - 1 - layer)) // (num_layers - 1)
    per_layer = jnp.where(2 * layer <= num_layers - 1, lower, upper)
    per_layer = jnp.where(seen < 2 * base, base, per_layer)  # short prompt: uniform SnapKV
    return per_layer + w


@register
@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV with pyramid per-layer budgets (`beta` = 20); memory = the bottom layer's budget."""

    name = "pyramidkv"

    beta: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "beta", self.beta, 1)

    def layer_budget(self, cache: KVCache, step: Step) -> Array:
        seen = jnp.max(last_position(cache), axis=-1) + 1  # prompt tokens seen so far
        schedule = pyramid_budgets(
            step.budget, seen, num_layers=step.num_layers, window=self.window_size, beta=self.beta
        )
        return jax.lax.dynamic_index_in_dim(schedule, step.layer, 0, keepdims=False)

    def max_layer_budget(self, prompt_len: int) -> int:
        budget = self.prompt_budget(prompt_len)
        w = min(self.window_size, budget)
        base = budget - w
        return min(2 * base - base // self.beta, prompt_len - w) + w
