"""Pallas GPU (Triton) decode attention reading a quantized cache (`kvjax.quant.QuantizedKV`) where it lies.

The twin of `kvjax.pallas.gpu_attention.decode_attention` for K / V stores: each block's codes and scales are
loaded and dequantized in registers, so a step reads the packed bytes (int8 / fp8: one byte per value, int4 half a
byte, KIVI-2 a quarter) instead of a 16-bit cache. The scales are folded into the two dots instead of scaling every
element:

* keys per token (int8 `x = q s`, int4 `x = q s + z`): logits `= s_c (q . codes_c) + z_c sum(q)`;
* fp8 per head: logits `= s (q . codes_c)`;
* KIVI keys per channel over a group of `G` slots (`x = q_ch S_gh + Z_gh`): the query scaled by the group's scale
  row, `(q * S_g) . codes_c + q . Z_g`; a block never crosses a group (`block_k` divides `G`);
* values per token: `p V = (p * s) codes + (p . z)` (one scale / zero per token and head), fp8 `(p codes) s`.

Sub-byte codes are packed planar (`kvjax.quant.codes`): byte `i` holds channels `i, i + H / P, ...`, so the query
and the output are split into `P` channel slices and each dot runs over one nibble / crumb plane (no interleave).
A compiled kernel turns each plane into floats with `kvjax.pallas.gpu_unpack`'s inline PTX, two codes an
instruction, rather than one integer-to-float `cvt` a code (`Tuning.gpu_unpack_asm`).
An int8 or fp8 cache of a bf16 model may be attended with float16 dots (`Tuning.gpu_f16_dots`, `dots_dtype`): the
codes convert to float16 in fewer instructions (int8 by `gpu_unpack`'s assembly, fp8 by one `cvt` a pair), and the
softmax weights are scaled so that none flushes to zero (`F16_TOP`).
An int8 cache's value codes may be read as int16 pairs of channels (`gpu_planes.as_pairs`, a bitcast in XLA;
`Tuning.gpu_int8_pairs`). `p V` contracts over slots while a V row holds one slot's channels: a block of 8-bit
values reaches the dot's operand layout one byte a load from shared memory (Hopper has no transposing 8-bit
`ldmatrix`), a 16-bit one through transposing `ldmatrix`. V's planes are then its even and odd channels, the low
and high bytes, each converted as int8 by Triton's `prmt` / bf16x2 path rather than one `cvt` a value (conversions
have low throughput on Hopper: triton-lang/triton PR 4563); the output is kept in them. With float16 dots the keys
are read in pairs too (`reads_key_pairs`), the query split into its even and odd channels: Triton gives a dot
operand converted from 8-bit data a layout of four elements a thread along the contraction, and its other operand
(the query) the same, which it loads with 64-bit loads and register moves instead of `ldmatrix`. With bf16 dots
the keys stay bytes: Triton's conversion of the pairs' bytes to bf16 costs more than that. An int4 cache's key and
value bytes are read as int16 pairs too (`Tuning.gpu_int4_pairs`, on): a pair holds channels `2n` and `2n + 1` of
each nibble plane, so the query and the output take four planes (`gpu_planes.plane_lanes`), each converted by
`gpu_unpack.pair_plane`.

KIVI's quantized slots `[0, qlen)` are split over the programs in whole blocks; its newest tokens (the
full-precision ring) and a partial last block (after an eviction left `qlen` off a block boundary) are attended
in XLA and merged with the splits' partials (`merge_splits`). Layouts the kernel does not take (scales shared by
part of a head: `channel_group` below head_dim; a per-query-head mask; attention weights asked for) run the dense
kernel on the dequantized cache instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax import slots as sl
from kvjax import tuning
from kvjax.pallas import gpu_unpack
from kvjax.pallas._common import INT_MAX, NEG, live_blocks, merge_splits, pad_axis
from kvjax.pallas.gpu_common import (
    check_block,
    compiler_params,
    dot,
    initial_state,
    interpret_mode,
    keep_mask,
    pow2,
    slot_ok,
    split_bounds,
    split_count,
    tile_or_tuned,
)
from kvjax.pallas.gpu_planes import as_pairs, plane_count, planes_to_channels, query_planes
from kvjax.quant import storage as qs
from kvjax.quant.storage import QuantizedKV

Array = jax.Array


def _layout(qa: QuantizedKV) -> str:
    """"sym" (int8 per token), "fp8" (per head), "asym" (per token scale + zero), "group" (KIVI keys)."""
    if qa.key_groups:
        return "group"
    if qa.spec.per_head_scale:
        return "fp8"
    return "sym" if qa.zero is None else "asym"


def supports(k: QuantizedKV, v: QuantizedKV, block_k: int, k_valid: Array, return_weights: bool) -> bool:
    """Whether the fused kernel takes these stores (else: the dense kernel on dequantized values)."""
    if not (isinstance(k, QuantizedKV) and isinstance(v, QuantizedKV)) or k.spec != v.spec:
        return False
    if k.wraps:  # KIVI on a sliding-window ring: groups follow positions, not slot blocks
        return False
    if return_weights or k_valid.ndim != 3:
        return False
    spec = k.spec
    if not spec.per_head_scale and spec.channels(k.head_dim) != k.head_dim:
        return False
    if spec.kivi:
        group = spec.group_size
        return group & (group - 1) == 0 and group >= 16 and group % min(block_k, group) == 0
    return True


def reads_pairs(k: QuantizedKV, int8_pairs: bool | None, int4_pairs: bool | None = None) -> bool:
    """Whether a kernel reads this cache's value codes as int16 pairs of bytes: int8 codes with one scale per token
    where `int8_pairs` (None: the current tuning's `gpu_int8_pairs`) asks for it, int4 codes where `int4_pairs`
    (None: `gpu_int4_pairs`) does."""
    if k.spec.scheme == "int4":
        asked = tuning.current().gpu_int4_pairs if int4_pairs is None else int4_pairs
        return asked and k.head_dim % 4 == 0
    asked = tuning.current().gpu_int8_pairs if int8_pairs is None else int8_pairs
    return asked and k.spec.scheme == "int8" and k.head_dim % 2 == 0


def reads_key_pairs(k: QuantizedKV, int8_pairs: bool | None, f16_dots: bool | None,
                    int4_pairs: bool | None = None) -> bool:
    """Whether a kernel reads this cache's key codes as int16 pairs too: int4's always with its values; int8's with
    its values (`reads_pairs`) where the dots are float16 (`dots_dtype`), whose codes convert by `gpu_unpack`'s
    assembly. Every dot operand then comes from 16-bit data, and Triton loads the query with `ldmatrix` instead of
    64-bit loads and register moves; int8 keys with bf16 dots stay bytes, as Triton's conversion of the pairs'
    bytes to bf16 costs more than that saves (BENCHMARKS.md, "int8 keys in pairs")."""
    if not reads_pairs(k, int8_pairs, int4_pairs):
        return False
    return k.spec.scheme == "int4" or dots_dtype(k, f16_dots) == jnp.float16


def _planes(data: Array, bits: int, dtype: jnp.dtype, unpack_asm: bool) -> list[Array]:
    """A block of codes `[W, H * bits / 8]` -> its `8 / bits` channel planes `[W, H * bits / 8]` in `dtype`; codes
    read as int16 pairs of bytes (`as_pairs`) -> twice as many, each byte plane's even and odd channels
    (`gpu_planes.plane_lanes`; int8: `[W, H / 2]` each, int4 `[W, H / 4]`). Sub-byte codes by
    `gpu_unpack.plane`, int8 codes by `gpu_unpack.int8_plane` / `int8_pair_planes` (into float16 times
    `gpu_unpack.int8_unit`, by their inline assembly where `unpack_asm`)."""
    if data.dtype == jnp.int16 and bits < 8:  # bytes of packed codes in pairs: per byte plane, low then high bytes
        return [gpu_unpack.pair_plane(data, j * bits, high, bits, dtype, asm=unpack_asm) for j in range(8 // bits)
                for high in (False, True)]
    if data.dtype == jnp.int16:
        return list(gpu_unpack.int8_pair_planes(data, dtype, asm=unpack_asm))
    if data.dtype == jnp.int8:
        return [gpu_unpack.int8_plane(data, dtype, asm=unpack_asm)]
    if bits == 8:  # fp8 (e4m3 -> float16 is exact: one `cvt` for two codes)
        return [data.astype(dtype) if jnp.dtype(dtype) == jnp.float16 else data.astype(jnp.float32).astype(dtype)]
    return [gpu_unpack.plane(data, j * bits, bits, dtype, asm=unpack_asm) for j in range(8 // bits)]


def dots_dtype(k: QuantizedKV, f16_dots: bool | None = None) -> jnp.dtype:
    """The dtype of a kernel's dots over quantized cache `k`: its model dtype (bf16 / fp16; else float32), or
    float16 for 8-bit codes (int8, fp8) of a bf16 model where `f16_dots` (None: the current tuning's
    `gpu_f16_dots`) asks for it."""
    model = k.dtype if k.dtype in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)
    asked = tuning.current().gpu_f16_dots if f16_dots is None else f16_dots
    return jnp.dtype(jnp.float16) if asked and model == jnp.bfloat16 and k.spec.scheme in ("int8", "fp8") else model


def unpacks_with_asm(compiled: bool, unpack_asm: bool | None = None) -> bool:
    """Whether a kernel converts codes with `gpu_unpack`'s assembly (sub-byte codes; int8 codes into float16):
    compiled only, where `unpack_asm` (None: the current tuning's `gpu_unpack_asm`) asks for it."""
    return compiled and (tuning.current().gpu_unpack_asm if unpack_asm is None else unpack_asm)


#: Float16 dots take the softmax weights scaled so that the largest of a row is at most 2^15 (float16 tops out at
#: 65,504). A weight, or a weight times a per-token scale, can lie far below float16's smallest normal (2^-14) and
#: flush to zero, where bfloat16's exponent keeps it; scaled, a row loses only terms under 2^-39 of its largest.
F16_TOP = 32768.0
F16_FLOOR = 2.0**-100


def _weights(w: Array, dtype: jnp.dtype, at_most_one: bool, unit: float = 1.0) -> tuple[Array, Array | float | None]:
    """Softmax weights `w [Gp, W]` (float32, >= 0) as the `p V` dot's operand in `dtype`, and the factor the dot's
    result takes back (None: unscaled), which also undoes the value codes' `unit` (`gpu_unpack.int8_unit`). Float16
    weights at most one (no per-token scale in them) are scaled by `F16_TOP`, others row by row to put the row's
    largest there."""
    if jnp.dtype(dtype) != jnp.float16:
        return w.astype(dtype), None
    if at_most_one:
        return (w * F16_TOP).astype(dtype), 1 / (F16_TOP * unit)
    # A row's largest under 2^-100 (nothing kept, or weights far below the running maximum, even subnormal) is
    # scaled as if it were 2^-100: the factor stays finite, and such weights matter to no row (its largest is 1).
    top = jnp.maximum(jnp.max(w, axis=1, keepdims=True), F16_FLOOR)
    return (w * (F16_TOP / top)).astype(dtype), top * (1 / (F16_TOP * unit))


def attend_block(carry: tuple, qf: list[Array], qsum: Array, refs: tuple, start: Array, keep: Array, *,
                 k_layout: str, v_layout: str, bits: int, group: int, dot_dtype: jnp.dtype,
                 unpack_asm: bool = False) -> tuple:
    """One online-softmax step over the `W = keep.shape[1]` slots from `start` of quantized K / V refs `refs`
    (`k_data, k_scale, k_zero, v_data, v_scale, v_zero`; None where the layout has none): `carry` is
    `(m [Gp], l [Gp], acc)` with `acc` a tuple of `P` planes `[Gp, H / P]` (`8 / bits`; int8 values read as int16
    pairs: 2, even and odd channels); `qf` the query's planes
    (float32, scaled by 1 / sqrt(H)), `qsum` their sum per row, `keep` `[Gp, W]` float32 1 / 0; `unpack_asm`:
    sub-byte codes converted by `gpu_unpack`'s assembly (compiled kernels only)."""
    k_data, k_scale, k_zero, v_data, v_scale, v_zero = refs
    m, l, acc = carry
    parts = len(qf)
    rows = pl.ds(start, keep.shape[1])
    # int8 codes in float16 come out times 2^-10 (`gpu_unpack.int8_unit`): the scales take 2^10 back
    k_unit, v_unit = (gpu_unpack.int8_unit(dot_dtype) if layout == "sym" else 1.0 for layout in (k_layout, v_layout))
    # ---- logits [Gp, W]
    planes = _planes(k_data[rows, :], bits, dot_dtype, unpack_asm)
    if k_layout == "group":  # the block's group: one scale / zero row [1, H / P] per channel plane
        g, width = start // group, qf[0].shape[1]
        scale = [k_scale[pl.ds(g, 1), pl.ds(i * width, width)].astype(jnp.float32) for i in range(parts)]
        zero = [k_zero[pl.ds(g, 1), pl.ds(i * width, width)].astype(jnp.float32) for i in range(parts)]
        s = sum(dot((qf[i] * scale[i]).astype(dot_dtype), planes[i], 1) for i in range(parts))
        s = s + sum(jnp.sum(qf[i] * zero[i], axis=1) for i in range(parts))[:, None]
    else:
        s = sum(dot(qf[i].astype(dot_dtype), planes[i], 1) for i in range(parts))
        if k_layout == "fp8":
            s = s * k_scale[()]
        else:
            row_scale = k_scale[rows].astype(jnp.float32)
            s = s * (row_scale if k_unit == 1 else row_scale * (1 / k_unit))[None, :]
            if k_zero is not None:
                s = s + qsum[:, None] * k_zero[rows].astype(jnp.float32)[None, :]
    s = jnp.where(keep > 0.5, s, NEG)  # the select of `gpu_common.attend_window`
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None]) * keep
    corr = jnp.exp(m - m_new)
    # ---- p V per channel plane
    v_planes = _planes(v_data[rows, :], bits, dot_dtype, unpack_asm)
    if v_layout == "fp8":
        w, back = _weights(p, dot_dtype, at_most_one=True)
        pv = [dot(w, x, 0) * (v_scale[()] if back is None else back * v_scale[()]) for x in v_planes]
    else:
        w, back = _weights(p * v_scale[rows].astype(jnp.float32)[None, :], dot_dtype, at_most_one=False, unit=v_unit)
        pv = [dot(w, x, 0) if back is None else dot(w, x, 0) * back for x in v_planes]
        if v_zero is not None:
            pz = jnp.sum(p * v_zero[rows].astype(jnp.float32)[None, :], axis=1)[:, None]
            pv = [x + pz for x in pv]
    acc = tuple(a * corr[:, None] + x for a, x in zip(acc, pv, strict=True))
    return m_new, l * corr + jnp.sum(p, axis=1), acc


def _kernel(nlive_ref: Array, qpos_ref: Array, q_ref: Array, kp_ref: Array, *refs: Array, block_k: int, splits: int,
            sliding_window: int | None, k_layout: str, v_layout: str, bits: int, group: int, clamp: bool,
            dot_dtype: jnp.dtype, unpack_asm: bool) -> None:
    refs = list(refs)
    k_data, k_scale = refs.pop(0), refs.pop(0)
    k_zero = refs.pop(0) if k_layout in ("asym", "group") else None
    v_data, v_scale = refs.pop(0), refs.pop(0)
    v_zero = refs.pop(0) if v_layout == "asym" else None
    o_ref, m_out, l_out = refs
    parts = q_ref.shape[0]
    qf = [q_ref[j] for j in range(parts)]  # float32 [Gp, H / P] each, already scaled by 1 / sqrt(H)
    gp = qf[0].shape[0]
    qsum = sum(jnp.sum(x, axis=1) for x in qf)  # [Gp]
    qp = qpos_ref[()]
    lo, hi = split_bounds(nlive_ref[()], splits, pl.program_id(2))
    stores = (k_data, k_scale, k_zero, v_data, v_scale, v_zero)

    def body(j: Array, carry: tuple) -> tuple:
        start = pl.multiple_of(j * block_k, block_k)
        if clamp:  # the last block of a capacity that is no block multiple ends at the capacity
            nominal, start = start, jnp.minimum(start, kp_ref.shape[0] - block_k)
        ok = slot_ok(kp_ref[pl.ds(start, block_k)], qp, sliding_window)
        if clamp:
            ok &= start + jnp.arange(block_k, dtype=jnp.int32) >= nominal
        return attend_block(carry, qf, qsum, stores, start, keep_mask(ok, gp), k_layout=k_layout,
                            v_layout=v_layout, bits=bits, group=group, dot_dtype=dot_dtype, unpack_asm=unpack_asm)

    # the output's planes: the values' (int8 pairs: 2; else the query's)
    m0, l0, acc0 = initial_state(gp, o_ref.shape[-1])
    m, l, acc = jax.lax.fori_loop(lo, hi, body, (m0, l0, (acc0,) * o_ref.shape[0]))
    for i in range(o_ref.shape[0]):
        o_ref[i] = acc[i]
    m_out[...] = m
    l_out[...] = l


def _extra_partials(q: Array, q_pos: Array, k: QuantizedKV, v: QuantizedKV, k_pos: Array, valid: Array,
                    sliding_window: int | None, block_k: int) -> tuple[Array, Array, Array]:
    """KIVI: the slots the kernel leaves, `[floor_block(qlen), qlen)` (a partial block) and the ring, attended in
    XLA: split partials `acc [B, K, 1, Gp, H]`, `m`, `l [B, K, 1, Gp]`. `q` `[B, K, Gp, H]` float32, scaled."""
    qlen = k.qlen
    start = (qlen // block_k) * block_k
    tail = start[..., None] + jnp.arange(block_k, dtype=jnp.int32)  # [B, K, W]
    ring = qs._ring_slots(qlen, k.spec.ring)  # [B, K, R + 1]
    slots = jnp.concatenate([tail, ring], axis=-1)
    mine = jnp.concatenate([tail < qlen[..., None], jnp.ones(ring.shape, bool)], axis=-1)
    c = k.capacity
    safe = jnp.clip(slots, 0, c - 1)
    ok = mine & (slots < c) & sl.take_slots(valid, safe)
    kp = sl.take_slots(k_pos, safe)
    qp = q_pos[:, None, None]
    ok &= (kp <= qp) & (qp >= 0)
    if sliding_window is not None:
        ok &= qp - kp < sliding_window
    kk, vv = qs.take(k, safe), qs.take(v, safe)  # float32 [B, K, S, H]
    s = jnp.where(ok[:, :, None], jnp.einsum("bkgh,bksh->bkgs", q, kk), NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None]) * ok[:, :, None]
    acc = jnp.einsum("bkgs,bksh->bkgh", p, vv)
    return acc[:, :, None], m[:, :, None], jnp.sum(p, axis=-1)[:, :, None]


def decode_attention(q: Array, q_pos: Array, k: QuantizedKV, v: QuantizedKV, k_pos: Array, k_valid: Array, *,
                     sliding_window: int | None = None, block_k: int | None = None, num_splits: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None, int8_pairs: bool | None = None,
                     int4_pairs: bool | None = None, unpack_asm: bool | None = None, f16_dots: bool | None = None,
                     interpret: bool | None = None) -> Array:
    """`kvjax.pallas.gpu_attention.decode_attention` over quantized K / V stores (`supports(...)` must hold):
    q `[B, N, H]`, q_pos `[B]`, k_pos / k_valid `[B, K, C]`. Returns `[B, N, H]` in q's dtype. `block_k`,
    `num_warps` and `num_stages` default to the current tuning's quantized tile (`kvjax.tuning.Tuning.tile`),
    `int8_pairs` (int8 value codes read as int16 pairs, `as_pairs`) to its `gpu_int8_pairs`, `int4_pairs` (int4
    codes read so) to its `gpu_int4_pairs`, `unpack_asm`
    (codes converted by `gpu_unpack`'s assembly when compiled) to its `gpu_unpack_asm`, `f16_dots` (an int8 / fp8
    cache of a bf16 model attended with float16 dots, `dots_dtype`) to its `gpu_f16_dots`."""
    block_k, num_warps, num_stages = tile_or_tuned(True, block_k, num_warps, num_stages)
    pairs = reads_pairs(k, int8_pairs, int4_pairs)
    key_pairs = reads_key_pairs(k, int8_pairs, f16_dots, int4_pairs)
    batch, kv, c, h = k.shape
    spec = k.spec
    if spec.kivi:
        block_k = min(block_k, spec.group_size)
    check_block("decode_attention", "block_k", block_k)
    compiled = not interpret_mode(interpret)
    if compiled and h & (h - 1):
        from kvjax.errors import ConfigError

        raise ConfigError(f"compiled for GPU (Triton), head_dim must be a power of two, got {h}")
    n = q.shape[1]
    g = n // kv
    gp = max(16, pow2(g))
    parts, out_parts = plane_count(spec.bits, key_pairs), plane_count(spec.bits, pairs)  # the query's, the output's
    qf = pad_axis(q.reshape(batch, kv, g, h).astype(jnp.float32) / math.sqrt(h), 2, gp, 0)  # [B, K, Gp, H]
    q_planes = query_planes(qf, parts, key_pairs)  # [B, K, P, Gp, H / P]
    c_pad = max(c, block_k)
    clamp = c_pad % block_k != 0 and not spec.kivi  # KIVI's kernel blocks all lie below qlen
    nlive = live_blocks(k_valid, block_k)
    if spec.kivi:
        nlive = jnp.minimum(nlive, k.qlen // block_k)
    splits = split_count(num_splits, batch * kv, -(-c_pad // block_k), quantized=True)
    kp = pad_axis(jnp.where(k_valid, k_pos, INT_MAX).astype(jnp.int32), 2, c_pad, INT_MAX)

    def per_slot(x: Array) -> Array:  # [B, K, C, 1] scales -> [B, K, C_pad]
        return pad_axis(x[..., 0], 2, c_pad, 0)

    head = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, hd, s: (b, hd) + (0,) * len(shape))  # noqa: E731
    width = h * spec.bits // 8
    operands = [kp]
    in_specs = [head(), pl.BlockSpec((None,), lambda b, hd, s: (b,)), head(parts, gp, h // parts), head(c_pad)]
    for qa in (k, v):
        layout = _layout(qa)
        as_pair = key_pairs if qa is k else pairs
        operands.append(pad_axis(as_pairs(qa.data) if as_pair else qa.data, 2, c_pad, 0))
        in_specs.append(head(c_pad, width // 2 if as_pair else width))
        if layout == "fp8":
            operands.append(qa.scale)
            in_specs.append(head())
        elif layout == "group":
            groups = -(-c_pad // spec.group_size)
            operands += [pad_axis(qa.scale, 2, groups, 0), pad_axis(qa.zero, 2, groups, 0)]
            in_specs += [head(groups, h)] * 2
        else:
            operands.append(per_slot(qa.scale))
            in_specs.append(head(c_pad))
            if layout == "asym":
                operands.append(per_slot(qa.zero))
                in_specs.append(head(c_pad))
    part = lambda *shape: pl.BlockSpec((None, None, None, *shape), lambda b, hd, s: (b, hd, s) + (0,) * len(shape))  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((batch, kv, splits, out_parts, gp, h // out_parts), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv, splits, gp), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv, splits, gp), jnp.float32)]
    kernel = functools.partial(_kernel, block_k=block_k, splits=splits, sliding_window=sliding_window,
                               k_layout=_layout(k), v_layout=_layout(v), bits=spec.bits,
                               group=spec.group_size or block_k, clamp=clamp, dot_dtype=dots_dtype(k, f16_dots),
                               unpack_asm=unpacks_with_asm(compiled, unpack_asm))
    acc, m, l = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(batch, kv, splits), in_specs=in_specs,
        out_specs=[part(out_parts, gp, h // out_parts), part(gp), part(gp)],
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret_mode(interpret),
        name="kvjax_gpu_quantized_decode_attention",
    )(nlive, q_pos.astype(jnp.int32), q_planes, *operands)
    acc = planes_to_channels(acc, pairs)  # [B, K, splits, Gp, H]
    if spec.kivi:
        extra = _extra_partials(qf, q_pos, k, v, k_pos, k_valid, sliding_window, block_k)
        acc, m, l = (jnp.concatenate([a, b], axis=2) for a, b in zip((acc, m, l), extra, strict=True))
    out = merge_splits(acc, m, l)[0]
    return out[:, :, :g].reshape(batch, kv * g, h).astype(q.dtype)
