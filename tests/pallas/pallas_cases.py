"""Shared inputs for the Pallas kernel tests: padded caches with per-head lengths whose unused slots are
poisoned with NaN (the kernels get the poisoned copy, the XLA reference the clean one)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

#: The TPU simulator: NaN-filled scratch and out-of-bounds reads raise (slower than interpret=True).
TPU_SIM = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")

RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 5e-3}


def assert_close(got, want, dtype) -> None:
    """Within the dtype's relative tolerance of the reference (relative to its largest entry), no NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    assert np.isfinite(got).all(), "NaN / inf leaked into the kernel output"
    rtol = RTOL[dtype]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(1.0, float(np.abs(want).max())))


@dataclasses.dataclass
class Cache:
    """Keys / values `[B, K, C, H]` with per-head lengths: `clean` has zeros past the length, `poisoned` NaN."""

    k: np.ndarray
    v: np.ndarray
    k_nan: np.ndarray
    v_nan: np.ndarray
    pos: np.ndarray
    stored: np.ndarray
    lengths: np.ndarray

    def arrays(self, dtype, poisoned: bool) -> tuple:
        k, v = (self.k_nan, self.v_nan) if poisoned else (self.k, self.v)
        return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(self.pos), jnp.asarray(self.stored)


def make_cache(rng: np.random.Generator, lengths: np.ndarray, capacity: int, head_dim: int,
               shuffle: bool = True) -> Cache:
    """Valid slots packed at the front (`slot < length`), positions a permutation of the slots (a
    compressed cache is not contiguous) or the slot index."""
    b, kv = lengths.shape
    k = rng.standard_normal((b, kv, capacity, head_dim)).astype(np.float32)
    v = rng.standard_normal((b, kv, capacity, head_dim)).astype(np.float32)
    stored = np.arange(capacity)[None, None] < lengths[..., None]
    if shuffle:
        pos = np.stack([np.stack([rng.permutation(capacity) for _ in range(kv)]) for _ in range(b)])
    else:
        pos = np.broadcast_to(np.arange(capacity), (b, kv, capacity))
    pos = np.where(stored, pos, -1).astype(np.int32)
    col = stored[..., None]
    return Cache(np.where(col, k, 0), np.where(col, v, 0), np.where(col, k, np.nan), np.where(col, v, np.nan),
                 pos, stored, lengths)
