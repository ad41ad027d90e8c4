"""The compressible KV cache: a fixed-shape pytree and pure functions over it.

Layout of one layer's cache (`KVCache`); a model's cache (`ModelCache`) is one such buffer per decoder layer,
as MaxText's inference path and tpu-inference keep them (a rolled scan over stacked `[L, ...]` arrays makes
XLA copy each layer's slice before reading it):

| field    | shape             | meaning                                                          |
|----------|-------------------|------------------------------------------------------------------|
| `k`, `v` | `[B, K, C, H]`    | keys **after RoPE** and values, storage dtype                    |
| `pos`    | `[B, K, C]` int32 | original absolute position of each slot, -1 for an empty slot    |
| `length` | `[B, K]` int32    | valid slots per KV head; slots `[0, length)` are valid           |
| `score`  | `[B, K, C]` f32   | optional per-slot accumulator (H2O, TOVA, ...), else None        |
| `attend` | `[B, K, C]` bool  | optional per-slot mask a retrieval method writes, else None      |
| `state`  | dict of arrays    | method-specific leaves (per-layer budgets, running statistics)   |

Cross-layer method state (a remaining budget shared by the layers of one step, statistics pooled over
layers) is `ModelCache.shared`, stored once. A method hook sees it as `state["shared"]` (`SHARED_STATE`) of
the layer it is given (`ModelCache.layer`), and the version a layer returns is what the next layer sees.

`k` / `v` hold the model dtype, or a quantized store (`kvjax.quant.QuantizedKV`: codes, scales, KIVI's
full-precision ring) when the cache was made with `quant=` (`kv_dtype=` of `generate`). Every op below moves
quantized values together with their scales; code that reads keys or values for scoring uses `keys(cache)` /
`values(cache)` (the array itself for a model-dtype cache, else the dequantized layer).

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

from kvjax import slots as sl
from kvjax.quant import storage as qs
from kvjax.quant.spec import KVQuant
from kvjax.quant.storage import QuantizedKV
from kvjax.rope import rotate_by

Array = jax.Array

#: Key of `KVCache.state` under which a method hook sees the cross-layer state (see the module docstring).
SHARED_STATE = "shared"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys, values, original positions and per-head lengths; see the module docstring."""

    k: Array | QuantizedKV
    v: Array | QuantizedKV
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
    """A model's cache: one `KVCache` per decoder layer, each in buffers of its own, and the cross-layer
    method state (`shared`, None when the method keeps none). Every path (prefill, decode, shared-prefill
    replay, RAG) reads and writes a layer's buffers where they lie: no stacked copy exists."""

    layers: tuple[KVCache, ...]
    shared: dict[str, Any] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def capacity(self) -> int:
        """The largest layer capacity (a sliding-window layer's ring holds its window only, `kvjax.runtime.step`)."""
        return max(layer.capacity for layer in self.layers)

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    @property
    def nbytes(self) -> int:
        """Bytes held by every array of the cache (what it really costs in memory)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))

    def replace(self, **changes: Any) -> ModelCache:
        return dataclasses.replace(self, **changes)

    def layer(self, index: int) -> KVCache:
        """Layer `index` as a method hook sees it: its own buffers, the shared state as `state["shared"]`."""
        return join_shared(self.layers[index], self.shared)

    def with_layer(self, index: int, cache: KVCache) -> ModelCache:
        """This cache with layer `index` replaced by `cache` (as a hook returned it: its `state["shared"]`,
        if any, becomes the shared state)."""
        one, shared = split_shared(cache)
        layers = list(self.layers)
        layers[index] = one
        return ModelCache(tuple(layers), self.shared if shared is None else shared)

    def map_layers(self, fn: Any) -> ModelCache:
        """`fn` applied to every layer's `KVCache` (the shared state is left alone)."""
        return self.replace(layers=tuple(fn(layer) for layer in self.layers))

    def stacked(self) -> KVCache:
        """A stacked `[L, ...]` copy of the layers, for inspection (tests, reports); never used by the runtime,
        and only for layers of one capacity."""
        return jax.tree.map(lambda *xs: jnp.stack(xs), *self.layers)


def init(
    batch: int,
    kv_heads: int,
    capacity: int,
    head_dim: int,
    dtype: Any = jnp.bfloat16,
    *,
    score: bool = False,
    attend: bool = False,
    state: dict[str, Any] | None = None,
    quant: KVQuant | None = None,
    ring: bool = False,
) -> KVCache:
    """An empty cache of one layer (`quant`: a quantized storage format for K / V, `dtype` then the dtype they
    dequantize to and KIVI's full-precision ring is stored in; `ring`: a sliding-window layer's ring, written by
    `ring_append` only)."""
    if min(batch, kv_heads, capacity, head_dim) <= 0:
        raise ValueError(
            f"cache dimensions must be positive, got batch={batch}, kv_heads={kv_heads}, "
            f"capacity={capacity}, head_dim={head_dim}"
        )
    slots = (batch, kv_heads, capacity)
    if quant is not None:
        k = qs.empty(quant, "k", batch, kv_heads, capacity, head_dim, dtype, ring=ring)
        v = qs.empty(quant, "v", batch, kv_heads, capacity, head_dim, dtype, ring=ring)
    else:
        k = jnp.zeros((*slots, head_dim), dtype)
        v = jnp.zeros((*slots, head_dim), dtype)
    return KVCache(
        k=k,
        v=v,
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


def quantization(cache: KVCache) -> KVQuant | None:
    """The cache's quantized storage format, None for a model-dtype cache."""
    return cache.k.spec if isinstance(cache.k, QuantizedKV) else None


def keys(cache: KVCache, dtype: Any = None) -> Array:
    """The layer's keys `[B, K, C, H]`: `cache.k` itself for a model-dtype cache, else dequantized (into the
    model dtype, or `dtype`). Slots past a head's length hold junk, as in a model-dtype cache."""
    return _plain(cache.k, dtype)


def values(cache: KVCache, dtype: Any = None) -> Array:
    """The layer's values `[B, K, C, H]` (see `keys`)."""
    return _plain(cache.v, dtype)


def _plain(buf: Array | QuantizedKV, dtype: Any) -> Array:
    if isinstance(buf, QuantizedKV):
        return qs.dequantize(buf, buf.dtype if dtype is None else dtype)
    return buf if dtype is None else buf.astype(dtype)


def select_rows(active: Array, new: Any, old: Any) -> Any:
    """`new` on the rows where `active` `[B]` is set, `old` on the others, leaf by leaf (same structures). A leaf
    that is the very same array in both is passed through, and a leaf without the batch axis first (constants such
    as a learned file's weights in the shared state) is taken from `new`."""
    batch = active.shape[0]

    def pick(n: Any, o: Any) -> Any:
        if n is o or n is None or n.ndim == 0 or n.shape[0] != batch or n.shape != o.shape:
            return n
        return jnp.where(active.reshape((batch,) + (1,) * (n.ndim - 1)), n, o)

    return jax.tree.map(pick, new, old, is_leaf=lambda x: x is None)


def with_keys(cache: KVCache, k: Array) -> KVCache:
    """`cache` with new keys `[B, K, C, H]` in its slots (a quantized cache quantizes them; slots whose keys did
    not change keep their codes exactly)."""
    if isinstance(cache.k, QuantizedKV):
        return cache.replace(k=qs.requantize(cache.k, k, cache.length, keep_slots=True))
    return cache.replace(k=k.astype(cache.k.dtype))


def with_values(cache: KVCache, v: Array) -> KVCache:
    """`cache` with new values `[B, K, C, H]` in its slots (as `with_keys`)."""
    if isinstance(cache.v, QuantizedKV):
        return cache.replace(v=qs.requantize(cache.v, v, cache.length, keep_slots=True))
    return cache.replace(v=v.astype(cache.v.dtype))


def dequantized(cache: KVCache) -> KVCache:
    """A model-dtype-free working copy of a quantized layer: K / V dequantized to float32 (exact values of the
    codes, so `requantized` gives the same codes back for slots nothing changed)."""
    if not isinstance(cache.k, QuantizedKV):
        return cache
    return cache.replace(k=qs.dequantize(cache.k), v=qs.dequantize(cache.v))


def requantized(plain: KVCache, like: KVCache) -> KVCache:
    """`plain` (a working copy from `dequantized`, after any op or method hook) stored in `like`'s format; its
    state leaves get back the dtypes `like`'s had. Identity when `like` is a model-dtype cache."""
    if not isinstance(like.k, QuantizedKV):
        return plain
    state = plain.state
    if jax.tree.structure(state) == jax.tree.structure(like.state):
        state = jax.tree.map(lambda new, old: new.astype(old.dtype), state, like.state)
    return plain.replace(
        k=qs.requantize(like.k, plain.k, plain.length, keep_slots=False),
        v=qs.requantize(like.v, plain.v, plain.length, keep_slots=False),
        state=state,
    )


def quantized(cache: KVCache, quant: KVQuant | None) -> KVCache:
    """A model-dtype layer stored in the format `quant` (K / V dequantize back to their dtype); itself when
    `quant` is None or the layer is already quantized."""
    if quant is None or isinstance(cache.k, QuantizedKV):
        return cache
    return cache.replace(k=qs.quantize(quant, "k", cache.k, cache.length, cache.k.dtype),
                         v=qs.quantize(quant, "v", cache.v, cache.length, cache.v.dtype))


def _dense(buf: QuantizedKV, length: Array, fn: Any, *, keep_slots: bool) -> QuantizedKV:
    """A KIVI (or any) store through an op on its float32 values, requantized (see `qs.requantize`)."""
    return qs.requantize(buf, fn(qs.dequantize(buf)), length, keep_slots=keep_slots)


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

    if isinstance(cache.k, QuantizedKV):
        k, v = qs.resize(cache.k, cache.capacity + extra), qs.resize(cache.v, cache.capacity + extra)
    else:
        k, v = pad(cache.k, 0), pad(cache.v, 0)
    return cache.replace(
        k=k,
        v=v,
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
    if isinstance(cache.k, QuantizedKV):
        return _append_quantized(cache, k, v, positions)
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


def _append_quantized(cache: KVCache, k: Array, v: Array, positions: Array) -> KVCache:
    """`append` into quantized K / V: per-token layouts write codes and scales; KIVI appends one token through
    its ring (`append_token`) and a longer chunk through its float32 values, requantized."""
    t = k.shape[1]
    if not cache.k.slotwise and t == 1:
        return append_token(cache, k, v, positions)
    n_valid = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)  # [B]
    new_length = cache.length + n_valid[:, None]
    valid = jnp.broadcast_to((positions >= 0)[:, None, :], (positions.shape[0], cache.num_kv_heads, t))

    def store(buf: QuantizedKV, x: Array) -> QuantizedKV:
        x = jnp.swapaxes(x, 1, 2)  # [B, K, T, H]
        if buf.slotwise:
            return qs.append_rows(buf, x, cache.length, valid)
        return _dense(buf, new_length, lambda old: sl.write_rows(old, cache.length, x.astype(jnp.float32)),
                      keep_slots=True)

    plain = KVCache(k=jnp.zeros((), jnp.float32), v=jnp.zeros((), jnp.float32), pos=cache.pos, length=cache.length,
                    score=cache.score, attend=cache.attend, state=cache.state)
    out = _append_fields(plain, positions, n_valid)
    return out.replace(k=store(cache.k, k), v=store(cache.v, v))


def _append_fields(cache: KVCache, positions: Array, n_valid: Array) -> KVCache:
    """`append`'s writes of everything but K / V (positions, length, score, attend)."""
    num_heads = cache.pos.shape[1]
    new_pos = jnp.broadcast_to(positions[:, None, :], (positions.shape[0], num_heads, positions.shape[1]))
    out = cache.replace(pos=sl.write_rows(cache.pos, cache.length, new_pos.astype(jnp.int32)),
                        length=cache.length + n_valid[:, None])
    if cache.score is not None:
        out = out.replace(score=sl.write_rows(cache.score, cache.length, jnp.zeros(new_pos.shape, jnp.float32)))
    if cache.attend is not None:
        out = out.replace(attend=sl.write_rows(cache.attend, cache.length, jnp.ones(new_pos.shape, bool)))
    return out


def append_token(cache: KVCache, k: Array, v: Array, positions: Array) -> KVCache:
    """`append` of one token per example, written as a scatter of one slot per (example, KV head).

    Same result as `append`; a decode step touches O(B K H) bytes of the layer's buffers (written in place
    inside the decode loop) and B / K stay batch dimensions, so a cache sharded over them scatters locally.
    `k`, `v`: `[B, 1, K, H]`; `positions`: `[B, 1]` (-1: padding, stored but not counted, as `append` does).
    """
    if k.ndim != 4 or k.shape[1] != 1:
        raise ValueError(f"append_token writes one token per example, got k of shape {k.shape}")
    new_pos = jnp.broadcast_to(positions[:, :1], cache.length.shape).astype(jnp.int32)
    n_valid = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)  # [B]
    # `append`'s dynamic_update_slice clamps the start index into the buffer; CLIP mode does the same.
    slot = jnp.clip(cache.length, 0, cache.capacity - 1)
    if isinstance(cache.k, QuantizedKV):
        counted = jnp.broadcast_to((positions[:, :1] >= 0), cache.length.shape)
        new_k = qs.write_token(cache.k, slot, k[:, 0], cache.length, counted)
        new_v = qs.write_token(cache.v, slot, v[:, 0], cache.length, counted)
    else:
        new_k, new_v = sl.put_slots(cache.k, slot, k[:, 0]), sl.put_slots(cache.v, slot, v[:, 0])
    return cache.replace(
        k=new_k,
        v=new_v,
        pos=sl.put_slots(cache.pos, slot, new_pos),
        length=cache.length + n_valid[:, None],
        score=sl.put_slots(cache.score, slot, 0.0),
        attend=sl.put_slots(cache.attend, slot, True),
    )


def ring_append(cache: KVCache, k: Array, v: Array, positions: Array) -> KVCache:
    """Writes tokens into a sliding-window layer's ring: the token at position `p` goes to slot `p % C` (`C` the
    capacity: the window, or less when the sequence never outgrows it), where it replaces position `p - C`, which no
    later query can see. Decode writes one token in place; a prefill chunk writes only the last `C` positions of each
    row (the earlier ones would be overwritten by the same chunk). `pos` keeps every slot's position, so the window
    mask stays exact.

    `k`, `v`: `[B, T, K, H]`; `positions`: `[B, T]` (-1 = padding, at the end of a row). Each row's positions run on
    from 0 without gaps, so until a ring fills its slots `[0, length)` hold positions `0 .. length - 1` (the packed
    layout every other op reads), and a full ring has every slot valid.

    A quantized ring (`init(..., quant=, ring=True)`) stores the tokens in its format (`kvjax.quant.storage.
    ring_write`: codes and scales slot by slot; KIVI through its full-precision ring and group flushes).
    """
    capacity = cache.capacity
    batch, t = positions.shape
    last = jnp.max(positions, axis=1, keepdims=True)
    written = (positions >= 0) & (positions > last - capacity)
    slot = jnp.where(written, positions % capacity, capacity)  # `capacity`: dropped by the scatter
    slots = jnp.broadcast_to(slot[:, None, :], (batch, cache.num_kv_heads, t))
    new_pos = jnp.broadcast_to(positions[:, None, :], slots.shape)
    n_valid = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, H]
    if isinstance(cache.k, QuantizedKV):
        new_k, new_v = qs.ring_write(cache.k, k, slots, new_pos), qs.ring_write(cache.v, v, slots, new_pos)
    else:
        new_k, new_v = sl.scatter_rows(cache.k, slots, k), sl.scatter_rows(cache.v, slots, v)
    return cache.replace(
        k=new_k,
        v=new_v,
        pos=sl.scatter_rows(cache.pos, slots, new_pos),
        length=jnp.minimum(cache.length + n_valid[:, None], capacity),
        score=sl.scatter_rows(cache.score, slots, 0.0),
        attend=sl.scatter_rows(cache.attend, slots, True),
    )


def take_slots(buf: Array | QuantizedKV, slots: Array) -> Array:
    """`buf[b, k, slots[b, k, ...]]` of a `[B, K, C, ...]` buffer: `slots` `[B, K, *S]` within `[0, C)` gives
    `[B, K, *S, ...]`, read straight from the buffer (B and K are batch dimensions of the gather). A quantized
    store gives its dequantized values (in its model dtype), reading only those slots' codes and scales."""
    if isinstance(buf, QuantizedKV):
        return qs.take(buf, slots).astype(buf.dtype)
    return sl.take_slots(buf, slots)


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
    pos = jnp.where(keep, sl.gather_slots(cache.pos, safe), -1)
    if isinstance(cache.k, QuantizedKV):
        k, v = (_gather_quantized(buf, safe, num_kept) for buf in (cache.k, cache.v))
    else:
        k, v = sl.gather_slots(cache.k, safe), sl.gather_slots(cache.v, safe)
    out = cache.replace(
        k=k,
        v=v,
        pos=pos,
        length=num_kept,
        score=sl.gather_slots(cache.score, safe),
        attend=sl.gather_slots(cache.attend, safe),
    )
    return out


def _gather_quantized(buf: QuantizedKV, index: Array, length: Array) -> QuantizedKV:
    """`compact` of a quantized store: per-token layouts gather codes and scales; KIVI regroups (requantizes)."""
    if buf.slotwise:
        return qs.map_slots(buf, lambda x: sl.gather_slots(x, index))
    return _dense(buf, length, lambda x: sl.gather_slots(x, index), keep_slots=False)


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

    if isinstance(cache.k, QuantizedKV):
        k, v = qs.resize(cache.k, capacity), qs.resize(cache.v, capacity)
    else:
        k, v = cut(cache.k), cut(cache.v)
    return cache.replace(
        k=k,
        v=v,
        pos=cut(cache.pos),
        length=jnp.minimum(cache.length, capacity),
        score=cut(cache.score),
        attend=cut(cache.attend),
    )


def evict(cache: KVCache, slot: Array, where: Array | None = None) -> KVCache:
    """Removes one slot per head (`slot` `[B, K]`), moving the last valid slot into its place.

    It writes only the evicted slot, the cleared last slot and `length` of each (example, KV head): O(B K H)
    bytes instead of a compaction, so a decode step that evicts stays cheap and in place. Heads where
    `where` `[B, K]` is False (or whose length is 0) are left alone.
    """
    last = cache.length - 1
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
        out = sl.put_slots(buf, slot, take_slots(buf, last_c))
        # When the victim is the last slot itself, the clear comes second and wins.
        return out if empty is None else sl.put_slots(out, clear, empty)

    length = jnp.where(do, last, cache.length)

    def move_kv(buf: Array | QuantizedKV) -> Array | QuantizedKV:
        if not isinstance(buf, QuantizedKV):
            return move(buf, None)
        if buf.slotwise:  # codes and scales move with their slot
            return qs.map_slots(buf, lambda x: move(x, None))
        return _dense(buf, length, lambda x: move(x, None), keep_slots=True)

    return cache.replace(
        k=move_kv(cache.k),
        v=move_kv(cache.v),
        pos=move(cache.pos, -1),
        length=length,
        score=move(cache.score, 0.0),
        attend=move(cache.attend, True),
    )


def rerotate(cache: KVCache, delta: Array, inv_freq: Array) -> KVCache:
    """Shifts the RoPE position of stored keys by `delta` (`[B, K, C]` or broadcastable).

    Keys are stored after RoPE, so moving a key from position p to p + delta is one more rotation;
    `pos` keeps the original positions (which tokens were kept), only the keys change.
    """
    delta = jnp.broadcast_to(delta, cache.pos.shape)
    if isinstance(cache.k, QuantizedKV):  # rotated keys are requantized; unmoved ones keep their codes
        return cache.replace(k=_dense(cache.k, cache.length, lambda k: rotate_by(k, delta, inv_freq), keep_slots=True))
    return cache.replace(k=rotate_by(cache.k, delta, inv_freq))


def positions_kept(cache: KVCache | ModelCache) -> list:
    """Host-side helper for tests and reports: sorted kept positions, nested like `[..., B, K]` (`[L, B, K]` for
    a `ModelCache`)."""
    import numpy as np

    if isinstance(cache, ModelCache):
        return [positions_kept(layer) for layer in cache.layers]
    pos = np.asarray(cache.pos)

    def rows(block: np.ndarray) -> list:
        if block.ndim == 1:
            return sorted(int(p) for p in block if p >= 0)
        return [rows(b) for b in block]

    return rows(pos)
