"""Helpers more than one method uses, so that no method imports another method's file for them.

* Budgets: `head_cap` (Ada-KV's per-head cap: `adakv`, `criticaladakv`, `kvzip`), `cache_limit` and
  `rolling_capacity` (a cache held at its budget while decoding: `h2o`, `tova`, `lm_infinite`, `quest`).
* Slots: `stored_tokens`, `new_slots` (the step's own tokens: `dms`, `decoding`), `lowest_slot` (the next
  eviction of a decode-time evictor: `h2o`, `tova`).
* Positions and draws: `pack_positions` (kept keys re-rotated to contiguous positions: `key_rerotation`,
  `finch`), `token_uniform` (a counter-based uniform per token: `random`, `nacl`), `dense_chunk_ids` (chunks of
  consecutive positions: `chunkkv`, `entropy_gated_chunkkv`).
* Key leverage (`compactor`, `leverage`): `gaussian_sketch` (a layer's seeded right sketch), `sketched_leverage`
  (through `cholesky_with_jitter`, kvpress's growing jitter, `jitters`), `z_scores` over an example's heads.

Hyperparameter checks live in `kvjax.validation`; the method protocol's own helpers (`last_position`,
`per_example_budget`) in `kvjax.methods.base`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.methods.base import Method, Step
from kvjax.ops import select

Array = jax.Array

__all__ = ["cache_limit", "cholesky_with_jitter", "dense_chunk_ids", "gaussian_sketch", "head_cap", "jitters",
           "lowest_slot", "new_slots", "pack_positions", "rolling_capacity", "sketched_leverage", "stored_tokens",
           "token_uniform", "z_scores"]


# ---- budgets ------------------------------------------------------------------------------------------------


def head_cap(budget: Any, share: float) -> Any:
    """`ceil(budget * share)` in float32, identically on host (static capacity) and in a trace."""
    if isinstance(budget, int | np.integer):
        return int(np.ceil(np.float32(budget) * np.float32(share)))
    return jnp.ceil(budget.astype(jnp.float32) * jnp.float32(share)).astype(jnp.int32)


def cache_limit(method: Method, step: Step) -> Array:
    """`[B]` int32 tokens per KV head once the cache is full: `budget` as given (not clipped to the
    prompt, so a short prompt's cache grows with generated tokens up to it), or with a ratio the
    example's own prompt budget."""
    if method.budget is not None:
        return jnp.full(step.budget.shape, method.budget, jnp.int32)
    return step.budget


def rolling_capacity(method: Method, prompt_len: int, max_new_tokens: int) -> int:
    """Static slots for a cache kept at its limit: the limit plus the token that arrives before the
    eviction, never more than the whole sequence."""
    limit = method.budget if method.budget is not None else method.prompt_budget(prompt_len)
    return min(prompt_len + max_new_tokens, limit + 1)


# ---- slots --------------------------------------------------------------------------------------------------


def stored_tokens(cache: KVCache) -> Array:
    """`[B]` int32 tokens held per example (the largest head length)."""
    return jnp.max(cache.length, axis=-1).astype(jnp.int32)


def new_slots(cache: KVCache, positions: Array) -> Array:
    """`[B, K, C]` the stored slots holding one of the step's tokens (`positions` `[B, T]`, contiguous per row)."""
    t = positions.shape[1]
    start = positions[:, :1, None]
    row = cache.pos - start
    return kvc.stored_mask(cache) & (start >= 0) & (row >= 0) & (row < t)


def lowest_slot(score: Array, candidates: Array, pos: Array) -> Array:
    """`[B, K]` slot of the lowest `score` `[B, K, C]` among `candidates`; among tied scores the
    latest position goes (lower positions win ties, as in `topk_keep`)."""
    low = jnp.min(jnp.where(candidates, score, jnp.inf), axis=-1, keepdims=True)
    tie = candidates & (score <= low)
    return select.argmax(jnp.where(tie, pos, -1))


def oldest_slot(cache: KVCache, among: Array) -> Array:
    """`[B, K]` int32 slot of the lowest position among the slots `among` `[B, K, C]` (0 where there is none): the
    victim of a first-in-first-out eviction."""
    return select.argmin(jnp.where(among, cache.pos, jnp.iinfo(jnp.int32).max))


# ---- positions and draws ------------------------------------------------------------------------------------


def pack_positions(cache: KVCache, seen: Array, inv_freq: Array) -> KVCache:
    """Keys of every head moved to contiguous positions ending at `seen - 1` (`seen` `[B]`), in slot order
    (slots are in position order after a selection)."""
    slot = jnp.arange(cache.capacity, dtype=jnp.int32)
    target = seen[:, None, None] - cache.length[..., None] + slot
    delta = jnp.where(kvc.stored_mask(cache), target - cache.pos, 0)
    return kvc.rerotate(cache, delta, inv_freq)


def _mix(x: Array) -> Array:
    """MurmurHash3's 32-bit finaliser: a bijective avalanche of a uint32."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def token_uniform(seed: int, layer: Array, positions: Array) -> Array:
    """`[B, K, C]` float32 uniforms in [0, 1) hashed from (seed, layer, KV head, position).

    A counter-based hash (chained MurmurHash3 finalisers), so the draw of a token depends on
    nothing else: not the batch, the slot, nor the chunking.
    """
    heads = jnp.arange(positions.shape[1], dtype=jnp.uint32)[None, :, None]
    h = _mix(jnp.uint32(seed & 0xFFFFFFFF) ^ jnp.uint32(0x9E3779B9))
    h = _mix(h ^ jnp.asarray(layer).astype(jnp.uint32))
    h = _mix(h ^ heads)
    h = _mix(h ^ jnp.maximum(positions, 0).astype(jnp.uint32))
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def z_scores(x: Array, valid: Array) -> Array:
    """`(x - mean) / std` over each example's valid entries of `[B, K, C]` (unbiased std, floored at 1e-6)."""
    n = jnp.maximum(jnp.sum(valid, axis=(1, 2), keepdims=True), 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, x, 0.0), axis=(1, 2), keepdims=True) / n
    var = jnp.sum(jnp.where(valid, (x - mean) ** 2, 0.0), axis=(1, 2), keepdims=True) / jnp.maximum(n - 1, 1.0)
    return jnp.where(valid, (x - mean) / jnp.maximum(jnp.sqrt(var), 1e-6), 0.0)


#: Cholesky tries of the sketched Gram matrix, the jitter growing between them (kvpress's escalation).
CHOLESKY_TRIES = 5


def gaussian_sketch(seed: int, layer: int | Array, kv_heads: int, head_dim: int, dim: int) -> Array:
    """`[K, H, S]` standard normal draws of layer `layer`'s right sketch (scaled by `1 / sqrt(S)` where used)."""
    key = jax.random.fold_in(jax.random.key(seed), layer)
    return jax.random.normal(key, (kv_heads, head_dim, dim), jnp.float32)


def jitters(ridge: float, tries: int = CHOLESKY_TRIES) -> list[float]:
    """The ridge of each Cholesky try: `ridge`, then 1e-2 after a zero ridge, else 10x the last (at least 1e-8)."""
    out = [float(ridge)]
    for _ in range(tries - 1):
        out.append(max(1e-8, 1e-2 if out[-1] == 0.0 else 10.0 * out[-1]))
    return out


def cholesky_with_jitter(gram: Array, ridge: float) -> Array:
    """Lower Cholesky factor of `gram + r I` `[B, K, S, S]`, `r` the first of `jitters(ridge)` whose factor is
    finite for every head of the example."""
    eye = jnp.eye(gram.shape[-1], dtype=gram.dtype)
    chol = None
    for r in jitters(ridge):
        trial = jnp.linalg.cholesky(gram + r * eye)
        if chol is None:
            chol = trial
            continue
        failed = ~jnp.all(jnp.isfinite(chol), axis=(1, 2, 3), keepdims=True)
        chol = jnp.where(failed, trial, chol)
    return chol


def sketched_leverage(keys: Array, valid: Array, sketch: Array, ridge: float) -> Array:
    """`[B, K, C]` leverage of each valid row of `keys` `[B, K, C, H]` after centring and the right sketch
    `sketch` `[K, H, S]`: `diag(Y (Y^T Y + ridge I)^{-1} Y^T)`, `Y = (X - mean) sketch`, clamped at 0."""
    w = valid[..., None].astype(jnp.float32)
    x = keys.astype(jnp.float32)
    mean = jnp.sum(x * w, axis=2, keepdims=True) / jnp.maximum(jnp.sum(w, axis=2, keepdims=True), 1.0)
    y = jnp.einsum("bkch,khs->bkcs", (x - mean) * w, sketch)
    chol = cholesky_with_jitter(jnp.einsum("bkcs,bkct->bkst", y, y), ridge)
    solved = jax.scipy.linalg.solve_triangular(chol, jnp.swapaxes(y, -1, -2), lower=True)  # L^{-1} Y^T
    return jnp.where(valid, jnp.maximum(jnp.sum(solved * solved, axis=-2), 0.0), 0.0)


def dense_chunk_ids(member: Array, pos: Array, chunk: int) -> Array:
    """`[C]` int32: one example's chunk (`pos // chunk`) of each `member` slot as a dense id `0, 1, ...` in position
    order (a chunk's slots need not be adjacent); the other slots share the id after the last chunk."""
    c = member.shape[0]
    cid = jnp.where(member, pos // chunk, jnp.iinfo(jnp.int32).max)
    slot = jnp.arange(c, dtype=jnp.int32)
    s_cid, s_slot = jax.lax.sort((cid, slot), num_keys=2)
    opens = jnp.concatenate([jnp.ones((1,), bool), s_cid[1:] != s_cid[:-1]])
    dense_sorted = jnp.cumsum(opens.astype(jnp.int32)) - 1
    return jnp.zeros((c,), jnp.int32).at[s_slot].set(dense_sorted)
