"""A NumPy reference of the quantized cache formats, written from their definitions (not from kvjax):

* int8, symmetric per token and head: s = max|x| / 127 rounded to bfloat16, q = clip(round(x / s), -127, 127).
* int4 and KIVI (Liu et al., 2024, Eq. of its quantization): asymmetric over a group,
  z = min X, s = (max X - min X) / (2^B - 1) (both stored bfloat16), Q(X) = clip(round((X - z) / s), 0, 2^B - 1),
  X^ = Q s + z. int4 and KIVI's values group the channels of one token; KIVI's keys group one channel over
  G consecutive tokens.
* fp8 e4m3 per head: s the power of two at or above max|x| * 4 / 448, q = e4m3(clip(x / s, -448, 448)).
* KIVI's residual, as kvjax documents it: a prompt of L tokens keeps its last L - ceil_G(L - R) tokens in full
  precision (at most R, whole groups before them); each new token joins the residual, and once more than R are
  pending the oldest G of them are quantized as one group.
* Planar packing: byte i of a head of H channels holds channels i, i + H / P, ... (P = 8 / bits) from its low bits.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    h = codes.shape[-1]
    out = np.zeros(codes.shape[:-1] + (h // per,), np.uint8)
    for i in range(h // per):
        for j in range(per):
            out[..., i] |= (codes[..., i + j * (h // per)].astype(np.uint8) << (j * bits)).astype(np.uint8)
    return out


def int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scale, values) per token over the last axis."""
    s = bf16(np.max(np.abs(x), axis=-1, keepdims=True) / 127.0)
    safe = np.where(s > 0, s, 1.0)
    q = np.clip(np.round(x / safe), -127, 127)
    return q.astype(np.int8), s[..., 0], q * s


def asym(x: np.ndarray, bits: int, axis: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scale, zero, values) with one (scale, zero) over `axis`."""
    lo, hi = np.min(x, axis=axis, keepdims=True), np.max(x, axis=axis, keepdims=True)
    s, z = bf16((hi - lo) / (2**bits - 1)), bf16(lo)
    safe = np.where(s > 0, s, 1.0)
    q = np.clip(np.round((x - z) / safe), 0, 2**bits - 1)
    return q.astype(np.uint8), np.squeeze(s, axis), np.squeeze(z, axis), q * s + z


def fp8(x: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """(codes, scale, values) of one head's tokens `x` `[T, H]`."""
    want = float(np.max(np.abs(x))) * 4.0 / 448.0
    s = 2.0 ** math.ceil(math.log2(want)) if want > 0 else 0.0  # 0: not set (all zeros so far)
    q = np.clip(x / (s or 1.0), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, s, q.astype(np.float32) * s


class KiviHead:
    """One head's KIVI cache, token by token: quantized groups plus the full-precision residual."""

    def __init__(self, bits: int, group: int, residual: int):
        self.bits, self.group, self.residual = bits, group, residual
        self.keys: list[np.ndarray] = []  # dequantized keys of the quantized part, in order
        self.values: list[np.ndarray] = []
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []  # full-precision (k, v), oldest first

    def _quantize_group(self, ks: np.ndarray, vs: np.ndarray) -> None:
        self.keys.extend(asym(ks, self.bits, axis=0)[3])  # per channel over the group's tokens
        self.values.extend(asym(vs, self.bits, axis=-1)[3])  # per token

    def prefill(self, k: np.ndarray, v: np.ndarray) -> None:
        n = len(k)
        quantized = math.ceil(max(n - self.residual, 0) / self.group) * self.group
        for start in range(0, quantized, self.group):
            self._quantize_group(k[start:start + self.group], v[start:start + self.group])
        self.pending = [(k[i], v[i]) for i in range(quantized, n)]

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        self.pending.append((k, v))
        if len(self.pending) > self.residual:
            oldest, self.pending = self.pending[:self.group], self.pending[self.group:]
            self._quantize_group(np.stack([a for a, _ in oldest]), np.stack([b for _, b in oldest]))

    @property
    def quantized(self) -> int:
        return len(self.keys)

    def view(self, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
        """Every token's (key, value) as attention reads them, in order (the residual in `dtype`)."""
        ks = [*self.keys, *(np.asarray(a, dtype).astype(np.float32) for a, _ in self.pending)]
        vs = [*self.values, *(np.asarray(b, dtype).astype(np.float32) for _, b in self.pending)]
        return np.stack(ks), np.stack(vs)
