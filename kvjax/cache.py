"""The compressible KV cache: a fixed-shape pytree and pure functions over it.

Layout (per layer; a model's cache stacks the same fields on a leading `[L]` axis):

| field    | shape             | meaning                                                          |
|----------|-------------------|------------------------------------------------------------------|
| `k`, `v` | `[B, K, C, H]`    | keys **after RoPE** and values, storage dtype                    |
| `pos`    | `[B, K, C]` int32 | original absolute position of each slot, -1 for an empty slot    |
| `length` | `[B, K]` int32    | valid slots per KV head; slots `[0, length)` are valid           |
| `score`  | `[B, K, C]` f32   | optional per-slot accumulator (H2O, TOVA, ...), else None        |
| `attend` | `[B, K, C]` bool  | optional per-slot mask a retrieval method writes, else None      |
| `state`  | dict of arrays    | method-specific leaves (per-layer budgets, running statistics)   |

`state["shared"]` (optional, `SHARED_STATE`) is a dict of cross-layer leaves **without** the `[L]`
axis (a remaining budget shared by the layers of one step, statistics pooled over layers): the layer
scan hands it unsliced to every layer's hook and carries the version each layer returns to the next.

Valid slots are always packed at the front of each head (`slot < length`), and `pos` is -1 beyond.
Slot order is free (attention is permutation invariant), but prefill keeps slots sorted by position
and decode appends at the end, so most methods can rely on it. Eviction is compaction into a cache
allocated at the budget's capacity: memory really shrinks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.rope import rotate_by

Array = jax.Array

#: Key of `KVCache.state` holding cross-layer leaves that have no `[L]` axis (see the module docstring).
SHARED_STATE = "shared"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys, values, original positions and per-head lengths; see the module docstring."""

    k: Array
    v: Array
    pos: Array
    length: Array
    score: Array | None = None
    attend: Array | None = None
    state: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return self.k.shape[-2]

    @property
    def batch_size(self) -> int:
        return self.k.shape[-4]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[-3]

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1]

    def replace(self, **changes: Any) -> KVCache:
        return dataclasses.replace(self, **changes)

    def layer(self, index: int) -> KVCache:
        """The cache of one layer from a stacked `[L, ...]` cache (`state["shared"]` is not sliced)."""
        per_layer, shared = split_shared(self)
        return join_shared(jax.tree.map(lambda x: x[index], per_layer), shared)

    @property
    def nbytes(self) -> int:
        """Bytes held by every array of the cache (what it really costs in memory)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def split_shared(cache: KVCache) -> tuple[KVCache, dict[str, Any] | None]:
    """(the cache without `state["shared"]`, the shared dict or None)."""
    if SHARED_STATE not in cache.state:
        return cache, None
    state = dict(cache.state)
    shared = state.pop(SHARED_STATE)
    return cache.replace(state=state), shared


def join_shared(cache: KVCache, shared: dict[str, Any] | None) -> KVCache:
    """Puts a shared dict (from `split_shared`) back into `cache.state`; None leaves it alone."""
    if shared is None:
        return cache
    return cache.replace(state={**cache.state, SHARED_STATE: shared})


def init(
    batch: int,
    kv_heads: int,
    capacity: int,
    head_dim: int,
    dtype: Any = jnp.bfloat16,
    *,
    num_layers: int | None = None,
    score: bool = False,
    attend: bool = False,
    state: dict[str, Any] | None = None,
) -> KVCache:
    """An empty cache; with `num_layers` every field gets a leading `[L]` axis."""
    if min(batch, kv_heads, capacity, head_dim) <= 0:
        raise ValueError(
            f"cache dimensions must be positive, got batch={batch}, kv_heads={kv_heads}, "
            f"capacity={capacity}, head_dim={head_dim}"
        )
    lead = () if num_layers is None else (num_layers,)
    slots = (*lead, batch, kv_heads, capacity)
    return KVCache(
        k=jnp.zeros((*slots, head_dim), dtype),
        v=jnp.zeros((*slots, head_dim), dtype),
        pos=jnp.full(slots, -1, jnp.int32),
        length=jnp.zeros(slots[:-1], jnp.int32),
        score=jnp.zeros(slots, jnp.float32) if score else None,
        attend=jnp.ones(slots, bool) if attend else None,
        state=dict(state or {}),
    )


def valid_mask(cache: KVCache) -> Array:
    """`[..., B, K, C]` bool: the slot holds a token (and, if set, the method lets it be attended)."""
    slots = jnp.arange(cache.capacity, dtype=jnp.int32)
    mask = (slots < cache.length[..., None]) & (cache.pos >= 0)
    if cache.attend is not None:
        mask &= cache.attend
    return mask


def stored_mask(cache: KVCache) -> Array:
    """`[..., B, K, C]` bool: the slot holds a token (ignoring any retrieval mask)."""
    slots = jnp.arange(cache.capacity, dtype=jnp.int32)
    return (slots < cache.length[..., None]) & (cache.pos >= 0)


def extend(cache: KVCache, extra: int) -> KVCache:
    """The same cache with `extra` more empty slots per head (room for a prefill chunk)."""
    if extra == 0:
        return cache

    def pad(x: Array | None, fill: Any) -> Array | None:
        if x is None:
            return None
        width = [(0, 0)] * x.ndim
        axis = cache.pos.ndim - 1
        width[axis] = (0, extra)
        return jnp.pad(x, width, constant_values=fill)

    return cache.replace(
        k=pad(cache.k, 0),
        v=pad(cache.v, 0),
        pos=pad(cache.pos, -1),
        score=pad(cache.score, 0.0),
        attend=pad(cache.attend, True),
    )


def append(cache: KVCache, k: Array, v: Array, positions: Array) -> KVCache:
    """Writes a chunk of new tokens after each head's valid slots (one layer, no `[L]` axis).

    `k`, `v`: `[B, T, K, H]` (the model's layout); `positions`: `[B, T]` int32 with -1 for padding,
    padding only at the end of each row. The caller guarantees room: `length + T <= capacity`
    (prefill extends the cache by T first; decode keeps `length < capacity`).
    """
    k = jnp.swapaxes(k, 1, 2).astype(cache.k.dtype)  # [B, K, T, H]
    v = jnp.swapaxes(v, 1, 2).astype(cache.v.dtype)
    num_heads = cache.num_kv_heads
    new_pos = jnp.broadcast_to(positions[:, None, :], (positions.shape[0], num_heads, positions.shape[1]))
    n_valid = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)  # [B]

    def write(buf: Array, new: Array, start: Array) -> Array:
        index = (start,) + (0,) * (buf.ndim - 1)
        return jax.lax.dynamic_update_slice(buf, new, index)

    write_heads = jax.vmap(jax.vmap(write))  # over B, K
    out = cache.replace(
        k=write_heads(cache.k, k, cache.length),
        v=write_heads(cache.v, v, cache.length),
        pos=write_heads(cache.pos, new_pos.astype(jnp.int32), cache.length),
        length=cache.length + n_valid[:, None],
    )
    if cache.score is not None:
        out = out.replace(score=write_heads(cache.score, jnp.zeros(new_pos.shape, jnp.float32), cache.length))
    if cache.attend is not None:
        out = out.replace(attend=write_heads(cache.attend, jnp.ones(new_pos.shape, bool), cache.length))
    return out


def append_token_in_layer(cache: KVCache, layer: Array, k: Array, v: Array, positions: Array) -> KVCache:
    """`append` of one token per example into layer `layer` of a stacked `[L, ...]` cache.

    Same result as slicing the layer out, calling `append` and writing the layer back, but it writes
    only the new slot of each (example, KV head) and `length`, so a decode step touches O(B K H)
    bytes of the cache per layer instead of copying the layer. `k`, `v`: `[B, 1, K, H]`;
    `positions`: `[B, 1]` (-1: padding, stored but not counted, as `append` does); `layer`: int32
    scalar, may be traced. `state["shared"]` is left alone.
    """
    if k.ndim != 4 or k.shape[1] != 1:
        raise ValueError(f"append_token_in_layer writes one token per example, got k of shape {k.shape}")
    length = jax.lax.dynamic_index_in_dim(cache.length, layer, 0, keepdims=False)  # [B, K]
    new_pos = jnp.broadcast_to(positions[:, :1], length.shape).astype(jnp.int32)
    n_valid = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)  # [B]
    # (layer, slot) of each (example, KV head): the slot `append` writes. Its dynamic_update_slice
    # clamps the start index into the buffer; CLIP mode does the same.
    index = jnp.stack([jnp.broadcast_to(layer, length.shape).astype(jnp.int32), length], axis=-1)  # [B, K, 2]

    def put(buf: Array | None, new: Array) -> Array | None:
        if buf is None:
            return None
        # B and K are batch dimensions of the scatter (no transposes, and a cache sharded over
        # them scatters locally); L and C are indexed; the rest (head_dim) is the written window.
        dims = jax.lax.ScatterDimensionNumbers(
            update_window_dims=tuple(range(2, buf.ndim - 2)),
            inserted_window_dims=(0, 3),
            scatter_dims_to_operand_dims=(0, 3),
            operand_batching_dims=(1, 2),
            scatter_indices_batching_dims=(0, 1),
        )
        return jax.lax.scatter(
            buf, index, new.astype(buf.dtype), dims, indices_are_sorted=True, unique_indices=True,
            mode=jax.lax.GatherScatterMode.CLIP,
        )

    return cache.replace(
        k=put(cache.k, k[:, 0]),
        v=put(cache.v, v[:, 0]),
        pos=put(cache.pos, new_pos),
        length=jax.lax.dynamic_update_index_in_dim(cache.length, length + n_valid[:, None], layer, 0),
        score=put(cache.score, jnp.zeros(length.shape, jnp.float32)),
        attend=put(cache.attend, jnp.ones(length.shape, bool)),
    )


def _slot_dims(ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(window dims of the update / gathered slice, the indexed dims) for one slot per (example, KV head) of
    a stacked `[L, B, K, C, ...]` buffer: B and K are batch dimensions, L and C are indexed."""
    return tuple(range(2, ndim - 2)), (0, 3)


def _slot_index(layer: Array, slot: Array) -> Array:
    """`[B, K, ..., 2]` int32 (layer, slot) pairs addressing a stacked buffer, for `_put_slots` / `_take_slots` /
    `take_slots_in_layer`."""
    return jnp.stack([jnp.broadcast_to(layer, slot.shape).astype(jnp.int32), slot.astype(jnp.int32)], axis=-1)


def _put_slots(buf: Array | None, layer: Array, slot: Array, new: Any) -> Array | None:
    """Writes `new` `[B, K, ...]` at `(layer, slot[b, k])` of `buf`; a slot >= C is dropped."""
    if buf is None:
        return None
    window, indexed = _slot_dims(buf.ndim)
    index = _slot_index(layer, slot)
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=window, inserted_window_dims=indexed, scatter_dims_to_operand_dims=indexed,
        operand_batching_dims=(1, 2), scatter_indices_batching_dims=(0, 1),
    )
    new = jnp.broadcast_to(jnp.asarray(new, buf.dtype), slot.shape + buf.shape[4:])
    return jax.lax.scatter(
        buf, index, new, dims, indices_are_sorted=True, unique_indices=True,
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )


def _take_slots(buf: Array | None, layer: Array, slot: Array) -> Array | None:
    """`buf[layer, b, k, slot[b, k]]` `[B, K, ...]` of a stacked buffer (`slot` within `[0, C)`)."""
    if buf is None:
        return None
    window, indexed = _slot_dims(buf.ndim)
    index = _slot_index(layer, slot)
    dims = jax.lax.GatherDimensionNumbers(
        offset_dims=window, collapsed_slice_dims=indexed, start_index_map=indexed,
        operand_batching_dims=(1, 2), start_indices_batching_dims=(0, 1),
    )
    return jax.lax.gather(
        buf, index, dims, (1, 1, 1, 1, *buf.shape[4:]), indices_are_sorted=True,
        mode=jax.lax.GatherScatterMode.CLIP,
    )


def take_slots_in_layer(cache: KVCache, layer: Array, slots: Array) -> tuple[Array, Array, Array]:
    """`(k, v, pos)` at `slots` `[B, K, W]` (within `[0, C)`) of layer `layer` of a stacked `[L, ...]` cache:
    `[B, K, W, H]` twice and `[B, K, W]`, read straight from the stacked buffers (no copy of the layer)."""
    index = _slot_index(layer, slots)  # [B, K, W, 2]

    def take(buf: Array) -> Array:
        window = tuple(range(3, buf.ndim - 1))  # head_dim, after [B, K, W]
        dims = jax.lax.GatherDimensionNumbers(
            offset_dims=window, collapsed_slice_dims=(0, 3), start_index_map=(0, 3),
            operand_batching_dims=(1, 2), start_indices_batching_dims=(0, 1),
        )
        return jax.lax.gather(buf, index, dims, (1, 1, 1, 1, *buf.shape[4:]), mode=jax.lax.GatherScatterMode.CLIP)

    return take(cache.k), take(cache.v), take(cache.pos)


def evict_in_layer(cache: KVCache, layer: Array, slot: Array, where: Array | None = None) -> KVCache:
    """`evict` of one slot per head (`slot` `[B, K]`) in layer `layer` of a stacked `[L, ...]` cache.

    Same result as slicing the layer out, calling `evict` and writing the layer back, but it writes only
    the evicted slot, the cleared last slot and `length` of each (example, KV head): O(B K H) bytes per
    layer instead of a copy of the layer. `state` is left alone.
    """
    length = jax.lax.dynamic_index_in_dim(cache.length, layer, 0, keepdims=False)  # [B, K]
    last = length - 1
    do = last >= 0
    if where is not None:
        do &= where
    capacity = cache.capacity
    slot = jnp.where(do, jnp.clip(slot, 0, capacity - 1), capacity).astype(jnp.int32)  # capacity: dropped
    last_c = jnp.clip(last, 0, capacity - 1)
    clear = jnp.where(do, last_c, capacity)

    def move(buf: Array | None, empty: Any) -> Array | None:
        if buf is None:
            return None
        out = _put_slots(buf, layer, slot, _take_slots(buf, layer, last_c))
        # When the victim is the last slot itself, the clear comes second and wins, as in `evict`.
        return out if empty is None else _put_slots(out, layer, clear, empty)

    return cache.replace(
        k=move(cache.k, None),
        v=move(cache.v, None),
        pos=move(cache.pos, -1),
        length=jax.lax.dynamic_update_index_in_dim(cache.length, jnp.where(do, last, length), layer, 0),
        score=move(cache.score, 0.0),
        attend=move(cache.attend, True),
    )


def _gather_slots(x: Array | None, index: Array) -> Array | None:
    """Gathers `[B, K, C, ...]` along the slot axis with `index` `[B, K, C']`."""
    if x is None:
        return None
    idx = index.reshape(index.shape + (1,) * (x.ndim - index.ndim))
    return jnp.take_along_axis(x, idx, axis=2)


def compact(cache: KVCache, indices: Array, num_kept: Array | None = None) -> KVCache:
    """Keeps the slots `indices` `[B, K, C']` (valid ones first) in a cache of capacity `C'`.

    The first `num_kept` `[B, K]` entries of each row are the kept slots (all of them when None);
    later entries are ignored and become empty slots. Per-layer (no `[L]` axis).
    """
    new_capacity = indices.shape[-1]
    if num_kept is None:
        num_kept = jnp.full(indices.shape[:-1], new_capacity, jnp.int32)
    num_kept = jnp.minimum(num_kept, cache.length).astype(jnp.int32)
    keep = jnp.arange(new_capacity, dtype=jnp.int32) < num_kept[..., None]
    safe = jnp.where(keep, indices, 0).astype(jnp.int32)
    pos = jnp.where(keep, _gather_slots(cache.pos, safe), -1)
    out = cache.replace(
        k=_gather_slots(cache.k, safe),
        v=_gather_slots(cache.v, safe),
        pos=pos,
        length=num_kept,
        score=_gather_slots(cache.score, safe),
        attend=_gather_slots(cache.attend, safe),
    )
    return out


def keep_where(cache: KVCache, keep: Array, capacity: int) -> KVCache:
    """Keeps the slots where `keep` `[B, K, C]` is True, in slot order, in a cache of `capacity`.

    At most `capacity` slots survive per head (the earliest by slot when more are marked).
    """
    keep = keep & stored_mask(cache)
    slots = jnp.arange(cache.capacity, dtype=jnp.int32)
    # Stable partition: kept slots first, each group in slot order.
    order_key = jnp.where(keep, slots, slots + cache.capacity)
    order = jnp.argsort(order_key, axis=-1)
    if capacity <= cache.capacity:
        order = order[..., :capacity]
    else:
        pad = jnp.zeros((*order.shape[:-1], capacity - cache.capacity), order.dtype)
        order = jnp.concatenate([order, pad], axis=-1)
    num_kept = jnp.minimum(jnp.sum(keep, axis=-1), capacity).astype(jnp.int32)
    return compact(cache, order, num_kept)


def truncate(cache: KVCache, capacity: int) -> KVCache:
    """The first `capacity` slots of every head (lengths clamped); `capacity` may also grow it."""
    if capacity == cache.capacity:
        return cache
    if capacity > cache.capacity:
        return extend(cache, capacity - cache.capacity)
    axis = cache.pos.ndim - 1

    def cut(x: Array | None) -> Array | None:
        return None if x is None else jax.lax.slice_in_dim(x, 0, capacity, axis=axis)

    return cache.replace(
        k=cut(cache.k),
        v=cut(cache.v),
        pos=cut(cache.pos),
        length=jnp.minimum(cache.length, capacity),
        score=cut(cache.score),
        attend=cut(cache.attend),
    )


def evict(cache: KVCache, slot: Array, where: Array | None = None) -> KVCache:
    """Removes one slot per head (`slot` `[B, K]`), moving the last valid slot into its place.

    O(head_dim) writes instead of a compaction, so a decode step that evicts stays cheap. Heads
    where `where` `[B, K]` is False (or whose length is 0) are left alone.
    """
    last = cache.length - 1
    do = last >= 0
    if where is not None:
        do &= where
    slot = jnp.clip(slot, 0, cache.capacity - 1).astype(jnp.int32)
    last_c = jnp.clip(last, 0, cache.capacity - 1)

    def move(x: Array | None, empty: Any) -> Array | None:
        if x is None:
            return None

        def one(row: Array, s: Array, l: Array, d: Array) -> Array:
            # Two single-slot writes that leave the row as it was where `d` is False (never a select
            # over the whole row, which would copy every slot of K / V per step).
            moved = row.at[s].set(jnp.where(d, row[l], row[s]))
            if empty is not None:
                # When the victim is the last slot itself, this clear wins, as it should.
                moved = moved.at[l].set(jnp.where(d, jnp.full_like(row[l], empty), moved[l]))
            return moved

        return jax.vmap(jax.vmap(one))(x, slot, last_c, do)

    return cache.replace(
        k=move(cache.k, None),
        v=move(cache.v, None),
        pos=move(cache.pos, -1),
        length=jnp.where(do, last, cache.length),
        score=move(cache.score, 0.0),
        attend=move(cache.attend, True),
    )


def rerotate(cache: KVCache, delta: Array, inv_freq: Array) -> KVCache:
    """Shifts the RoPE position of stored keys by `delta` (`[B, K, C]` or broadcastable).

    Keys are stored after RoPE, so moving a key from position p to p + delta is one more rotation;
    `pos` keeps the original positions (which tokens were kept), only the keys change.
    """
    delta = jnp.broadcast_to(delta, cache.pos.shape)
    return cache.replace(k=rotate_by(cache.k, delta, inv_freq))


def positions_kept(cache: KVCache) -> list:
    """Host-side helper for tests and reports: sorted kept positions, nested like `[..., B, K]`."""
    import numpy as np

    pos = np.asarray(cache.pos)

    def rows(block: np.ndarray) -> list:
        if block.ndim == 1:
            return sorted(int(p) for p in block if p >= 0)
        return [rows(b) for b in block]

    return rows(pos)
