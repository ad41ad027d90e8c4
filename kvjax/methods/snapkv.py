"""`snapkv`: SnapKV, "LLM Knows What You are Looking for Before Generation" (Li et al., 2024).

Section 4 of the paper, after the prompt has been prefilled, per layer and KV head:

1. Observation window: the last `window_size` (L_obs) prompt tokens. Their queries vote for the
   prefix keys with their attention weights `softmax(q_i K^T / sqrt(d))[j]` (causal softmax over the whole
   prompt, float32). Listing 1 sums the votes over the window rows i; kvjax averages them, which keeps the
   same ranking and so the same kept set, and leaves each score an attention weight: what a wrapper that
   adds to a score or thresholds it is defined against (CriticalKV's `epsilon`, DMS's threshold), in the
   Ada-KV / CriticalKV authors' code and in kvpress.
2. Clustering: 1-D pooling of the votes over the prefix (`kernel_size` 5, avg; PyTorch
   `avg_pool1d(padding=k//2)` semantics, the window itself is outside the pooled prefix).
3. Selection: the top `budget - window_size` prefix tokens by pooled vote (ties: lower position),
   plus the whole window. The budget counts the window. Nothing is evicted during decoding.

GQA (not in the paper, which is MHA): the cache is stored per KV head, so votes are reduced over
the query heads of each group, **mean by default** (`group_reduce="max"` as an option). kvpress
does the same (mean over the group and over the window rows; its default window is 64); the original
SnapKV repo and KVCache-Factory repeat K/V to every query head (`repeat_kv`) and select per query head,
which costs `G` times the memory. With `compression_ratio`, an example
whose budget is below `window_size` keeps only its last `budget` tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.scoring import GROUP_REDUCE, POOLING, pool1d, window_scores
from kvjax.ops.select import protect_regions
from kvjax.validation import check_choice, check_int

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class SnapKV(ScoringMethod):
    """Observation-window votes, pooled, top-k; `window_size` 32, `kernel_size` 5, avg pooling."""

    name = "snapkv"

    window_size: int = 32
    kernel_size: int = 5
    pooling: str = "avg"
    group_reduce: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "window_size", self.window_size, 1)
        check_int(self.name, "kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"{self.name}: kernel_size must be odd (centred pooling), got {self.kernel_size}")
        check_choice(self.name, "pooling", self.pooling, POOLING)
        check_choice(self.name, "group_reduce", self.group_reduce, tuple(g for g in GROUP_REDUCE if g))
        if self.budget is not None and self.window_size >= self.budget:
            raise ConfigError(
                f"{self.name}: window_size={self.window_size} must be smaller than budget={self.budget} "
                "(the budget counts the observation window)"
            )

    def window(self, budget: Array) -> Array:
        """`[B]` tokens of the observation window actually kept (the window, or the whole budget)."""
        return jnp.minimum(self.window_size, budget)

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array:
        return protect_regions(cache, recent=self.window(budget), last=False)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        stored = kvc.stored_mask(cache)
        votes = window_scores(
            q, step.positions, kvc.keys(cache), cache.pos, stored,
            window=self.window_size, row_reduce="mean", group_reduce=self.group_reduce,
        )
        # Pool over the prefix only: window and empty slots act as the pooling's padding.
        prefix = stored if protect is None else stored & ~protect
        return pool1d(votes, self.kernel_size, self.pooling, valid=prefix)
