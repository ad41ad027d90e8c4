"""Sub-byte codes (int4 nibbles, KIVI-2 crumbs), and int8 codes to float16, into 16-bit floats inside a Triton
kernel, two codes an instruction.

Converted one value at a time (`astype`), each code costs an integer-to-float `cvt` (`I2F.BF16.U16` on Hopper),
an instruction with a quarter of the throughput of integer logic, and a block of int4 codes spends more time
converting than loading (BENCHMARKS.md, "Sub-byte codes unpacked by the exponent"). Here four codes of one plane
(one byte each, `pack=4` of Triton's elementwise inline assembly) become two pairs of floats by bit operations:

* `shr`: the plane's bits to the bottom of each byte;
* `prmt`: bytes 0, 1 (then 2, 3) into the low byte of each 16-bit half of a register;
* `lop3`: `(x & mask) | magic`, the code into the mantissa of `magic` = 128 (bf16) or 1024 (fp16), whose unit in
  the last place is 1: the half now holds `magic + code` exactly;
* `fma` (bf16x2 / f16x2): `x * 1 - magic`, exactly the code.

The result equals `((byte >> shift) & mask).astype(dtype)` bit for bit. Codes read as int16 pairs of bytes
(`pair_plane`, `pack=2`: two pairs an instance) take one `prmt` of the low (or high) bytes of both pairs, one `lop3`
and one `fma` for two codes. int8 codes (`int8_plane`, and the low and
high bytes of int16 pairs, `int8_pair_planes`) go into float16 only, whose 11 significant bits hold 128 + 255
(bfloat16's 8 cannot), and come out times `INT8_F16_UNIT` (2^-10): an `xor` flips the sign bits (the code plus
128), the `prmt` places each byte in the low byte of a zero half (the float16 subnormal `(code + 128) 2^-24`), and
the `fma` multiplies by 2^14 and subtracts 2^-3, leaving `code 2^-10` exactly. The zero half is the zero register,
where a constant high byte (1024.0's, to come out as the code itself) took a register move for every `prmt`; the
kernels fold 2^10 into the scales instead (`int8_unit`). Triton packs the `pack` elements of one
instance by their order among the thread's elements, the first in the lowest byte of the operand and in the low
half of the first result register, so the assembly is elementwise whatever layout Triton picks. It runs only in a
compiled kernel; interpret mode, and other dtypes, use `astype`. `tests/pallas/test_pallas_gpu_unpack.py` runs
the assembly text on an emulator of the instructions it uses against `astype`; a GPU runs it in the kernels' tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

Array = jax.Array

#: Per 16-bit float: (magic, one, -magic) as bit patterns: magic's unit in the last place is 1.
CONSTANTS = {jnp.dtype(jnp.bfloat16): (0x4300, 0x3F80, 0xC300), jnp.dtype(jnp.float16): (0x6400, 0x3C00, 0xE400)}
#: Codes a byte of `bits`-bit codes holds, where the assembly applies.
BITS = (2, 4)
#: int8 codes in float16 are `code * INT8_F16_UNIT`: the code plus 128 (its sign bit flipped, 0..255) as a subnormal's
#: mantissa, `(code + 128) 2^-24`, times 2^14, minus 2^-3. Exact: `code 2^-10` is a normal float16 or zero.
INT8_F16_UNIT = 2.0**-10
#: (2^14, -2^-3), the assembly's `fma` operands, as float16 bit patterns.
INT8_F16 = (0x7400, 0xB000)


def applies(bits: int, dtype: jnp.dtype) -> bool:
    """Whether `plane` converts `bits`-bit codes to `dtype` with the assembly."""
    return bits in BITS and jnp.dtype(dtype) in CONSTANTS


def int8_unit(dtype: jnp.dtype) -> float:
    """What `int8_plane` / `int8_pair_planes` multiply int8 codes by in `dtype`: `INT8_F16_UNIT` in float16 (by
    the assembly and by `astype` alike, so that interpret mode runs the kernels' scaling), else 1."""
    return INT8_F16_UNIT if jnp.dtype(dtype) == jnp.float16 else 1.0


def _codes_ptx(shift: int, bits: int, dtype: jnp.dtype, source: str, selects: list[tuple[str, str]]) -> str:
    """One instance turning the `bits`-bit codes at `shift` of each byte of `source` into floats: for each
    `(selector, out)` a `prmt` of two bytes into the low bytes of two halves, the `lop3` into `magic`'s mantissa
    and the `fma` that subtracts it, into `out`."""
    magic, one, neg = CONSTANTS[jnp.dtype(dtype)]
    mask = (1 << bits) - 1
    fma = "fma.rn.bf16x2" if jnp.dtype(dtype) == jnp.bfloat16 else "fma.rn.f16x2"
    pair = lambda x: f"0x{x * 0x10001:08X}"  # noqa: E731  (a 16-bit constant in both halves)
    regs = ["kvj_a", "kvj_b"][:len(selects)]
    lines = [f".reg .b32 kvj_w, {', '.join(regs)}, kvj_one, kvj_neg;"]
    if shift:
        lines.append(f"shr.b32 kvj_w, {source}, {shift};")
        source = "kvj_w"
    lines += [f"prmt.b32 {r}, {source}, 0, {select};" for r, (select, _) in zip(regs, selects, strict=True)]
    lines += [f"lop3.b32 {r}, {r}, {pair(mask)}, {pair(magic)}, 0xEA;" for r in regs]
    lines += [f"mov.b32 kvj_one, {pair(one)};", f"mov.b32 kvj_neg, {pair(neg)};"]
    lines += [f"{fma} {out}, {r}, kvj_one, kvj_neg;" for r, (_, out) in zip(regs, selects, strict=True)]
    return "{\n" + "\n".join(lines) + "\n}"


def ptx(shift: int, bits: int, dtype: jnp.dtype) -> str:
    """The assembly of one instance: `$2` four bytes of codes, `$0` / `$1` the floats of bytes 0, 1 / 2, 3."""
    return _codes_ptx(shift, bits, dtype, "$2", [("0x4140", "$0"), ("0x4342", "$1")])


def int8_ptx(pairs: bool, high: bool = False) -> str:
    """The assembly of one instance converting int8 codes to float16 (times `INT8_F16_UNIT`): four codes (`$2`, four
    bytes) -> `$0` / `$1` the floats of bytes 0, 1 / 2, 3; `pairs`: two int16 pairs of codes (`$1`) -> `$0` their
    low bytes (the even channels), or where `high` their high bytes (the odd)."""
    one, neg = INT8_F16
    pair = lambda x: f"0x{x * 0x10001:08X}"  # noqa: E731
    source = "$1" if pairs else "$2"
    selects = [("0x4341" if high else "0x4240", "$0")] if pairs else [("0x4140", "$0"), ("0x4342", "$1")]
    lines = [".reg .b32 kvj_u, kvj_a, kvj_one, kvj_neg;", f"xor.b32 kvj_u, {source}, 0x80808080;",
             f"mov.b32 kvj_one, {pair(one)};", f"mov.b32 kvj_neg, {pair(neg)};"]
    for select, out in selects:
        lines += [f"prmt.b32 kvj_a, kvj_u, 0, {select};", f"fma.rn.f16x2 {out}, kvj_a, kvj_one, kvj_neg;"]
    return "{\n" + "\n".join(lines) + "\n}"


def int8_plane(data: Array, dtype: jnp.dtype = jnp.float16, *, asm: bool) -> Array:
    """int8 codes `data` -> `dtype`, times `int8_unit(dtype)`: by the assembly where `asm` and `dtype` is float16,
    else by `astype` (through float32)."""
    if asm and jnp.dtype(dtype) == jnp.float16:
        [out] = plt.elementwise_inline_asm(int8_ptx(False), args=[data], constraints="=r,=r,r", pack=4,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(data.shape, jnp.float16)])
        return out
    return _scaled(data.astype(jnp.float32), dtype)


def _scaled(codes: Array, dtype: jnp.dtype) -> Array:
    """float32 codes -> `dtype`, times `int8_unit(dtype)` (a power of two: exact)."""
    unit = int8_unit(dtype)
    return (codes if unit == 1 else codes * unit).astype(dtype)


def int8_pair_planes(data: Array, dtype: jnp.dtype = jnp.float16, *, asm: bool) -> tuple[Array, Array]:
    """int16 pairs of int8 codes `data` (`gpu_planes.as_pairs`) -> their low and high bytes (even and odd
    channels) in `dtype`, times `int8_unit(dtype)`: by the assembly where `asm` and `dtype` is float16, else by
    `astype` (each byte as int8, which Triton converts to bf16 without `cvt`: byte permutes, bf16x2 subtractions).
    One result an assembly: Pallas' Triton lowering (jax 0.10) takes a multi-result one outside a loop only."""
    if asm and jnp.dtype(dtype) == jnp.float16:
        shape = jax.ShapeDtypeStruct(data.shape, jnp.float16)
        return tuple(plt.elementwise_inline_asm(int8_ptx(True, high), args=[data], constraints="=r,r", pack=2,
                                                result_shape_dtypes=[shape])[0] for high in (False, True))
    return tuple(_scaled(x.astype(jnp.int8).astype(jnp.float32), dtype) for x in (data, data >> 8))


def pair_ptx(shift: int, high: bool, bits: int, dtype: jnp.dtype) -> str:
    """The assembly of one instance over codes packed `8 / bits` a byte and read as int16 pairs of bytes: `$1` two
    int16 -> `$0` the floats of the codes at `shift` of their low bytes, or where `high` of their high bytes."""
    return _codes_ptx(shift, bits, dtype, "$1", [("0x4341" if high else "0x4240", "$0")])


def pair_plane(data: Array, shift: int, high: bool, bits: int, dtype: jnp.dtype, *, asm: bool) -> Array:
    """int16 pairs of bytes `data` holding `8 / bits` codes a byte (`gpu_planes.as_pairs` of packed codes) ->
    the codes at `shift` of the low bytes (where `high`: the high bytes) in `dtype`: with the assembly where `asm`
    and `applies(bits, dtype)`, else with `astype` (through float32)."""
    if asm and applies(bits, dtype):
        [out] = plt.elementwise_inline_asm(pair_ptx(shift, high, bits, dtype), args=[data], constraints="=r,r",
                                           pack=2, result_shape_dtypes=[jax.ShapeDtypeStruct(data.shape, dtype)])
        return out
    return ((data >> (8 * high + shift)) & ((1 << bits) - 1)).astype(jnp.float32).astype(dtype)


def plane(data: Array, shift: int, bits: int, dtype: jnp.dtype, *, asm: bool) -> Array:
    """`((data >> shift) & mask).astype(dtype)` for uint8 `data` holding `8 / bits` codes a byte: with the assembly
    where `asm` and `applies(bits, dtype)`, else with `astype` (through float32)."""
    if asm and applies(bits, dtype):
        [out] = plt.elementwise_inline_asm(ptx(shift, bits, dtype), args=[data], constraints="=r,=r,r", pack=4,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(data.shape, dtype)])
        return out
    return ((data >> shift) & ((1 << bits) - 1)).astype(jnp.float32).astype(dtype)
