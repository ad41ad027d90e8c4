"""`capkv`: CapKV, "Rethinking KV Cache Eviction via a Unified Information-Theoretic Objective" (Yang, Tang, Zhen
and Lv, 2026, arXiv 2604.25975; kvpress's `CapPress`).

The paper (its abstract) treats attention as a linear-Gaussian surrogate and asks which subset of the cache keeps
the most information about the layer's output: a closed-form mutual information, the "capacity" of the kept set,
which CapKV approximates by a log-determinant through statistical leverage scores. With `u_i` the direction pair
`i` writes in the output and `w_i` how much future queries weigh it, the capacity of the whole cache is
`log det A`, `A = I + sum_i w_i u_i u_i^T`, and by the matrix determinant lemma evicting pair `i` alone lowers it by
`-log(1 - w_i u_i^T A^{-1} u_i)`, which grows with the weighted leverage. So CapKV scores

    w_i = exp(tau * <k_i, mu_q>)            (query relevance of key i)
    A   = I + sum_i w_i u_i u_i^T           (capacity matrix of the head, over the non-sink tokens)
    s_i = w_i * u_i^T A^{-1} u_i            (weighted leverage: relevant *and* not already spanned by the others)

Relevance alone (`w_i`) keeps redundant neighbours; leverage alone keeps outliers nobody attends; the product keeps
the relevant pairs that add new directions.

How kvpress 0.5.5's `CapPress` realises it, which is kvjax's default (the paper's text beyond its abstract was not
reachable here, so the choices below are kvpress's; its docstring's notes 1-4 say where it departs from the
paper):

1. The anchor `mu_q` is the mean pre-RoPE query of the prompt's non-sink tokens (per query head), rotated by the
   RoPE rotation averaged over the next `n_future_positions` positions (Expected Attention's device: keys are
   stored post-RoPE, a future query will sit at a later position; not in the paper, kvpress's note 3).
2. Keys and anchor are unit-normalised and their dot product clipped to [-1, 1] (the paper: unnormalised dot
   products; `normalize_alignment=False` is that form).
3. The logits `tau * <k_i, mu_q>` are shifted by their maximum over the head's non-sink tokens before `exp`, so
   the largest `w_i` is 1. The shift rescales every `w_i` by one constant, which changes `A` (the identity is not
   rescaled) and so the ranking: it is part of the method, not only a numerical guard.
4. `u_i = v_i`, the raw value (a proxy of the output direction `W_o v_i`).
5. `A = I + sum_i (w_i + epsilon) v_i v_i^T`; the score multiplies the leverage by `w_i` (without `epsilon`).
6. Scores are per query head and averaged over each KV head's group (GQA); the first `n_sink` tokens are kept
   (counted in the budget; a smaller budget, a short prompt's under a ratio, keeps its first `budget` tokens) and
   take part in neither the anchor, the maximum, nor `A`.

Defaults: `tau=5`, `n_future_positions=512`, `n_sink=4`, `epsilon=1e-6`, kvpress's. The `d x d` systems (one per
example and query head) are solved in float32 through a Cholesky factor, `u^T A^{-1} u = ||L^{-1} u||^2` (kvpress:
an LU solve in float32); `A` is symmetric positive definite (identity plus a Gram matrix). `A` and the solves run
blockwise over 512 slots, so a long prompt never holds the values repeated per query head.

Queries: the pre-RoPE queries are recovered from the post-RoPE `q` the step passes (each row rotated back by its
own position) and kept as a running mean in `cache.state` (`query_count`, `query_mean`), with Expected
Attention's helpers (`kvjax.methods.common`). Chunked prefill: each chunk compresses what the cache
holds with the anchor of the queries seen so far and the capacity matrix of the slots then stored; the last chunk
scores with the whole prompt's anchor, so one chunk is exactly the one-shot press.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Step
from kvjax.methods.common import future_rotation, observe_queries, query_statistics_state
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.scoring import map_slot_blocks
from kvjax.ops.select import protect_regions
from kvjax.validation import check_bool, check_int, check_number

Array = jax.Array


def _unit(x: Array) -> Array:
    """`x / max(||x||, 1e-12)` along the last axis."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def relevance_weights(anchor: Array, k: Array, candidates: Array, tau: float, normalize: bool) -> Array:
    """`w = exp(tau * <k_i, a> - max_i)` `[B, K, G, C]` float32 over the `candidates` `[B, K, C]` (0 elsewhere), for
    the anchors `a` `[B, K, G, H]` (query head `k * G + g` reads KV head `k`); with `normalize` keys and anchors
    are unit vectors and the cosine is clipped to [-1, 1]."""
    kf = k.astype(jnp.float32)
    if normalize:
        align = jnp.clip(jnp.einsum("bkgh,bkch->bkgc", _unit(anchor), _unit(kf)), -1.0, 1.0)
    else:
        align = jnp.einsum("bkgh,bkch->bkgc", anchor, kf)
    ok = candidates[:, :, None]
    logits = jnp.where(ok, tau * align, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.where(ok, jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)


def weighted_leverage(w: Array, u: Array, candidates: Array, epsilon: float, block: int = 512) -> Array:
    """`w_i * u_i^T A^{-1} u_i` `[B, K, G, C]` with `A = I + sum_j (w_j + epsilon) u_j u_j^T` per query head, the
    sum over the `candidates` `[B, K, C]`; `w` `[B, K, G, C]`, `u` `[B, K, C, H]` (shared by the group).

    Blockwise over `block` slots (both the sum into `A` and the solves), so no more than `[B, N, block, H]` exists
    at a time: a long prompt never materialises the values repeated per query head."""
    uf = u.astype(jnp.float32)
    b, kv, g, c = w.shape
    h = uf.shape[-1]
    gain = jnp.where(candidates[:, :, None], w + epsilon, 0.0)  # [B, K, G, C]

    def gram(gb: Array, ub: Array) -> Array:  # sum over the block's slots of gain u u^T, [B, K, G, H, H]
        return jnp.einsum("bkgci,bkcj->bkgij", gb[..., None] * ub[:, :, None], ub)

    eye = jnp.eye(h, dtype=jnp.float32)
    if c <= block:
        a = eye + gram(gain, uf)
    else:
        pad = -c % block  # zero gain and zero values: the padding slots add nothing to A
        gains = jnp.pad(gain, ((0, 0), (0, 0), (0, 0), (0, pad))).reshape(b, kv, g, -1, block)
        us = jnp.pad(uf, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(b, kv, -1, block, h)
        a, _ = jax.lax.scan(lambda acc, xs: (acc + gram(*xs), None), jnp.broadcast_to(eye, (b, kv, g, h, h)),
                            (jnp.moveaxis(gains, 3, 0), jnp.moveaxis(us, 2, 0)))
    chol = jnp.linalg.cholesky(a)  # [B, K, G, H, H] lower

    def leverage(ub: Array, wb: Array) -> Array:  # ||L^{-1} u||^2 = u^T A^{-1} u, times w; [B, K, G, block]
        rhs = jnp.broadcast_to(jnp.swapaxes(ub, -1, -2)[:, :, None], (b, kv, g, h, ub.shape[2]))
        z = solve_triangular(chol, rhs, lower=True)
        return jnp.moveaxis(wb, -1, 2) * jnp.sum(z * z, axis=-2)

    return map_slot_blocks(leverage, (uf, jnp.moveaxis(w, 2, -1)), block)


@register
@dataclasses.dataclass(frozen=True)
class CapKV(ScoringMethod):
    """Capacity-aware leverage: `exp(tau * cos(k, mu_q)) * v^T A^{-1} v` with `A` the head's relevance-weighted
    value Gram matrix plus the identity; `n_sink` first tokens kept. kvpress's `CapPress` defaults."""

    name = "capkv"

    tau: float = 5.0
    n_future_positions: int = 512
    n_sink: int = 4
    epsilon: float = 1e-6
    normalize_alignment: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.name, "tau", self.tau, 0)
        check_number(self.name, "epsilon", self.epsilon, 0)
        check_int(self.name, "n_future_positions", self.n_future_positions, 1)
        check_int(self.name, "n_sink", self.n_sink, 0)
        check_bool(self.name, "normalize_alignment", self.normalize_alignment)
        if self.budget is not None and self.n_sink >= self.budget:
            raise ConfigError(
                f"{self.name}: n_sink={self.n_sink} must be smaller than budget={self.budget} (the budget counts "
                "the sink tokens)"
            )

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Array]:
        return query_statistics_state(spec, covariance=False)

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array:
        """The first `n_sink` tokens, never more than the budget (a small ratio budget keeps its first tokens)."""
        return protect_regions(cache, sink=jnp.minimum(self.n_sink, budget), last=False)

    def before_scoring(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Merges the chunk's pre-RoPE queries into the running mean."""
        return observe_queries(cache, q, step, self.n_sink, covariance=False)

    def query_anchor(self, cache: KVCache, step: Step) -> Array:
        """`mu_q` `[B, K, G, H]`: the mean pre-RoPE query rotated by the RoPE averaged over the next positions."""
        rotation = future_rotation(cache, step, self.n_future_positions)
        mean = jnp.einsum("bij,bnj->bni", rotation, cache.state["query_mean"])
        b, n, h = mean.shape
        return mean.reshape(b, cache.num_kv_heads, n // cache.num_kv_heads, h)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        stored = kvc.stored_mask(cache)
        candidates = stored if protect is None else stored & ~protect
        w = relevance_weights(self.query_anchor(cache, step), cache.k, candidates, self.tau, self.normalize_alignment)
        score = jnp.mean(weighted_leverage(w, cache.v, candidates, self.epsilon), axis=2)  # [B, K, C]
        return jnp.where(candidates, score, 0.0)
