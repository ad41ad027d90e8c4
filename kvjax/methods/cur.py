"""`cur`: CurDKV, "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition" (Sengupta et al.,
2025; kvpress's `CURPress`).

A CUR decomposition approximates a matrix by a few of its actual rows, sampled by their leverage scores; CurDKV
applies it to each KV head's key and value matrices, so the kept pairs are those that best span what the keys
and values can express, not those a query happened to attend. Leverage needs a factorisation; CurDKV
approximates the leverage of row `i` by its squared norm (exact in expectation for a Gaussian sketch `G`:
`E ||x_i G||^2 = ||x_i||^2`), optionally after such a sketch (`use_random_leverage`, `r = 20` columns):

1. `l^K_i = ||k_i||^2`, `l^V_i = ||v_i||^2` (or of `k_i G`, `v_i G`).
2. Local approximation (`use_local_approximation`): each is normalised within its window of
   `local_window_size` positions (`l_i / sum_{j in window(i)} l_j`), so the selection spreads over the prompt.
3. Combined by `leverage_type`: `kv_product` `l^K_i l^V_i` (default), `kv_avg`, `key` or `value`, then
   normalised to sum to one per head.
4. The first `num_sinks` tokens are always kept (the budget counts them: a smaller budget keeps its first
   `budget` tokens); each head keeps its best pairs.

Defaults are kvpress 0.5.5's (`num_sinks=4`, `kv_product`, local windows of 16, no sketch). The sketch, when on,
is drawn from `seed` and the layer index (kvpress draws it from torch's global generator). Windows are by
position (`pos // local_window_size`), which is kvpress's slot blocks for a one-shot prefill and stays
meaningful after chunked compression.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.methods.base import Step
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.select import protect_regions
from kvjax.validation import check_bool, check_choice, check_int

Array = jax.Array

LEVERAGE_TYPES = ("kv_product", "kv_avg", "key", "value")
SKETCH_COLUMNS = 20


def window_normalised(x: Array, pos: Array, valid: Array, window: int) -> Array:
    """`x / (sum of x over the valid slots in the same window of positions)`, `[B, K, C]`; slots sorted by
    position within each head (as prefill keeps them), so a window is a run of slots."""
    block = jnp.where(valid, pos // window, -1)
    start = jnp.concatenate([jnp.ones_like(block[..., :1], bool), block[..., 1:] != block[..., :-1]], axis=-1)
    segment = jnp.cumsum(start, axis=-1) - 1  # [B, K, C] run index within the row
    b, k, c = x.shape
    flat = (segment + jnp.arange(b * k).reshape(b, k, 1) * c).reshape(-1)
    sums = jax.ops.segment_sum(jnp.where(valid, x, 0.0).reshape(-1), flat, num_segments=b * k * c)
    total = sums[flat].reshape(b, k, c)
    return jnp.where(valid, x / jnp.where(total > 0, total, 1.0), 0.0)


@register
@dataclasses.dataclass(frozen=True)
class CUR(ScoringMethod):
    """Approximate CUR leverage of keys and values (squared norms, locally normalised, multiplied); `num_sinks`
    first tokens kept. kvpress's `CURPress` defaults."""

    name = "cur"

    num_sinks: int = 4
    leverage_type: str = "kv_product"
    use_local_approximation: bool = True
    local_window_size: int = 16
    use_random_leverage: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "num_sinks", self.num_sinks, 0)
        check_int(self.name, "local_window_size", self.local_window_size, 1)
        check_int(self.name, "seed", self.seed, 0)
        check_choice(self.name, "leverage_type", self.leverage_type, LEVERAGE_TYPES)
        check_bool(self.name, "use_local_approximation", self.use_local_approximation)
        check_bool(self.name, "use_random_leverage", self.use_random_leverage)

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array:
        """The first `num_sinks` tokens, never more than the budget (a small budget keeps its first tokens)."""
        return protect_regions(cache, sink=jnp.minimum(self.num_sinks, budget), last=False)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        stored = kvc.stored_mask(cache)
        k, v = cache.k.astype(jnp.float32), cache.v.astype(jnp.float32)
        if self.use_random_leverage:
            key = jax.random.fold_in(jax.random.key(self.seed), step.layer)
            sketch = jax.random.normal(key, (cache.head_dim, SKETCH_COLUMNS), jnp.float32) / SKETCH_COLUMNS ** 0.5
            k, v = k @ sketch, v @ sketch
        lk, lv = jnp.sum(k * k, axis=-1), jnp.sum(v * v, axis=-1)
        if self.use_local_approximation:
            lk = window_normalised(lk, cache.pos, stored, self.local_window_size)
            lv = window_normalised(lv, cache.pos, stored, self.local_window_size)
        score = {"kv_product": lk * lv, "kv_avg": (lk + lv) / 2, "key": lk, "value": lv}[self.leverage_type]
        score = jnp.where(stored, score, 0.0)
        return score / jnp.maximum(jnp.sum(score, axis=-1, keepdims=True), 1e-30)
