"""One decode-attention kernel per layer (Pallas Triton): the new token's RoPE, its write into the cache and the
split-K attention over the cache, in one `pallas_call`.

The twin of what a decode step does for one layer in XLA (`kvjax.ops.fused_decode.decode_append_attention`'s
"xla" path): `kvjax.rope.apply_rope` of the new query and key, `kvjax.cache.append_token` of its key / value
(slot `length`, clipped into the buffer; `pos`, `length` updated), then `kvjax.ops.attention.decode_attention`
over the layer. Here, per program `(example, KV head, split)`:

* **QK-norm** (Qwen3, Gemma 3; `qk_norm`): each query row and the key row normed over head_dim with the head's
  weight before RoPE, the permuted load scaled by the same row statistics, as `kvjax.ops.norm.rms_norm_xla`.
* **RoPE in registers** (HF rotate-half): `x cos + rotate_half(x) sin`, with `rotate_half(x) = sign * x[perm]`
  read as a second, permuted load of the same row (Triton has no concatenation); `cos` / `sin` from the layer's
  `inv_freq` at the token's position, float32, then rounded to the model dtype as `apply_rope` does. The
  family's query scale (Gemma) is applied after it, as the decoder block does.
* **The write in place**: split 0 of each (example, KV head) stores the rotated key and the value into slot
  `min(length, C - 1)` and the position into `pos` (the cache buffers are `input_output_aliases` of the call:
  donated, never copied). The length is counted by the merge kernel below (in place), since a split here could
  read a length another split had already updated. A quantized cache (int8, or int4: two codes a byte in
  channel planes, with a zero) gets the token's codes, scale and zero exactly as `kvjax.quant.storage.write_token`
  computes them (round half to even from `floor`: Triton has no round; a code may move by one where XLA and the
  kernel round the RoPE's multiply-add or a division differently).
* **The attention**: the earlier tokens are the slots `[0, min(length, C - 1))` (valid slots are packed at the
  front), so a head's live blocks come from its length (no XLA pass over the slot mask); they are split evenly
  over the splits and read as `kvjax.pallas.gpu_attention` (plain K / V: `_attend`) or
  `kvjax.pallas.gpu_quantized` (int8 / int4 codes: `attend_block`; int4 splits the query and the output into
  the codes' two channel planes) read them. The new token is attended from
  registers, never re-read from the slot another program is writing. The splits merge in one more kernel
  (`gpu_attention.merge_split_heads`, one program per (example, KV head)), which writes the group's rows in the
  query's dtype and the new length (`length + (position >= 0)`) over the old one.
* **A gathered slot list** (the retrieval family's compact decode, `slots`): per (example, KV head) `W` slot
  indices (-1: not listed), read by gather loads; a listed slot equal to the new token's slot attends the new
  token (as many times as it is listed, like the twin's gather).

The queries, key and value come as one operand `[B, K, G + 2, H]` (per KV head its G query rows, then the key
row, then the value row: the decoder block's fused q|k|v layout, which the block hands over as its projection left
it, `qkv=`; formed here from q, k and v otherwise). The query group is read with a clamped row gather (rows `>= G`
repeat row `G - 1`; their outputs are dropped): no padding copy. A capacity below 16 slots (tests only) is
padded, which copies the cache.

Compiled for an H200 (`benchmarks/gpu_compile.py`, Llama-3-8B shape), a decode step on this path launches 14
kernels per layer (the XLA path 26): the two norms (two each), the four weight GEMMs, the q|k|v operand (the
projection's split-K sum), this kernel, its merge, the two residual adds and the MLP's activation product; 6 with
the RMSNorm and weight-product kernels (`kvjax.pallas.gpu_norm`, `kvjax.pallas.gpu_linear`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax import tuning
from kvjax.errors import ConfigError
from kvjax.pallas._common import NEG, pad_axis, round_up
from kvjax.pallas.gpu_attention import (
    _as_keep,
    _attend,
    _check_block,
    _init,
    _params,
    _pow2,
    _slot_ok,
    _splits,
    interpret_mode,
    merge_split_heads,
    split_bounds,
)
from kvjax.pallas.gpu_norm import weighted
from kvjax.pallas.gpu_quantized import attend_block
from kvjax.quant import codes
from kvjax.quant.storage import QuantizedKV

Array = jax.Array

_INT8_MAX = 127.0
_INT4_LEVELS = 15.0

#: Cache leaves the kernel reads and writes per layout: K's then V's (`leaves` in `decode_append_attention`).
_LEAVES = {"plain": 2, "int8": 4, "int4": 6}


def _round_even(x: Array) -> Array:
    """`jnp.round` (nearest integer, ties to even) of float32 `|x| < 2^23` from `floor`, which Triton has: every
    step is exact (`x - floor(x)` included), so no compiler may fold it away as it may `(x + 1.5 2^23) - 1.5 2^23`
    (XLA:CPU does)."""
    low = jnp.floor(x)
    frac = x - low
    odd = low - 2.0 * jnp.floor(low * 0.5)
    up = jnp.where(frac > 0.5, 1.0, 0.0) + jnp.where(frac == 0.5, odd, 0.0)
    return low + up


def layout(k: Array | QuantizedKV) -> str:
    """"plain" (a model-dtype cache), "int8" (per-token symmetric codes, one scale per token and head) or "int4"
    (per-token asymmetric codes, two per byte, a scale and a zero per token and head)."""
    return k.spec.scheme if isinstance(k, QuantizedKV) else "plain"


def supports(k: Array | QuantizedKV, v: Array | QuantizedKV, gathered: bool) -> str | None:
    """None when the kernel takes these K / V stores, else why not (one line)."""
    if isinstance(k, QuantizedKV) != isinstance(v, QuantizedKV):
        return "keys and values must both be quantized or both plain"
    if not isinstance(k, QuantizedKV):
        return None if k.dtype == v.dtype else "keys and values must share a dtype"
    if k.spec != v.spec or k.spec.scheme not in ("int8", "int4"):
        return f"a quantized cache must be int8 or int4 for the fused kernel, got {k.spec.scheme}"
    if k.spec.channels(k.head_dim) != k.head_dim:
        return f"an {k.spec.scheme} cache with one scale per head and token (channel_group=None)"
    if gathered:
        return "the gathered slot list reads a model-dtype cache only"
    return None


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def _rope_rows(x: Array, x_perm: Array, cos: Array, sin: Array) -> Array:
    """float32 `x cos + rotate_half(x) sin` (`sin` carries rotate-half's sign)."""
    return x.astype(jnp.float32) * cos + x_perm.astype(jnp.float32) * sin


def _int8_codes(x: Array) -> tuple[Array, Array]:
    """`kvjax.quant.codes.symmetric` of one token `[H]` (float32): int8 codes and its bfloat16 scale (scalar)."""
    scale = (jnp.max(jnp.abs(x)) / _INT8_MAX).astype(codes.SCALE_DTYPE)
    sf = scale.astype(jnp.float32)
    q = jnp.clip(_round_even(x / jnp.where(sf > 0, sf, 1.0)), -_INT8_MAX, _INT8_MAX)
    return q.astype(jnp.int8), scale


def _int4_codes(x: Array) -> tuple[Array, Array, Array, Array]:
    """`kvjax.quant.codes.asymmetric` (4 bits, the head one group) of one token `[H]` (float32), then `codes.pack`:
    its codes as float32 `[H]` (channel order), the packed bytes `[H / 2]` (byte `i`: channels `i` and `i + H / 2`)
    and the bfloat16 scale and zero (scalars)."""
    lo, hi = jnp.min(x), jnp.max(x)
    scale, zero = ((hi - lo) / _INT4_LEVELS).astype(codes.SCALE_DTYPE), lo.astype(codes.SCALE_DTYPE)
    sf = scale.astype(jnp.float32)
    q = jnp.clip(_round_even((x - zero.astype(jnp.float32)) / jnp.where(sf > 0, sf, 1.0)), 0.0, _INT4_LEVELS)
    low, high = jnp.split(q.astype(jnp.int32), 2)
    return q, (low | (high << 4)).astype(jnp.uint8), scale, zero


def _head_normed(x: Array, x_perm: Array, w_ref: Array, perm: Array, eps: float, plus_one: bool,
                 dtype: jnp.dtype) -> tuple[Array, Array]:
    """QK-norm of rows `x` `[..., H]` and of their rotate-half permutation `x_perm` (the same rows' statistics), as
    `kvjax.ops.norm.rms_norm_xla` of each row with the head's weight, in `dtype`."""
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weighted(xf * inv, w_ref[...], x.dtype, plus_one, dtype),
            weighted(x_perm.astype(jnp.float32) * inv, w_ref[perm], x.dtype, plus_one, dtype))


def _kernel(len_ref: Array, qpos_ref: Array, inv_ref: Array, scaling_ref: Array, qkv_ref: Array, kp_ref: Array,
            *refs: Array, store: str, gathered: bool, block_k: int, splits: int,
            sliding_window: int | None, clamp: bool, query_scale: float, group: int, gp: int,
            dot_dtype: jnp.dtype, qk_norm: tuple[float, bool] | None) -> None:
    refs = list(refs)
    n_leaves = _LEAVES[store]
    leaves, refs = refs[:n_leaves], refs[n_leaves:]
    slots_ref = refs.pop(0) if gathered else None
    qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if qk_norm is not None else (None, None)
    o_ref, m_out, l_out, kp_out, *leaves_out = refs
    capacity, h = kp_ref.shape[0], qkv_ref.shape[1]
    half = h // 2
    qp = qpos_ref[()]
    length = len_ref[()]
    slot = jnp.clip(length, 0, capacity - 1)  # where `append_token` writes
    old = jnp.minimum(length, capacity - 1)  # slots [0, old) hold the earlier tokens
    split = pl.program_id(2)

    # ---- RoPE of the new query rows and key, in registers
    lane = jnp.arange(h, dtype=jnp.int32)
    perm = jax.lax.rem(lane + half, h)
    angle = qp.astype(jnp.float32) * inv_ref[jax.lax.rem(lane, half)].astype(jnp.float32)
    scaling = scaling_ref[0]
    cos = jnp.cos(angle) * scaling
    sin = jnp.where(lane < half, -1.0, 1.0) * (jnp.sin(angle) * scaling)
    rows = jnp.minimum(jnp.arange(gp, dtype=jnp.int32), group - 1)  # the group, its last row repeated up to Gp
    dtype = qkv_ref.dtype
    q_rows, q_perm = qkv_ref[rows, :], qkv_ref[rows[:, None], perm[None, :]]
    k_row, k_perm = qkv_ref[group, :], qkv_ref[group, perm]
    if qk_norm is not None:  # QK-norm (Qwen3, Gemma 3): each head's row normed over head_dim, before RoPE
        q_rows, q_perm = _head_normed(q_rows, q_perm, qn_ref, perm, *qk_norm, dtype)
        k_row, k_perm = _head_normed(k_row, k_perm, kn_ref, perm, *qk_norm, dtype)
    q = _rope_rows(q_rows, q_perm, cos[None, :], sin[None, :]).astype(dtype)
    if query_scale != 1.0:
        q = (q.astype(jnp.float32) * query_scale).astype(dtype)
    qs = q.astype(jnp.float32) / math.sqrt(h)  # [Gp, H], the logit scale folded in
    k_new = _rope_rows(k_row, k_perm, cos, sin).astype(dtype).astype(jnp.float32)
    v_new = qkv_ref[group + 1, :].astype(jnp.float32)

    # ---- the new token as stored (and as the attention reads it back)
    k_zero = None  # the new token's key zero (int4): its logit gains `sum(q) zero`
    if store == "plain":
        k_row, v_row = k_new.astype(leaves[0].dtype), v_new.astype(leaves[1].dtype)
        written = (k_row, v_row)
        k_att, v_att = k_row.astype(dot_dtype).astype(jnp.float32), v_row.astype(jnp.float32)
    elif store == "int8":
        (k_codes, k_scale), (v_codes, v_scale) = _int8_codes(k_new), _int8_codes(v_new)
        written = (k_codes, k_scale, v_codes, v_scale)
        k_att = k_codes.astype(jnp.float32)  # the scale multiplies the logit, as in the cache blocks
        v_att = v_codes.astype(jnp.float32) * v_scale.astype(jnp.float32)
    else:
        k_att, k_packed, k_scale, k_zero = _int4_codes(k_new)
        v_codes, v_packed, v_scale, v_zero = _int4_codes(v_new)
        written = (k_packed, k_scale, k_zero, v_packed, v_scale, v_zero)
        v_att = v_codes * v_scale.astype(jnp.float32) + v_zero.astype(jnp.float32)

    @pl.when(split == 0)
    def _write() -> None:
        kp_out[slot] = qp
        for leaf, value in zip(leaves_out, written, strict=True):
            if value.ndim:
                leaf[slot, :] = value
            else:  # a per-token scale or zero
                leaf[slot] = value

    # ---- split-K attention over the earlier tokens
    qd = qs.astype(dot_dtype)
    quantized = store != "plain"
    # int4: the query and the output in the codes' two channel planes (`kvjax.quant.codes`' planar packing)
    q_planes = list(jnp.split(qs, 2, axis=1)) if store == "int4" else [qs]
    stores = None  # attend_block's (k codes, scale, zero, v codes, scale, zero)
    if store == "int8":
        stores = (leaves[0], leaves[1], None, leaves[2], leaves[3], None)
    elif store == "int4":
        stores = tuple(leaves)
    q_sum = jnp.sum(qs, axis=1) if store == "int4" else jnp.zeros((gp,), jnp.float32)

    def attend(carry: tuple, start: Array, keep: Array, k_rows: Array | None, v_rows: Array | None) -> tuple:
        if quantized:
            layout_ = "asym" if store == "int4" else "sym"
            return attend_block(carry, q_planes, q_sum, stores, start, keep, k_layout=layout_, v_layout=layout_,
                                bits=8 if store == "int8" else 4, group=block_k, dot_dtype=dot_dtype)
        return _attend(carry, qd, k_rows, v_rows, keep)[0]

    if gathered:
        def body(j: Array, carry: tuple) -> tuple:
            inner, hits = carry
            start = pl.multiple_of(j * block_k, block_k)
            idx = slots_ref[pl.ds(start, block_k)]
            listed = idx >= 0
            safe = jnp.clip(idx, 0, capacity - 1)
            kp = kp_ref[safe]
            ok = listed & (idx < old) & (kp >= 0) & _slot_ok(kp, qp, sliding_window)
            inner = attend(inner, start, _as_keep(ok, gp), leaves[0][safe, :], leaves[1][safe, :])
            return inner, hits + jnp.sum(jnp.where(listed & (idx == slot), 1.0, 0.0))

        lo, hi = split_bounds(jnp.int32(slots_ref.shape[0] // block_k), splits, split)
        (m, l, acc), mult = jax.lax.fori_loop(lo, hi, body, (_init(gp, h), jnp.float32(0.0)))
    else:
        def body(j: Array, carry: tuple) -> tuple:
            start = pl.multiple_of(j * block_k, block_k)
            if clamp:  # the last block of a capacity that is no block multiple ends at the capacity
                nominal, start = start, jnp.minimum(start, capacity - block_k)
            slot_ids = start + jnp.arange(block_k, dtype=jnp.int32)
            kp = kp_ref[pl.ds(start, block_k)]
            ok = (slot_ids < old) & (kp >= 0) & _slot_ok(kp, qp, sliding_window)
            if clamp:
                ok &= slot_ids >= nominal
            rows_ = pl.ds(start, block_k)
            k_rows = None if quantized else leaves[0][rows_, :]
            v_rows = None if quantized else leaves[1][rows_, :]
            return attend(carry, start, _as_keep(ok, gp), k_rows, v_rows)

        lo, hi = split_bounds(jax.lax.div(old + (block_k - 1), block_k), splits, split)
        m0, l0, acc0 = _init(gp, h // len(q_planes))
        m, l, acc = jax.lax.fori_loop(lo, hi, body, (m0, l0, (acc0,) * len(q_planes) if quantized else acc0))
        mult = (split == 0).astype(jnp.float32)
    planes = acc if quantized else (acc,)

    # ---- the new token, from registers (split 0; gathered: each split as often as its entries list its slot)
    mult = mult * (qp >= 0).astype(jnp.float32)
    s_new = jnp.sum(qd.astype(jnp.float32) * k_att[None, :], axis=1)
    if quantized:
        s_new = s_new * k_scale.astype(jnp.float32)
    if k_zero is not None:
        s_new = s_new + q_sum * k_zero.astype(jnp.float32)
    seen = jnp.minimum(mult, 1.0)
    s_new = s_new * seen + (1.0 - seen) * NEG
    m_new = jnp.maximum(m, s_new)
    corr = jnp.exp(m - m_new)
    p_new = jnp.exp(s_new - m_new) * mult
    v_planes = jnp.split(v_att, len(planes)) if len(planes) > 1 else (v_att,)
    width = h // len(planes)
    for i, (plane, v_plane) in enumerate(zip(planes, v_planes, strict=True)):
        o_ref[:, pl.ds(i * width, width)] = plane * corr[:, None] + p_new[:, None] * v_plane[None, :]
    m_out[...] = m_new
    l_out[...] = l * corr + p_new


def decode_append_attention(
    q: Array,
    k_new: Array,
    v_new: Array,
    position: Array,
    inv_freq: Array,
    k: Array | QuantizedKV,
    v: Array | QuantizedKV,
    pos: Array,
    length: Array,
    *,
    scaling: float | Array = 1.0,
    query_scale: float = 1.0,
    sliding_window: int | None = None,
    slots: Array | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
    qkv: Array | None = None,
    qk_norm: tuple[Array, Array, float, bool] | None = None,
) -> tuple[Array, Array | QuantizedKV, Array | QuantizedKV, Array, Array]:
    """One decode step of one layer: q `[B, N, H]` and k_new `[B, K, H]` before RoPE, v_new `[B, K, H]`,
    `position` `[B]` (-1: a padding row), the layer's `inv_freq` `[H / 2]`, its cache `k` / `v` `[B, K, C, H]`
    (or int8 / int4 `QuantizedKV` stores, one scale per token and head), `pos` `[B, K, C]`, `length` `[B, K]`;
    `scaling` the RoPE's attention factor (a float or a traced scalar), `query_scale` the family's (static);
    `slots` `[B, K, W]` (-1: unused) attends only those slots. `qkv` `[B, K, G + 2, H]`: the same q, k_new and
    v_new in the fused layout the kernel reads, where the caller holds them so (the decoder block's q|k|v
    projection), else formed here. `qk_norm` `(q_weight [H], k_weight [H], eps, plus_one)`: q and k come before
    their QK-norm, which the kernel applies (in q's dtype) before RoPE. Returns `(out [B, N, H] in q's dtype, k,
    v, pos, length)` with the new token written (the cache leaves are aliased in place: donate them). `block_k`
    (slots per block), `num_warps`, `num_stages` and the program target default to the current tuning's `gpu_*`
    fields (`kvjax.tuning`)."""
    block_k = tuning.current().gpu_decode_block_k if block_k is None else block_k
    _check_block("decode_append_attention", "block_k", block_k)
    batch, n, h = q.shape
    kv, c = pos.shape[1], pos.shape[2]
    gathered = slots is not None
    why = supports(k, v, gathered)
    if why:
        raise ConfigError(f"decode_append_attention: {why}")
    if h % 2 or (not interpret_mode(interpret) and h & (h - 1)):
        raise ConfigError(f"decode_append_attention: head_dim must be even (a power of two compiled), got {h}")
    if n % kv:
        raise ConfigError(f"decode_append_attention: {n} query heads are not a multiple of {kv} KV heads")
    store = layout(k)
    group = n // kv
    gp = max(16, _pow2(group))
    if store == "plain":
        leaves = [k, v]
    else:  # codes, then the per-token scale (and zero) as [B, K, C]
        leaves = [x[..., 0] if i else x for qa in (k, v)
                  for i, x in enumerate((qa.data, qa.scale, qa.zero)) if x is not None]
    dot_dtype = k.dtype if k.dtype in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)
    # A capacity below one block: the block shrinks to it (a power of two >= 16), else the cache is padded.
    c_pad = c
    if c < block_k:
        if c >= 16:
            block_k = _pow2_floor(c)
        else:
            block_k, c_pad = 16, 16
    if c_pad != c:
        leaves = [pad_axis(x, 2, c_pad, 0) for x in leaves]
        pos_in = pad_axis(pos, 2, c_pad, -1)
    else:
        pos_in = pos
    clamp = c_pad % block_k != 0
    # One operand for the group's queries, key and value (`kvjax.models.block`'s fused q|k|v layout), which the
    # kernel reads by rows: XLA makes it in one fusion (with the projection's split-K sum) instead of three slices.
    if qkv is None:
        qkv = jnp.concatenate([q.reshape(batch, kv, group, h), k_new[:, :, None], v_new[:, :, None]], axis=2)
    elif qkv.shape != (batch, kv, group + 2, h) or qkv.dtype != q.dtype:
        raise ConfigError(f"decode_append_attention: qkv must be {q.dtype} {(batch, kv, group + 2, h)}, got "
                          f"{qkv.dtype} {qkv.shape}")
    operands = [length.astype(jnp.int32), position.astype(jnp.int32), inv_freq.astype(jnp.float32),
                jnp.asarray(scaling, jnp.float32).reshape(1), qkv, pos_in.astype(jnp.int32), *leaves]
    head = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, hd, s: (b, hd) + (0,) * len(shape))  # noqa: E731
    leaf_specs = [head(c_pad, x.shape[3]) if x.ndim == 4 else head(c_pad) for x in leaves]
    in_specs = [head(), pl.BlockSpec((None,), lambda b, hd, s: (b,)), pl.BlockSpec((h // 2,), lambda b, hd, s: (0,)),
                pl.BlockSpec((1,), lambda b, hd, s: (0,)), head(group + 2, h), head(c_pad), *leaf_specs]
    if gathered:
        width = round_up(max(slots.shape[2], 1), block_k)
        operands.append(pad_axis(slots.astype(jnp.int32), 2, width, -1))
        in_specs.append(head(width))
        blocks = width // block_k
    else:
        blocks = -(-c_pad // block_k)
    if qk_norm is not None:
        if qk_norm[0].shape != (h,) or qk_norm[1].shape != (h,):
            raise ConfigError(f"decode_append_attention: QK-norm weights must be [{h}], got {qk_norm[0].shape} and "
                              f"{qk_norm[1].shape}")
        operands += [qk_norm[0], qk_norm[1]]
        in_specs += [pl.BlockSpec((h,), lambda b, hd, s: (0,))] * 2
    splits = _splits(num_splits, batch * kv, blocks)
    part = lambda *shape: pl.BlockSpec((None, None, None, *shape), lambda b, hd, s: (b, hd, s) + (0,) * len(shape))  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((batch, kv, splits, gp, h), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv, splits, gp), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv, splits, gp), jnp.float32),
                 jax.ShapeDtypeStruct(pos_in.shape, jnp.int32),
                 *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)]
    out_specs = [part(gp, h), part(gp), part(gp), head(c_pad), *leaf_specs]
    first_leaf = 6  # operands: length, position, inv_freq, scaling, qkv, pos, *leaves
    aliases = {5: 3, **{first_leaf + i: 4 + i for i in range(len(leaves))}}
    kernel = functools.partial(_kernel, store=store, gathered=gathered, block_k=block_k, splits=splits,
                               sliding_window=sliding_window, clamp=clamp, query_scale=float(query_scale),
                               group=group, gp=gp, dot_dtype=dot_dtype,
                               qk_norm=None if qk_norm is None else (float(qk_norm[2]), bool(qk_norm[3])))
    acc, m, l, new_pos, *new_leaves = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(batch, kv, splits), in_specs=in_specs, out_specs=out_specs,
        input_output_aliases=aliases, compiler_params=_params(num_warps, num_stages),
        interpret=interpret_mode(interpret), name="kvjax_gpu_decode_append_attention",
    )(*operands)
    out, new_length = merge_split_heads(acc, m, l, group, q.dtype, length=length, position=position,
                                        interpret=interpret)
    out = out.reshape(batch, n, h)
    if c_pad != c:
        new_pos, new_leaves = new_pos[:, :, :c], [x[:, :, :c] for x in new_leaves]
    if store == "plain":
        new_k, new_v = new_leaves
    else:
        half = len(new_leaves) // 2
        new_k, new_v = (qa.replace(data=xs[0], scale=xs[1][..., None],
                                   **({"zero": xs[2][..., None]} if len(xs) > 2 else {}))
                        for qa, xs in ((k, new_leaves[:half]), (v, new_leaves[half:])))
    return out, new_k, new_v, new_pos, new_length
