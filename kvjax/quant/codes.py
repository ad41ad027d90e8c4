"""The quantization formulas and the sub-byte packing, on plain arrays (float32 maths).

* Symmetric int8 per group of channels: `s = max|x| / 127` (stored bfloat16), `q = clip(round(x / s), -127, 127)`,
  `x^ = q s`.
* Asymmetric b-bit over a group (int4 per token, KIVI): `z = min x`, `s = (max x - min x) / (2^b - 1)` (both
  stored bfloat16), `q = clip(round((x - z) / s), 0, 2^b - 1)`, `x^ = q s + z`.
* fp8 e4m3 per head: a power-of-two scale `s` puts the head's largest magnitude times `FP8_HEADROOM` at or below
  448 (the largest e4m3 value); `q = e4m3(clip(x / s, -448, 448))`, `x^ = q s`. Powers of two make growing the
  scale exact (the codes shift by whole binades).

Codes are always computed from the *stored* (rounded) scale and zero, so the rounding of the bfloat16 scale
costs no accuracy. `quantize(dequantize(q))` gives back `q` for int8 and fp8, but not always for the asymmetric
formats: a bfloat16 zero rounded away from the minimum by more than a step leaves the codes short of the full range,
so the dequantized group has another (scale, zero). A store requantized after an op therefore keeps its old codes
wherever the values did not change (`kvjax.quant.storage.requantize`; tests/quant/test_codes.py).

Packing is planar: in a head of `H` channels with `P = 8 / bits` codes per byte, byte `i` holds channels
`i, i + H / P, i + 2 H / P, ...` from its low bits up. Unpacking is `P` shifts and a concatenation, and a kernel
can split a dot product over the `P` channel slices instead of interleaving (`kvjax.pallas.gpu_attention`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

SCALE_DTYPE = jnp.bfloat16
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
#: fp8: the scale leaves this factor of room above the largest magnitude seen when the head was first written
#: (later tokens beyond it saturate at +-448 s); two binades keep everything above max / 7000 a normal e4m3 value.
FP8_HEADROOM = 4.0


def pack(codes: Array, bits: int) -> Array:
    """uint8 codes `[..., H]` (each below 2^bits) -> `[..., H * bits / 8]` uint8, planar (module docstring)."""
    if bits == 8:
        return codes
    per = 8 // bits
    part = codes.shape[-1] // per
    out = jnp.zeros(codes.shape[:-1] + (part,), jnp.uint8)
    for j in range(per):
        out = out | (codes[..., j * part:(j + 1) * part].astype(jnp.uint8) << (j * bits))
    return out


def unpack(packed: Array, bits: int) -> Array:
    """Inverse of `pack`: `[..., H * bits / 8]` uint8 -> `[..., H]` uint8 codes."""
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    return jnp.concatenate([(packed >> (j * bits)) & mask for j in range(8 // bits)], axis=-1)


def _grouped(x: Array, channels: int) -> Array:
    """`[..., H]` -> `[..., H / channels, channels]`."""
    return x.reshape(x.shape[:-1] + (x.shape[-1] // channels, channels))


def as_stored(x: Array) -> Array:
    """`x` rounded to `SCALE_DTYPE` (bfloat16, to nearest, ties to even) and returned as float32: the value a scale
    or zero is stored as, for the codes to be computed from. Rounded by integer operations on the bits, not as
    `x.astype(bfloat16).astype(float32)`: XLA:GPU (excess precision allowed, its default) folds that round trip into
    `x` inside a fusion, and an H200 computed int4 codes from the float32 minimum instead of the stored zero (run 13,
    BENCHMARKS.md). Integer operations are not folded, and Triton has them (the fused decode kernel uses this too).
    The identity on values already bfloat16."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = bits + (jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1)))  # carries into bit 16 past the half-way point
    rounded = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isnan(x), x, rounded)


def widen(x: Array) -> Array:
    """float32 values of `x` exactly as its dtype holds them: a bfloat16 `x` (the model dtype, fresh from RoPE or a
    norm) rounded again by `as_stored`, since XLA:GPU may fold the rounding that made it bfloat16 and quantize the
    float32 value it came from (the codes then differ from the kernel's and the storage's at rounding boundaries)."""
    return as_stored(x) if x.dtype == jnp.bfloat16 else x.astype(jnp.float32)


def _safe(scale: Array) -> Array:
    return jnp.where(scale > 0, scale, 1.0)


def symmetric(x: Array, channels: int, bits: int = 8) -> tuple[Array, Array]:
    """int8 codes `[..., H]` and bfloat16 scales `[..., H / channels]` of `x` (float32)."""
    qmax = (1 << (bits - 1)) - 1
    g = _grouped(widen(x), channels)
    stored = as_stored(jnp.max(jnp.abs(g), axis=-1) / qmax)
    q = jnp.clip(jnp.round(g / _safe(stored)[..., None]), -qmax, qmax)
    return q.astype(jnp.int8).reshape(x.shape), stored.astype(SCALE_DTYPE)


def symmetric_dequantize(q: Array, scale: Array) -> Array:
    channels = q.shape[-1] // scale.shape[-1]
    g = _grouped(q.astype(jnp.float32), channels) * scale.astype(jnp.float32)[..., None]
    return g.reshape(q.shape)


def asymmetric_stats(lo: Array, hi: Array, bits: int) -> tuple[Array, Array]:
    """bfloat16 (scale, zero) of a group with minimum `lo` and maximum `hi`."""
    levels = (1 << bits) - 1
    return ((hi - lo) / levels).astype(SCALE_DTYPE), lo.astype(SCALE_DTYPE)


def asymmetric_codes(x: Array, scale: Array, zero: Array, bits: int) -> Array:
    """uint8 codes of `x` against a stored (scale, zero), broadcast to `x`."""
    levels = (1 << bits) - 1
    q = jnp.round((widen(x) - as_stored(zero)) / _safe(as_stored(scale)))
    return jnp.clip(q, 0, levels).astype(jnp.uint8)


def asymmetric(x: Array, channels: int, bits: int) -> tuple[Array, Array, Array]:
    """Per-token asymmetric codes `[..., H]` uint8 and (scale, zero) `[..., H / channels]` of `x`."""
    g = _grouped(widen(x), channels)
    scale, zero = asymmetric_stats(jnp.min(g, axis=-1), jnp.max(g, axis=-1), bits)
    q = asymmetric_codes(g, scale[..., None], zero[..., None], bits)
    return q.reshape(x.shape), scale, zero


def asymmetric_dequantize(q: Array, scale: Array, zero: Array) -> Array:
    """`q s + z` with (scale, zero) broadcast over channel groups of `q` `[..., H]`."""
    channels = q.shape[-1] // scale.shape[-1]
    g = _grouped(q.astype(jnp.float32), channels)
    out = g * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]
    return out.reshape(q.shape)


def fp8_scale(amax: Array) -> Array:
    """float32 power of two with `amax * FP8_HEADROOM / scale <= 448`; 0 ("not set yet") when `amax` is 0, so
    that a head whose first values are all zeros takes its scale from the first nonzero ones."""
    want = amax.astype(jnp.float32) * FP8_HEADROOM / FP8_MAX
    mantissa, exponent = jnp.frexp(jnp.where(want > 0, want, 1.0))  # want = mantissa 2^exponent, mantissa in [.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # an exact power of two is its own ceiling
    return jnp.where(want > 0, jnp.ldexp(jnp.float32(1.0), exponent), 0.0).astype(jnp.float32)


def fp8_codes(x: Array, scale: Array) -> Array:
    """e4m3 codes of `x` against `scale` broadcast to it (saturating at +-448; a scale of 0, not set, codes the
    zeros it was taken from as zeros)."""
    return jnp.clip(widen(x) / jnp.where(scale > 0, scale, 1.0), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def fp8_dequantize(q: Array, scale: Array) -> Array:
    return q.astype(jnp.float32) * scale
