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

Memory: each layer is allocated at the most it can keep over every prompt up to the bucket (at its own budget, fixed
or a ratio of its length) and every point of a chunked prefill (`layer_capacities`): the upper layers at the budget
(a prompt below `2 * base` keeps it in every layer), the lower ones down the pyramid to the bottom layer's
`~(2 - 1/beta) * base + window`; about two thirds of allocating every layer at the bottom layer's budget (`capacity`),
and the runtime groups the sizes into a few (`Tuning.layer_slack`). With a ratio under one half a long prompt is below
`2 * base`, so every layer keeps the budget, as SnapKV, and is allocated at it. The per-layer `length` shows each
layer's real budget.
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
        budget, base = self._budget_and_base(prompt_len)
        w = budget - base
        return min(2 * base - base // self.beta, prompt_len - w) + w

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...]:
        """Layer `l` is allocated at the most it keeps over every prompt of at most `prompt_len` tokens, at its own
        budget `b(n)` (fixed, or a ratio of its length `n`), and every count `s` of its tokens seen (a chunked
        prefill's chunk ends): `max min(s, schedule_l(b(n), s))`, taken at the pairs `_widest_pairs` names. The upper
        layers then take the uniform budget, the lower ones their pyramid step: about two thirds of allocating every
        layer at the bottom layer's budget."""
        lengths, seen = self._widest_pairs(prompt_len)
        budgets = np.array([self.prompt_budget(int(n)) for n in lengths])
        schedule = pyramid_budgets(budgets, seen, num_layers=num_layers, window=self.window_size, beta=self.beta, xp=np)
        kept = np.minimum(schedule, seen[None]).max(axis=1)
        return tuple(int(k) + max_new_tokens for k in kept)

    def _widest_pairs(self, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
        """The (prompt length `n`, tokens seen `s`) pairs where each layer keeps its most, `[P]` each.

        Over `s` for one prompt (`base = b - window`): below `2 base` the schedule is uniform and keeps `min(s, b)`,
        most at `s = min(n, 2 base - 1)`; from `2 base` the pyramid, whose upper layers grow with `s` up to `s = b`
        (the bottom layer clamped below the mean, when `base < window`) and shrink after it, and whose lower layers
        grow up to `s = n`. Over `n`: the uniform part grows with the prompt (`n = prompt_len`), the pyramid part
        with the prompts that reach it (`2 base(n) <= n`), the longest of them. Checked against an enumeration of
        every pair in tests/methods/test_pyramidkv.py."""
        lengths, seen = [], []
        for n in sorted({prompt_len, self._longest_pyramid_prompt(prompt_len)} - {0}):
            budget, base = self._budget_and_base(n)
            for s in sorted({min(n, 2 * base - 1), 2 * base, budget, n}):
                if 1 <= s <= n:
                    lengths.append(n)
                    seen.append(s)
        return np.asarray(lengths), np.asarray(seen)

    def _longest_pyramid_prompt(self, prompt_len: int) -> int:
        """The longest prompt of at most `prompt_len` tokens whose whole length reaches the pyramid
        (`h(n) = n - 2 base(n) >= 0`; 0 if none). `h` moves by one each token (`b(n)` grows by 0 or 1), so no
        prompt within `-h(n)` tokens below `n` reaches it: the search jumps there."""
        n = prompt_len
        while n > 0:
            gap = n - 2 * self._budget_and_base(n)[1]
            if gap >= 0:
                return n
            n += gap
        return 0

    def _budget_and_base(self, prompt_len: int) -> tuple[int, int]:
        """A prompt's budget and its non-window part `base` (as `pyramid_budgets`)."""
        budget = self.prompt_budget(prompt_len)
        return budget, budget - min(self.window_size, budget)
