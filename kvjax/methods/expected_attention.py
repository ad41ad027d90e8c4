"""`expected_attention`: Expected Attention, "KV Cache Compression by Estimating Attention from Future Queries
Distribution" (Devoto, Jeblick and Jegou, 2025; kvpress's `ExpectedAttentionPress`).

The attention a future query will pay to a cached key is unknown at compression time, so the paper models the
future queries as Gaussian and scores each key by the attention it receives *in expectation* (Section 3):

1. Query statistics. The pre-RoPE queries `q_t` of the prompt (per query head, the first `n_sink` positions
   left out as outliers) have mean `mu` and covariance `Sigma` (divided by the count).
2. Positions to come. A query at future position `j` is `R_j q`; averaging the RoPE rotation over the next
   `n_future_positions` positions, `R = mean_j R_j` for `j = n .. n + T - 1` (`n`: tokens seen), gives the
   rotated statistics `mu_bar = R mu`, `Sigma_bar = R Sigma R^T`.
3. Closed form. For `q ~ N(mu_bar, Sigma_bar)` the Gaussian moment-generating function gives
   `E[exp(q . k / sqrt(d))] = exp(mu_bar . k / sqrt(d) + k^T Sigma_bar k / (2 d))`, and normalising over the
   keys gives the expected attention `a_i = softmax_i(mu_bar . k_i / sqrt(d) + k_i^T Sigma_bar k_i / (2 d))`.
4. Contribution to the output. A pair's effect on the residual stream grows with its value, so the score is
   `(a_i + epsilon) * ||v_i||` (`use_vnorm`, the value-norm proxy of `||W_o v_i||`; CriticalKV uses the latter).

The first `n_sink` keys are kept and excluded from the softmax; the budget counts them (a budget below `n_sink`, a
short prompt's under a ratio, keeps its first `budget` tokens, as kvpress's top-k). GQA: the softmax is
per query head and averaged over the group (kvpress). Defaults are kvpress 0.5.5's (`n_future_positions=512`,
`n_sink=4`, `use_covariance=True`, `use_vnorm=True`, `epsilon=0`), which the paper's experiments use.

Queries come post-RoPE; rotating each back by its own position recovers the pre-RoPE query (times a yarn
attention factor, which the averaged rotation then carries exactly as HF's rotary embedding does).

Chunked prefill: the statistics are running sums over every chunk so far (count, mean and centred second
moment merged chunk by chunk, per layer in `cache.state`: `query_count`, `query_mean`, `query_m2`), so the last
chunk scores with the whole prompt's statistics and `n` its length, as the one-shot method; earlier chunks
compress with the statistics seen so far.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Step
from kvjax.methods.common import future_rotation, observe_queries, query_statistics_state
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.scoring import gaussian_query_logits, value_norm_scores
from kvjax.ops.select import protect_regions
from kvjax.validation import check_bool, check_int, check_number

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class ExpectedAttention(ScoringMethod):
    """Expected attention of Gaussian future queries (RoPE averaged over the next `n_future_positions`), times
    the value norm; `n_sink` first tokens kept. kvpress's `ExpectedAttentionPress` defaults."""

    name = "expected_attention"

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "n_future_positions", self.n_future_positions, 1)
        check_int(self.name, "n_sink", self.n_sink, 0)
        check_bool(self.name, "use_covariance", self.use_covariance)
        check_bool(self.name, "use_vnorm", self.use_vnorm)
        check_number(self.name, "epsilon", self.epsilon, 0)
        if self.budget is not None and self.n_sink >= self.budget:
            raise ConfigError(
                f"{self.name}: n_sink={self.n_sink} must be smaller than budget={self.budget} (the budget counts "
                "the sink tokens)"
            )

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Array]:
        return query_statistics_state(spec, self.use_covariance)

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array:
        """The first `n_sink` tokens, never more than the budget (a small ratio budget keeps its first tokens)."""
        return protect_regions(cache, sink=jnp.minimum(self.n_sink, budget), last=False)

    def before_scoring(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Merges the chunk's pre-RoPE queries into the running statistics."""
        return observe_queries(cache, q, step, self.n_sink, self.use_covariance)

    def future_statistics(self, cache: KVCache, step: Step) -> tuple[Array, Array | None]:
        """The query mean `[B, N, H]` and covariance `[B, N, H, H]` (or None) rotated by the RoPE averaged over
        the next `n_future_positions` positions after the tokens seen."""
        stats = cache.state
        rotation = future_rotation(cache, step, self.n_future_positions)
        mean = jnp.einsum("bij,bnj->bni", rotation, stats["query_mean"])
        if not self.use_covariance:
            return mean, None
        cov = stats["query_m2"] / jnp.maximum(stats["query_count"], 1.0)[:, None, None, None]
        return mean, jnp.einsum("bij,bnjk,blk->bnil", rotation, cov, rotation)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        stored = kvc.stored_mask(cache)
        candidates = stored if protect is None else stored & ~protect
        mean, cov = self.future_statistics(cache, step)
        logits = gaussian_query_logits(mean, cov, cache.k, scale=1.0 / math.sqrt(cache.head_dim))
        ok = candidates[:, :, None]
        top = jnp.max(jnp.where(ok, logits, -jnp.inf), axis=-1, keepdims=True)
        e = jnp.where(ok, jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
        probs = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
        score = jnp.mean(probs, axis=2)  # [B, K, C]
        if self.use_vnorm:
            score = (score + self.epsilon) * value_norm_scores(cache.v)
        return jnp.where(candidates, score, 0.0)
