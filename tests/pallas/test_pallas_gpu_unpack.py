"""`kvjax.pallas.gpu_unpack`: the inline PTX that turns sub-byte and int8 codes into 16-bit floats, run on an
emulator of its instructions (written from the PTX ISA: `shr`, `xor`, `prmt`, `lop3`, `mov`, `fma.rn` on bf16x2 /
f16x2) against `astype`, for every code in every byte position of an instance: each plane of int4 and KIVI-2 codes,
bf16 and fp16, and of int4 codes read as int16 pairs of bytes; int8 codes to fp16, as bytes and as int16 pairs. The
emulator takes Triton's packing of elementwise assembly: element `i` of an instance is byte (16-bit half) `i` of its
input register, and the low then high half of `$0`, then of `$1`. A GPU runs the assembly itself in the kernels'
compiled tests."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.pallas import gpu_quantized, gpu_unpack


def _halves_to_float(word: int, dtype) -> tuple[float, float]:
    halves = np.array([word & 0xFFFF, word >> 16], np.uint16)
    return tuple(float(x) for x in halves.view(jnp.dtype(dtype)).astype(np.float32))


def _float_to_halves(values: tuple[float, float], dtype) -> int:
    bits = np.array(values, np.float64).astype(np.float32).astype(jnp.dtype(dtype)).view(np.uint16)
    return int(bits[0]) | int(bits[1]) << 16


def _prmt(a: int, b: int, selector: int) -> int:
    source = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        assert nibble < 8, "sign-replicating selectors are outside the emulator"
        out |= source[nibble] << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        index = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)  # LUT index: a=4, b=2, c=1
        out |= ((lut >> index) & 1) << bit
    return out


def run_ptx(text: str, word: int, source: str = "$2") -> tuple[int, int | None]:
    """`text` (one instance: `source` in, `$0` and, where `source` is `$2`, `$1` out) on `word`; returns the
    result registers."""
    regs = {source: word}

    def value(operand: str) -> int:
        operand = operand.strip()
        return regs[operand] if operand in regs else int(operand, 0) & 0xFFFFFFFF

    for line in text.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dest, *args = [x.strip() for x in rest.split(",")]
        if op == "shr.b32":
            regs[dest] = value(args[0]) >> value(args[1])
        elif op == "xor.b32":
            regs[dest] = value(args[0]) ^ value(args[1])
        elif op == "prmt.b32":
            regs[dest] = _prmt(value(args[0]), value(args[1]), value(args[2]))
        elif op == "lop3.b32":
            regs[dest] = _lop3(*(value(a) for a in args))
        elif op == "mov.b32":
            regs[dest] = value(args[0])
        elif m := re.fullmatch(r"fma\.rn\.(bf16|f16)x2", op):
            dtype = jnp.bfloat16 if m.group(1) == "bf16" else jnp.float16
            a, b, c = (_halves_to_float(value(x), dtype) for x in args)
            regs[dest] = _float_to_halves(tuple(a[i] * b[i] + c[i] for i in range(2)), dtype)  # exact in float64
        else:
            raise AssertionError(f"instruction outside the emulator: {line}")
    return regs["$0"], regs.get("$1") if source == "$2" else None


def _words() -> np.ndarray:
    """Every byte value in every byte position, plus random words."""
    every = np.arange(256, dtype=np.uint32)
    rolled = [every | np.roll(every, 1 + i) << 8 | np.roll(every, 7 + 3 * i) << 16 | np.roll(every, 100 + i) << 24
              for i in range(4)]
    mixed = [np.roll(w, 0) for w in rolled] + [(w << 8 | w >> 24) & 0xFFFFFFFF for w in rolled]
    random = np.random.default_rng(0).integers(0, 2**32, 256, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([*mixed, random])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bits", [4, 2])
def test_the_assembly_is_astype_on_every_code(bits, dtype):
    words = _words()
    for shift in range(0, 8, bits):
        text = gpu_unpack.ptx(shift, bits, dtype)
        for word in words.tolist():
            lo, hi = run_ptx(text, word)
            got = _halves_to_float(lo, dtype) + _halves_to_float(hi, dtype)
            codes = [(word >> (8 * i) >> shift) & ((1 << bits) - 1) for i in range(4)]
            want = np.asarray(gpu_unpack.plane(np.asarray(
                [(word >> (8 * i)) & 0xFF for i in range(4)], np.uint8), shift, bits, dtype, asm=False), np.float32)
            assert list(got) == want.tolist() == [float(c) for c in codes], (shift, hex(word), got, codes)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_pairs_assembly_is_astype_on_every_code(dtype):
    """int4 codes read as int16 pairs of bytes (`Tuning.gpu_int4_pairs`): two pairs an instance, the codes of each
    nibble plane of their low and of their high bytes: every code in every byte position."""
    for word in _words().tolist():
        pairs = np.array([word & 0xFFFF, word >> 16], np.uint16).view(np.int16)
        for shift in (0, 4):
            for high in (False, True):
                out = run_ptx(gpu_unpack.pair_ptx(shift, high, 4, dtype), word, source="$1")[0]
                want = np.asarray(gpu_unpack.pair_plane(pairs, shift, high, 4, dtype, asm=False), np.float32)
                codes = [(word >> (16 * i + 8 * high + shift)) & 0xF for i in range(2)]
                assert list(_halves_to_float(out, dtype)) == want.tolist() == codes, (shift, high, hex(word))


def test_the_pairs_emulation_can_fail():
    """A wrong byte selector or a missing shift gives other floats."""
    text, word = gpu_unpack.pair_ptx(4, True, 4, jnp.bfloat16), 0x9B_79_57_35
    right = run_ptx(text, word, "$1")
    assert run_ptx(text.replace("0x4341", "0x4240"), word, "$1") != right
    assert run_ptx(text.replace("shr.b32 kvj_w, $1, 4", "shr.b32 kvj_w, $1, 0"), word, "$1") != right


def test_the_int8_assembly_is_astype_on_every_code():
    """int8 codes to fp16 (`Tuning.gpu_f16_dots`), times 2^-10 (`INT8_F16_UNIT`): four bytes an instance, and
    int16 pairs of codes two an instance, their low bytes (even channels) and high bytes (odd) by two assemblies:
    every signed code in every byte position, through a float16 subnormal."""
    f16, unit = jnp.float16, gpu_unpack.INT8_F16_UNIT
    assert gpu_unpack.int8_unit(f16) == unit == 2.0**-10 and gpu_unpack.int8_unit(jnp.bfloat16) == 1.0
    for word in _words().tolist():
        codes = np.array([(word >> (8 * i)) & 0xFF for i in range(4)], np.uint8).view(np.int8)
        lo, hi = run_ptx(gpu_unpack.int8_ptx(False), word)
        want = np.asarray(gpu_unpack.int8_plane(codes, asm=False), np.float32)
        assert list(_halves_to_float(lo, f16) + _halves_to_float(hi, f16)) == want.tolist()
        assert want.tolist() == (codes * unit).tolist()
        pairs = codes.view(np.int16)
        even, odd = (run_ptx(gpu_unpack.int8_ptx(True, high), word, source="$1")[0] for high in (False, True))
        want = [np.asarray(x, np.float32).tolist() for x in gpu_unpack.int8_pair_planes(pairs, asm=False)]
        assert [list(_halves_to_float(even, f16)), list(_halves_to_float(odd, f16))] == want
        assert want == [(codes[0::2] * unit).tolist(), (codes[1::2] * unit).tolist()]
    assert np.asarray(gpu_unpack.int8_plane(codes, jnp.bfloat16, asm=False), np.float32).tolist() == codes.tolist()


def test_the_int8_emulation_can_fail():
    """A missing sign flip, a wrong byte selector, a factor other than 2^14 or a bias other than 2^-3 gives other
    floats."""
    text, word = gpu_unpack.int8_ptx(False), 0x80_7F_01_FE  # -128, 127, 1, -2 from the top byte down
    right = run_ptx(text, word)
    assert run_ptx(text.replace("0x80808080", "0x00000000"), word) != right
    assert run_ptx(text.replace("0x4140", "0x4041"), word) != right
    assert run_ptx(text.replace("0x74007400", "0x78007800"), word) != right
    assert run_ptx(text.replace("0xB000B000", "0xAC00AC00"), word) != right
    pairs = gpu_unpack.int8_ptx(True, True)
    assert run_ptx(pairs, word, "$1") != run_ptx(pairs.replace("0x4341", "0x4240"), word, "$1")


def test_the_emulator_can_fail():
    """A wrong byte selector or mask gives other floats on the emulator (so the test above can fail)."""
    text = gpu_unpack.ptx(4, 4, jnp.bfloat16)
    word = 0x9B_79_57_35  # odd bytes: a mask one bit wide of the plane picks up the next code
    right = run_ptx(text, word)
    assert run_ptx(text.replace("0x4140", "0x4041"), word) != right
    assert run_ptx(text.replace("0x000F000F", "0x001F001F"), word) != right
    assert run_ptx(text.replace("shr.b32 kvj_w, $2, 4", "shr.b32 kvj_w, $2, 0"), word) != right


def test_where_the_assembly_applies():
    assert gpu_unpack.applies(4, jnp.bfloat16) and gpu_unpack.applies(2, jnp.float16)
    assert not gpu_unpack.applies(8, jnp.bfloat16) and not gpu_unpack.applies(4, jnp.float32)
    assert gpu_unpack.int8_ptx(False).count("prmt") == 2 and gpu_unpack.int8_ptx(True).count("prmt") == 1
    assert not gpu_quantized.unpacks_with_asm(compiled=False, unpack_asm=True)  # interpret mode: never
    assert gpu_quantized.unpacks_with_asm(compiled=True, unpack_asm=True)
    assert not gpu_quantized.unpacks_with_asm(compiled=True, unpack_asm=False)
