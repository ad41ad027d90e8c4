"""`ahakv`: AhaKV, "Adaptive Holistic Attention-Driven KV Cache Eviction" (Gu et al., 2025,
arXiv 2506.03762), Algorithm 1.

At the end of prefill, per layer and KV head (budget `B` tokens, recent budget `B_r`):

1. **Recent Accumulation** (RA, Eq. 5 / Alg. 1 line 8): the attention of the last `B_r` prompt rows
   summed per key, `F_j = sum_p P[p, j]`, so every candidate gets the same number of terms. `B_r` is
   the recent budget, `min(recent_size, B // 2)`: the same rows are summed and protected.
2. **Step-Gain softmax** (SG-softmax, Eqs. 9-12): those rows use the logits scaled by
   `lambda(i) = sqrt(2 ln(i / k) / d)` (`i` keys in the row, `k` the budget, `d` the head dim), the
   scale that makes the expected row entropy `log k`; clamped to 0 when `i <= k` (uniform row). Only
   the eviction score uses it; the model's attention is unchanged.
3. **Value-Prior Enhancement** (VPE, Eqs. 13-15): `F_hat = F * gamma / max(gamma)` with
   `gamma = AvgPool_kappa(||v_j||^2)` (zero padding, count_include_pad, over the valid tokens).
4. Selection: the `B_r` most recent tokens plus the top `B - B_r` others by `F_hat` (ties: lower
   position). GQA: scores are reduced over each group of query heads (mean; `group_reduce="max"`).

Decoding (Alg. 1 lines 16-33): every new token's SG-softmax row over the cache is added to the
running scores (`decode`, before the model attends), and after the model attended a token the
cache holds `B + 1` tokens, so the lowest-scoring token outside the `B_r` most recent is evicted
(`observe`). A prompt within the budget is kept whole and the first eviction happens when the cache
would exceed `B`.

Ambiguities (spec section 9), with the defaults the spec argues for and a flag each:
`sg_scale_on="raw_qk"` (lambda multiplies the raw `q . k`, as the derivation; `"scaled_qk"` is Alg. 1
read literally, lambda times `q . k / sqrt(d)`); `lambda_budget="total"` (`k = B`; `"selected"`:
`B - B_r`); per-row `i = position + 1` at prefill; `decode_lambda_i="cache_length"` (`i` = keys in
the decode row; `"absolute_position"`: position + 1); `kappa = 5` (`pool_kernel`; not in the paper,
SnapKV's default); pooling of the value norms only (`pool_score=True` also pools `F_hat`); no value
prior on decode increments (`vpe_in_decode=True` applies it, pooling the kept tokens in position
order); `B_r = min(recent_size, B // 2)` for budgets below `2 B_r` (the short-text setting).
The ablations of Table 2 are flags: `recent_accumulation=False` (H2O-style all-row accumulation),
`sg_softmax=False` (standard `1 / sqrt(d)` softmax), `value_prior=False`. With `sg_softmax=False`
and `value_prior=False` the prefill selection is SnapKV's window vote without pooling.
Chunked prefill (`chunk_size`) re-runs the selection after every chunk with that chunk's rows.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Method, Step, last_position
from kvjax.methods.capabilities import AttentionObserver
from kvjax.methods.common import oldest_slot
from kvjax.methods.registry import register
from kvjax.ops.scoring import accumulated_scores, pool1d, value_norm_scores, window_scores
from kvjax.ops.select import protect_regions, topk_keep

Array = jax.Array

SCALE_ON = ("raw_qk", "scaled_qk")
LAMBDA_BUDGET = ("total", "selected")
DECODE_LAMBDA_I = ("cache_length", "absolute_position")
GROUP_REDUCE = ("mean", "max")


def sg_lambda(i: Array | float, k: Array | float, head_dim: int) -> Array:
    """Eq. 12: `sqrt(2 ln(i / k) / d)`, float32, clamped to 0 where `i <= k` (and for `i < 1`)."""
    i = jnp.asarray(i, jnp.float32)
    k = jnp.maximum(jnp.asarray(k, jnp.float32), 1.0)
    gain = jnp.log(jnp.maximum(i, 1.0) / k)
    return jnp.sqrt(2.0 * jnp.maximum(gain, 0.0) / head_dim)


def value_prior(v: Array, stored: Array, kernel: int, pos: Array | None = None) -> Array:
    """VPE (Eqs. 13-14): `gamma / max(gamma)`, `gamma = AvgPool_kernel(||v||^2)` over the stored slots,
    `[B, K, C]` float32 in [0, 1] (1 where no value has any norm). With `pos`, slots are pooled in
    position order (a compressed cache after decode evictions is not sorted)."""
    nu = value_norm_scores(v, stored, squared=True)
    if pos is not None:
        order = jnp.argsort(jnp.where(stored, pos, jnp.iinfo(jnp.int32).max), axis=-1)
        inverse = jnp.argsort(order, axis=-1)
        sorted_valid = jnp.take_along_axis(stored, order, axis=-1)
        gamma = pool1d(jnp.take_along_axis(nu, order, axis=-1), kernel, "avg", valid=sorted_valid)
        gamma = jnp.take_along_axis(gamma, inverse, axis=-1)
    else:
        gamma = pool1d(nu, kernel, "avg", valid=stored)
    gamma = jnp.where(stored, gamma, 0.0)
    top = jnp.max(gamma, axis=-1, keepdims=True)
    return jnp.where(top > 0, gamma / jnp.where(top > 0, top, 1.0), 1.0)


def _check(name: str, ok: bool, value: object, what: str) -> None:
    if not ok:
        raise ConfigError(f"ahakv: {name} must be {what}, got {value!r}")


@register
@dataclasses.dataclass(frozen=True)
class AhaKV(Method, AttentionObserver):
    """AhaKV: RA over the last `recent_size` (32) rows with SG-softmax, value prior (avg-pool 5),
    top-k, H2O-style decode eviction; `budget` (1000 in the paper) or `compression_ratio`."""

    name = "ahakv"
    uses_score = True

    recent_size: int = 32
    pool_kernel: int = 5
    sg_softmax: bool = True
    sg_scale_on: str = "raw_qk"
    lambda_budget: str = "total"
    decode_lambda_i: str = "cache_length"
    recent_accumulation: bool = True
    value_prior: bool = True
    vpe_in_decode: bool = False
    pool_score: bool = False
    group_reduce: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.compresses:
            raise ConfigError("ahakv: needs budget= (tokens per KV head) or compression_ratio=")
        for name in ("recent_size", "pool_kernel"):
            value = getattr(self, name)
            _check(name, isinstance(value, int) and not isinstance(value, bool) and value >= 1, value,
                   "an integer >= 1")
        _check("pool_kernel", self.pool_kernel % 2 == 1, self.pool_kernel, "odd (centred pooling)")
        for name, choices in (("sg_scale_on", SCALE_ON), ("lambda_budget", LAMBDA_BUDGET),
                              ("decode_lambda_i", DECODE_LAMBDA_I), ("group_reduce", GROUP_REDUCE)):
            _check(name, getattr(self, name) in choices, getattr(self, name), f"one of {list(choices)}")
        for name in ("sg_softmax", "recent_accumulation", "value_prior", "vpe_in_decode", "pool_score"):
            _check(name, isinstance(getattr(self, name), bool), getattr(self, name), "a bool")
        if self.budget is not None and self.budget < 2:
            raise ConfigError(f"ahakv: budget must be >= 2 (recent + selected tokens), got {self.budget}")

    # ---- budgets -----------------------------------------------------------------------------------
    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        # B tokens stay between steps; the new token attends before the eviction: B + 1 slots.
        budget = self.budget if self.budget is not None else self.prompt_budget(prompt_len)
        return min(prompt_len + max_new_tokens, budget + 1)

    def _budget(self, step: Step) -> Array:
        """`[B]` tokens kept per KV head once the cache is full (not clipped to the prompt)."""
        if self.budget is not None:
            return jnp.full(step.budget.shape, self.budget, jnp.int32)
        return step.budget

    def _recent(self, budget: Array) -> Array:
        return jnp.minimum(self.recent_size, budget // 2)

    def _lambda_k(self, budget: Array) -> Array:
        return budget if self.lambda_budget == "total" else budget - self._recent(budget)

    def _scale(self, lam: Array, head_dim: int) -> Array | float:
        """Logit scale of the scoring rows: SG lambda on raw or scaled q.k, or the standard one."""
        if not self.sg_softmax:
            return 1.0 / math.sqrt(head_dim)
        return lam if self.sg_scale_on == "raw_qk" else lam / math.sqrt(head_dim)

    # ---- hooks -------------------------------------------------------------------------------------
    def scores(self, cache: KVCache, q: Array, step: Step) -> Array:
        """`F_hat` `[B, K, C]` float32 (Alg. 1 lines 6-10) of every stored slot for this chunk's rows."""
        stored = kvc.stored_mask(cache)
        d = cache.head_dim
        budget = self._budget(step)
        lam = sg_lambda(step.positions + 1, self._lambda_k(budget)[:, None], d)  # [B, T], i = p + 1
        scale = jnp.broadcast_to(jnp.asarray(self._scale(lam, d), jnp.float32), step.positions.shape)
        common = dict(group_reduce=self.group_reduce, scale=scale)
        if self.recent_accumulation:
            # Alg. 1 line 8: the B_r = min(recent_size, B // 2) latest rows, the protected window itself.
            last = jnp.max(step.positions, axis=-1, keepdims=True)
            rows = jnp.where(step.positions > last - self._recent(budget)[:, None], step.positions, -1)
            f = window_scores(q, rows, kvc.keys(cache), cache.pos, stored, window=self.recent_size,
                              row_reduce="sum", **common)
        else:
            f = accumulated_scores(q, step.positions, kvc.keys(cache), cache.pos, stored, **common)
        if self.value_prior:
            f = f * value_prior(kvc.values(cache), stored, self.pool_kernel)
        if self.pool_score:
            f = pool1d(f, self.pool_kernel, "avg", valid=stored)
        return jnp.where(stored, f, 0.0)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        stored = kvc.stored_mask(cache)
        f_hat = self.scores(cache, q, step)
        # Examples without queries in this chunk (their prompt ended earlier) keep cache and scores.
        active = jnp.any(step.positions >= 0, axis=-1)
        cache = cache.replace(score=jnp.where(active[:, None, None], f_hat, cache.score))
        budget = jnp.where(active, step.budget, jnp.iinfo(jnp.int32).max)
        protect = protect_regions(cache, recent=self._recent(self._budget(step)), last=False)
        idx, count = topk_keep(f_hat, stored, budget, capacity=step.capacity, protect=protect, positions=cache.pos)
        return kvc.compact(cache, idx, count)

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Alg. 1 line 27: `F_t = SG-softmax(q K^T) + F_{t-1}` for the new token's row (its own key
        included), reduced over the group; the model's attention is untouched."""
        stored = kvc.stored_mask(cache)
        b, kv, c, d = cache.k.shape
        qg = q[:, 0].reshape(b, kv, -1, d).astype(jnp.float32)
        logits = jnp.einsum("bkgh,bkch->bkgc", qg, kvc.keys(cache, jnp.float32))
        if self.decode_lambda_i == "cache_length":
            i = cache.length.astype(jnp.float32)
        else:
            i = jnp.broadcast_to((step.positions[:, :1] + 1).astype(jnp.float32), (b, kv))
        lam = sg_lambda(i, self._lambda_k(self._budget(step))[:, None], d)
        scale = jnp.broadcast_to(jnp.asarray(self._scale(lam, d), jnp.float32), (b, kv))
        logits = jnp.where(stored[:, :, None], logits * scale[..., None, None], -jnp.inf)
        top = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.where(stored[:, :, None], jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
        p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
        inc = jnp.mean(p, axis=2) if self.group_reduce == "mean" else jnp.max(p, axis=2)
        if self.vpe_in_decode:
            inc = inc * value_prior(kvc.values(cache), stored, self.pool_kernel, pos=cache.pos)
        return cache.replace(score=cache.score + jnp.where(stored, inc, 0.0))

    def observe(self, cache: KVCache, weights: Array, step: Step) -> KVCache:
        """Alg. 1 lines 28-30 after the token attended: over budget, evict the lowest score outside the
        recent window (ties: lower position)."""
        budget = self._budget(step)[:, None]
        stored = kvc.stored_mask(cache)
        newest = last_position(cache)
        recent = cache.pos > (newest - self._recent(budget))[..., None]
        cand = stored & ~recent
        low = jnp.min(jnp.where(cand, cache.score, jnp.inf), axis=-1, keepdims=True)
        tie = cand & (cache.score == low)
        victim = oldest_slot(cache, tie)
        over = (cache.length > budget) & jnp.any(cand, axis=-1)
        return kvc.evict(cache, victim, where=over)
