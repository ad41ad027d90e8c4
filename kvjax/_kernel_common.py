"""Helpers that both the XLA ops (`kvjax.ops`) and their Pallas kernels (`kvjax.pallas`) use.

They live here, below both packages, so that imports flow one way: `kvjax.ops` may import `kvjax.pallas`
(it dispatches to the kernels), `kvjax.pallas` never imports `kvjax.ops`, and both import this module
(`tests/pallas/test_import_graph.py` checks it). Only plain `jax.numpy` here: no Pallas, no kvjax
package but `kvjax.errors`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import ConfigError

Array = jax.Array

#: The masked logit of every attention / score path (exp() of it minus a real max is exactly 0).
NEG = -1e30
INT_MIN = int(jnp.iinfo(jnp.int32).min)
INT_MAX = int(jnp.iinfo(jnp.int32).max)

#: Options of the scoring ops and their kernels.
ROW_REDUCE = ("sum", "mean")
GROUP_REDUCE = ("mean", "max", None)
POOLING = ("avg", "max")
SIMILARITIES = ("dot", "cosine")
NORM_EPS = 1e-6  # the smallest norm `representative_scores(kind="cosine")` divides by


def check_choice(op: str, name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{op}: {name} must be one of {list(choices)}, got {value!r}")


def check_window(op: str, sliding_window: Any) -> None:
    """A sliding window is None (no window) or a positive number of positions; 0, a negative or a bool would mask
    every key (an output of zeros), so they are refused by name. A traced window passes unchecked."""
    if sliding_window is None or isinstance(sliding_window, jax.Array):
        return
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int | np.integer) or sliding_window < 1:
        raise ConfigError(f"{op}: sliding_window must be a positive integer or None, got {sliding_window!r}")


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def pad_axis(x: Array, axis: int, size: int, fill: Any) -> Array:
    """Pads `x` along `axis` to `size` entries with `fill` (no-op when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    width = [(0, 0)] * x.ndim
    width[axis] = (0, extra)
    return jnp.pad(x, width, constant_values=fill)


def pad_to_multiple(x: Array, axis: int, multiple: int, fill: Any) -> Array:
    """Pads `x` along `axis` to the next multiple of `multiple` with `fill`."""
    return pad_axis(x, axis, round_up(x.shape[axis], multiple), fill)


def row_scale(scale: float | Array | None, head_dim: int, batch: int, rows: int) -> Array:
    """`[B, T]` float32 logit scale per query row (default `1 / sqrt(head_dim)`)."""
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    return jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (batch, rows))


def group_queries(q: Array, kv_heads: int) -> Array:
    """`[B, T, N, H]` -> `[B, K, G, T, H]` float32 (query head `n` reads KV head `n // G`)."""
    b, t, n, h = q.shape
    if n % kv_heads:
        raise ConfigError(f"{n} query heads are not a multiple of {kv_heads} KV heads")
    return q.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4).astype(jnp.float32)


def order_key(scores: Array, valid: Array, protect: Array | None = None) -> Array:
    """int32 key ordering like the float scores: protected > any score > invalid.

    NaN ranks like -inf (below every real score, above invalid); -0.0 equals +0.0.
    """
    s = scores.astype(jnp.float32)
    s = jnp.where(jnp.isnan(s), -jnp.inf, s)
    s = jnp.where(s == 0.0, 0.0, s)
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    if protect is not None:
        key = jnp.where(protect, INT_MAX, key)
    return jnp.where(valid, key, INT_MIN)


def broadcast_lead(x: Array, shape: tuple[int, ...]) -> Array:
    """Broadcasts `x` over the leading axes of `shape` (trailing axes appended)."""
    x = jnp.asarray(x)
    return jnp.broadcast_to(x.reshape(x.shape + (1,) * (len(shape) - x.ndim)), shape)
