"""The new token's codes as each quantized cache stores them, computed inside a Triton kernel (the fused decode
kernel's in-place write, `kvjax.pallas.gpu_fused_decode`; KIVI's group flush, `kvjax.pallas.gpu_fused_kivi`).

Each function is the in-kernel twin of a `kvjax.quant.codes` function, bit for bit in interpret mode: Triton has
no `round`, so codes round half to even from `floor` (`round_even`); scales and zeros are taken as stored
(`codes.as_stored`) before they divide."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.pallas.gpu_planes import deinterleave
from kvjax.quant import codes

Array = jax.Array

INT8_MAX = 127.0


def round_even(x: Array) -> Array:
    """`jnp.round` (nearest integer, ties to even) of float32 `|x| < 2^23` from `floor`, which Triton has: every
    step is exact (`x - floor(x)` included), so no compiler may fold it away as it may `(x + 1.5 2^23) - 1.5 2^23`
    (XLA:CPU does)."""
    low = jnp.floor(x)
    frac = x - low
    odd = low - 2.0 * jnp.floor(low * 0.5)
    up = jnp.where(frac > 0.5, 1.0, 0.0) + jnp.where(frac == 0.5, odd, 0.0)
    return low + up


def int8_codes(x: Array) -> tuple[Array, Array]:
    """`kvjax.quant.codes.symmetric` of one token `[H]` (float32): int8 codes and its bfloat16 scale (scalar)."""
    sf = codes.as_stored(jnp.max(jnp.abs(x)) / INT8_MAX)
    q = jnp.clip(round_even(x / jnp.where(sf > 0, sf, 1.0)), -INT8_MAX, INT8_MAX)
    return q.astype(jnp.int8), sf.astype(codes.SCALE_DTYPE)


def fp8_codes(x: Array, old_scale: Array, counted: Array) -> tuple[Array, Array]:
    """fp8 e4m3 codes of one token `[H]` (float32) and its head's scale (scalar): the scale already set, else (0:
    a head never written) one from the token, where it counts (`kvjax.quant.storage.write_token`)."""
    amax = jnp.where(counted, jnp.max(jnp.abs(x)), 0.0)
    scale = jnp.where(old_scale > 0, old_scale, codes.fp8_scale(amax))
    return codes.fp8_codes(x, scale), scale


def asymmetric_codes(x: Array, scale: Array, zero: Array, bits: int) -> Array:
    """`kvjax.quant.codes.asymmetric_codes` as float32, rounding with `round_even`; the scale and zero as stored
    (`codes.as_stored`)."""
    sf = codes.as_stored(scale)
    q = round_even((x - codes.as_stored(zero)) / jnp.where(sf > 0, sf, 1.0))
    return jnp.clip(q, 0.0, float((1 << bits) - 1))


def pack_planes(planes: list[Array], bits: int) -> Array:
    """The codes (float32, each below `2^bits`) of a head's `8 / bits` channel planes -> their bytes, plane `j` in
    bits `[j bits, (j + 1) bits)` (`kvjax.quant.codes.pack`'s planar layout)."""
    shifted = [q.astype(jnp.int32) << (j * bits) for j, q in enumerate(planes)]
    return functools.reduce(jnp.bitwise_or, shifted).astype(jnp.uint8)


def int4_codes(x: Array) -> tuple[Array, Array, Array, Array]:
    """`kvjax.quant.codes.asymmetric` (4 bits, the head one group) of one token `[H]` (float32), then `codes.pack`:
    its codes as float32 `[H]` (channel order), the packed bytes `[H / 2]` (byte `i`: channels `i` and `i + H / 2`)
    and the bfloat16 scale and zero (scalars)."""
    scale, zero = codes.asymmetric_stats(jnp.min(x), jnp.max(x), 4)
    q = asymmetric_codes(x, scale, zero, 4)
    return q, pack_planes(jnp.split(q, 2), 4), scale, zero


def pairs_of(codes_: Array) -> Array:
    """Bytes `[H]` (int8 codes, uint8 packed codes) -> the int16 pairs `gpu_planes.as_pairs` makes of them (byte
    `2i` the low byte, `2i + 1` the high)."""
    if codes_.dtype == jnp.uint8:
        codes_ = jax.lax.bitcast_convert_type(codes_, jnp.int8)
    even, odd = deinterleave(codes_.astype(jnp.int32))
    return ((even & 0xFF) | (odd << 8)).astype(jnp.int16)


def store_token(leaves: list[Array], written: tuple[Array, ...], slot: Array) -> None:
    """The token's rows (K / V or codes) and per-token scalars (scales, zeros) into slot `slot` of the leaves. A
    leaf of one value per head (fp8's scale) is not a slot's: the kernel writes it once, for every row."""
    for leaf, value in zip(leaves, written, strict=True):
        if value.ndim:
            leaf[slot, :] = value
        elif leaf.ndim:
            leaf[slot] = value


def token_as_stored(store: str, k_new: Array, v_new: Array, leaves: list[Array], position: Array,
                    dot_dtype: jnp.dtype, *, pairs: bool, key_pairs: bool
                    ) -> tuple[tuple[Array, ...], Array, Array, Array | None, Array | None]:
    """The new token's key and value rows (float32 `[H]`, after RoPE) as the `store` layout's leaves hold them
    (`written`, in the leaves' order, `gpu_fused_decode._LEAVES`), and as the attention reads them back: `(written,
    k_att, v_att, k_scale, k_zero)`. `k_att` is the key's codes where a key scale (int8, fp8, int4) multiplies the
    logit, and a key zero (int4) adds `sum(q) zero` to it; `v_att` the value as read. A plain cache, and KIVI's
    full-precision ring, take the rows in the model dtype; with `pairs` (`key_pairs`) the value (key) bytes are the
    int16 pairs the leaves hold."""
    k_scale = k_zero = None
    if store in ("plain", "kivi"):  # KIVI: the token goes into the full-precision ring
        model_dtype = leaves[3 if store == "kivi" else 0].dtype
        k_row, v_row = k_new.astype(model_dtype), v_new.astype(model_dtype)
        written = (k_row, v_row)
        k_att, v_att = k_row.astype(dot_dtype).astype(jnp.float32), v_row.astype(jnp.float32)
    elif store in ("int8", "fp8"):
        if store == "int8":
            (k_codes, k_scale), (v_codes, v_scale) = int8_codes(k_new), int8_codes(v_new)
        else:  # the head's scale as the token leaves it (set here where the head was never written)
            counted = position >= 0
            (k_codes, k_scale), (v_codes, v_scale) = (fp8_codes(x, leaves[i][()], counted)
                                                      for x, i in ((k_new, 1), (v_new, 3)))
        written = (k_codes, k_scale, v_codes, v_scale)
        if pairs:  # the codes as the int16 leaves hold them
            written = (pairs_of(k_codes) if key_pairs else k_codes, k_scale, pairs_of(v_codes), v_scale)
        k_att = k_codes.astype(jnp.float32)  # the scale multiplies the logit, as in the cache blocks
        v_att = v_codes.astype(jnp.float32) * v_scale.astype(jnp.float32)
    else:
        k_att, k_packed, k_scale, k_zero = int4_codes(k_new)
        v_codes, v_packed, v_scale, v_zero = int4_codes(v_new)
        written = (k_packed, k_scale, k_zero, v_packed, v_scale, v_zero)
        if pairs:  # the packed bytes as the int16 leaves hold them (int4: keys and values alike)
            written = (pairs_of(k_packed), k_scale, k_zero, pairs_of(v_packed), v_scale, v_zero)
        v_att = v_codes * v_scale.astype(jnp.float32) + v_zero.astype(jnp.float32)
    return written, k_att, v_att, k_scale, k_zero
