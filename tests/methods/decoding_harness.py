"""One layer of a tiny model run through prefill then decode steps, for the decode-time compression tests
(`decoding`, `compression_ratio_decoding`): three ragged examples, GQA, float32."""

import jax.numpy as jnp
import numpy as np

from kvjax.methods.base import CacheSpec, per_example_budget
from kvjax.runtime import step

B, N, K, H = 3, 4, 2, 16
LENGTHS = np.array([20, 9, 24])
T, NEW = 24, 11
INV_FREQ = 1.0 / (10000.0 ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))


def kept_heads(cache):
    """Each example's and KV head's kept positions, sorted."""
    pos, length = np.asarray(cache.pos), np.asarray(cache.length)
    return [[sorted(pos[b, h][: length[b, h]].tolist()) for h in range(K)] for b in range(B)]


def run_layer(method, seed=0):
    """The layer's cache after prefill and after each of `NEW` decode steps, and the keys `[B, T + NEW, K, H]`."""
    rng = np.random.default_rng(seed)
    capacity = method.capacity(T, NEW)
    spec = CacheSpec(batch=B, kv_heads=K, capacity=capacity, num_heads=N, head_dim=H, num_layers=2,
                     dtype=jnp.float32)
    cache = step.init_cache(method, spec).layer(0)
    q = jnp.asarray(rng.normal(size=(B, T + NEW, N, H)), jnp.float32)
    k = rng.normal(size=(B, T + NEW, K, H)).astype(np.float32)
    v = jnp.asarray(rng.normal(size=(B, T + NEW, K, H)), jnp.float32)
    positions = np.arange(T)[None].repeat(B, 0)
    positions = jnp.asarray(np.where(positions < LENGTHS[:, None], positions, -1), jnp.int32)
    budget = jnp.asarray(per_example_budget(method, LENGTHS))
    kj = jnp.asarray(k)
    _, cache = step.prefill_layer(method, cache, q[:, :T], kj[:, :T], v[:, :T], positions, budget, layer=0,
                                  inv_freq=INV_FREQ, num_layers=2)
    caches = [cache]
    for i in range(NEW):
        pos = jnp.asarray((LENGTHS + i)[:, None], jnp.int32)
        r = slice(T + i, T + i + 1)
        _, cache = step.decode_layer(method, cache, q[:, r], kj[:, r], v[:, r], pos, budget, layer=0,
                                     inv_freq=INV_FREQ, num_layers=2)
        assert cache.capacity == capacity
        caches.append(cache)
    return caches, k


def knorm_scores(k, b: int) -> np.ndarray:
    """KNorm's float64 scores `[positions, K]` of example `b`'s prompt and new tokens, by position (`k` from
    `run_layer`)."""
    n = int(LENGTHS[b])
    rows = np.concatenate([np.arange(n), T + np.arange(NEW)])
    return -np.linalg.norm(k[b, rows].astype(np.float64), axis=-1)
