"""Pallas kernels for the per-key attention scores (twins of `kvjax.ops.scoring`).

**Fused column-probability kernel** (`window_scores`, `accumulated_scores`). Grid
`(B, K, query_blocks, 2, key_blocks)`: per KV head, a block of query rows (the whole GQA group of the
head stacked as rows, `R = G * block_q`) meets the cached keys block by block, twice. Phase 0 keeps
each row's running max and normaliser (the online softmax statistics, VMEM scratch); phase 1
recomputes the logits, normalises them exactly and reduces them per key over the rows of each query
head with a one-hot matmul (MXU) into a row of `G` (or 1, for the group mean) accumulators that spans
the whole (padded) capacity and stays resident in VMEM for the head. The last step reduces over the
group ("max"), optionally pools the row, and the row is written once. Key blocks past the last valid
slot of a head are skipped (their count is scalar-prefetched, the key `index_map` is clamped so they
do not DMA). Masking is causal by position: invalid slots carry position `INT_MAX`, padding rows
position -1, so NaN-poisoned unused slots never reach a sum.

**Pooling** (`pool1d`): blocks of 8 rows with the whole (128-padded) slot axis in VMEM, neighbours
brought in with `pltpu.roll` and masked by lane index (PyTorch `count_include_pad` semantics, invalid
entries act as padding).

All outputs are float32. Tested in interpret mode against the XLA reference (see COMPAT.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax import tuning
from kvjax._kernel_common import GROUP_REDUCE, POOLING, ROW_REDUCE
from kvjax._kernel_common import check_choice as _check_choice
from kvjax._kernel_common import group_queries as _group_queries
from kvjax._kernel_common import row_scale as _row_scale
from kvjax.errors import ConfigError
from kvjax.pallas._common import (
    INT_MAX,
    NEG,
    Interpret,
    block_size,
    check_lane_block,
    compiler_params,
    dot_nn,
    dot_nt,
    interpret_mode,
    live_blocks,
    pad_axis,
    round_up,
)

Array = jax.Array


# ------------------------------------------------------------------------------------------------
# In-kernel pooling
# ------------------------------------------------------------------------------------------------


def _pool_rows(x: Array, valid: Array, kernel: int, kind: str) -> Array:
    """Stride-1 same-length pooling of `x` `[R, W]` along lanes; `valid` (broadcastable) False = padding."""
    fill = 0.0 if kind == "avg" else -jnp.inf
    x = jnp.where(valid, x, fill)
    width = x.shape[1]
    lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    out = x
    for d in range(1, min(kernel // 2, width - 1) + 1):
        left = jnp.where(lane >= d, pltpu.roll(x, d, 1), fill)  # x[c - d]
        right = jnp.where(lane < width - d, pltpu.roll(x, width - d, 1), fill)  # x[c + d]
        out = out + left + right if kind == "avg" else jnp.maximum(out, jnp.maximum(left, right))
    return out / kernel if kind == "avg" else out


def _pool_kernel(x_ref: Array, ok_ref: Array, o_ref: Array, *, kernel: int, kind: str) -> None:
    o_ref[...] = _pool_rows(x_ref[...], ok_ref[...] != 0, kernel, kind)


def pool1d(
    scores: Array, kernel: int, kind: str = "avg", *, valid: Array | None = None, interpret: Interpret = None
) -> Array:
    """Twin of `kvjax.ops.scoring.pool1d` (same checks, same semantics), float32."""
    _check_choice("pool1d", "kind", kind, POOLING)
    if not isinstance(kernel, int) or isinstance(kernel, bool) or kernel < 1 or kernel % 2 == 0:
        raise ConfigError(f"pool1d: kernel must be a positive odd integer, got {kernel!r}")
    x = scores.astype(jnp.float32)
    lead, c = x.shape[:-1], x.shape[-1]
    ok = jnp.ones(x.shape, jnp.int32) if valid is None else jnp.broadcast_to(valid, x.shape).astype(jnp.int32)
    rows = x.reshape(-1, c)
    ok = ok.reshape(-1, c)
    n_rows = rows.shape[0]
    r_pad, c_pad = round_up(n_rows, 8), round_up(c, 128)
    rows = pad_axis(pad_axis(rows, 0, r_pad, 0.0), 1, c_pad, 0.0)
    ok = pad_axis(pad_axis(ok, 0, r_pad, 0), 1, c_pad, 0)
    spec = pl.BlockSpec((8, c_pad), lambda i: (i, 0))
    out = pl.pallas_call(
        functools.partial(_pool_kernel, kernel=kernel, kind=kind),
        out_shape=jax.ShapeDtypeStruct((r_pad, c_pad), jnp.float32),
        grid=(r_pad // 8,),
        in_specs=[spec, spec],
        out_specs=spec,
        compiler_params=compiler_params(("parallel",)),
        interpret=interpret_mode(interpret),
        name="kvjax_pool1d",
    )(rows, ok)
    return out[:n_rows, :c].reshape(*lead, c)


# ------------------------------------------------------------------------------------------------
# Fused column probabilities
# ------------------------------------------------------------------------------------------------


def _column_kernel(
    nlive_ref: Array,
    q_ref: Array,
    qp_ref: Array,
    kp_ref: Array,
    k_ref: Array,
    *rest: Array,
    groups: int,
    rows_per_group: int,
    block_k: int,
    kv_heads: int,
    group_reduce: str | None,
    pool: tuple[int, str] | None,
) -> None:
    if pool is not None:
        kv_row_ref, out_ref, m_ref, l_ref, *acc = rest
    else:
        out_ref, m_ref, l_ref, *acc = rest
    acc_ref = acc[0] if acc else out_ref  # group max keeps per-head sums apart until the end
    b, h, i, ph, j = (pl.program_id(a) for a in range(5))
    nq, nk = pl.num_programs(2), pl.num_programs(4)
    live = j < nlive_ref[b * kv_heads + h]

    @pl.when((i == 0) & (ph == 0) & (j == 0))
    def _zero() -> None:
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((ph == 0) & (j == 0))
    def _init() -> None:
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    def logits() -> tuple[Array, Array]:
        s = dot_nt(q_ref[...], k_ref[...].astype(jnp.float32))  # [R, bk]
        qp = qp_ref[...]  # [R, 1]
        return s, (kp_ref[...] <= qp) & (qp >= 0)  # invalid slots: INT_MAX; padding rows: -1

    @pl.when((ph == 0) & live)
    def _stats() -> None:
        s, mask = logits()
        s = jnp.where(mask, s, NEG)
        m = m_ref[...]
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        l_ref[...] = l_ref[...] * jnp.exp(m - m_new) + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_new

    @pl.when((ph == 1) & (j == 0))
    def _invert() -> None:
        l = l_ref[...]
        l_ref[...] = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)

    @pl.when((ph == 1) & live)
    def _probs() -> None:
        s, mask = logits()
        m = m_ref[...]
        p = jnp.where(mask, jnp.exp(jnp.where(mask, s, m) - m), 0.0) * l_ref[...]  # [R, bk]
        if group_reduce == "mean":
            cols = jnp.sum(p, axis=0, keepdims=True)
        else:  # per query head: one-hot [G, R] selects each head's rows
            rows = jax.lax.broadcasted_iota(jnp.int32, (groups, groups * rows_per_group), 1)
            first = jax.lax.broadcasted_iota(jnp.int32, (groups, groups * rows_per_group), 0) * rows_per_group
            sel = ((rows >= first) & (rows < first + rows_per_group)).astype(jnp.float32)
            cols = dot_nn(sel, p)  # [G, bk]
        start = pl.multiple_of(j * block_k, block_k)
        acc_ref[:, pl.ds(start, block_k)] += cols

    @pl.when((i == nq - 1) & (ph == 1) & (j == nk - 1))
    def _finish() -> None:
        row = acc_ref[...]
        if group_reduce == "mean":
            row = row / groups
        elif group_reduce == "max":
            row = jnp.max(row, axis=0, keepdims=True)
        if pool is not None:
            row = _pool_rows(row, kv_row_ref[...] != INT_MAX, pool[0], pool[1])
        out_ref[...] = row


def _vmem_bytes(rows: int, h: int, bk: int, c_pad: int, groups: int, g_out: int, itemsize: int,
                group_reduce: str | None, pool: tuple[int, str] | None) -> int:
    """Scoped VMEM the column kernel needs (double-buffered blocks, the resident row, temporaries), with
    room to spare; at least the 32 MiB default of recent chips."""
    blocks = 2 * (rows * h * 4 + rows * 4 + bk * 4 + bk * h * itemsize) + 2 * g_out * c_pad * 4
    extra = (groups * c_pad * 4 if group_reduce == "max" else 0) + (2 * c_pad * 4 if pool else 0)
    temporaries = 6 * rows * bk * 4 + 2 * rows * 4
    return max(32 << 20, int(1.5 * (blocks + extra + temporaries)))


def _column_probs(
    rows_q: Array,
    rows_pos: Array,
    k: Array,
    k_pos: Array,
    k_valid: Array,
    *,
    groups: int,
    rows_per_group: int,
    group_reduce: str | None,
    pool: tuple[int, str] | None,
    block_k: int,
    interpret: Interpret,
) -> Array:
    """Sums of softmax probabilities per key. rows_q `[B, K, nq * G * bq, H]` float32 (already scaled,
    rows ordered query block, head of the group, row), rows_pos `[B, nq * G * bq]` (-1 = padding).
    Returns `[B, K, G', C]` float32 (`G' = 1` for group mean / max, `G` for None)."""
    b, kv, c, h = k.shape
    r = groups * rows_per_group
    nq = rows_q.shape[2] // r
    bk = block_size(block_k, c)
    c_pad = round_up(c, bk)
    nk = c_pad // bk
    check_lane_block("column_probs", bk, nk, interpret)
    k = pad_axis(k, 2, c_pad, 0)
    kp = jnp.where(k_valid, k_pos, INT_MAX).astype(jnp.int32)
    kp = pad_axis(kp, 2, c_pad, INT_MAX).reshape(b, kv, 1, c_pad)
    nlive = live_blocks(k_valid, bk).reshape(-1)
    g_out = groups if group_reduce is None else 1

    def key_block(bi, hi, i, ph, j, nlive_ref):
        return bi, hi, jnp.maximum(jnp.minimum(j, nlive_ref[bi * kv + hi] - 1), 0)

    in_specs = [
        pl.BlockSpec((None, None, r, h), lambda bi, hi, i, ph, j, n: (bi, hi, i, 0)),
        pl.BlockSpec((None, r, 1), lambda bi, hi, i, ph, j, n: (bi, i, 0)),
        pl.BlockSpec((None, None, 1, bk), lambda *a: (*key_block(*a)[:2], 0, key_block(*a)[2])),
        pl.BlockSpec((None, None, bk, h), lambda *a: (*key_block(*a), 0)),
    ]
    operands = [rows_q, rows_pos.reshape(b, -1, 1).astype(jnp.int32), kp, k]
    if pool is not None:
        in_specs.append(pl.BlockSpec((None, None, 1, c_pad), lambda bi, hi, i, ph, j, n: (bi, hi, 0, 0)))
        operands.append(kp)
    scratch = [pltpu.VMEM((r, 1), jnp.float32), pltpu.VMEM((r, 1), jnp.float32)]
    if group_reduce == "max":
        scratch.append(pltpu.VMEM((groups, c_pad), jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, kv, nq, 2, nk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, g_out, c_pad), lambda bi, hi, i, ph, j, n: (bi, hi, 0, 0)),
        scratch_shapes=scratch,
    )
    kernel = functools.partial(
        _column_kernel, groups=groups, rows_per_group=rows_per_group, block_k=bk, kv_heads=kv,
        group_reduce=group_reduce, pool=pool,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, kv, g_out, c_pad), jnp.float32),
        grid_spec=grid_spec,
        compiler_params=compiler_params(("parallel", "parallel", "arbitrary", "arbitrary", "arbitrary"),
                                        vmem_limit_bytes=_vmem_bytes(r, h, bk, c_pad, groups, g_out, k.dtype.itemsize,
                                                                     group_reduce, pool)),
        interpret=interpret_mode(interpret),
        name="kvjax_column_probs",
    )(nlive, *operands)
    return out[..., :c]


def _squeeze_group(out: Array, group_reduce: str | None) -> Array:
    b, kv, g, c = out.shape
    return out[:, :, 0] if group_reduce is not None else out.reshape(b, kv * g, c)


def _check_pool(pool: tuple[int, str] | None) -> None:
    if pool is None:
        return
    kernel, kind = pool
    _check_choice("window_scores", "pool kind", kind, POOLING)
    if not isinstance(kernel, int) or isinstance(kernel, bool) or kernel < 1 or kernel % 2 == 0:
        raise ConfigError(f"pool kernel must be a positive odd integer, got {kernel!r}")


def window_scores(
    q: Array,
    q_pos: Array,
    k: Array,
    k_pos: Array,
    k_valid: Array,
    *,
    window: int,
    row_reduce: str = "sum",
    group_reduce: str | None = "mean",
    scale: float | Array | None = None,
    block_k: int | None = None,
    pool: tuple[int, str] | None = None,
    interpret: Interpret = None,
) -> Array:
    """Twin of `kvjax.ops.scoring.window_scores`; `pool=(kernel, kind)` also fuses
    `pool1d(..., valid=k_valid)` into the kernel's last step. Returns `[B, K, C]` (`[B, N, C]`) float32.
    `block_k` (default: the current tuning's `tpu_score_block_k`, `kvjax.tuning`) key slots per block."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"window_scores: window must be a positive integer, got {window!r}")
    _check_choice("window_scores", "row_reduce", row_reduce, ROW_REDUCE)
    _check_choice("window_scores", "group_reduce", group_reduce, GROUP_REDUCE)
    _check_pool(pool)
    b, t, n, h = q.shape
    kv = k.shape[1]
    w = min(window, t)
    top_pos, rows = jax.lax.top_k(q_pos, w)  # the w latest positions of each example (as the reference)
    row_ok = top_pos >= 0
    qw = jnp.take_along_axis(q, rows[:, :, None, None], axis=1)
    row_scale = jnp.take_along_axis(_row_scale(scale, h, b, t), rows, axis=1)
    qg = _group_queries(qw, kv) * row_scale[:, None, None, :, None]  # [B, K, G, W, H]
    g = n // kv
    block_k = tuning.current().tpu_score_block_k if block_k is None else block_k
    wp = round_up(w, 8)
    qg = pad_axis(qg, 3, wp, 0.0).reshape(b, kv, g * wp, h)
    rpos = pad_axis(jnp.where(row_ok, top_pos, -1), 1, wp, -1)
    rpos = jnp.broadcast_to(rpos[:, None, :], (b, g, wp)).reshape(b, g * wp)
    out = _column_probs(
        qg, rpos, k, k_pos, k_valid, groups=g, rows_per_group=wp, group_reduce=group_reduce, pool=pool,
        block_k=block_k, interpret=interpret,
    )
    if row_reduce == "mean":
        count = jnp.maximum(jnp.sum(row_ok, axis=-1), 1).astype(jnp.float32)
        out = out / count[:, None, None, None]
    return _squeeze_group(out, group_reduce)


def accumulated_scores(
    q: Array,
    q_pos: Array,
    k: Array,
    k_pos: Array,
    k_valid: Array,
    *,
    group_reduce: str | None = "mean",
    scale: float | Array | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    pool: tuple[int, str] | None = None,
    interpret: Interpret = None,
) -> Array:
    """Twin of `kvjax.ops.scoring.accumulated_scores` (H2O's column sums over every valid query row).
    `block_q` query rows per head and `block_k` key slots per block default to the current tuning's
    `tpu_score_block_q` / `tpu_score_block_k` (`kvjax.tuning`)."""
    _check_choice("accumulated_scores", "group_reduce", group_reduce, GROUP_REDUCE)
    _check_pool(pool)
    b, t, n, h = q.shape
    kv = k.shape[1]
    g = n // kv
    knobs = tuning.current()
    block_q = knobs.tpu_score_block_q if block_q is None else block_q
    block_k = knobs.tpu_score_block_k if block_k is None else block_k
    bq = block_size(block_q, t)
    tp = round_up(t, bq)
    nq = tp // bq
    qg = _group_queries(q, kv) * _row_scale(scale, h, b, t)[:, None, None, :, None]  # [B, K, G, T, H]
    qg = pad_axis(qg, 3, tp, 0.0).reshape(b, kv, g, nq, bq, h).transpose(0, 1, 3, 2, 4, 5)
    qg = qg.reshape(b, kv, nq * g * bq, h)
    rpos = pad_axis(q_pos.astype(jnp.int32), 1, tp, -1).reshape(b, nq, 1, bq)
    rpos = jnp.broadcast_to(rpos, (b, nq, g, bq)).reshape(b, nq * g * bq)
    out = _column_probs(
        qg, rpos, k, k_pos, k_valid, groups=g, rows_per_group=bq, group_reduce=group_reduce, pool=pool,
        block_k=block_k, interpret=interpret,
    )
    return _squeeze_group(out, group_reduce)
