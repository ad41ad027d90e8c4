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
  kernel round the RoPE's multiply-add or a division differently). An fp8 cache (e4m3 codes, one power-of-two
  scale per head) gets the token's codes against its head's scale; a head never written (scale 0) takes one from
  the token, which split 0 writes in place. No other split depends on that write: a set scale is rewritten with
  its own value, and a head never written has no earlier tokens for the splits to read it for (their own copy of
  the new token's term is weighted 0: split 0 alone attends the new token).
* **The attention**: the earlier tokens are the slots `[0, min(length, C - 1))` (valid slots are packed at the
  front), so a head's live blocks come from its length (no XLA pass over the slot mask); they are split evenly
  over the splits and read as `kvjax.pallas.gpu_attention` (plain K / V: `_attend`) or
  `kvjax.pallas.gpu_quantized` (int8 / int4 codes: `attend_block`; int4 splits the query and the output into
  the codes' two channel planes; int8 values read as int16 pairs of bytes, `Tuning.gpu_int8_pairs`: the output in
  even and odd channels, the token's value codes written as pairs, and with float16 dots the keys too, the query in
  even and odd channels; int4 codes read so too, `Tuning.gpu_int4_pairs`, keys and values: four planes, each byte
  plane's even and odd channels, `gpu_quantized.plane_lanes`) read them; a sub-byte cache's (or codes in pairs')
  query planes are loaded by their own channels (`_query_planes`). The new token is attended from registers, never
  re-read from the slot another program is writing, and first: its logit and value open the online softmax, so
  that the loops carry nothing else. The splits merge in one more kernel
  (`gpu_attention.merge_split_heads`, one program per (example, KV head)), which writes the group's rows in the
  query's dtype and the new length (`length + (position >= 0)`) over the old one.
* **KIVI** (KIVI-2 / KIVI-4: keys per channel over groups of `G` slots, values per token, the newest tokens in a
  full-precision ring of `R + 1` rows, `kvjax.quant.storage`): split 0 writes the token into its slot's ring row.
  The splits share the whole groups below `qlen` (codes read by `attend_block`, a block never crossing a group),
  split 0 taking as many blocks fewer as the rows it attends alone fill (`split_bounds`' `head`);
  split 0 alone then reads the group at `qlen` (its codes below `qlen`, ring rows from it) and, when the token
  leaves more than `R` tokens pending, flushes it as `write_token` does: keys quantized per channel over the group
  (their range taken over its rows first) and values per token, written in place with their scales and zeros, and
  the group attended as its new codes read back. Then split 0 attends the ring's pending tokens past it (a gather
  of their rows). It reads these rows `KIVI_CHUNK` at a time.
  Everything is kept in the codes' channel planes: no concatenation, none to pack. `qlen` moves to the group's
  end in the merge kernel (`_flushed_qlen` per head), after every split has read it: the other splits read it to
  count the whole groups, so a write by split 0 would race with them (jax 0.11's interpreter, which runs the
  aliased operands in place, showed it: a later split attended the flushed group a second time). A head that is
  full (its token clipped onto the last slot) is outside what decode produces: the layer written is XLA's, but
  where that slot is quantized the kernel attends the token from registers and XLA its codes.
* **In-place eviction** (StreamingLLM, DuoAttention's streaming heads; `evict`, decided before the call): the
  token is written into the evicted slot as well as slot `length`, whose position is cleared, the blocks skip the
  evicted slot, and the merge kernel leaves the length as it was: what `kvjax.cache.append_token` then `evict`
  leave. A token that evicts itself is written, cleared and not attended.
* **A sliding-window ring** (`ring`, Gemma 3's local layers; `kvjax.cache.ring_append`): the token goes to slot
  `position % C` over the position that left the window (a padding row writes nothing), the blocks cover the ring
  as the write leaves it and skip that slot, and the merge kernel caps the length at `C`.
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
the RMSNorm and weight-product kernels (`kvjax.pallas.gpu_norm`, `kvjax.pallas.gpu_linear`), for a bf16, int8,
int4 or KIVI-2 cache alike (the XLA write of int4 and KIVI-2 made 22 and 37).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.errors import ConfigError
from kvjax.pallas import gpu_unpack
from kvjax.pallas._common import NEG, pad_axis, round_up
from kvjax.pallas.gpu_attention import (
    _as_keep,
    _attend,
    _check_block,
    _dot,
    _params,
    _pow2,
    _slot_ok,
    _splits,
    interpret_mode,
    merge_split_heads,
    split_bounds,
    tile_or_tuned,
)
from kvjax.pallas.gpu_norm import weighted
from kvjax.pallas.gpu_quantized import (
    as_pairs,
    attend_block,
    deinterleave,
    dots_dtype,
    from_pairs,
    join_planes,
    plane_count,
    plane_lanes,
    reads_key_pairs,
    reads_pairs,
    split_planes,
    unpacks_with_asm,
)
from kvjax.quant import codes
from kvjax.quant.storage import QuantizedKV

Array = jax.Array

_INT8_MAX = 127.0
#: Cache leaves the kernel reads and writes per layout: K's then V's (`leaves` in `decode_append_attention`).
_LEAVES = {"plain": 2, "int8": 4, "fp8": 4, "int4": 6, "kivi": 10}


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
    """"plain" (a model-dtype cache), "int8" (per-token symmetric codes, one scale per token and head), "fp8" (e4m3
    codes, one power-of-two scale per head), "int4" (per-token asymmetric codes, two per byte, a scale and a zero
    per token and head) or "kivi" (KIVI-2 / KIVI-4: keys per channel over slot groups, values per token, the newest
    tokens in a full-precision ring)."""
    if not isinstance(k, QuantizedKV):
        return "plain"
    return "kivi" if k.spec.kivi else k.spec.scheme


def supports(k: Array | QuantizedKV, v: Array | QuantizedKV, gathered: bool) -> str | None:
    """None when the kernel takes these K / V stores, else why not (one line)."""
    if isinstance(k, QuantizedKV) != isinstance(v, QuantizedKV):
        return "keys and values must both be quantized or both plain"
    if not isinstance(k, QuantizedKV):
        return None if k.dtype == v.dtype else "keys and values must share a dtype"
    if k.spec != v.spec:
        return f"keys and values must share a quantization, got {k.spec.name} and {v.spec.name}"
    if k.spec.channels(k.head_dim) != k.head_dim:
        return f"a {k.spec.scheme} cache with one scale per head and token (channel_group=None)"
    if k.spec.kivi:
        group = k.spec.group_size
        if k.wraps:
            return "a KIVI sliding-window ring stays on the XLA path"
        if group & (group - 1) or group < 16 or k.capacity < 16:
            return f"KIVI in the fused kernel: group_size a power of two >= 16 and 16+ slots, got {group}"
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
    sf = codes.as_stored(jnp.max(jnp.abs(x)) / _INT8_MAX)
    q = jnp.clip(_round_even(x / jnp.where(sf > 0, sf, 1.0)), -_INT8_MAX, _INT8_MAX)
    return q.astype(jnp.int8), sf.astype(codes.SCALE_DTYPE)


def _pairs_of(codes_: Array) -> Array:
    """Bytes `[H]` (int8 codes, uint8 packed codes) -> the int16 pairs `as_pairs` makes of them (byte `2i` the low
    byte, `2i + 1` the high)."""
    if codes_.dtype == jnp.uint8:
        codes_ = jax.lax.bitcast_convert_type(codes_, jnp.int8)
    even, odd = deinterleave(codes_.astype(jnp.int32))
    return ((even & 0xFF) | (odd << 8)).astype(jnp.int16)


def _fp8_codes(x: Array, old_scale: Array, counted: Array) -> tuple[Array, Array]:
    """fp8 e4m3 codes of one token `[H]` (float32) and its head's scale (scalar): the scale already set, else (0:
    a head never written) one from the token, where it counts (`kvjax.quant.storage.write_token`)."""
    amax = jnp.where(counted, jnp.max(jnp.abs(x)), 0.0)
    scale = jnp.where(old_scale > 0, old_scale, codes.fp8_scale(amax))
    return codes.fp8_codes(x, scale), scale


def _asymmetric_codes(x: Array, scale: Array, zero: Array, bits: int) -> Array:
    """`kvjax.quant.codes.asymmetric_codes` as float32, rounding with `_round_even` (Triton has no round); the
    scale and zero as stored (`codes.as_stored`)."""
    sf = codes.as_stored(scale)
    q = _round_even((x - codes.as_stored(zero)) / jnp.where(sf > 0, sf, 1.0))
    return jnp.clip(q, 0.0, float((1 << bits) - 1))


def _int4_codes(x: Array) -> tuple[Array, Array, Array, Array]:
    """`kvjax.quant.codes.asymmetric` (4 bits, the head one group) of one token `[H]` (float32), then `codes.pack`:
    its codes as float32 `[H]` (channel order), the packed bytes `[H / 2]` (byte `i`: channels `i` and `i + H / 2`)
    and the bfloat16 scale and zero (scalars)."""
    scale, zero = codes.asymmetric_stats(jnp.min(x), jnp.max(x), 4)
    q = _asymmetric_codes(x, scale, zero, 4)
    return q, _pack_planes(jnp.split(q, 2), 4), scale, zero


def _store_token(leaves: list[Array], written: tuple[Array, ...], slot: Array) -> None:
    """The token's rows (K / V or codes) and per-token scalars (scales, zeros) into slot `slot` of the leaves. A
    leaf of one value per head (fp8's scale) is not a slot's: the kernel writes it once, for every row."""
    for leaf, value in zip(leaves, written, strict=True):
        if value.ndim:
            leaf[slot, :] = value
        elif leaf.ndim:
            leaf[slot] = value


def _pack_planes(planes: list[Array], bits: int) -> Array:
    """The codes (float32, each below `2^bits`) of a head's `8 / bits` channel planes -> their bytes, plane `j` in
    bits `[j bits, (j + 1) bits)` (`kvjax.quant.codes.pack`'s planar layout)."""
    shifted = [q.astype(jnp.int32) << (j * bits) for j, q in enumerate(planes)]
    return functools.reduce(jnp.bitwise_or, shifted).astype(jnp.uint8)


def _attend_planes(carry: tuple, q_planes: list[Array], k_planes: list[Array], v_planes: list[Array],
                   keep: Array) -> tuple:
    """`_attend` with q / k / v split into the codes' channel planes (`[Gp | W, H / P]` each; q in the dot dtype,
    k / v float32 values): `carry` is `(m, l, acc)` with `acc` a tuple of `P` planes, as `attend_block`'s."""
    m, l, acc = carry
    dtype = q_planes[0].dtype
    clean = lambda x: jnp.where(jnp.isfinite(x), x, 0.0).astype(dtype)  # noqa: E731  (a NaN-poisoned ring row)
    s = sum(_dot(qp, clean(kp), 1) for qp, kp in zip(q_planes, k_planes, strict=True))
    s = s * keep + (1.0 - keep) * NEG
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None]) * keep
    corr = jnp.exp(m - m_new)
    acc = tuple(a * corr[:, None] + _dot(p.astype(dtype), clean(vp), 0) for a, vp in zip(acc, v_planes, strict=True))
    return m_new, l * corr + jnp.sum(p, axis=1), acc


#: Rows of KIVI's group and ring that split 0 reads, quantizes and attends at a time. Read whole (a group of 64 and
#: a ring of 128 rows, every channel plane in float32), they held more values than a thread's registers and spilled
#: (BENCHMARKS.md, "The fused kernel's registers").
KIVI_CHUNK = 16


def _kivi_pending(carry: tuple, refs: list[Array], outs: list[Array], kp_ref: Array, q_planes: list[Array],
                  new_planes: tuple[list[Array], list[Array]], qp: Array, length: Array, slot: Array, old: Array,
                  *, bits: int, group: int, residual: int, sliding_window: int | None) -> tuple:
    """KIVI, split 0: the slots past the whole groups below `qlen`, attended into `carry` (planes), `KIVI_CHUNK`
    rows at a time.

    The group at `qlen` is read (codes below `qlen`, ring rows from it); when the step's token leaves more than
    `residual` pending it is flushed as `kvjax.quant.storage.write_token` does (keys per channel over the group,
    values per token; written in place, `qlen` moved to its end by the merge kernel) and attended as its new codes
    read back, else its codes below `qlen` are attended (a prefix that ended inside a group); then the ring's
    pending tokens past it."""
    k_data, k_scale, k_zero, k_ring, k_qlen, v_data, v_scale, v_zero, v_ring, _ = refs
    capacity, ring = kp_ref.shape[0], residual + 1
    parts = 8 // bits
    gp, width = q_planes[0].shape
    chunk = min(group, KIVI_CHUNK)
    cols = [i * width + jnp.arange(width, dtype=jnp.int32) for i in range(parts)]
    qlen = k_qlen[()]
    start = (qlen // group) * group
    # the group's key scale / zero row (clamped: a head quantized to a capacity that is a group multiple has no
    # group at `qlen`, and a ref read past its rows is not bounds-checked in Triton; a flush never clamps)
    g_row = pl.ds(jnp.minimum(start // group, k_scale.shape[0] - 1), 1)
    k_stats = [(k_scale[g_row, pl.ds(i * width, width)].astype(jnp.float32),
                k_zero[g_row, pl.ds(i * width, width)].astype(jnp.float32)) for i in range(parts)]

    def read(first: Array) -> tuple[Array, Array, list[Array], list[Array]]:
        """Rows `[first, first + chunk)` as they read now: codes below `qlen`, the ring from it (the step's token
        from registers); their ids, clamped ids, and K / V planes `[chunk, H / P]` float32."""
        ids = first + jnp.arange(chunk, dtype=jnp.int32)
        safe = jnp.minimum(ids, capacity - 1)
        k_codes, v_codes = k_data[safe[:, None], cols[0][None, :]], v_data[safe[:, None], cols[0][None, :]]
        coded = (safe < qlen)[:, None]
        fresh = (safe == slot)[:, None]
        ring_rows = jax.lax.rem(safe, ring)
        v_s, v_z = v_scale[safe].astype(jnp.float32)[:, None], v_zero[safe].astype(jnp.float32)[:, None]
        k_vals, v_vals = [], []
        for i, (k_s, k_z) in enumerate(k_stats):
            kc = gpu_unpack.plane(k_codes, i * bits, bits, jnp.float32, asm=False) * k_s + k_z
            vc = gpu_unpack.plane(v_codes, i * bits, bits, jnp.float32, asm=False) * v_s + v_z
            at = (ring_rows[:, None], cols[i][None, :])
            kr = jnp.where(fresh, new_planes[0][i][None, :], k_ring[at].astype(jnp.float32))
            vr = jnp.where(fresh, new_planes[1][i][None, :], v_ring[at].astype(jnp.float32))
            k_vals.append(jnp.where(coded, kc, kr))
            v_vals.append(jnp.where(coded, vc, vr))
        return ids, safe, k_vals, v_vals

    def keep(ids: Array, safe: Array, end: Array) -> Array:
        kp = kp_ref[safe]
        return _as_keep((ids < end) & (ids < old) & (kp >= 0) & _slot_ok(kp, qp, sliding_window), gp)

    def chunks(rows: Array) -> Array:
        return jnp.maximum(rows + (chunk - 1), 0) // chunk

    def coded_part(carry: tuple) -> tuple:
        """No flush: the group's codes below `qlen` (none unless a prefix ended inside the group)."""
        def step(j: Array, carry: tuple) -> tuple:
            ids, safe, k_vals, v_vals = read(start + j * chunk)
            return _attend_planes(carry, q_planes, k_vals, v_vals, keep(ids, safe, qlen))

        return jax.lax.fori_loop(0, chunks(jnp.minimum(qlen, old) - start), step, carry)

    def flushed(carry: tuple) -> tuple:
        """The group quantized (keys per channel over its rows, values per token), written in place, and attended
        as its new codes read back."""
        def extremes(j: Array, acc: tuple) -> tuple:
            k_vals = read(start + j * chunk)[2]
            return tuple((jnp.minimum(lo, jnp.min(x, axis=0, keepdims=True)),
                          jnp.maximum(hi, jnp.max(x, axis=0, keepdims=True)))
                         for (lo, hi), x in zip(acc, k_vals, strict=True))

        unset = (jnp.full((1, width), jnp.inf, jnp.float32), jnp.full((1, width), -jnp.inf, jnp.float32))
        bounds = jax.lax.fori_loop(0, group // chunk, extremes, (unset,) * parts)
        k_new = [codes.asymmetric_stats(lo, hi, bits) for lo, hi in bounds]  # per channel: scale, zero [1, H / P]

        def step(j: Array, carry: tuple) -> tuple:
            first = start + j * chunk
            ids, safe, k_vals, v_vals = read(first)
            k_q = [_asymmetric_codes(x, scale, zero, bits) for x, (scale, zero) in zip(k_vals, k_new, strict=True)]
            v_lo = functools.reduce(jnp.minimum, [jnp.min(x, axis=1) for x in v_vals])  # per token over the head
            v_hi = functools.reduce(jnp.maximum, [jnp.max(x, axis=1) for x in v_vals])
            v_s, v_z = codes.asymmetric_stats(v_lo, v_hi, bits)
            v_sf, v_zf = v_s.astype(jnp.float32)[:, None], v_z.astype(jnp.float32)[:, None]
            v_q = [_asymmetric_codes(x, v_sf, v_zf, bits) for x in v_vals]
            rows = pl.ds(first, chunk)
            outs[0][rows, :] = _pack_planes(k_q, bits)
            outs[5][rows, :] = _pack_planes(v_q, bits)
            outs[6][rows] = v_s
            outs[7][rows] = v_z
            k_back = [q * scale.astype(jnp.float32) + zero.astype(jnp.float32)
                      for q, (scale, zero) in zip(k_q, k_new, strict=True)]
            return _attend_planes(carry, q_planes, k_back, [q * v_sf + v_zf for q in v_q],
                                  keep(ids, safe, start + group))

        carry = jax.lax.fori_loop(0, group // chunk, step, carry)
        for i, (scale, zero) in enumerate(k_new):  # after every chunk read the group's old row
            outs[1][g_row, pl.ds(i * width, width)] = scale
            outs[2][g_row, pl.ds(i * width, width)] = zero
        return carry

    # ---- the group at qlen (the flush is static: a capacity within the ring never flushes)
    counted = (qp >= 0).astype(jnp.int32)
    if capacity > residual:
        flush = _flushes(length, counted, qlen, residual)
        # a branch, not a select: a step flushes once a group, and only a flushing step pays for the quantization
        carry = jax.lax.cond(flush, flushed, coded_part, carry)
    else:
        flush, carry = jnp.bool_(False), coded_part(carry)
    # ---- the ring's pending tokens past the group
    done = jnp.where(flush, start + group, qlen)  # slots below it are codes after this step

    def pending(j: Array, carry: tuple) -> tuple:
        ids = done + j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        safe = jnp.minimum(ids, capacity - 1)
        rows = jax.lax.rem(safe, ring)
        k_vals = [k_ring[rows[:, None], c[None, :]].astype(jnp.float32) for c in cols]
        v_vals = [v_ring[rows[:, None], c[None, :]].astype(jnp.float32) for c in cols]
        return _attend_planes(carry, q_planes, k_vals, v_vals, keep(ids, safe, old))

    return jax.lax.fori_loop(0, jnp.minimum(chunks(old - done), _pow2(residual) // chunk), pending, carry)


def _flushes(length: Array, counted: Array, qlen: Array, residual: int) -> Array:
    """Whether KIVI's step flushes the group at `qlen`: the `counted` token leaves more than `residual` pending (a
    capacity within the ring never flushes: the callers' static check)."""
    return length + counted - qlen > residual


def _flushed_qlen(length: Array, counted: Array, qlen: Array, group: int, residual: int) -> Array:
    """KIVI's `qlen` after the step (the merge kernel's `update`, per head): the end of the group at `qlen` where
    split 0 flushed it, else as it was."""
    return jnp.where(_flushes(length, counted, qlen, residual), (qlen // group) * group + group, qlen)


def _head_normed(xs: list[Array], x_perms: list[Array], weights: list[Array], perm_weights: list[Array], eps: float,
                 plus_one: bool, dtype: jnp.dtype) -> tuple[list[Array], list[Array]]:
    """QK-norm of rows given as channel planes `xs` (`[..., H / P]` each; one plane: the whole row) and of their
    rotate-half partners `x_perms` (the same rows' statistics), as `kvjax.ops.norm.rms_norm_xla` of each row with
    the head's weight (`weights` / `perm_weights`: its entries at each plane's channels and their partners'), in
    `dtype`."""
    xf = [x.astype(jnp.float32) for x in xs]
    width = sum(x.shape[-1] for x in xs)
    inv = jax.lax.rsqrt(sum(jnp.sum(x * x, axis=-1, keepdims=True) for x in xf) / width + eps)
    return ([weighted(x * inv, w, xs[0].dtype, plus_one, dtype) for x, w in zip(xf, weights, strict=True)],
            [weighted(x.astype(jnp.float32) * inv, w, xs[0].dtype, plus_one, dtype)
             for x, w in zip(x_perms, perm_weights, strict=True)])


def _rope_terms(lane: Array, position: Array, inv_ref: Array, scaling: Array, head_dim: int) -> tuple[Array, Array]:
    """`cos` and `sin` (carrying rotate-half's sign) at channels `lane` for the token at `position`, float32, the
    RoPE's attention factor `scaling` applied."""
    half = head_dim // 2
    angle = position.astype(jnp.float32) * inv_ref[jax.lax.rem(lane, half)].astype(jnp.float32)
    return jnp.cos(angle) * scaling, jnp.where(lane < half, -1.0, 1.0) * (jnp.sin(angle) * scaling)


def _query_planes(qkv_ref: Array, qn_ref: Array | None, inv_ref: Array, rows: Array, position: Array,
                  scaling: Array, parts: int, *, pairs: bool, qk_norm: tuple[float, bool] | None,
                  query_scale: float) -> list[Array]:
    """The group's query rows `rows` after QK-norm, RoPE and the family's query scale (each rounded to q's dtype as
    the decoder block rounds it), then scaled by `1 / sqrt(H)` in float32: `[Gp, H / parts]` for each of `parts`
    channel planes (`gpu_quantized.plane_lanes`: the codes' byte planes, where `pairs` each one's even and odd
    channels). Each plane is loaded by its own
    channels rather than sliced from the whole row in registers: a sliced register tensor leaves Triton a layout
    that costs conversions on every step of the loop that reads it (BENCHMARKS.md)."""
    h = qkv_ref.shape[1]
    dtype = qkv_ref.dtype
    lanes = plane_lanes(h, parts, pairs)
    partners = [jax.lax.rem(lane + h // 2, h) for lane in lanes]  # rotate-half's channel for each
    xs = [qkv_ref[rows, :]] if parts == 1 else [qkv_ref[rows[:, None], lane[None, :]] for lane in lanes]
    x_perms = [qkv_ref[rows[:, None], partner[None, :]] for partner in partners]
    if qk_norm is not None:  # QK-norm (Qwen3, Gemma 3): each head's row normed over head_dim, before RoPE
        xs, x_perms = _head_normed(xs, x_perms, [qn_ref[...]] if parts == 1 else [qn_ref[lane] for lane in lanes],
                                   [qn_ref[partner] for partner in partners], *qk_norm, dtype)
    planes = []
    for x, x_perm, lane in zip(xs, x_perms, lanes, strict=True):
        cos, sin = _rope_terms(lane, position, inv_ref, scaling, h)
        q = _rope_rows(x, x_perm, cos[None, :], sin[None, :]).astype(dtype)
        if query_scale != 1.0:
            q = (q.astype(jnp.float32) * query_scale).astype(dtype)
        planes.append(q.astype(jnp.float32) / math.sqrt(h))
    return planes


def _kernel(len_ref: Array, qpos_ref: Array, inv_ref: Array, scaling_ref: Array, qkv_ref: Array, kp_ref: Array,
            *refs: Array, store: str, gathered: bool, block_k: int, splits: int,
            sliding_window: int | None, clamp: bool, query_scale: float, group: int, gp: int,
            dot_dtype: jnp.dtype, qk_norm: tuple[float, bool] | None, kivi: tuple[int, int, int] | None,
            evicts: bool, ring: int | None, pairs: bool, key_pairs: bool, unpack_asm: bool) -> None:
    refs = list(refs)
    n_leaves = _LEAVES[store]
    leaves, refs = refs[:n_leaves], refs[n_leaves:]
    slots_ref = refs.pop(0) if gathered else None
    qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if qk_norm is not None else (None, None)
    ev_ref = refs.pop(0) if evicts else None
    o_ref, m_out, l_out, kp_out, *leaves_out = refs
    capacity, h = kp_ref.shape[0], qkv_ref.shape[1]
    half = h // 2
    qp = qpos_ref[()]
    length = len_ref[()]
    if ring is None:
        slot = jnp.clip(length, 0, capacity - 1)  # where `append_token` writes
        old = jnp.minimum(length, capacity - 1)  # slots [0, old) hold the earlier tokens
    else:  # a sliding-window ring (`ring_append`): position p at slot p % C, over the one that left the window
        slot = jax.lax.rem(jnp.maximum(qp, 0), ring)
        old = jnp.minimum(length + 1, ring)  # the ring as the write leaves it; its slot `slot` is the new token
    split = pl.program_id(2)
    # In-place eviction: the token also goes into the evicted slot `into` (slot `slot` is then cleared; `into ==
    # slot`: the token itself was evicted), which the blocks skip. Without one `into` is `slot`.
    evicted = (ev_ref[()] >= 0) if evicts else False
    into = jnp.where(evicted, ev_ref[()], slot) if evicts else slot
    skips = evicts or ring is not None  # the blocks skip slot `into` (the token is attended from registers)

    # ---- RoPE of the new query rows and key, in registers
    lane = jnp.arange(h, dtype=jnp.int32)
    perm = jax.lax.rem(lane + half, h)
    scaling = scaling_ref[0]
    dtype = qkv_ref.dtype
    bits = {"int8": 8, "fp8": 8, "int4": 4, "kivi": kivi[0] if kivi else 0}.get(store, 16)
    # sub-byte codes: the query and the output in the codes' channel planes (`kvjax.quant.codes`' planar packing)
    rows = jnp.minimum(jnp.arange(gp, dtype=jnp.int32), group - 1)  # the group, its last row repeated up to Gp
    q_planes = _query_planes(qkv_ref, qn_ref, inv_ref, rows, qp, scaling, plane_count(bits, key_pairs),
                             pairs=key_pairs, qk_norm=qk_norm, query_scale=query_scale)  # [Gp, H / P] each
    k_row, k_perm = qkv_ref[group, :], qkv_ref[group, perm]
    if qk_norm is not None:
        (k_row,), (k_perm,) = _head_normed([k_row], [k_perm], [kn_ref[...]], [kn_ref[perm]], *qk_norm, dtype)
    cos, sin = _rope_terms(lane, qp, inv_ref, scaling, h)
    k_new = _rope_rows(k_row, k_perm, cos, sin).astype(dtype).astype(jnp.float32)
    v_new = qkv_ref[group + 1, :].astype(jnp.float32)

    # ---- the new token as stored (and as the attention reads it back)
    k_scale = k_zero = None  # the new token's key scale (int8 / int4: on its logit) and zero (int4: `sum(q) zero`)
    if store in ("plain", "kivi"):  # KIVI: the token goes into the full-precision ring
        model_dtype = leaves[3 if store == "kivi" else 0].dtype
        k_row, v_row = k_new.astype(model_dtype), v_new.astype(model_dtype)
        written = (k_row, v_row)
        k_att, v_att = k_row.astype(dot_dtype).astype(jnp.float32), v_row.astype(jnp.float32)
    elif store in ("int8", "fp8"):
        if store == "int8":
            (k_codes, k_scale), (v_codes, v_scale) = _int8_codes(k_new), _int8_codes(v_new)
        else:  # the head's scale as the token leaves it (set here where the head was never written)
            counted = qp >= 0
            (k_codes, k_scale), (v_codes, v_scale) = (_fp8_codes(x, leaves[i][()], counted)
                                                      for x, i in ((k_new, 1), (v_new, 3)))
        written = (k_codes, k_scale, v_codes, v_scale)
        if pairs:  # the codes as the int16 leaves hold them
            written = (_pairs_of(k_codes) if key_pairs else k_codes, k_scale, _pairs_of(v_codes), v_scale)
        k_att = k_codes.astype(jnp.float32)  # the scale multiplies the logit, as in the cache blocks
        v_att = v_codes.astype(jnp.float32) * v_scale.astype(jnp.float32)
    else:
        k_att, k_packed, k_scale, k_zero = _int4_codes(k_new)
        v_codes, v_packed, v_scale, v_zero = _int4_codes(v_new)
        written = (k_packed, k_scale, k_zero, v_packed, v_scale, v_zero)
        if pairs:  # the packed bytes as the int16 leaves hold them (int4: keys and values alike)
            written = (_pairs_of(k_packed), k_scale, k_zero, _pairs_of(v_packed), v_scale, v_zero)
        v_att = v_codes * v_scale.astype(jnp.float32) + v_zero.astype(jnp.float32)

    @pl.when((split == 0) & (qp >= 0) if ring is not None else split == 0)  # a ring drops a padding row's token
    def _write() -> None:
        if evicts:  # `kvjax.cache.append_token` then `evict`: the token in both slots, slot `slot` cleared
            kp_out[slot] = jnp.where(evicted, -1, qp)
            kp_out[into] = jnp.where(evicted & (into == slot), -1, qp)
            _store_token(leaves_out, written, into)
        else:
            kp_out[slot] = qp
        if store == "kivi":  # the ring row of the slot (`write_token`)
            ring_row = jax.lax.rem(slot, kivi[2] + 1)
            leaves_out[3][ring_row, :] = written[0]
            leaves_out[8][ring_row, :] = written[1]
            return
        _store_token(leaves_out, written, slot)

    if store == "fp8":  # the heads' scales, set where never written even by a padding row (`write_token`)
        @pl.when(split == 0)
        def _scales() -> None:
            leaves_out[1][()] = k_scale
            leaves_out[3][()] = v_scale

    # ---- split-K attention over the earlier tokens
    qd = q_planes[0].astype(dot_dtype)  # the plain cache's query (one plane)
    quantized = store != "plain"
    out_planes = plane_count(bits, pairs)  # the values' planes: read as pairs, each byte plane's even and odd
    stores = None  # attend_block's (k codes, scale, zero, v codes, scale, zero)
    if store in ("int8", "fp8"):
        stores = (leaves[0], leaves[1], None, leaves[2], leaves[3], None)
    elif store == "int4":
        stores = tuple(leaves)
    elif store == "kivi":
        stores = (leaves[0], leaves[1], leaves[2], leaves[5], leaves[6], leaves[7])
    q_sum = sum(jnp.sum(x, axis=1) for x in q_planes) if bits < 8 else jnp.zeros((gp,), jnp.float32)
    k_layout, v_layout = {"int8": ("sym", "sym"), "fp8": ("fp8", "fp8"), "int4": ("asym", "asym"),
                          "kivi": ("group", "asym")}.get(store, (None, None))

    def attend(carry: tuple, start: Array, keep: Array, k_rows: Array | None, v_rows: Array | None) -> tuple:
        if quantized:
            return attend_block(carry, q_planes, q_sum, stores, start, keep, k_layout=k_layout, v_layout=v_layout,
                                bits=bits, group=kivi[1] if kivi else block_k, dot_dtype=dot_dtype,
                                unpack_asm=unpack_asm)
        return _attend(carry, qd, k_rows, v_rows, keep)[0]

    # ---- the new token, from registers, opens the online softmax: the loops below then carry nothing else across
    # (attended after them, its query and value stayed live through them: BENCHMARKS.md). Split 0 attends it; with
    # a gathered list each split as often as its entries list its slot.
    if gathered:
        lo, hi = split_bounds(jnp.int32(slots_ref.shape[0] // block_k), splits, split)
        listed_here = lambda j, n: n + jnp.sum(jnp.where(slots_ref[pl.ds(j * block_k, block_k)] == slot, 1.0, 0.0))  # noqa: E731
        mult = jax.lax.fori_loop(lo, hi, listed_here, jnp.float32(0.0))
    else:
        mult = (split == 0).astype(jnp.float32)
    mult = mult * (qp >= 0).astype(jnp.float32)
    if evicts:  # a token that evicted itself is not in the cache
        mult = mult * (1.0 - (evicted & (into == slot)).astype(jnp.float32))
    k_planes = split_planes(k_att, len(q_planes), key_pairs)
    s_new = sum(jnp.sum(x.astype(dot_dtype).astype(jnp.float32) * y[None, :], axis=1)
                for x, y in zip(q_planes, k_planes, strict=True))
    if k_scale is not None:
        s_new = s_new * k_scale.astype(jnp.float32)
    if k_zero is not None:
        s_new = s_new + q_sum * k_zero.astype(jnp.float32)
    seen = jnp.minimum(mult, 1.0)
    v_planes = split_planes(v_att, out_planes, pairs)
    acc_new = tuple(jnp.broadcast_to(mult * x[None, :], (gp, x.shape[0])) for x in v_planes)
    opened = (s_new * seen + (1.0 - seen) * NEG, jnp.broadcast_to(mult, (gp,)),
              acc_new if quantized else acc_new[0])

    if gathered:
        def body(j: Array, carry: tuple) -> tuple:
            start = pl.multiple_of(j * block_k, block_k)
            idx = slots_ref[pl.ds(start, block_k)]
            listed = idx >= 0
            safe = jnp.clip(idx, 0, capacity - 1)
            kp = kp_ref[safe]
            ok = listed & (idx < old) & (kp >= 0) & _slot_ok(kp, qp, sliding_window)
            return attend(carry, start, _as_keep(ok, gp), leaves[0][safe, :], leaves[1][safe, :])

        m, l, acc = jax.lax.fori_loop(lo, hi, body, opened)
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
            if skips:  # the evicted token's (a ring: the departed token's) slot holds the new one
                ok &= slot_ids != into
            rows_ = pl.ds(start, block_k)
            k_rows = None if quantized else leaves[0][rows_, :]
            v_rows = None if quantized else leaves[1][rows_, :]
            return attend(carry, start, _as_keep(ok, gp), k_rows, v_rows)

        head = 0  # blocks' worth of rows split 0 attends besides its blocks
        if store == "kivi":  # the splits take the whole key groups below qlen; split 0 the rest
            blocks = jax.lax.div(jax.lax.div(leaves[4][()], kivi[1]) * kivi[1], block_k)
            head = -(-(kivi[1] + _pow2(kivi[2])) // block_k)  # the group at qlen and the ring's pending rows
        else:
            blocks = jax.lax.div(old + (block_k - 1), block_k)
        lo, hi = split_bounds(blocks, splits, split, head)
        m, l, acc = jax.lax.fori_loop(lo, hi, body, opened)
        if store == "kivi":
            new_planes = [jnp.split(x, len(q_planes)) for x in (k_att, v_att)]
            pending = functools.partial(
                _kivi_pending, refs=leaves, outs=leaves_out, kp_ref=kp_ref,
                q_planes=[x.astype(dot_dtype) for x in q_planes], new_planes=new_planes, qp=qp, length=length,
                slot=slot, old=old, bits=bits, group=kivi[1], residual=kivi[2], sliding_window=sliding_window)
            m, l, acc = jax.lax.fori_loop(0, (split == 0).astype(jnp.int32), lambda _, c: pending(c), (m, l, acc))
    blocks = join_planes(acc if quantized else (acc,), pairs)
    if len(blocks) == 1:
        o_ref[...] = blocks[0]
    else:
        width = h // len(blocks)
        for i, block in enumerate(blocks):
            o_ref[:, pl.ds(i * width, width)] = block
    m_out[...] = m
    l_out[...] = l


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
    int8_pairs: bool | None = None,
    int4_pairs: bool | None = None,
    unpack_asm: bool | None = None,
    f16_dots: bool | None = None,
    interpret: bool | None = None,
    qkv: Array | None = None,
    qk_norm: tuple[Array, Array, float, bool] | None = None,
    evict: Array | None = None,
    ring: bool = False,
) -> tuple[Array, Array | QuantizedKV, Array | QuantizedKV, Array, Array]:
    """One decode step of one layer: q `[B, N, H]` and k_new `[B, K, H]` before RoPE, v_new `[B, K, H]`,
    `position` `[B]` (-1: a padding row), the layer's `inv_freq` `[H / 2]`, its cache `k` / `v` `[B, K, C, H]`
    (or int8 / int4 `QuantizedKV` stores, one scale per token and head; fp8, one per head; KIVI), `pos`
    `[B, K, C]`, `length` `[B, K]`;
    `scaling` the RoPE's attention factor (a float or a traced scalar), `query_scale` the family's (static);
    `slots` `[B, K, W]` (-1: unused) attends only those slots. `qkv` `[B, K, G + 2, H]`: the same q, k_new and
    v_new in the fused layout the kernel reads, where the caller holds them so (the decoder block's q|k|v
    projection), else formed here. `qk_norm` `(q_weight [H], k_weight [H], eps, plus_one)`: q and k come before
    their QK-norm, which the kernel applies (in q's dtype) before RoPE. `evict` `[B, K]` int32: the slot whose token
    the new one replaces (`kvjax.cache.append_token` then `evict`: the token written there too, slot `length`
    cleared, the length unchanged), -1 where none (given only for a counted token). `ring`: the layer is a
    sliding-window ring (`kvjax.cache.ring_append`: the token at slot `position % C`, a padding row's not written,
    the length capped at `C`). Returns `(out [B, N, H] in q's
    dtype, k, v, pos, length)` with the new token written (the cache leaves are aliased in place: donate them).
    `block_k` (slots per block), `num_warps`, `num_stages` and the program target default to the current tuning's
    `gpu_*` fields (`kvjax.tuning`; a quantized cache's tile: `Tuning.tile(quantized=True)`), `int8_pairs` (an int8
    cache's value codes read and written as int16 pairs, `gpu_quantized.as_pairs`) to its `gpu_int8_pairs`,
    `int4_pairs` (an int4 cache's codes read so) to its `gpu_int4_pairs`, `unpack_asm` (codes converted by
    `gpu_unpack`'s assembly when compiled) to its `gpu_unpack_asm`, `f16_dots` (an int8 / fp8 cache of a bf16 model
    attended with float16 dots, `gpu_quantized.dots_dtype`) to its `gpu_f16_dots`."""
    block_k, num_warps, num_stages = tile_or_tuned(isinstance(k, QuantizedKV), block_k, num_warps, num_stages)
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
    if (evict is not None or ring) and (store == "kivi" or gathered):
        raise ConfigError("decode_append_attention: in-place eviction and a ring take a plain or per-token "
                          "quantized cache, not KIVI (which requantizes its groups) nor a gathered slot list")
    if evict is not None and ring:
        raise ConfigError("decode_append_attention: a ring evicts by its slot rule, not `evict`")
    group = n // kv
    gp = max(16, _pow2(group))
    kivi = None
    if store == "plain":
        leaves = [k, v]
    elif store == "kivi":  # per role: codes, scale, zero (keys `[B, K, C / G, H]`, values `[B, K, C]`), ring, qlen
        spec = k.spec
        kivi = (spec.bits, spec.group_size, spec.residual)
        block_k = min(block_k, spec.group_size)  # a block never crosses a key group
        leaves = [k.data, k.scale, k.zero, k.residual, k.qlen, v.data, v.scale[..., 0], v.zero[..., 0], v.residual,
                  v.qlen]
    elif store == "fp8":  # codes, then the head's scale [B, K]
        leaves = [k.data, k.scale, v.data, v.scale]
    else:  # codes, then the per-token scale (and zero) as [B, K, C]
        leaves = [x[..., 0] if i else x for qa in (k, v)
                  for i, x in enumerate((qa.data, qa.scale, qa.zero)) if x is not None]
    # int8 value codes (with float16 dots the key codes too) and int4 codes as int16 pairs of bytes (bitcasts)
    pairs = store in ("int8", "int4") and reads_pairs(k, int8_pairs, int4_pairs)
    key_pairs = store in ("int8", "int4") and reads_key_pairs(k, int8_pairs, f16_dots, int4_pairs)
    v_data = {"int8": 2, "int4": 3}.get(store)
    if pairs:
        leaves[v_data] = as_pairs(leaves[v_data])
    if key_pairs:
        leaves[0] = as_pairs(leaves[0])
    dots = dots_dtype(k, f16_dots) if isinstance(k, QuantizedKV) else (
        k.dtype if k.dtype in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32))
    # A capacity below one block: the block shrinks to it (a power of two >= 16), else the cache is padded.
    c_pad = c
    if c < block_k:
        if c >= 16:
            block_k = _pow2_floor(c)
        else:
            block_k, c_pad = 16, 16
    if c_pad != c:  # the slot axis of every per-slot leaf (not fp8's per-head scale)
        leaves = [pad_axis(x, 2, c_pad, 0) if x.ndim > 2 else x for x in leaves]
        pos_in = pad_axis(pos, 2, c_pad, -1)
    else:
        pos_in = pos
    clamp = c_pad % block_k != 0 and store != "kivi"  # KIVI's blocks all lie below its whole groups
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
    leaf_specs = [head(*x.shape[2:]) for x in leaves]
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
    if evict is not None:
        operands.append(evict.astype(jnp.int32))
        in_specs.append(head())
    splits = _splits(num_splits, batch * kv, blocks, quantized=store != "plain")
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
                               group=group, gp=gp, dot_dtype=dots,
                               qk_norm=None if qk_norm is None else (float(qk_norm[2]), bool(qk_norm[3])),
                               kivi=kivi, evicts=evict is not None, ring=c if ring else None, pairs=pairs,
                               key_pairs=key_pairs,
                               unpack_asm=unpacks_with_asm(not interpret_mode(interpret), unpack_asm))
    acc, m, l, new_pos, *new_leaves = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(batch, kv, splits), in_specs=in_specs, out_specs=out_specs,
        input_output_aliases=aliases, compiler_params=_params(num_warps, num_stages),
        interpret=interpret_mode(interpret), name="kvjax_gpu_decode_append_attention",
    )(*operands)
    # KIVI's `qlen` moves in the merge kernel, after every split read it (a capacity within the ring never flushes)
    flushing = store == "kivi" and c_pad > kivi[2]
    qlens = (new_leaves[4], new_leaves[9]) if flushing else ()
    out, new_length, *qlens = merge_split_heads(
        acc, m, l, group, q.dtype, length=length, position=position, evict=evict, cap=c if ring else None,
        heads=qlens, update=functools.partial(_flushed_qlen, group=kivi[1], residual=kivi[2]) if flushing else None,
        interpret=interpret)
    if flushing:
        new_leaves[4], new_leaves[9] = qlens
    if pairs:
        new_leaves[v_data] = from_pairs(new_leaves[v_data], v.data.dtype)
    if key_pairs:
        new_leaves[0] = from_pairs(new_leaves[0], k.data.dtype)
    out = out.reshape(batch, n, h)
    if c_pad != c:
        new_pos, new_leaves = new_pos[:, :, :c], [x[:, :, :c] if x.ndim > 2 else x for x in new_leaves]
    if store == "plain":
        new_k, new_v = new_leaves
    elif store == "kivi":
        new_k, new_v = (qa.replace(data=xs[0], scale=xs[1] if qa is k else xs[1][..., None],
                                   zero=xs[2] if qa is k else xs[2][..., None], residual=xs[3], qlen=xs[4])
                        for qa, xs in ((k, new_leaves[:5]), (v, new_leaves[5:])))
    elif store == "fp8":
        new_k, new_v = (qa.replace(data=xs[0], scale=xs[1]) for qa, xs in ((k, new_leaves[:2]), (v, new_leaves[2:])))
    else:
        half = len(new_leaves) // 2
        new_k, new_v = (qa.replace(data=xs[0], scale=xs[1][..., None],
                                   **({"zero": xs[2][..., None]} if len(xs) > 2 else {}))
                        for qa, xs in ((k, new_leaves[:half]), (v, new_leaves[half:])))
    return out, new_k, new_v, new_pos, new_length
