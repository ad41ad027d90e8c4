"""GGML's tensor types and kvjax's NumPy de-quantizers for them (no ``gguf`` package, no torch).

A quantized GGML tensor is a sequence of fixed-size blocks, each holding ``block_size`` weights of one row (a row
is a whole number of blocks). Every routine below takes a ``[n_blocks, type_size]`` uint8 array and returns the
``[n_blocks, block_size]`` weights in float32, computed in float32 in the order ggml's reference C code uses (the
block scale times the scale of the sub-block first, then times the quant, minus the minimum), so the values are the
ones llama.cpp multiplies with. Block layouts (ggml-common.h), little-endian, ``f16`` an IEEE half:

======  ====  =====  ==========================================================================================
type    QK    bytes  layout
======  ====  =====  ==========================================================================================
Q4_0    32    18     d:f16, qs[16]: weight j = d * (nibble_j - 8); low nibbles are j < 16, high ones j >= 16
Q4_1    32    20     d:f16, m:f16, qs[16]: d * nibble_j + m
Q5_0    32    22     d:f16, qh:u32, qs[16]: the nibble's fifth bit is bit j of qh; d * (q_j - 16)
Q5_1    32    24     d:f16, m:f16, qh:u32, qs[16]: d * q_j + m
Q8_0    32    34     d:f16, qs[32]:i8: d * q_j
Q2_K    256   84     scales[16] (low nibble scale, high nibble min, of 16 sub-blocks of 16), qs[64] (2 bits),
                     d:f16, dmin:f16: (d * sc) * q - (dmin * m)
Q3_K    256   110    hmask[32], qs[64] (2 low bits), scales[12] (16 six-bit scales, offset 32), d:f16:
                     (d * (sc - 32)) * (q - 4 where the hmask bit is clear)
Q4_K    256   144    d:f16, dmin:f16, scales[12] (8 six-bit scales and 8 six-bit mins), qs[128]:
                     (d * sc) * nibble - (dmin * m) over 8 sub-blocks of 32
Q5_K    256   176    as Q4_K with qh[32] before qs: bit s of qh[l] is the fifth bit of sub-block s's weight l
Q6_K    256   210    ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16]:i8, d:f16: (d * sc) * (q - 32)
======  ====  =====  ==========================================================================================

:func:`dequantize_rows` turns a tensor's rows into an output dtype a bounded number of rows at a time, so a
262144-row embedding never exists as one float32 temporary beside its output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

__all__ = ["DEQUANTIZERS", "GGML_TYPES", "GgmlType", "dequantize", "dequantize_rows", "row_bytes"]


class GgmlType(NamedTuple):
    """A GGML tensor type: its name, weights per block and bytes per block (None: not known to kvjax)."""

    name: str
    block_size: int | None = None
    type_size: int | None = None


# ggml's `enum ggml_type` (ids 4, 5 and 31-33, 36-38 were removed upstream and never reused). Sizes are given for the
# types a file can hold and kvjax sizes (Q8_1 is an intermediate of the dot products; gguf-py and ggml disagree on it).
GGML_TYPES: dict[int, GgmlType] = {
    0: GgmlType("F32", 1, 4), 1: GgmlType("F16", 1, 2), 2: GgmlType("Q4_0", 32, 18), 3: GgmlType("Q4_1", 32, 20),
    6: GgmlType("Q5_0", 32, 22), 7: GgmlType("Q5_1", 32, 24), 8: GgmlType("Q8_0", 32, 34),
    9: GgmlType("Q8_1"), 10: GgmlType("Q2_K", 256, 84), 11: GgmlType("Q3_K", 256, 110),
    12: GgmlType("Q4_K", 256, 144), 13: GgmlType("Q5_K", 256, 176), 14: GgmlType("Q6_K", 256, 210),
    15: GgmlType("Q8_K", 256, 292), 16: GgmlType("IQ2_XXS"), 17: GgmlType("IQ2_XS"), 18: GgmlType("IQ3_XXS"),
    19: GgmlType("IQ1_S"), 20: GgmlType("IQ4_NL"), 21: GgmlType("IQ3_S"), 22: GgmlType("IQ2_S"),
    23: GgmlType("IQ4_XS"), 24: GgmlType("I8", 1, 1), 25: GgmlType("I16", 1, 2), 26: GgmlType("I32", 1, 4),
    27: GgmlType("I64", 1, 8), 28: GgmlType("F64", 1, 8), 29: GgmlType("IQ1_M"), 30: GgmlType("BF16", 1, 2),
    34: GgmlType("TQ1_0"), 35: GgmlType("TQ2_0"), 39: GgmlType("MXFP4"),
}  # fmt: skip
_BY_NAME = {t.name: t for t in GGML_TYPES.values()}


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, as a ``[n, 1]`` float32 column."""
    return np.ascontiguousarray(raw[:, start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[n, 16]`` bytes -> ``[n, 32]``: the 16 low nibbles, then the 16 high ones (a 32-weight block's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits32(raw: np.ndarray, start: int) -> np.ndarray:
    """The little-endian 32-bit word at byte ``start`` as ``[n, 32]`` bits (bit j in column j)."""
    word = np.ascontiguousarray(raw[:, start : start + 4]).view("<u4")
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _f32(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view("<f4")


def _f16_values(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(raw).view("<u2").astype(np.uint32) << 16).view(np.float32)


def _q4_0(raw: np.ndarray) -> np.ndarray:
    q = _nibbles(raw[:, 2:18]).astype(np.int8) - np.int8(8)
    return _f16(raw, 0) * q.astype(np.float32)


def _q4_1(raw: np.ndarray) -> np.ndarray:
    return _f16(raw, 0) * _nibbles(raw[:, 4:20]).astype(np.float32) + _f16(raw, 2)


def _q5_0(raw: np.ndarray) -> np.ndarray:
    q = (_nibbles(raw[:, 6:22]) | (_bits32(raw, 2) << 4)).astype(np.int8) - np.int8(16)
    return _f16(raw, 0) * q.astype(np.float32)


def _q5_1(raw: np.ndarray) -> np.ndarray:
    q = _nibbles(raw[:, 8:24]) | (_bits32(raw, 4) << 4)
    return _f16(raw, 0) * q.astype(np.float32) + _f16(raw, 2)


def _q8_0(raw: np.ndarray) -> np.ndarray:
    return _f16(raw, 0) * np.ascontiguousarray(raw[:, 2:34]).view(np.int8).astype(np.float32)


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """``[n, 64]`` bytes of 2-bit quants -> ``[n, 2, 4, 2, 16]``: (half, shift j, group, l) holds bits 2j..2j+1 of
    byte ``32 * half + 16 * group + l``, the weight at ``128 * half + 32 * j + 16 * group + l``."""
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1, 1)
    return (qs.reshape(-1, 2, 1, 2, 16) >> shifts) & 3


def _q2_k(raw: np.ndarray) -> np.ndarray:
    n = raw.shape[0]
    scales = raw[:, 0:16].reshape(n, 2, 4, 2, 1)  # sub-block 8 * half + 2 * j + group
    d, dmin = _f16(raw, 80).reshape(n, 1, 1, 1, 1), _f16(raw, 82).reshape(n, 1, 1, 1, 1)
    q = _two_bit_planes(raw[:, 16:80]).astype(np.float32)
    return ((d * (scales & 0x0F).astype(np.float32)) * q - dmin * (scales >> 4).astype(np.float32)).reshape(n, 256)


def _q3_k(raw: np.ndarray) -> np.ndarray:
    n = raw.shape[0]
    packed = raw[:, 96:108]
    i = np.arange(16)
    low = (packed[:, i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 0x0F
    high = (packed[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 0x03
    scales = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32).reshape(n, 2, 4, 2, 1)
    # bit 4 * half + j of hmask[16 * group + l] set: the weight's offset of -4 is dropped
    hbit_shift = (4 * np.arange(2) [:, None] + np.arange(4)[None, :]).astype(np.uint8).reshape(1, 2, 4, 1, 1)
    hbit = (raw[:, 0:32].reshape(n, 1, 1, 2, 16) >> hbit_shift) & 1
    q = _two_bit_planes(raw[:, 32:96]).astype(np.int8) - (np.int8(4) * (1 - hbit).astype(np.int8))
    return ((_f16(raw, 108).reshape(n, 1, 1, 1, 1) * scales) * q.astype(np.float32)).reshape(n, 256)


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins of a Q4_K / Q5_K block from its 12 packed bytes: sub-blocks 0-3 hold
    them in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take their low 4 bits from the
    nibbles of bytes 8-11 (scale low, min high) and their top 2 bits from the top bits of bytes 0-3 / 4-7."""
    first, second, tail = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([first & 63, (tail & 0x0F) | ((first >> 6) << 4)], axis=1)
    mins = np.concatenate([second & 63, (tail >> 4) | ((second >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_quant(raw: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: ``q`` ``[n, 8, 32]`` quants of the 8 sub-blocks, scaled and shifted by the block's header."""
    scales, mins = _scale_min_k4(raw[:, 4:16])
    d = (_f16(raw, 0) * scales)[:, :, None]
    m = (_f16(raw, 2) * mins)[:, :, None]
    return (d * q.astype(np.float32) - m).reshape(raw.shape[0], 256)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """``[n, 128]`` -> ``[n, 8, 32]``: sub-block 2c holds the low nibbles of bytes 32c..32c+31, 2c+1 the high ones."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k(raw: np.ndarray) -> np.ndarray:
    return _k_quant(raw, _k_nibbles(raw[:, 16:144]))


def _q5_k(raw: np.ndarray) -> np.ndarray:
    high = (raw[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return _k_quant(raw, _k_nibbles(raw[:, 48:176]) | (high << 4))


def _q6_k(raw: np.ndarray) -> np.ndarray:
    n = raw.shape[0]
    # Each half of 128 weights: ql[64 * half + 32 * a + l] gives the low 4 bits of group g = 2 * nibble + a
    # (weight 128 * half + 32 * g + l), bits 2g..2g+1 of qh[32 * half + l] the top two.
    ql = raw[:, 0:128].reshape(n, 2, 1, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    high = (raw[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32).reshape(n, 2, 4, 2, 16)
    scales = np.ascontiguousarray(raw[:, 192:208]).view(np.int8).astype(np.float32).reshape(n, 2, 4, 2, 1)
    return ((_f16(raw, 208).reshape(n, 1, 1, 1, 1) * scales) * q).reshape(n, 256)


#: GGML type name -> routine from ``[n_blocks, type_size]`` uint8 to ``[n_blocks, block_size]`` float32.
DEQUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "F32": _f32, "F16": _f16_values, "BF16": _bf16, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q8_0": _q8_0, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}  # fmt: skip


def row_bytes(type_name: str, row_length: int) -> int:
    """Bytes of one row of ``row_length`` weights (a whole number of blocks, else ValueError)."""
    t = _BY_NAME[type_name]
    if t.block_size is None or t.type_size is None:
        raise ValueError(f"GGML type {type_name} has no known block size")
    if row_length % t.block_size:
        raise ValueError(f"a {type_name} row of {row_length} weights is not a whole number of {t.block_size}-blocks")
    return row_length // t.block_size * t.type_size


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...], dtype: np.dtype | type = np.float32
               ) -> np.ndarray:
    """A whole tensor of ``shape`` (rows last-axis-fastest) from its raw bytes, in ``dtype``."""
    out = np.empty(shape, dtype=dtype)
    flat = out.reshape(-1, shape[-1]) if shape else out.reshape(1, 1)
    for start, rows in dequantize_rows(np.asarray(raw, np.uint8).reshape(flat.shape[0], -1), type_name,
                                       flat.shape[1], dtype):
        flat[start : start + rows.shape[0]] = rows
    return out


#: Weights de-quantized per step of :func:`dequantize_rows` (float32 temporaries of a few times this many bytes).
CHUNK_WEIGHTS = 1 << 20


def dequantize_rows(raw_rows: np.ndarray, type_name: str, row_length: int, dtype: np.dtype | type = np.float32,
                    chunk_weights: int = CHUNK_WEIGHTS, align_rows: int = 1) -> Iterator[tuple[int, np.ndarray]]:
    """Yields ``(first_row, rows)``: ``raw_rows`` (``[rows, row_bytes]`` uint8, e.g. a memory map) de-quantized a
    bounded number of rows at a time (a multiple of ``align_rows``), each block converted once into ``dtype``."""
    if type_name not in DEQUANTIZERS:
        raise ValueError(f"GGML type {type_name} is not supported by kvjax's de-quantizers")
    t = _BY_NAME[type_name]
    n_rows = raw_rows.shape[0]
    if raw_rows.ndim != 2 or raw_rows.shape[1] != row_bytes(type_name, row_length):
        raise ValueError(f"{type_name} rows of {row_length} weights take {row_bytes(type_name, row_length)} bytes, "
                         f"got an array of shape {raw_rows.shape}")
    step = max(align_rows, chunk_weights // max(row_length, 1) // align_rows * align_rows)
    routine = DEQUANTIZERS[type_name]
    for start in range(0, n_rows, step):
        block = np.asarray(raw_rows[start : start + step], dtype=np.uint8)
        values = routine(block.reshape(-1, t.type_size))
        yield start, values.reshape(block.shape[0], row_length).astype(dtype, copy=False)
