"""Helpers shared by the Pallas kernels: interpret-mode choice, compiler parameters, MXU dots, split merge.

What the XLA ops need as well lives in `kvjax._kernel_common`, below both `kvjax.ops` and `kvjax.pallas`
(which never imports `kvjax.ops`); its padding, rounding and constants are re-exported here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from kvjax._kernel_common import INT_MAX, INT_MIN, NEG, pad_axis, round_up
from kvjax.errors import ConfigError

Array = jax.Array

__all__ = ["HIGHEST", "INT_MAX", "INT_MIN", "NEG", "Interpret", "block_size", "check_lane_block", "compiler_params",
           "dot_nn", "dot_nt", "interpret_mode", "live_blocks", "merge_splits", "pad_axis", "round_up",
           "row_to_column"]

HIGHEST = jax.lax.Precision.HIGHEST

#: `interpret=` values the kernels accept: None (compiled on TPU, interpreted elsewhere), a bool, or
#: `pltpu.InterpretParams(...)` (the TPU simulator: NaN-filled scratch, out-of-bounds reads raise).
Interpret = bool | pltpu.InterpretParams | None


def interpret_mode(interpret: Interpret) -> bool | pltpu.InterpretParams:
    """The `interpret=` argument for `pl.pallas_call`.

    The kernels are written for Mosaic TPU, so they compile only on a TPU backend; on CPU (and GPU,
    where no Mosaic GPU variant exists yet) None runs them in interpret mode: correct but slow.
    """
    if interpret is None:
        return jax.default_backend() != "tpu"
    return interpret


def block_size(requested: int, length: int, align: int = 8) -> int:
    """A block of at most `requested` (rounded to `align`) that is not needlessly larger than `length`."""
    return round_up(max(1, min(requested, length)), align)


def compiler_params(semantics: tuple[str, ...], vmem_limit_bytes: int | None = None) -> pltpu.CompilerParams:
    """Mosaic TPU compiler parameters (ignored in interpret mode)."""
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes)


def dot_nt(a: Array, b: Array) -> Array:
    """`a [M, D] @ b[N, D]^T` -> `[M, N]` float32 at full precision (MXU, transposed right operand)."""
    return jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32
    )


def dot_nn(a: Array, b: Array) -> Array:
    """`a [M, D] @ b [D, N]` -> `[M, N]` float32 at full precision."""
    return jax.lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32
    )


def row_to_column(row: Array) -> Array:
    """`[1, N]` float32 -> `[N, 1]` through a (8, N) transpose, which Mosaic lowers on the XLU."""
    return jnp.transpose(jnp.broadcast_to(row, (8, row.shape[1])))[:, :1]


def live_blocks(valid: Array, block: int) -> Array:
    """Number of blocks of `block` slots up to the last valid slot, per row of `valid` `[..., C]` (int32)."""
    slots = jnp.arange(valid.shape[-1], dtype=jnp.int32)
    last = jnp.max(jnp.where(valid, slots, -1), axis=-1)
    return ((last + block) // block).astype(jnp.int32)


def merge_splits(acc: Array, m: Array, l: Array) -> tuple[Array, Array, Array]:
    """Log-sum-exp merge of split-K partials `acc [B, K, S, G, H]`, `m`, `l [B, K, S, G]` (float32).

    Returns the normalised output `[B, K, G, H]`, the merged max `[B, K, G]` and `1 / l` (0 for a row
    that attended nothing, so its output is 0 rather than NaN).
    """
    m_all = jnp.max(m, axis=2)
    w = jnp.exp(m - m_all[:, :, None])
    l_all = jnp.sum(l * w, axis=2)
    inv = jnp.where(l_all > 0, 1.0 / jnp.where(l_all > 0, l_all, 1.0), 0.0)
    return jnp.sum(acc * w[..., None], axis=2) * inv[..., None], m_all, inv


def check_lane_block(op: str, block: int, num_blocks: int, interpret: Interpret) -> None:
    """Compiled for TPU, a block along a lane (slot) axis spanning several blocks must be a multiple of 128."""
    if interpret_mode(interpret) is False and num_blocks > 1 and block % 128:
        raise ConfigError(f"{op}: compiled for TPU, the slot block must be a multiple of 128, got {block}")
