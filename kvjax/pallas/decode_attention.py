"""Pallas decode attention over the padded (compressed) cache: twin of `kvjax.ops.attention.decode_attention`.

Ragged, split-K pattern. Grid `(B, K, splits, blocks_per_split)`: the `G` query heads of a KV head are
the rows of one `[G, H]` query block; split `s` walks key blocks `s * blocks_per_split ...` with an
online softmax (running max, normaliser and accumulator in VMEM scratch, float32) and writes its
partial `(acc, m, l)`; the splits are merged in XLA with a log-sum-exp rescale. Per KV head, the number
of blocks up to its last valid slot and the query positions are scalar-prefetched: later blocks are
skipped with `pl.when` and their `index_map` is clamped to the last live block, so they issue no DMA.

Validity: invalid slots get position `INT_MAX` (never `<=` the query position), so one int32 row per
block carries the slot mask, causality and the sliding window; a per-query-head mask `[B, K, G, C]`
travels as one int32 bit set per slot (bit `g` = query head `g` of the group sees it, `G <= 32`).
Value rows no query head attends are zeroed before `p @ V`, so NaN-poisoned unused slots cannot leak
(`0 * NaN` would). With `return_weights`, the masked logits are written per block and normalised with
the merged statistics in XLA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax import tuning
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
    merge_splits,
    pad_axis,
    round_up,
    row_to_column,
)

Array = jax.Array


def _decode_kernel(
    nlive_ref: Array,
    qpos_ref: Array,
    q_ref: Array,
    kp_ref: Array,
    *refs: Array,
    kv_heads: int,
    blocks_per_split: int,
    sliding_window: int | None,
    per_head_mask: bool,
    with_logits: bool,
) -> None:
    refs = list(refs)
    bits_ref = refs.pop(0) if per_head_mask else None
    k_ref, v_ref, o_ref, m_out, l_out = refs[:5]
    logits_ref = refs[5] if with_logits else None
    m_ref, l_ref, acc_ref = refs[-3:]
    b, h, s, j = (pl.program_id(a) for a in range(4))
    block = s * blocks_per_split + j
    live = block < nlive_ref[b * kv_heads + h]

    @pl.when(j == 0)
    def _init() -> None:
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(live)
    def _step() -> None:
        q = q_ref[...]  # [G, H] float32, scaled
        qp = qpos_ref[b]
        kp = kp_ref[...]  # [1, bk]
        ok = (kp <= qp) & (qp >= 0)
        if sliding_window is not None:
            ok &= qp - kp < sliding_window
        mask = jnp.broadcast_to(ok, (q.shape[0], kp.shape[1]))
        if per_head_mask:
            g = jax.lax.broadcasted_iota(jnp.int32, mask.shape, 0)
            mask &= ((bits_ref[...] >> g) & 1) == 1
        s_blk = jnp.where(mask, dot_nt(q, k_ref[...].astype(jnp.float32)), NEG)  # [G, bk]
        if with_logits:
            logits_ref[...] = s_blk
        m = m_ref[...]
        m_new = jnp.maximum(m, jnp.max(s_blk, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s_blk - m_new), 0.0)
        corr = jnp.exp(m - m_new)
        l_ref[...] = l_ref[...] * corr + jnp.sum(p, axis=1, keepdims=True)
        used = row_to_column(jnp.max(jnp.where(mask, 1.0, 0.0), axis=0, keepdims=True))  # [bk, 1]
        v = jnp.where(used > 0, v_ref[...].astype(jnp.float32), 0.0)
        acc_ref[...] = acc_ref[...] * corr + dot_nn(p, v)
        m_ref[...] = m_new

    if with_logits:

        @pl.when(jnp.logical_not(live))
        def _dead() -> None:
            logits_ref[...] = jnp.full(logits_ref.shape, NEG, jnp.float32)

    @pl.when(j == pl.num_programs(3) - 1)
    def _write() -> None:
        o_ref[...] = acc_ref[...]
        m_out[...] = m_ref[...]
        l_out[...] = l_ref[...]


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
    interpret: Interpret = None,
) -> Array | tuple[Array, Array]:
    """Twin of `kvjax.ops.attention.decode_attention`: q `[B, N, H]`, q_pos `[B]`, k / v `[B, K, C, H]`,
    k_pos `[B, K, C]`, k_valid `[B, K, C]` or `[B, K, G, C]`. Returns `[B, N, H]` in q's dtype and, with
    `return_weights`, the float32 probabilities `[B, K, G, C]`. `num_splits` splits the key blocks of
    `block_k` slots (defaults: the current tuning's `tpu_decode_splits` / `tpu_decode_block_k`)."""
    knobs = tuning.current()
    block_k = knobs.tpu_decode_block_k if block_k is None else block_k
    num_splits = knobs.tpu_decode_splits if num_splits is None else num_splits
    batch, n, h = q.shape
    kv, c = k.shape[1], k.shape[2]
    if n % kv:
        raise ConfigError(f"{n} query heads are not a multiple of {kv} KV heads")
    g = n // kv
    per_head = k_valid.ndim == 4
    if per_head and g > 32:
        raise ConfigError(f"decode_attention: a per-query-head mask needs at most 32 heads per group, got {g}")
    bk = block_size(block_k, c)
    nk = round_up(c, bk) // bk
    check_lane_block("decode_attention", bk, nk, interpret)
    splits = max(1, min(num_splits, nk))
    per = -(-nk // splits)
    c_pad = per * splits * bk
    any_valid = jnp.any(k_valid, axis=2) if per_head else k_valid
    kp = pad_axis(jnp.where(any_valid, k_pos, INT_MAX).astype(jnp.int32), 2, c_pad, INT_MAX)
    operands = [kp.reshape(batch, kv, 1, c_pad)]
    if per_head:
        weights = jnp.left_shift(jnp.int32(1), jnp.arange(g, dtype=jnp.int32))[:, None]
        bits = jnp.sum(jnp.where(k_valid, weights, 0), axis=2, dtype=jnp.int32)
        operands.append(pad_axis(bits, 2, c_pad, 0).reshape(batch, kv, 1, c_pad))
    operands += [pad_axis(k, 2, c_pad, 0), pad_axis(v, 2, c_pad, 0)]
    qf = q.reshape(batch, kv, g, h).astype(jnp.float32) / math.sqrt(h)
    nlive = live_blocks(any_valid, bk).reshape(-1)

    def blk(b, hd, s, j, nlive_ref, qpos_ref):
        return jnp.maximum(jnp.minimum(s * per + j, nlive_ref[b * kv + hd] - 1), 0)

    row_spec = pl.BlockSpec((None, None, 1, bk), lambda b, hd, s, j, *r: (b, hd, 0, blk(b, hd, s, j, *r)))
    kv_spec = pl.BlockSpec((None, None, bk, h), lambda b, hd, s, j, *r: (b, hd, blk(b, hd, s, j, *r), 0))
    in_specs = [pl.BlockSpec((None, None, g, h), lambda b, hd, s, j, *r: (b, hd, 0, 0)), row_spec]
    in_specs += [row_spec] * per_head + [kv_spec, kv_spec]
    part = lambda last: pl.BlockSpec((None, None, None, g, last), lambda b, hd, s, j, *r: (b, hd, s, 0, 0))  # noqa: E731
    out_specs = [part(h), part(1), part(1)]
    out_shape = [jax.ShapeDtypeStruct((batch, kv, splits, g, d), jnp.float32) for d in (h, 1, 1)]
    if return_weights:
        out_specs.append(pl.BlockSpec((None, None, g, bk), lambda b, hd, s, j, *r: (b, hd, 0, s * per + j)))
        out_shape.append(jax.ShapeDtypeStruct((batch, kv, g, c_pad), jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, kv, splits, per),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, 1), jnp.float32),
                        pltpu.VMEM((g, h), jnp.float32)],
    )
    kernel = functools.partial(
        _decode_kernel, kv_heads=kv, blocks_per_split=per, sliding_window=sliding_window,
        per_head_mask=per_head, with_logits=return_weights,
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret_mode(interpret),
        name="kvjax_decode_attention",
    )(nlive, q_pos.astype(jnp.int32), qf, *operands)
    acc, m, l = outs[0], outs[1][..., 0], outs[2][..., 0]  # [B, K, S, G, H], [B, K, S, G]
    out, m_all, inv = merge_splits(acc, m, l)
    out = out.reshape(batch, n, h).astype(q.dtype)
    if not return_weights:
        return out
    probs = jnp.exp(outs[3][..., :c] - m_all[..., None]) * inv[..., None]
    return out, probs
