"""Pallas kernels for selection and compaction (twins of `kvjax.ops.select.topk_keep` and
`kvjax.ops.gather.gather_kept`).

**Threshold top-k** (`threshold_topk`). No sort, no top-k, no integer reduction: only compares and
float32 counts (exact below 2^24 slots), so it lowers on Mosaic TPU. Rows of 8 heads are processed
together with the whole slot axis in VMEM. Per row, from the int32 order key of
`kvjax._kernel_common.order_key` (protected = INT_MAX, invalid = INT_MIN):

1. the kept count `min(max(budget, #protected), #valid, capacity)`;
2. the key `T` of the last kept slot, the largest `t` with `#{key >= t} >= count`, found bit by bit
   (the sign first, then bits 30..0: 32 counting passes, no overflow);
3. the ties at `T`: the `count - #{key > T}` lowest positions among them, by the same search on
   `~position` (order-reversing, overflow-free).

The kept mask is `key > T | (key == T & position <= P)`: exactly the set `topk_keep` keeps.

**Compaction** (`gather_rows`). The kept slots' indices are scalar-prefetched (SMEM); K and V stay in
HBM (`pl.ANY`) and each grid step DMAs a block of rows of each into the output blocks, all copies in
flight before the first wait. Index lists come from the mask by a prefix count in XLA (O(C), no sort);
when the slots' positions are not their slot order, only the `capacity` kept entries are sorted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax import tuning
from kvjax._kernel_common import broadcast_lead, order_key
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.pallas._common import INT_MAX, INT_MIN, Interpret, compiler_params, interpret_mode, pad_axis, round_up

Array = jax.Array

_MAX_SLOTS = 1 << 24  # counts are float32 sums


# ------------------------------------------------------------------------------------------------
# Threshold search
# ------------------------------------------------------------------------------------------------


def _chunked_count(pred: Callable[[pl.Slice], Array], width: int, chunk: int, rows: int) -> Array:
    """Per row, the number of True entries of `pred(lanes)` over `width` lanes, `chunk` lanes at a time,
    as float32 `[rows, 1]` (TPU has no integer reductions; exact below 2^24)."""

    def body(i: Array, acc: Array) -> Array:
        lanes = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
        return acc + jnp.sum(jnp.where(pred(lanes), 1.0, 0.0), axis=1, keepdims=True)

    return jax.lax.fori_loop(0, width // chunk, body, jnp.zeros((rows, 1), jnp.float32))


def _largest_threshold(count_at_least: Callable[[Array], Array], need: Array) -> Array:
    """Per row, the largest int32 `t` with `count_at_least(t) >= need` (`[R, 1]`; the count is non-increasing
    in `t` and `need` float32 >= 1 is reachable).

    Sign bit first (is `t >= 0` feasible?), then bits 30..0 greedily: with the sign fixed, two's
    complement order is the order of the low 31 bits. 32 counting passes, no overflow.
    """
    lo = jnp.where(count_at_least(jnp.zeros(need.shape, jnp.int32)) >= need, 0, INT_MIN).astype(jnp.int32)

    def step(_: int, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        lo, bit = carry
        cand = lo | bit
        return jnp.where(count_at_least(cand) >= need, cand, lo), bit >> 1

    lo, _ = jax.lax.fori_loop(0, 31, step, (lo, jnp.full(need.shape, 1 << 30, jnp.int32)))
    return lo


def _topk_kernel(key_ref: Array, pos_ref: Array, budget_ref: Array, keep_ref: Array, count_ref: Array, *,
                 capacity: int, chunk: int) -> None:
    rows, width = key_ref.shape

    def count(pred: Callable[[pl.Slice], Array]) -> Array:
        return _chunked_count(pred, width, chunk, rows)

    n_valid = count(lambda ln: key_ref[:, ln] != INT_MIN)
    n_prot = count(lambda ln: key_ref[:, ln] == INT_MAX)  # unprotected keys never reach INT_MAX (NaN ~ -inf)
    budget = budget_ref[...].astype(jnp.float32)
    kept = jnp.clip(jnp.maximum(budget, n_prot), 0.0, jnp.minimum(n_valid, float(capacity)))
    # T: the key of the last kept slot.
    threshold = _largest_threshold(lambda t: count(lambda ln: key_ref[:, ln] >= t), jnp.maximum(kept, 1.0))
    need = kept - count(lambda ln: key_ref[:, ln] > threshold)  # >= 1 when kept >= 1

    # Among the slots tied at T, the `need` lowest positions: the largest t with #{tie, ~pos >= t} >= need.
    def ties_at_least(t: Array) -> Array:
        return count(lambda ln: (key_ref[:, ln] == threshold) & (~pos_ref[:, ln] >= t))

    last = _largest_threshold(ties_at_least, jnp.maximum(need, 1.0))  # ~(position of the last kept tie)

    def write(i: Array, carry: int) -> int:
        ln = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
        key = key_ref[:, ln]
        keep = (key > threshold) | ((key == threshold) & (~pos_ref[:, ln] >= last))
        keep_ref[:, ln] = jnp.where(keep & (kept > 0), 1, 0).astype(jnp.int32)
        return carry

    jax.lax.fori_loop(0, width // chunk, write, 0)
    count_ref[...] = kept.astype(jnp.int32)


def threshold_topk(
    key: Array, budget: Array, positions: Array, *, capacity: int, block_rows: int | None = None,
    chunk: int | None = None, interpret: Interpret = None,
) -> tuple[Array, Array]:
    """Kept mask `[R, C]` bool and counts `[R]` int32 from order keys `[R, C]`, per-row budgets `[R]`
    and positions `[R, C]` (distinct among a row's valid slots); same set as `topk_keep`.

    `block_rows` rows (a multiple of 8) per grid step hold their whole slot axis in VMEM (key, position
    and mask: 12 bytes per slot and row, double-buffered); the counting passes stream over it `chunk`
    lanes (a multiple of 128) at a time, so temporaries stay small. Defaults: the current tuning's
    `tpu_topk_block_rows` / `tpu_topk_chunk` (`kvjax.tuning`).
    """
    knobs = tuning.current()
    block_rows = knobs.tpu_topk_block_rows if block_rows is None else block_rows
    chunk = knobs.tpu_topk_chunk if chunk is None else chunk
    rows, c = key.shape
    if c >= _MAX_SLOTS:
        raise ConfigError(f"threshold_topk: {c} slots per row exceed the float32 counting limit {_MAX_SLOTS}")
    br = round_up(max(1, block_rows), 8)
    r_pad = round_up(rows, br)
    ch = min(round_up(chunk, 128), round_up(c, 128))
    c_pad = round_up(c, ch)
    key = pad_axis(pad_axis(key.astype(jnp.int32), 0, r_pad, INT_MIN), 1, c_pad, INT_MIN)
    positions = pad_axis(pad_axis(positions.astype(jnp.int32), 0, r_pad, 0), 1, c_pad, 0)
    budget = pad_axis(budget.astype(jnp.int32).reshape(rows, 1), 0, r_pad, 0)
    row_spec = pl.BlockSpec((br, c_pad), lambda i: (i, 0))
    col_spec = pl.BlockSpec((br, 1), lambda i: (i, 0))
    vmem = 2 * 3 * br * c_pad * 4 + (8 << 20)  # double-buffered key, position and mask blocks + temporaries
    keep, count = pl.pallas_call(
        functools.partial(_topk_kernel, capacity=capacity, chunk=ch),
        out_shape=(jax.ShapeDtypeStruct((r_pad, c_pad), jnp.int32), jax.ShapeDtypeStruct((r_pad, 1), jnp.int32)),
        grid=(r_pad // br,),
        in_specs=[row_spec, row_spec, col_spec],
        out_specs=(row_spec, col_spec),
        compiler_params=compiler_params(("parallel",), vmem_limit_bytes=max(vmem, 32 << 20)),
        interpret=interpret_mode(interpret),
        name="kvjax_threshold_topk",
    )(key, positions, budget)
    return keep[:rows, :c] != 0, count[:rows, 0]


def compact_indices(keep: Array, count: Array, capacity: int, positions: Array | None = None) -> Array:
    """`[R, capacity]` int32: the kept slots of each row of `keep` `[R, C]`, by position (slot order when
    `positions` is None); entries past `count` are 0. A prefix count and a scatter in XLA."""
    rows, c = keep.shape
    kc = min(capacity, c)
    dest = jnp.where(keep, jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1, kc)
    slots = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), keep.shape)
    row_ids = jnp.broadcast_to(jnp.arange(rows)[:, None], keep.shape)
    idx = jnp.zeros((rows, kc + 1), jnp.int32).at[row_ids, dest].set(slots, mode="drop")[:, :kc]
    if positions is not None:
        live = jnp.arange(kc) < count[:, None]
        order_pos = jnp.where(live, jnp.take_along_axis(positions.astype(jnp.int32), idx, axis=-1), INT_MAX)
        _, idx = jax.lax.sort((order_pos, idx), dimension=-1, num_keys=1)
        idx = jnp.where(live, idx, 0)
    return pad_axis(idx, 1, capacity, 0)


def topk_keep(
    scores: Array,
    valid: Array,
    budget: Array | int,
    *,
    capacity: int,
    protect: Array | None = None,
    positions: Array | None = None,
    interpret: Interpret = None,
) -> tuple[Array, Array]:
    """Twin of `kvjax.ops.select.topk_keep`: kept slot indices `[..., capacity]` (by position, then 0)
    and counts `[...]` int32."""
    if not isinstance(capacity, int) or capacity < 1:
        raise ConfigError(f"topk_keep: capacity must be a positive integer, got {capacity!r}")
    lead, c = scores.shape[:-1], scores.shape[-1]
    valid = jnp.broadcast_to(valid, scores.shape)
    key = order_key(scores, valid, protect).reshape(-1, c)
    budget = broadcast_lead(jnp.asarray(budget, jnp.int32), lead).reshape(-1)
    if positions is None:
        pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), key.shape)
    else:
        pos = jnp.broadcast_to(positions, scores.shape).astype(jnp.int32).reshape(-1, c)
    keep, count = threshold_topk(key, budget, pos, capacity=min(capacity, c), interpret=interpret)
    idx = compact_indices(keep, count, capacity, None if positions is None else pos)
    return idx.reshape(*lead, capacity), count.reshape(lead)


# ------------------------------------------------------------------------------------------------
# Compaction
# ------------------------------------------------------------------------------------------------


def _gather_kernel(idx_ref: Array, k_hbm: Array, v_hbm: Array, k_out: Array, v_out: Array, sems: Array, *,
                   block_rows: int, slots: int, rows_per_head: int) -> None:
    head, blk = pl.program_id(0), pl.program_id(1)
    base = head * rows_per_head + blk * block_rows

    def copies(r: int | Array, src: Array) -> tuple:
        rows = pl.ds(head * slots + src, 1)
        return (pltpu.make_async_copy(k_hbm.at[rows], k_out.at[pl.ds(r, 1)], sems.at[0]),
                pltpu.make_async_copy(v_hbm.at[rows], v_out.at[pl.ds(r, 1)], sems.at[1]))

    def start(r: Array, carry: int) -> int:
        for cp in copies(r, idx_ref[base + r]):
            cp.start()
        return carry

    def wait(r: Array, carry: int) -> int:
        for cp in copies(r, 0):  # same sizes: waits for one row of each
            cp.wait()
        return carry

    jax.lax.fori_loop(0, block_rows, start, 0)
    jax.lax.fori_loop(0, block_rows, wait, 0)


def gather_rows(k: Array, v: Array, indices: Array, *, block_rows: int | None = None,
                interpret: Interpret = None) -> tuple[Array, Array]:
    """`k[b, h, indices[b, h, i]]` and the same of `v`: `[B, K, C, H]` x `[B, K, C']` -> `[B, K, C', H]`.

    Indices must lie in `[0, C)`. They are scalar-prefetched into SMEM (4 bytes per entry), the rows
    move HBM -> VMEM by DMA, `block_rows` (a multiple of 16; default: the current tuning's
    `tpu_gather_block_rows`) per grid step and head.
    """
    block_rows = tuning.current().tpu_gather_block_rows if block_rows is None else block_rows
    b, kv, c, h = k.shape
    cap = indices.shape[-1]
    br = round_up(min(block_rows, round_up(cap, 16)), 16)
    cap_pad = round_up(cap, br)
    idx = pad_axis(indices.astype(jnp.int32).reshape(b * kv, cap), 1, cap_pad, 0).reshape(-1)
    out_spec = pl.BlockSpec((br, h), lambda hd, j, idx_ref: (hd * (cap_pad // br) + j, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b * kv, cap_pad // br),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=(out_spec, out_spec),
        scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
    )
    kernel = functools.partial(_gather_kernel, block_rows=br, slots=c, rows_per_head=cap_pad)
    k_out, v_out = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b * kv * cap_pad, h), k.dtype),
                   jax.ShapeDtypeStruct((b * kv * cap_pad, h), v.dtype)),
        grid_spec=grid_spec,
        compiler_params=compiler_params(("parallel", "arbitrary")),
        interpret=interpret_mode(interpret),
        name="kvjax_gather_rows",
    )(idx, k.reshape(b * kv * c, h), v.reshape(b * kv * c, h))
    shape = (b, kv, cap_pad, h)
    return k_out.reshape(shape)[:, :, :cap], v_out.reshape(shape)[:, :, :cap]


def gather_kept(cache: KVCache, indices: Array, counts: Array, *, interpret: Interpret = None) -> KVCache:
    """Twin of `kvjax.ops.gather.gather_kept` (= `kvjax.cache.compact`): K and V through the DMA kernel,
    the small per-slot leaves (positions, scores, retrieval mask) with `take_along_axis`."""
    cap = indices.shape[-1]
    num_kept = jnp.minimum(counts, cache.length).astype(jnp.int32)
    keep = jnp.arange(cap, dtype=jnp.int32) < num_kept[..., None]
    safe = jnp.where(keep, indices, 0).astype(jnp.int32)
    k, v = gather_rows(cache.k, cache.v, safe, interpret=interpret)

    def take(x: Array | None) -> Array | None:
        return None if x is None else jnp.take_along_axis(x, safe, axis=2)

    return cache.replace(k=k, v=v, pos=jnp.where(keep, take(cache.pos), -1), length=num_kept,
                         score=take(cache.score), attend=take(cache.attend))
