"""`h2o`: H2O, "Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
(Zhang et al., NeurIPS 2023), Algorithm 1 with the accumulated attention score.

Per layer and KV head the cache holds at most `budget` tokens: the `window_size` most recent ones
plus the "heavy hitters", the tokens with the largest accumulated attention

    S_j = sum_i softmax(q_i K^T / sqrt(d))[j]

over every query row i that has attended token j while it was cached (float32; an evicted token's
score leaves with it).

* Prefill: `S` = column sums over all prompt rows (`ops.scoring.accumulated_scores`, causal,
  blockwise: never `T x T`; one pass reusing the prefill attention's row log-sum-exp), then the
  recent window plus the top `budget - window` by `S` (ties: lower position). With chunked prefill
  the chunk's column sums are added to the carried scores.
* Decode: the new token is appended and attends the kept tokens plus itself (capacity
  `budget + 1`); `observe` adds its attention row to `S`, then evicts the lowest-`S` token outside the
  recent window with one O(head_dim) `cache.evict`. This is the order of H2O's real-drop code
  (attend, accumulate, evict), so the token that just attended is always scored first.

GQA (the paper is MHA): rows are reduced over each group of query heads by the **mean** (the sum
ranks the same), both at prefill and decode, so the running score stays one consistent sum.

Budget: `budget=` is the cache size in tokens (the paper's KV budget): a prompt shorter than it is
kept whole and the cache grows with generated tokens until it holds `budget`, then stays there.
With `compression_ratio` the size is each example's prompt budget `floor(n * (1 - ratio))`.
`window_size=None` (default) splits the budget equally between heavy hitters and recent tokens, as
the paper's experiments do (heavy ratio = recent ratio); AhaKV's comparison uses `window_size=32`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step, last_position
from kvjax.methods.capabilities import AttentionObserver
from kvjax.methods.common import cache_limit, lowest_slot, rolling_capacity
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.gather import keep_top
from kvjax.ops.scoring import accumulated_scores
from kvjax.ops.select import protect_regions
from kvjax.validation import check_int

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class H2O(ScoringMethod, AttentionObserver):
    """Heavy hitters (accumulated attention) + recent window, evicting one token per decode step;
    `window_size` None = half the budget (the paper's equal split)."""

    name = "h2o"
    uses_score = True
    layer_inputs = frozenset({"attention_lse"})

    window_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_size is not None:
            check_int(self.name, "window_size", self.window_size, 1)
            if self.budget is not None and self.window_size >= self.budget:
                raise ConfigError(
                    f"{self.name}: window_size={self.window_size} must be smaller than budget={self.budget} "
                    "(the budget counts the recent window; no room would be left for heavy hitters)"
                )

    def window(self, limit: Array) -> Array:
        """Recent tokens kept for a cache limit (same shape as `limit`)."""
        if self.window_size is None:
            return limit - limit // 2
        return jnp.minimum(self.window_size, limit)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return rolling_capacity(self, prompt_len, max_new_tokens)

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array:
        return protect_regions(cache, recent=self.window(cache_limit(self, step)), last=False)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        """Carried accumulated attention plus this chunk's column sums, `[B, K, C]` float32."""
        stored = kvc.stored_mask(cache)
        # The prefill attention's row statistics make this one pass (exact probabilities exp(s - lse));
        # with a retrieval mask or without them, accumulated_scores computes its own.
        lse = step.attention_lse if cache.attend is None else None
        new = accumulated_scores(q, step.positions, kvc.keys(cache), cache.pos, stored, group_reduce="mean", lse=lse)
        prior = 0.0 if cache.score is None else cache.score
        return jnp.where(stored, prior + new, 0.0)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        protect = self.protected(cache, step.budget, step)
        total = self.scores(cache, q, step, protect)
        cache = cache.replace(score=total)
        return keep_top(cache, total, step.budget, capacity=step.capacity, protect=protect)

    def observe(self, cache: KVCache, weights: Array, step: Step) -> KVCache:
        """Adds the step's attention row (mean over the group) to `S`, then, over the limit, evicts the
        lowest-`S` token outside the recent window."""
        stored = kvc.stored_mask(cache)
        prior = 0.0 if cache.score is None else cache.score
        score = jnp.where(stored, prior + jnp.mean(weights, axis=2), 0.0)
        cache = cache.replace(score=score)
        limit = cache_limit(self, step)[:, None]  # [B, 1]
        recent = cache.pos > (last_position(cache) - self.window(limit))[..., None]
        candidates = stored & ~recent
        over = (cache.length > limit) & jnp.any(candidates, axis=-1)
        return kvc.evict(cache, lowest_slot(score, candidates, cache.pos), where=over)
