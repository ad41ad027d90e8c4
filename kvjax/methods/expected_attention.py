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

The first `n_sink` keys are kept and excluded from the softmax; the budget counts them. GQA: the softmax is
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
from kvjax.methods.base import CacheSpec, Step, last_position
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.scoring import gaussian_query_logits, value_norm_scores
from kvjax.ops.select import protect_regions
from kvjax.rope import rotate_by
from kvjax.validation import check_bool, check_int

Array = jax.Array


def average_rotation(start: Array, count: int, inv_freq: Array) -> Array:
    """`[B, H, H]` float32: the RoPE rotation (rotate-half layout) averaged over positions `start .. start +
    count - 1` (`start` `[B]`): `diag(c) + diag(s) P` with `c`, `s` the mean cos / sin per frequency."""
    f = inv_freq.astype(jnp.float32)
    angles = (start.astype(jnp.float32)[:, None] + jnp.arange(count, dtype=jnp.float32)[None])[..., None] * f
    c, s = jnp.mean(jnp.cos(angles), axis=1), jnp.mean(jnp.sin(angles), axis=1)  # [B, H/2]
    half = f.shape[0]
    eye = jnp.eye(half, dtype=jnp.float32)
    zero = jnp.zeros((half, half), jnp.float32)
    rotate_half = jnp.block([[zero, -eye], [eye, zero]])  # P x = [-x2, x1]
    cc, ss = jnp.concatenate([c, c], -1), jnp.concatenate([s, s], -1)
    return jax.vmap(lambda a, b: jnp.diag(a) + b[:, None] * rotate_half)(cc, ss)


def merge_statistics(state: dict, x: Array, rows: Array, covariance: bool) -> dict:
    """Running count / mean / centred second moment per example and query head, merged with the rows `x`
    `[B, T, N, H]` where `rows` `[B, T]` (Chan et al.'s parallel update: exact, stable)."""
    x = x.astype(jnp.float32)
    w = rows.astype(jnp.float32)
    n_b = jnp.sum(w, axis=1)  # [B]
    mean_b = jnp.einsum("bt,btnh->bnh", w, x) / jnp.maximum(n_b, 1.0)[:, None, None]
    n_a, mean_a = state["query_count"], state["query_mean"]
    n = n_a + n_b
    delta = mean_b - mean_a
    frac = (n_b / jnp.maximum(n, 1.0))[:, None, None]
    out = {"query_count": n, "query_mean": mean_a + delta * frac}
    if covariance:
        centred = (x - mean_b[:, None]) * w[:, :, None, None]
        m2_b = jnp.einsum("btni,btnj->bnij", centred, centred)
        cross = (n_a * n_b / jnp.maximum(n, 1.0))[:, None, None, None]
        out["query_m2"] = state["query_m2"] + m2_b + cross * jnp.einsum("bni,bnj->bnij", delta, delta)
    return out


def query_statistics_state(spec: CacheSpec, covariance: bool) -> dict[str, Array]:
    """The empty running query statistics (`cache.state`): count `[B]`, mean `[B, N, H]` and, with `covariance`,
    the centred second moment `[B, N, H, H]`, all float32."""
    b, n, h = spec.batch, spec.num_heads, spec.head_dim
    state = {"query_count": jnp.zeros((b,), jnp.float32), "query_mean": jnp.zeros((b, n, h), jnp.float32)}
    if covariance:
        state["query_m2"] = jnp.zeros((b, n, h, h), jnp.float32)
    return state


def observe_queries(cache: KVCache, q: Array, step: Step, n_sink: int, covariance: bool) -> KVCache:
    """The cache with the chunk's pre-RoPE queries (rows at positions >= `n_sink`; padding left out) merged into
    its running statistics: each post-RoPE row of `q` rotated back by its own position."""
    rows = step.positions >= n_sink
    unrotated = rotate_by(q, -jnp.broadcast_to(step.positions[..., None], q.shape[:3]), step.inv_freq)
    prior = cache.state
    if "query_count" not in prior:  # a cache built without `init_cache_state`: nothing seen yet
        b, _, n, h = q.shape
        prior = query_statistics_state(CacheSpec(b, cache.num_kv_heads, cache.capacity, n, h, 1, q.dtype), covariance)
    stats = merge_statistics(prior, unrotated, rows, covariance)
    return cache.replace(state={**cache.state, **stats})


def future_rotation(cache: KVCache, step: Step, n_future_positions: int) -> Array:
    """`[B, H, H]`: the RoPE rotation averaged over the next `n_future_positions` positions after the tokens the
    cache has seen (its largest stored position + 1)."""
    seen = jnp.max(last_position(cache), axis=-1) + 1  # [B]
    return average_rotation(seen, n_future_positions, step.inv_freq)


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
        if not isinstance(self.epsilon, int | float) or isinstance(self.epsilon, bool) or self.epsilon < 0:
            raise ConfigError(f"{self.name}: epsilon must be a number >= 0, got {self.epsilon!r}")
        if self.budget is not None and self.n_sink >= self.budget:
            raise ConfigError(
                f"{self.name}: n_sink={self.n_sink} must be smaller than budget={self.budget} (the budget counts "
                "the sink tokens)"
            )

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Array]:
        return query_statistics_state(spec, self.use_covariance)

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array:
        return protect_regions(cache, sink=self.n_sink, last=False)

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
