"""Pallas GPU (Triton lowering) decode attention: dense split-K and block-sparse over retrieved blocks.

GPU twins of `kvjax.ops.attention.decode_attention` (`decode_attention`) and
`kvjax.ops.sparse_attention.block_sparse_decode_attention` (`block_sparse_decode_attention`). The Mosaic
TPU kernel of `kvjax.pallas.decode_attention` cannot run on a GPU (scalar prefetch, VMEM scratch); these
use only what the Triton backend lowers (a grid, BlockSpecs, `pl.ds` ref slices, `lax.fori_loop` with
traced bounds) and run in Pallas interpret mode elsewhere (`interpret=None`: compiled on GPU only).

* **GQA-aware**: one program per `(example, KV head, split)`; the `G` query heads of the KV head are the
  rows of one `[Gp, H]` query tile (`Gp`: `G` padded to a power of two, at least 16, for `tl.dot`), so
  each K / V block is read once for the whole group.
* **Dead blocks skipped by a bounded loop**, not a mask: the dense kernel reads, per head, the number
  of blocks up to its last valid slot and splits *those* evenly over the splits (length-balanced), so a
  short head costs its own length; the sparse kernel loops over the first `num_blocks` entries of its
  block list and the chunks of its dense ranges only.
* Online softmax in float32 per split; the splits are merged in XLA (`merge_splits`, log-sum-exp), which
  compiles into three launches per call on a GPU. `merge_split_heads` is that merge as one kernel: the fused
  decode kernel (`gpu_fused_decode`) uses it; these two keep XLA's merge, with which their speed was measured.
  16-bit caches: `QK^T` and `PV` take 16-bit operands (the query and the probabilities rounded to the
  cache dtype, as flash decoding does) with float32 accumulation; float32 caches: float32 dots at
  `Precision.HIGHEST`.
* Invalid slots carry position `INT_MAX` (the slot mask, causality and the window in one int32 row); their
  logits are set to `NEG` after `QK^T` and non-finite V values zeroed before `PV`, so NaN-poisoned unused
  slots cannot leak.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax import tuning
from kvjax.errors import ConfigError
from kvjax.pallas._common import INT_MAX, NEG, live_blocks, merge_splits, pad_axis, round_up
from kvjax.pallas.gpu_common import (
    attend_window,
    check_block,
    compiler_params,
    initial_state,
    interpret_mode,
    keep_mask,
    pow2,
    slot_ok,
    split_bounds,
    split_count,
    tile_or_tuned,
)

Array = jax.Array


def _group_query(q: Array, kv: int, dot_dtype: jnp.dtype, interpret: bool | None) -> tuple[Array, int, int]:
    """q `[B, N, H]` -> scaled `[B, K, Gp, H]` in the dot dtype (zero rows pad the group to Gp)."""
    batch, n, h = q.shape
    if not interpret_mode(interpret) and h & (h - 1):
        raise ConfigError(f"compiled for GPU (Triton), head_dim must be a power of two, got {h}")
    if n % kv:
        raise ConfigError(f"{n} query heads are not a multiple of {kv} KV heads")
    g = n // kv
    gp = max(16, pow2(g))
    qf = q.reshape(batch, kv, g, h).astype(jnp.float32) / math.sqrt(h)
    return pad_axis(qf, 2, gp, 0).astype(dot_dtype), g, gp


def _dot_dtype(k: Array) -> jnp.dtype:
    return k.dtype if k.dtype in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)


def strided_trips(n: Array, s: Array, splits: int) -> Array:
    """Trips of split `s` over entries `s, s + splits, ...` below `n`: over all splits they sum to `n`."""
    return jax.lax.div(jnp.maximum(n - s, 0) + (splits - 1), splits)


#: Splits the merge kernel reads per loop step: their loads issue together, and the running maximum rescales
#: the sums between steps (as flash attention does across key blocks).
MERGE_CHUNK = 8


def _merge_kernel(acc_ref: Array, m_ref: Array, l_ref: Array, *refs: Array, splits: int, group: int, rows: int,
                  chunk: int, count: bool, evicts: bool, cap: int | None, heads: int,
                  update: Callable[[Array, Array, Array], Array] | None) -> None:
    if count:  # the fused decode's cache length: the new token counted where its position is valid
        refs = list(refs)
        len_ref, pos_ref = refs[0], refs[1]
        ev_ref = refs[2] if evicts else None
        head_refs = refs[2 + evicts:2 + evicts + heads]
        o_ref, len_out, *head_outs = refs[2 + evicts + heads:]
        counted = (pos_ref[()] >= 0).astype(jnp.int32)
        new = len_ref[()] + counted
        if evicts:  # the token replaced an evicted one: the length does not grow
            new = new - (ev_ref[()] >= 0).astype(jnp.int32)
        if cap is not None:  # a ring holds at most its capacity
            new = jnp.minimum(new, cap)
        for x_ref, x_out in zip(head_refs, head_outs, strict=True):  # read before the length is written
            x_out[()] = update(len_ref[()], counted, x_ref[()])
        len_out[()] = new
    else:
        (o_ref,) = refs
    h = acc_ref.shape[-1]
    idx = jnp.minimum(jnp.arange(rows, dtype=jnp.int32), group - 1)
    lanes = jnp.arange(chunk, dtype=jnp.int32)

    def add(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        top, total, out = carry
        split = j * chunk + lanes
        live = (split < splits).astype(jnp.float32)[:, None]  # a clamped repeat of the last split weighs 0
        split = jnp.minimum(split, splits - 1)
        m = m_ref[split[:, None], idx[None, :]]  # [chunk, rows]
        new_top = jnp.maximum(top, jnp.max(m, axis=0))
        w = jnp.exp(m - new_top[None, :]) * live
        rescale = jnp.exp(top - new_top)
        total = total * rescale + jnp.sum(l_ref[split[:, None], idx[None, :]] * w, axis=0)
        acc = acc_ref[split[:, None, None], idx[None, :, None], jnp.arange(h, dtype=jnp.int32)[None, None, :]]
        return new_top, total, out * rescale[:, None] + jnp.sum(acc * w[:, :, None], axis=0)

    init = (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, h), jnp.float32))
    _, total, out = jax.lax.fori_loop(0, -(-splits // chunk), add, init)
    inv = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    o_ref[idx, :] = (out * inv[:, None]).astype(o_ref.dtype)


def merge_split_heads(acc: Array, m: Array, l: Array, group: int, dtype: jnp.dtype, *, length: Array | None = None,
                      position: Array | None = None, evict: Array | None = None, cap: int | None = None,
                      heads: tuple[Array, ...] = (), update: Callable[[Array, Array, Array], Array] | None = None,
                      num_warps: int | None = None,
                      interpret: bool | None = None) -> Array | tuple[Array, ...]:
    """The merged attention output `[B, K, group, H]` in `dtype` of split-K partials `acc [B, K, S, Gp, H]`,
    `m`, `l [B, K, S, Gp]` (float32; `Gp >= group`): what `merge_splits(acc, m, l)[0][:, :, :group]
    .astype(dtype)` computes, in one kernel. One program per (example, KV head) reads the splits `MERGE_CHUNK`
    at a time: `M = max_s m_s`, `w_s = exp(m_s - M)`, `out = sum_s w_s acc_s / sum_s w_s l_s` (0 where that sum
    is 0), in float32, the running maximum rescaling the sums between chunks. Rows and splits are clamped gathers
    (a row `>= group` repeats the last row and stores the same value; a split past `S` repeats the last and weighs
    0), so every loaded shape is a power of two, as Triton needs. `num_warps` defaults to the tuning's
    `gpu_num_warps`.

    With `length` `[B, K]` and `position` `[B]` (the fused decode step's), also returns the length with the new
    token counted (`length + (position >= 0)`), written in place of `length` (aliased: donate it). The decode
    kernel cannot write it itself without a race (a split would read a length another split already updated).
    `evict` `[B, K]` (the slot the token replaced, -1: none): a head that evicted keeps its length. `cap`: the
    length stops there (a sliding-window ring's capacity). `heads`: more `[B, K]` int32 values of the layer, each
    returned after the length as `update(length before the step, counted token (0 / 1), value)` and written in place
    (aliased: donate them); KIVI's `qlen`, which moves where the decode kernel flushed a group."""
    batch, kv, splits, gp, h = acc.shape
    whole = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, k: (b, k) + (0,) * len(shape))  # noqa: E731
    count = length is not None
    if heads and (not count or update is None):
        raise ConfigError("merge_split_heads: `heads` are updated with the length: give `length`, `position` and "
                          "`update`")
    kernel = functools.partial(_merge_kernel, splits=splits, group=group, rows=pow2(group),
                               chunk=min(MERGE_CHUNK, pow2(splits)), count=count, evicts=evict is not None, cap=cap,
                               heads=len(heads), update=update)
    operands, in_specs = [acc, m, l], [whole(splits, gp, h), whole(splits, gp), whole(splits, gp)]
    out_shape, out_specs = [jax.ShapeDtypeStruct((batch, kv, group, h), dtype)], [whole(group, h)]
    aliases = {}
    if count:
        operands += [length.astype(jnp.int32), position.astype(jnp.int32)]
        in_specs += [whole(), pl.BlockSpec((None,), lambda b, k: (b,))]
        if evict is not None:
            operands.append(evict.astype(jnp.int32))
            in_specs.append(whole())
        aliases[3] = 1
        for i, x in enumerate(heads):
            aliases[len(operands)] = 2 + i
            operands.append(x.astype(jnp.int32))
            in_specs.append(whole())
        out_shape += [jax.ShapeDtypeStruct((batch, kv), jnp.int32)] * (1 + len(heads))
        out_specs += [whole()] * (1 + len(heads))
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(batch, kv), in_specs=in_specs, out_specs=out_specs,
        input_output_aliases=aliases, compiler_params=compiler_params(num_warps, 1),
        interpret=interpret_mode(interpret), name="kvjax_gpu_merge_splits",
    )(*operands)
    return tuple(outs) if count else outs[0]


def _dense_kernel(nlive_ref: Array, qpos_ref: Array, q_ref: Array, kp_ref: Array, *refs: Array, block_k: int,
                  splits: int, sliding_window: int | None, per_head_mask: bool, with_logits: bool,
                  clamp: bool) -> None:
    refs = list(refs)
    bits_ref = refs.pop(0) if per_head_mask else None
    k_ref, v_ref = refs.pop(0), refs.pop(0)
    o_ref, m_out, l_out = refs[:3]
    logits_ref = refs[3] if with_logits else None
    rows = lambda ref, start: ref[pl.ds(start, block_k), :]  # noqa: E731
    q = q_ref[...]
    gp = q.shape[0]
    qp = qpos_ref[()]
    nlive = nlive_ref[()]
    lo, hi = split_bounds(nlive, splits, pl.program_id(2))  # length-balanced: this head's live blocks only

    def body(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        start = pl.multiple_of(j * block_k, block_k)
        if clamp:  # the last block of a capacity that is no block multiple ends at the capacity (no padding copy)
            nominal, start = start, jnp.minimum(start, kp_ref.shape[0] - block_k)
        ok = slot_ok(kp_ref[pl.ds(start, block_k)], qp, sliding_window)
        if clamp:
            ok &= start + jnp.arange(block_k, dtype=jnp.int32) >= nominal  # slots of the previous block
        keep = keep_mask(ok, gp)
        if per_head_mask:
            g = jnp.arange(gp, dtype=jnp.int32)[:, None]
            keep = keep * ((bits_ref[pl.ds(start, block_k)][None, :] >> g) & 1).astype(jnp.float32)
        carry, s = attend_window(carry, q, rows(k_ref, start), rows(v_ref, start), keep)
        if with_logits:
            logits_ref[:, pl.ds(start, block_k)] = s
        return carry

    m, l, acc = jax.lax.fori_loop(lo, hi, body, initial_state(gp, q.shape[1]))
    o_ref[...] = acc
    m_out[...] = m
    l_out[...] = l


def decode_attention(
    q: Array,
    q_pos: Array,
    k: Array,
    v: Array,
    k_pos: Array,
    k_valid: Array,
    *,
    sliding_window: int | None = None,
    return_weights: bool = False,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
) -> Array | tuple[Array, Array]:
    """Twin of `kvjax.ops.attention.decode_attention` on the Triton backend: q `[B, N, H]`, q_pos `[B]`,
    k / v `[B, K, C, H]`, k_pos `[B, K, C]`, k_valid `[B, K, C]` or `[B, K, G, C]`. Returns `[B, N, H]` in
    q's dtype and, with `return_weights`, the float32 probabilities `[B, K, G, C]`. `num_splits` (None:
    ~256 programs in all) splits each head's live blocks evenly. `block_k`, `num_warps`, `num_stages` and
    the program target default to the current tuning's `gpu_*` fields (`kvjax.tuning`). The kernel reads
    the layer's buffers where they lie (kvjax stores one per layer: no slice, no copy)."""
    block_k, num_warps, num_stages = tile_or_tuned(False, block_k, num_warps, num_stages)
    batch, kv, c, h = k.shape
    check_block("decode_attention", "block_k", block_k)
    qg, g, gp = _group_query(q, kv, _dot_dtype(k), interpret)
    per_head = k_valid.ndim == 4
    if per_head and g > 32:
        raise ConfigError(f"decode_attention: a per-query-head mask needs at most 32 heads per group, got {g}")
    # Without weights a capacity that is no block multiple is not padded (a copy of the cache per call):
    # its last block is read shifted back to end at the capacity, the slots of the previous block masked.
    c_pad = round_up(c, block_k) if return_weights else max(c, block_k)
    clamp = c_pad % block_k != 0
    splits = split_count(num_splits, batch * kv, -(-c_pad // block_k))
    any_valid = jnp.any(k_valid, axis=2) if per_head else k_valid
    operands = [pad_axis(jnp.where(any_valid, k_pos, INT_MAX).astype(jnp.int32), 2, c_pad, INT_MAX)]
    if per_head:
        weights = jnp.left_shift(jnp.int32(1), jnp.arange(g, dtype=jnp.int32))[:, None]
        operands.append(pad_axis(jnp.sum(jnp.where(k_valid, weights, 0), axis=2, dtype=jnp.int32), 2, c_pad, 0))
    operands += [pad_axis(k, 2, c_pad, 0), pad_axis(v, 2, c_pad, 0)]
    nlive = live_blocks(any_valid, block_k)  # [B, K]

    head = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, hd, s: (b, hd) + (0,) * len(shape))  # noqa: E731
    in_specs = [head(), pl.BlockSpec((None,), lambda b, hd, s: (b,)), head(gp, h), head(c_pad)]
    in_specs += [head(c_pad)] * per_head
    in_specs += [head(c_pad, h), head(c_pad, h)]
    part = lambda *shape: pl.BlockSpec((None, None, None, *shape), lambda b, hd, s: (b, hd, s) + (0,) * len(shape))  # noqa: E731
    out_specs = [part(gp, h), part(gp), part(gp)]
    out_shape = [jax.ShapeDtypeStruct((batch, kv, splits, gp, h), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv, splits, gp), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv, splits, gp), jnp.float32)]
    if return_weights:
        out_specs.append(head(gp, c_pad))
        out_shape.append(jax.ShapeDtypeStruct((batch, kv, gp, c_pad), jnp.float32))
    kernel = functools.partial(_dense_kernel, block_k=block_k, splits=splits, sliding_window=sliding_window,
                               per_head_mask=per_head, with_logits=return_weights, clamp=clamp)
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(batch, kv, splits), in_specs=in_specs, out_specs=out_specs,
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret_mode(interpret),
        name="kvjax_gpu_decode_attention",
    )(nlive, q_pos.astype(jnp.int32), qg, *operands)
    out, m_all, inv = merge_splits(*outs[:3])
    out = out[:, :, :g].reshape(batch, kv * g, h).astype(q.dtype)
    if not return_weights:
        return out
    # Blocks past a head's last valid slot were never written (the loop skipped them): masked here.
    written = jnp.arange(c, dtype=jnp.int32) < (nlive * block_k)[..., None]
    logits = jnp.where(written[:, :, None], outs[3][:, :, :g, :c], NEG)
    probs = jnp.exp(logits - m_all[:, :, :g, None]) * inv[:, :, :g, None]
    return out, probs


def _sparse_kernel(count_ref: Array, ranges_ref: Array, starts_ref: Array, qpos_ref: Array, q_ref: Array,
                   kp_ref: Array, k_ref: Array, v_ref: Array, o_ref: Array, m_out: Array, l_out: Array, *,
                   block_size: int, chunk: int, num_ranges: int, splits: int, sliding_window: int | None) -> None:
    q = q_ref[...]
    gp = q.shape[0]
    c_pad = k_ref.shape[0]
    qp = qpos_ref[()]
    s = pl.program_id(2)
    bounds = [(ranges_ref[2 * r], ranges_ref[2 * r + 1]) for r in range(num_ranges)]

    def in_ranges(slot: Array, upto: int) -> Array:
        hit = jnp.zeros(slot.shape, jnp.bool_)
        for lo, hi in bounds[:upto]:
            hit |= (slot >= lo) & (slot < hi)
        return hit

    def window(carry: tuple[Array, Array, Array], first: Array, size: int, keep: Callable[[Array], Array]):
        """Attends the `size` slots from `first` (clamped into the cache) that `keep(slot)` admits."""
        start = jnp.clip(first, 0, c_pad - size)
        slot = start + jnp.arange(size, dtype=jnp.int32)
        ok = keep(slot) & slot_ok(kp_ref[pl.ds(start, size)], qp, sliding_window)
        return attend_window(carry, q, k_ref[pl.ds(start, size), :], v_ref[pl.ds(start, size), :], keep_mask(ok, gp))[0]

    carry = initial_state(gp, q.shape[1])
    for r, (lo, hi) in enumerate(bounds):  # dense ranges (sinks, local window), chunk c on split c % splits
        chunks = jax.lax.div(jnp.maximum(hi - lo, 0) + (chunk - 1), chunk)

        def range_body(i: Array, carry: tuple, lo: Array = lo, hi: Array = hi, r: int = r) -> tuple:
            first = lo + (s + i * splits) * chunk
            keep = lambda slot: (slot >= first) & (slot < jnp.minimum(hi, first + chunk)) & ~in_ranges(slot, r)  # noqa: E731
            return window(carry, first, chunk, keep)

        carry = jax.lax.fori_loop(0, strided_trips(chunks, s, splits), range_body, carry)

    def block_body(i: Array, carry: tuple) -> tuple:  # retrieved blocks, entry j on split j % splits
        first = starts_ref[s + i * splits]
        keep = lambda slot: (slot >= first) & (slot < first + block_size) & ~in_ranges(slot, num_ranges)  # noqa: E731
        return window(carry, first, block_size, keep)

    m, l, acc = jax.lax.fori_loop(0, strided_trips(count_ref[()], s, splits), block_body, carry)
    o_ref[...] = acc
    m_out[...] = m
    l_out[...] = l


def block_sparse_decode_attention(
    q: Array,
    q_pos: Array,
    k: Array,
    v: Array,
    k_pos: Array,
    k_valid: Array,
    block_starts: Array,
    num_blocks: Array,
    ranges: Array,
    *,
    block_size: int,
    sliding_window: int | None = None,
    chunk: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
) -> Array:
    """Twin of `kvjax.ops.sparse_attention.block_sparse_decode_attention` on the Triton backend.

    q `[B, N, H]`, q_pos `[B]`, k / v `[B, K, C, H]`, k_pos / k_valid `[B, K, C]`; per (example, KV head):
    `block_starts` `[B, K, S]` first slot of each retrieved block of `block_size` slots, of which the
    first `num_blocks` `[B, K]` are live, and `ranges` `[B, K, R, 2]` half-open slot ranges always
    attended (sinks, local window). Only those slots are read. Returns `[B, N, H]` in q's dtype.
    `chunk` (slots per step over the ranges), `num_warps`, `num_stages` and the program target default to
    the current tuning's `gpu_*` fields (`kvjax.tuning`).
    """
    chunk = tuning.current().gpu_sparse_chunk if chunk is None else chunk
    batch, kv, c, h = k.shape
    check_block("block_sparse_decode_attention", "block_size", block_size)
    check_block("block_sparse_decode_attention", "chunk", chunk)
    qg, g, gp = _group_query(q, kv, _dot_dtype(k), interpret)
    num_ranges = ranges.shape[2]
    c_pad = max(c, block_size, chunk)  # windows are clamped into the cache: padded only when it is shorter
    s_pad = pow2(max(1, block_starts.shape[2]))
    splits = split_count(num_splits, batch * kv, max(1, block_starts.shape[2]))
    kp = pad_axis(jnp.where(k_valid, k_pos, INT_MAX).astype(jnp.int32), 2, c_pad, INT_MAX)
    starts = pad_axis(block_starts.astype(jnp.int32), 2, s_pad, 0)
    count = jnp.clip(jnp.broadcast_to(jnp.asarray(num_blocks, jnp.int32), (batch, kv)), 0, block_starts.shape[2])
    rng = ranges.astype(jnp.int32).reshape(batch, kv, 2 * num_ranges)

    head = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, hd, s: (b, hd) + (0,) * len(shape))  # noqa: E731
    in_specs = [head(), head(2 * num_ranges), head(s_pad), pl.BlockSpec((None,), lambda b, hd, s: (b,)),
                head(gp, h), head(c_pad), head(c_pad, h), head(c_pad, h)]
    part = lambda *shape: pl.BlockSpec((None, None, None, *shape), lambda b, hd, s: (b, hd, s) + (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_sparse_kernel, block_size=block_size, chunk=chunk, num_ranges=num_ranges,
                               splits=splits, sliding_window=sliding_window)
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((batch, kv, splits, gp, h), jnp.float32),
                   jax.ShapeDtypeStruct((batch, kv, splits, gp), jnp.float32),
                   jax.ShapeDtypeStruct((batch, kv, splits, gp), jnp.float32)],
        grid=(batch, kv, splits), in_specs=in_specs, out_specs=[part(gp, h), part(gp), part(gp)],
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret_mode(interpret),
        name="kvjax_gpu_block_sparse_decode_attention",
    )(count, rng, starts, q_pos.astype(jnp.int32), qg, kp, pad_axis(k, 2, c_pad, 0), pad_axis(v, 2, c_pad, 0))
    out = merge_splits(*outs)[0]
    return out[:, :, :g].reshape(batch, kv * g, h).astype(q.dtype)
