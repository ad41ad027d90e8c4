"""Per-head slot reads and writes of `[B, K, C, ...]` buffers, with B and K as batch dimensions.

Below both the cache (`kvjax.cache`) and its quantized storage (`kvjax.quant`), which move codes and scales
slot by slot with the same primitives as plain keys and values.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax import tuning

Array = jax.Array

#: `Tuning.slot_write="update_slice"` writes one slice per (example, head) up to this many; more scatter.
MAX_UPDATE_SLICES = 64


def _slot_dims(ndim: int) -> tuple[int, ...]:
    """The window dims (head_dim, if any) of one slot of a `[B, K, C, ...]` buffer."""
    return tuple(range(2, ndim - 1))


def put_slots(buf: Array | None, slot: Array, new: Any) -> Array | None:
    """Writes `new` `[B, K, ...]` at slot `slot[b, k]` of `buf` `[B, K, C, ...]`; a slot >= C is dropped.

    Three equivalent lowerings, chosen by `kvjax.tuning.current().slot_write` (a speed knob, see there)."""
    if buf is None:
        return None
    new = jnp.broadcast_to(jnp.asarray(new, buf.dtype), slot.shape + buf.shape[3:])
    how = tuning.current().slot_write
    if how == "update_slice" and slot.size <= MAX_UPDATE_SLICES:
        return _put_by_update_slices(buf, slot, new)
    if how == "flat_scatter":
        return _put_flat(buf, slot, new)
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=_slot_dims(buf.ndim), inserted_window_dims=(2,), scatter_dims_to_operand_dims=(2,),
        operand_batching_dims=(0, 1), scatter_indices_batching_dims=(0, 1),
    )
    return jax.lax.scatter(
        buf, slot[..., None].astype(jnp.int32), new, dims, indices_are_sorted=True, unique_indices=True,
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )


def _put_flat(buf: Array, slot: Array, new: Array) -> Array:
    """`put_slots` as one scatter of rows into `buf` viewed as `[B * K * C, ...]` (no batching dimensions)."""
    b, k, c = buf.shape[:3]
    rest = buf.shape[3:]
    heads = jnp.arange(b * k, dtype=jnp.int32).reshape(b, k)
    slot = slot.astype(jnp.int32)
    row = jnp.where((slot >= 0) & (slot < c), heads * c + slot, b * k * c)  # out of range: dropped
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(1, 1 + len(rest))), inserted_window_dims=(0,),
        scatter_dims_to_operand_dims=(0,),
    )
    flat = jax.lax.scatter(
        buf.reshape(b * k * c, *rest), row.reshape(-1, 1), new.reshape(b * k, *rest), dims,
        indices_are_sorted=True, unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )
    return flat.reshape(buf.shape)


def _put_by_update_slices(buf: Array, slot: Array, new: Array) -> Array:
    """`put_slots` as one in-place `dynamic_update_slice` per (example, head); a dropped slot rewrites the
    value it would have clamped onto."""
    b, k, c = buf.shape[:3]
    rest = buf.shape[3:]
    slot = slot.astype(jnp.int32)
    zeros = (0,) * len(rest)
    for i in range(b):
        for j in range(k):
            s = slot[i, j]
            at = (i, j, jnp.clip(s, 0, c - 1), *zeros)
            old = jax.lax.dynamic_slice(buf, at, (1, 1, 1, *rest))
            value = jnp.where((s >= 0) & (s < c), new[i, j].reshape(1, 1, 1, *rest), old)
            buf = jax.lax.dynamic_update_slice(buf, value, at)
    return buf


def scatter_rows(buf: Array | None, slots: Array, new: Any) -> Array | None:
    """Writes `new` `[B, K, T, ...]` at slots `slots` `[B, K, T]` of `buf` `[B, K, C, ...]`; a slot >= C is dropped
    (the slots of one head that are written are distinct)."""
    if buf is None:
        return None
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(3, buf.ndim)), inserted_window_dims=(2,), scatter_dims_to_operand_dims=(2,),
        operand_batching_dims=(0, 1), scatter_indices_batching_dims=(0, 1),
    )
    new = jnp.broadcast_to(jnp.asarray(new, buf.dtype), slots.shape + buf.shape[3:])
    return jax.lax.scatter(buf, slots[..., None].astype(jnp.int32), new, dims,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def take_slots(buf: Array, slots: Array) -> Array:
    """`buf[b, k, slots[b, k, ...]]` of a `[B, K, C, ...]` buffer: `slots` `[B, K, *S]` within `[0, C)` gives
    `[B, K, *S, ...]`, read straight from the buffer (B and K are batch dimensions of the gather)."""
    window = tuple(range(slots.ndim, slots.ndim + buf.ndim - 3))
    dims = jax.lax.GatherDimensionNumbers(
        offset_dims=window, collapsed_slice_dims=(2,), start_index_map=(2,),
        operand_batching_dims=(0, 1), start_indices_batching_dims=(0, 1),
    )
    return jax.lax.gather(buf, slots[..., None].astype(jnp.int32), dims, (1, 1, 1, *buf.shape[3:]),
                          mode=jax.lax.GatherScatterMode.CLIP)


def gather_slots(x: Array | None, index: Array) -> Array | None:
    """Gathers `[B, K, C, ...]` along the slot axis with `index` `[B, K, C']`."""
    if x is None:
        return None
    idx = index.reshape(index.shape + (1,) * (x.ndim - index.ndim))
    return jnp.take_along_axis(x, idx, axis=2)


def write_rows(buf: Array, start: Array, rows: Array, where: Array | None = None) -> Array:
    """`buf` `[B, K, C, ...]` with `rows` `[B, K, T, ...]` written from slot `start[b, k]` (clamped into the
    buffer, as `lax.dynamic_update_slice` does); heads where `where` `[B, K]` is False keep their rows."""

    def one(b: Array, s: Array, r: Array, w: Any) -> Array:
        index = (s,) + (0,) * (b.ndim - 1)
        if w is not None:
            r = jnp.where(w, r, jax.lax.dynamic_slice(b, index, r.shape))
        return jax.lax.dynamic_update_slice(b, r.astype(b.dtype), index)

    if where is None:
        return jax.vmap(jax.vmap(lambda b, s, r: one(b, s, r, None)))(buf, start, rows)
    return jax.vmap(jax.vmap(one))(buf, start, rows, where)


def read_rows(buf: Array, start: Array, size: int) -> Array:
    """`[B, K, size, ...]`: the `size` slots of each head from `start[b, k]` (clamped into the buffer)."""

    def one(b: Array, s: Array) -> Array:
        return jax.lax.dynamic_slice(b, (s,) + (0,) * (b.ndim - 1), (size,) + b.shape[1:])

    return jax.vmap(jax.vmap(one))(buf, start)


def pad_slots(x: Array | None, extra: int, fill: Any = 0) -> Array | None:
    """`[B, K, C, ...]` -> `[B, K, C + extra, ...]` filled with `fill`."""
    if x is None or extra == 0:
        return x
    width = [(0, 0)] * x.ndim
    width[2] = (0, extra)
    return jnp.pad(x, width, constant_values=fill)


def cut_slots(x: Array | None, capacity: int) -> Array | None:
    """The first `capacity` slots of `[B, K, C, ...]`."""
    return None if x is None else jax.lax.slice_in_dim(x, 0, capacity, axis=2)
