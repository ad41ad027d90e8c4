"""Helpers more than one method uses, so that no method imports another method's file for them.

* Budgets: `head_cap` (Ada-KV's per-head cap: `adakv`, `criticaladakv`, `kvzip`, `fastkvzip`, `kvcompose`),
  `descending_rank` (ranks, ties to the lower index: `kvzip`, `fastkvzip`, `kvcompose`, `lagkv`), `cache_limit` and
  `rolling_capacity` (a cache held at its budget while decoding: `h2o`, `tova`, `lm_infinite`, `quest`),
  `keep_masks` (one ranking of an example's pairs across every layer and head, capped per head: `kvzip`, `kvgrad`,
  `fastkvzip`).
* The prompt reading itself (`kvzip`, `kvcompose` through the plain step API): `self_read_probs`.
* Learned scores (`kvzap`, `fastkvzip`): `read_safetensors` (a published file's tensors, nothing unpickled),
  `write_entry_scores` (a chunk's per-token scores into `cache.score`).
* Slots: `stored_tokens`, `new_slots` (the step's own tokens: `dms`, `decoding`), `lowest_slot` (the next
  eviction of a decode-time evictor: `h2o`, `tova`).
* Positions and draws: `pack_positions` (kept keys re-rotated to contiguous positions: `key_rerotation`,
  `finch`), `token_uniform` (a counter-based uniform per token: `random`, `nacl`).
* Chunks (`chunkkv`, `entropy_gated_chunkkv`): `dense_chunk_ids`, `ranked_chunks` (sizes, means, order).
* Key leverage (`compactor`, `leverage`): `cache_key_leverage` (the cache's pre-RoPE keys), through
  `gaussian_sketch` (a layer's seeded right sketch) and `sketched_leverage` (with `cholesky_with_jitter`, kvpress's
  growing jitter, `jitters`); `z_scores` over an example's heads.
* Query statistics (`expected_attention`, `capkv`): the prompt's pre-RoPE queries as running count / mean /
  centred second moment in `cache.state` (`query_statistics_state`, `observe_queries`, `merge_statistics`), and
  the RoPE rotation averaged over the positions to come (`average_rotation`, `future_rotation`).

Hyperparameter checks live in `kvjax.validation`; the method protocol's own helpers (`last_position`,
`per_example_budget`) in `kvjax.methods.base`.
"""

from __future__ import annotations

import json
import math
import pathlib
import struct
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Method, Step, last_position
from kvjax.ops import select
from kvjax.ops.scoring import pool1d, value_norm_scores
from kvjax.rope import rotate_by

Array = jax.Array

__all__ = ["PARTIAL_CHUNK", "average_rotation", "cache_key_leverage", "cache_limit", "chunk_attention",
           "chunk_attention_scores", "cholesky_with_jitter", "dense_chunk_ids",
           "descending_rank", "future_rotation", "gaussian_sketch", "head_cap", "jitters", "keep_masks", "lowest_slot",
           "merge_statistics", "new_slots", "observe_queries", "pack_positions", "query_statistics_state",
           "ranked_chunks", "read_safetensors", "rolling_capacity", "self_read_probs", "sketched_leverage",
           "stored_tokens", "token_uniform", "write_entry_scores", "z_scores"]


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


# ---- key leverage -------------------------------------------------------------------------------------------


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


def cache_key_leverage(cache: KVCache, valid: Array, step: Step, seed: int, sketch_dimension: int,
                       ridge: float) -> Array:
    """`[B, K, C]` sketched leverage of the cache's pre-RoPE keys over its `valid` slots: each key rotated back by
    its position in float32 (a bf16 key un-rotated in bf16 would be rounded twice), the layer's seeded sketch
    scaled by `1 / sqrt(sketch_dimension)`."""
    pre_rope = rotate_by(cache.k.astype(jnp.float32), -jnp.maximum(cache.pos, 0), step.inv_freq)
    sketch = gaussian_sketch(seed, step.layer, cache.num_kv_heads, cache.head_dim, sketch_dimension)
    return sketched_leverage(pre_rope, valid, sketch / sketch_dimension ** 0.5, float(ridge))


# ---- chunks -------------------------------------------------------------------------------------------------


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


def ranked_chunks(member: Array, total: Array, pos: Array, chunk: int) -> tuple[Array, Array, Array, Array]:
    """One example's chunks of `chunk` positions over its `member` slots `[C]`, `total` `[C]` their scores:
    `(dense ids [C], sizes [C], mean scores [C], chunk order [C])`, the order by decreasing mean (ties: the lower
    first position), chunks without members last."""
    c = member.shape[0]
    dense = dense_chunk_ids(member, pos, chunk)
    size = jax.ops.segment_sum(member.astype(jnp.int32), dense, num_segments=c)
    mean = jax.ops.segment_sum(jnp.where(member, total, 0.0), dense, num_segments=c)
    mean = mean / jnp.maximum(size, 1).astype(jnp.float32)
    first_pos = jax.ops.segment_min(jnp.where(member, pos, jnp.iinfo(jnp.int32).max), dense, num_segments=c)
    ids = jnp.arange(c, dtype=jnp.int32)
    order = jax.lax.sort(((size == 0).astype(jnp.int32), -mean, first_pos, ids), num_keys=3)[-1]
    return dense, size, mean, order


# ---- query statistics ---------------------------------------------------------------------------------------


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
    # float32 before un-rotating: a bf16 query rotated back and stored in bf16 would be rounded a second time
    back = -jnp.broadcast_to(step.positions[..., None], q.shape[:3])
    unrotated = rotate_by(q.astype(jnp.float32), back, step.inv_freq)
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


# ---- learned scores -----------------------------------------------------------------------------------------

_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "F64": np.dtype(np.float64),
           "BF16": np.dtype(ml_dtypes.bfloat16)}


def read_safetensors(path: pathlib.Path, who: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 numpy arrays (header and raw data; nothing unpickled); errors
    name `who` (the method reading it)."""
    try:
        raw = path.read_bytes()
        (size,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + size])
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{who}: cannot read safetensors file {str(path)!r}: {e}") from e
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ConfigError(f"{who}: tensor {name!r} of {str(path)!r} has dtype {entry.get('dtype')!r}; "
                              f"expected one of {sorted(_DTYPES)}")
        start, end = entry["data_offsets"]
        data = np.frombuffer(raw, dtype=dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype,
                             count=(end - start) // dtype.itemsize, offset=8 + size + start)
        out[name] = data.reshape(entry["shape"]).astype(np.float32)
    return out


def write_entry_scores(cache: KVCache, new: Array, positions: Array) -> KVCache:
    """`cache.score` with the slots of the chunk at `positions` `[B, T]` (contiguous per row, -1 padding) set to
    their rows of `new` `[B, T, K]`; every other slot keeps its score."""
    t = positions.shape[1]
    start = positions[:, :1, None]  # [B, 1, 1]
    row = cache.pos - start  # [B, K, C]
    inside = kvc.stored_mask(cache) & (start >= 0) & (row >= 0) & (row < t)
    safe = jnp.clip(row, 0, t - 1)
    per_head = jnp.swapaxes(new, 1, 2)  # [B, K, T]
    picked = jnp.take_along_axis(per_head, safe, axis=-1)
    return cache.replace(score=jnp.where(inside, picked, cache.score))


# ---- the prompt reading itself ------------------------------------------------------------------------------


def self_read_probs(cache: KVCache, q: Array, step: Step) -> tuple[Array, Array]:
    """The call's own rows reading the cache: `[B, K, G, R, C]` float32 causal softmax probabilities of each query
    head (its KV head `K`, group index `G`) over the stored slots, 0 where a row is padding or cannot see the slot;
    and the `[B, R]` real rows (`kvzip` and `kvcompose` score this way through the plain step API)."""
    batch, rows, num_heads, dim = q.shape
    kv_heads = cache.pos.shape[1]
    qg = jnp.moveaxis(q.astype(jnp.float32).reshape(batch, rows, kv_heads, num_heads // kv_heads, dim), 1, 3)
    raw = jnp.einsum("bkgrh,bkch->bkgrc", qg, kvc.keys(cache, jnp.float32)) / math.sqrt(dim)
    real = step.positions >= 0
    sees = kvc.stored_mask(cache)[:, :, None, None, :] & \
        (cache.pos[:, :, None, None, :] <= step.positions[:, None, None, :, None])
    probs = jax.nn.softmax(jnp.where(sees, raw, -jnp.inf), axis=-1)
    return jnp.where(real[:, None, None, :, None] & sees, probs, 0.0), real


# ---- one ranking across layers ------------------------------------------------------------------------------

def descending_rank(key: Array) -> Array:
    """Each entry's place (0 = largest) along the last axis; ties: lower index first."""
    order = jnp.argsort(-key, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def keep_masks(scores: tuple[Array, ...], stored: tuple[Array, ...], positions: tuple[Array, ...], budget: Array,
               cap: Array, n_sink: int, layerwise: bool, total: Array | None = None) -> tuple[Array, ...]:
    """Which slots each layer keeps (`[B, K, C]` bool per layer).

    Slots at positions `< n_sink` are protected; each head keeps at most `cap` `[B]` slots (protected first, then
    its best scores); the example keeps its best `budget` `[B]` per KV head and layer, ranked across every layer
    and head (`layerwise`: within each layer); `total` `[B]`, where given, is the example's count instead (of all
    layers, or of each layer with `layerwise`)."""
    sinks = jnp.minimum(n_sink, cap)[:, None, None]
    keys = []
    for score, ok, pos in zip(scores, stored, positions, strict=True):
        protect = ok & (pos < sinks)
        candidate = ok & ~protect
        room = cap[:, None, None] - jnp.sum(protect, axis=-1, keepdims=True)
        eligible = candidate & (descending_rank(jnp.where(candidate, score, -jnp.inf)) < room)
        keys.append(jnp.where(protect, jnp.inf, jnp.where(eligible, score.astype(jnp.float32), -jnp.inf)))
    batch, heads = keys[0].shape[:2]
    per_layer = budget.astype(jnp.int32) * heads

    def top(group: list[Array], total: Array) -> list[Array]:
        sizes = [x.shape[-1] for x in group]
        flat = jnp.concatenate([x.reshape(batch, heads * c) for x, c in zip(group, sizes, strict=True)], axis=-1)
        kept = (descending_rank(flat) < total[:, None]) & (flat > -jnp.inf)
        out, at = [], 0
        for c in sizes:
            out.append(kept[:, at : at + heads * c].reshape(batch, heads, c))
            at += heads * c
        return out

    if layerwise:
        return tuple(top([x], per_layer if total is None else total)[0] for x in keys)
    return tuple(top(keys, per_layer * len(keys) if total is None else total))


#: Where the queries of part of the prompt scored alone (`chunk`, `block`) are rotated (`query_rope`): at their own
#: positions, or as kvpress's presses rotate them (with the RoPE of the prompt's last positions).
QUERY_ROPE = ("own", "kvpress")

#: How Compactor's chunk attention scores a partial last chunk (`partial_chunk`): see kvjax/methods/compactor.py.
PARTIAL_CHUNK = ("fill", "kvpress", "drop")


def chunk_attention(q: Array, k: Array, middle: Array, start: int, chunk: int, partial: str = "fill") -> Array:
    """Non-causal attention inside chunks of `chunk` positions from `start`, one-shot layout (slot `j` and query
    row `j` both hold position `j`): per KV head, the column sums over each chunk's query rows of their softmax
    over the chunk's keys, averaged over the group; `[B, K, C]`. `middle` `[B, K, C]`: the tokens taking part.
    A chunk of `m < chunk` such tokens: `partial` (`PARTIAL_CHUNK`) "fill" adds `(chunk - m) / chunk` to each
    of its keys (the missing query rows' uniform votes), "kvpress" also puts `chunk - m` keys at logit 0 in each
    row's softmax, "drop" adds nothing."""
    b, t, n, h = q.shape
    kv, c = k.shape[1], k.shape[2]
    g = n // kv
    count = max(1, -(-(c - start) // chunk))
    width = start + count * chunk
    qg = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, max(0, width - t)), (0, 0), (0, 0)))[:, :width]
    qg = qg.reshape(b, width, kv, g, h)
    kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, 0), (0, max(0, width - c)), (0, 0)))[:, :, :width]
    ok = jnp.pad(middle, ((0, 0), (0, 0), (0, max(0, width - c))))[:, :, :width]

    def one(i: Array) -> Array:
        lo = start + i * chunk
        qc = jax.lax.dynamic_slice_in_dim(qg, lo, chunk, axis=1)  # [B, chunk, K, G, H]
        kc = jax.lax.dynamic_slice_in_dim(kp, lo, chunk, axis=2)  # [B, K, chunk, H]
        mc = jax.lax.dynamic_slice_in_dim(ok, lo, chunk, axis=2)  # [B, K, chunk]
        missing = chunk - jnp.sum(mc, axis=-1).astype(jnp.float32)  # [B, K]
        logits = jnp.einsum("btkgh,bkch->bkgtc", qc, kc)
        logits = jnp.where(mc[:, :, None, None, :], logits, -jnp.inf)
        top = jnp.max(logits, axis=-1, keepdims=True)
        if partial == "kvpress":  # the padding keys' logit 0 joins the maximum only where there are some
            top = jnp.where(missing[:, :, None, None, None] > 0, jnp.maximum(top, 0.0), top)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        e = jnp.exp(logits - top)
        denom = jnp.sum(e, axis=-1, keepdims=True)
        if partial == "kvpress":  # the padding keys, zero vectors, at logit 0 (top >= 0 where there are some)
            pads = missing[:, :, None, None, None]
            denom = denom + jnp.where(pads > 0, pads * jnp.exp(-jnp.maximum(top, 0.0)), 0.0)
        p = e / jnp.maximum(denom, 1e-30)
        p = jnp.where(mc[:, :, None, :, None], p, 0.0)  # rows outside the middle do not vote
        col = jnp.mean(jnp.sum(p, axis=3), axis=2)  # [B, K, chunk]
        if partial != "drop":  # the missing rows' uniform votes
            col = jnp.where(mc, col + missing[..., None] / chunk, 0.0)
        return col

    cols = jax.lax.map(one, jnp.arange(count))  # [count, B, K, chunk]
    cols = jnp.moveaxis(cols, 0, 2).reshape(b, kv, count * chunk)
    out = jnp.concatenate([jnp.zeros((b, kv, start), jnp.float32), cols], axis=-1)
    return jnp.pad(out, ((0, 0), (0, 0), (0, max(0, c - out.shape[-1]))))[:, :, :c]


def chunk_attention_scores(q: Array, cache: KVCache, middle: Array, start: int, chunk: int, partial: str) -> Array:
    """Compactor's attention signal, before its z-score: `chunk_attention` times `||v_i||`, average-pooled over 3
    neighbours (kvpress's `NonCausalAttnPress`); `[B, K, C]`."""
    attention = chunk_attention(q, cache.k, middle, start, chunk, partial)
    return pool1d(attention * value_norm_scores(cache.v), 3, "avg", valid=middle)
