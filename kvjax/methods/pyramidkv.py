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

Memory: with a fixed budget each layer is allocated at the most it can keep for any prompt up to the bucket, at
any point of a chunked prefill (`layer_capacities`): the upper layers at the budget (a prompt below `2 * base`
keeps it in every layer), the lower ones down the pyramid to the bottom layer's `~(2 - 1/beta) * base + window`;
about two thirds of allocating every layer at the bottom layer's budget, and the runtime groups the sizes into a few
(`Tuning.layer_slack`). With `compression_ratio` the budget follows each prompt and every layer takes the bottom
layer's size (`capacity`). The per-layer `length` shows each layer's real budget.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache
from kvjax.methods.base import Step, last_position
from kvjax.methods.registry import register
from kvjax.methods.snapkv import SnapKV
from kvjax.validation import check_int

Array = jax.Array


def pyramid_budgets(budget: Array, seen: Array, *, num_layers: int, window: int, beta: int, xp: Any = jnp) -> Array:
    """`[L, B]` int32 per-layer budgets (window included) for per-example budgets and prompt
    lengths `[B]`; the mean over layers equals `budget` exactly. `xp`: `jax.numpy` (traced) or `numpy` (on the
    host, where `PyramidKV.layer_capacities` sizes the cache)."""
    budget = xp.asarray(budget, xp.int32)
    seen = xp.asarray(seen, xp.int32)
    w = xp.minimum(window, budget)
    base = budget - w
    top = base // beta
    bottom = 2 * base - top
    clamp = bottom >= seen - w
    bottom = xp.where(clamp, seen - w, bottom)
    top = xp.where(clamp, 2 * base - bottom, top)
    if num_layers == 1:
        return (base + w)[None]
    d = bottom - top
    layer = xp.arange(num_layers, dtype=xp.int32)[:, None]
    lower = bottom - (d * layer) // (num_layers - 1)
    upper = top + (d * (num_layers - 1 - layer)) // (num_layers - 1)
    per_layer = xp.where(2 * layer <= num_layers - 1, lower, upper)
    per_layer = xp.where(seen < 2 * base, base, per_layer)  # short prompt: uniform SnapKV
    return per_layer + w


@register
@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV with pyramid per-layer budgets (`beta` = 20); each layer allocated at the most it can keep."""

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

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...] | None:
        """With a fixed budget `b`, layer `l` is allocated at the most it can keep for any prompt of at most
        `prompt_len` tokens, at any point of a chunked prefill: `max(min(s, schedule_l(b', s)))` over the tokens seen
        `s` (the schedule's budget `b'` is `min(b, prompt_len)`; a prompt shorter than `b` keeps at most its length,
        under `b'`). Past `2 b'` tokens seen the schedule no longer changes, so the seen counts up to there are
        enough. The upper layers then take the uniform budget (a short prompt's), the lower ones their pyramid step:
        about two thirds of the bottom layer's budget for every layer. With `compression_ratio` the budget follows the
        prompt, and every layer keeps the bottom layer's size (None)."""
        if self.budget is None:
            return None
        budget = self.prompt_budget(prompt_len)
        seen = np.arange(1, min(prompt_len, 2 * budget + 1) + 1)
        schedule = pyramid_budgets(np.full(seen.shape, budget), seen, num_layers=num_layers, window=self.window_size,
                                   beta=self.beta, xp=np)
        kept = np.maximum(np.minimum(schedule, seen[None]).max(axis=1), budget - 1)
        return tuple(int(k) + max_new_tokens for k in kept)
