"""`QuantizedKV`: one layer's keys or values in a quantized format (`KVQuant`), a pytree under `KVCache.k` / `.v`.

Every leaf is `[B, K, ...]` (batch, KV heads first, like the rest of the cache, so sharding and per-head ops treat
them alike):

| leaf       | shape                                     | meaning                                                |
|------------|-------------------------------------------|--------------------------------------------------------|
| `data`     | `[B, K, C, H * bits / 8]`                 | codes: int8, float8 e4m3, or uint8 holding 2 / 4 codes |
| `scale`    | per token `[B, K, C, H / channels]`       | bfloat16; fp8: float32 `[B, K]` (per head); KIVI keys: |
|            |                                           | `[B, K, ceil(C / G), H]` (per channel and slot group)  |
| `zero`     | like `scale`, asymmetric schemes only     | bfloat16 minimum of the group                          |
| `residual` | `[B, K, R + 1, H]`, KIVI only             | the full-precision ring, in the model dtype            |
| `qlen`     | `[B, K]` int32, KIVI only                 | slots below it are codes; `[qlen, length)` are in the  |
|            |                                           | ring, at row `slot % (R + 1)`                          |

| `top`      | `[B, K]` int32, KIVI on a ring only       | positions written so far (`ring_write`)                |

A sliding-window layer's ring (`kvjax.cache.ring_append`: position `p` at slot `p % C`) stores per-token layouts
slot by slot, as any cache. KIVI on a ring counts in positions instead of slots: `qlen` is the first position not
yet quantized (a multiple of `G`), the positions `[qlen, top)` are in the full-precision ring at row `p % (R + 1)`,
and key groups are position groups `[j G, (j + 1) G)` whose (scale, zero) sit at entry `j % (ceil(C / G) + 1)`
(enough entries for every group a window of `C` positions touches). A group is flushed once complete, as on a
linear cache: its codes go to its positions' slots, which by then hold nothing older that is still visible.

KIVI's slot groups are fixed ranges `[j G, (j + 1) G)`. Tokens enter the ring; once more than `R` are pending,
the group holding slot `qlen` is quantized from its codes and ring rows and `qlen` moves to its end (a flush).
Operations that move tokens between slots of a KIVI layer requantize it whole (`quantize` with the old `qlen` as
a hint); per-token layouts (int8, fp8, int4) move codes and scales slot by slot, exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import slots as sl
from kvjax.quant import codes
from kvjax.quant.spec import KVQuant

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """Keys (`role="k"`) or values (`role="v"`) of one layer in the format `spec`; see the module docstring.
    `shape` / `dtype` are the logical ones (`[B, K, C, H]`, the model dtype `dequantize` returns)."""

    data: Array
    scale: Array
    zero: Array | None = None
    residual: Array | None = None
    qlen: Array | None = None
    top: Array | None = None
    spec: KVQuant = dataclasses.field(default=None, metadata=dict(static=True))
    role: str = dataclasses.field(default="k", metadata=dict(static=True))
    dtype_name: str = dataclasses.field(default="float32", metadata=dict(static=True))
    head_dim: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (*self.data.shape[:3], self.head_dim)

    @property
    def ndim(self) -> int:
        return 4

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype_name)

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    @property
    def key_groups(self) -> bool:
        """KIVI keys: scales per channel over groups of slots (not per slot)."""
        return self.spec.kivi and self.role == "k"

    @property
    def wraps(self) -> bool:
        """KIVI on a sliding-window ring: groups and the residual follow positions (`top`), not slots."""
        return self.top is not None

    @property
    def slotwise(self) -> bool:
        """Every per-slot leaf moves with its slot (no ring, no slot groups): int8, fp8, int4."""
        return not self.spec.kivi

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))

    def replace(self, **changes) -> QuantizedKV:
        return dataclasses.replace(self, **changes)


def is_quantized(x: object) -> bool:
    return isinstance(x, QuantizedKV)


def _code_dtype(spec: KVQuant) -> jnp.dtype:
    if spec.scheme == "int8":
        return jnp.dtype(jnp.int8)
    if spec.scheme == "fp8":
        return jnp.dtype(codes.FP8_DTYPE)
    return jnp.dtype(jnp.uint8)


def _groups(capacity: int, group: int) -> int:
    return -(-capacity // group)


def ring_groups(spec: KVQuant, capacity: int) -> int:
    """KIVI on a ring of `capacity` slots: key (scale, zero) entries, one per position group a window touches."""
    return _groups(capacity, spec.group_size) + 1


def empty(spec: KVQuant, role: str, batch: int, kv_heads: int, capacity: int, head_dim: int,
          dtype: jnp.dtype, *, ring: bool = False) -> QuantizedKV:
    """An all-zero store (dequantizes to zeros; fp8's per-head scale 0 means "not set yet"). `ring`: the store of
    a sliding-window layer's ring (`ring_write`; only KIVI's layout differs)."""
    spec.check_head_dim(head_dim)
    heads = (batch, kv_heads)
    data = jnp.zeros((*heads, capacity, head_dim * spec.bits // 8), _code_dtype(spec))
    wraps = ring and spec.kivi
    if spec.per_head_scale:
        scale = jnp.zeros(heads, jnp.float32)
    elif spec.kivi and role == "k":
        groups = ring_groups(spec, capacity) if wraps else _groups(capacity, spec.group_size)
        scale = jnp.zeros((*heads, groups, head_dim), codes.SCALE_DTYPE)
    else:
        scale = jnp.zeros((*heads, capacity, head_dim // spec.channels(head_dim)), codes.SCALE_DTYPE)
    zero = jnp.zeros_like(scale) if spec.scheme in ("int4", "kivi2", "kivi4") else None
    residual = jnp.zeros((*heads, spec.ring, head_dim), dtype) if spec.kivi else None
    qlen = jnp.zeros(heads, jnp.int32) if spec.kivi else None
    top = jnp.zeros(heads, jnp.int32) if wraps else None
    return QuantizedKV(data, scale, zero, residual, qlen, top, spec=spec, role=role,
                       dtype_name=jnp.dtype(dtype).name, head_dim=head_dim)


# ---- per-token codes (int8, fp8, int4, KIVI values) ---------------------------------------------------------

def _token_codes(spec: KVQuant, x: Array, fp8_scale: Array | None = None) -> tuple[Array, Array | None, Array | None]:
    """(data, scale, zero) of tokens `x` `[B, K, ..., H]` in a per-token layout; fp8 takes its `[B, K]` scale."""
    channels = spec.channels(x.shape[-1])
    if spec.scheme == "int8":
        q, scale = codes.symmetric(x, channels)
        return q, scale, None
    if spec.scheme == "fp8":
        s = fp8_scale.reshape(fp8_scale.shape + (1,) * (x.ndim - 2))
        return codes.fp8_codes(x, s), None, None
    q, scale, zero = codes.asymmetric(x, channels, spec.bits)
    return codes.pack(q, spec.bits), scale, zero


def _token_values(qa: QuantizedKV, data: Array, scale: Array, zero: Array | None) -> Array:
    """float32 values of per-token codes `data` `[B, K, ..., Hp]` with their per-token scales (fp8: `[B, K]`)."""
    spec = qa.spec
    if spec.scheme == "int8":
        return codes.symmetric_dequantize(data, scale)
    if spec.scheme == "fp8":
        return codes.fp8_dequantize(data, scale.reshape(scale.shape + (1,) * (data.ndim - 2)))
    return codes.asymmetric_dequantize(codes.unpack(data, spec.bits), scale, zero)


def _fp8_amax(x: Array, valid: Array) -> Array:
    """`[B, K]` largest magnitude of `x` `[B, K, T, H]` over the rows where `valid` `[B, K, T]`."""
    return jnp.max(jnp.where(valid[..., None], jnp.abs(codes.widen(x)), 0.0), axis=(2, 3))


def _fp8_first_scale(old: Array, x: Array, valid: Array) -> Array:
    """The per-head scale after writing `x`: the one already set, else one from `x`'s valid rows."""
    return jnp.where(old > 0, old, codes.fp8_scale(_fp8_amax(x, valid)))


# ---- whole-layer quantize / dequantize -----------------------------------------------------------------------

def _kivi_qlen(spec: KVQuant, length: Array, hint: Array | None) -> Array:
    """Quantized slots of a KIVI head: the hint, moved into `[ceil_G(length - R), length]` (at most `R` pending)."""
    group = spec.group_size
    pending = jnp.maximum(length - spec.residual, 0)
    low = -(-pending // group) * group
    hint = jnp.zeros_like(length) if hint is None else hint
    return jnp.clip(hint, low, length).astype(jnp.int32)


def _ring_slots(qlen: Array, ring: int) -> Array:
    """`[B, K, R + 1]`: the slot each ring row holds (`slot % ring == row`, `slot` in `[qlen, qlen + ring)`)."""
    rows = jnp.arange(ring, dtype=jnp.int32)
    return qlen[..., None] + jnp.mod(rows - qlen[..., None], ring)


def _key_group_codes(spec: KVQuant, x: Array, valid: Array) -> tuple[Array, Array, Array]:
    """KIVI keys: per-channel (scale, zero) `[B, K, n, H]` over slot groups of `x` `[B, K, n * G, H]` from its rows
    where `valid` `[B, K, n * G]`, and the unpacked codes `[B, K, n * G, H]`."""
    b, kv, c, h = x.shape
    g = codes.widen(x.reshape(b, kv, c // spec.group_size, spec.group_size, h))
    ok = valid.reshape(b, kv, c // spec.group_size, spec.group_size)[..., None]
    seen = jnp.any(ok, axis=3)
    lo = jnp.where(seen, jnp.min(jnp.where(ok, g, jnp.inf), axis=3), 0.0)
    hi = jnp.where(seen, jnp.max(jnp.where(ok, g, -jnp.inf), axis=3), 0.0)
    scale, zero = codes.asymmetric_stats(lo, hi, spec.bits)
    q = codes.asymmetric_codes(g, scale[:, :, :, None], zero[:, :, :, None], spec.bits)
    return q.reshape(x.shape), scale, zero


def quantize(spec: KVQuant, role: str, x: Array, length: Array, dtype: jnp.dtype, *, qlen_hint: Array | None = None,
             scale_hint: Array | None = None) -> QuantizedKV:
    """The store of a whole layer's keys / values `x` `[B, K, C, H]` (float32 or the model dtype) holding
    `length` `[B, K]` valid slots. `scale_hint` (fp8): the scale already in use, grown if `x` needs more room
    (by a power of two: the old codes shift exactly). `qlen_hint` (KIVI): keep this many slots quantized where
    the residual bound allows (an op that did not move slots keeps its groups; `requantize` keeps their codes)."""
    b, kv, c, h = x.shape
    spec.check_head_dim(h)
    meta = dict(spec=spec, role=role, dtype_name=jnp.dtype(dtype).name, head_dim=h)
    valid = jnp.arange(c, dtype=jnp.int32) < length[..., None]
    if not spec.kivi:
        fp8 = None
        if spec.per_head_scale:
            fp8 = codes.fp8_scale(_fp8_amax(x, valid))
            if scale_hint is not None:
                fp8 = jnp.where(scale_hint > 0, jnp.maximum(scale_hint, fp8), fp8)
        data, scale, zero = _token_codes(spec, x, fp8)
        return QuantizedKV(data, fp8 if scale is None else scale, zero, **meta)
    qlen = _kivi_qlen(spec, length, qlen_hint)
    quantized = jnp.arange(c, dtype=jnp.int32) < qlen[..., None]
    if role == "k":
        group = spec.group_size
        padded = _groups(c, group) * group
        xp = sl.pad_slots(x, padded - c)  # widened by _key_group_codes
        q, scale, zero = _key_group_codes(spec, xp, sl.pad_slots(quantized, padded - c, False))
        data = codes.pack(q[:, :, :c], spec.bits)
    else:
        data, scale, zero = _token_codes(spec, x)
    ring_slots = _ring_slots(qlen, spec.ring)
    rows = sl.take_slots(x, jnp.minimum(ring_slots, c - 1))
    residual = jnp.where((ring_slots < c)[..., None], rows, 0).astype(dtype)
    return QuantizedKV(data, scale, zero, residual, qlen, **meta)


def _per_head(x: Array, ndim: int) -> Array:
    """A `[B, K]` array broadcastable against `[B, K, *S]` of `ndim` dimensions."""
    return x.reshape(x.shape + (1,) * (ndim - 2))


def _slot_positions(qa: QuantizedKV, slots: Array) -> Array:
    """KIVI on a ring: the newest position written at each of `slots` `[B, K, *S]` (negative: none yet)."""
    last = _per_head(qa.top, slots.ndim) - 1
    return last - jnp.mod(last - slots, qa.capacity)


def _ring_overlay(qa: QuantizedKV, values: Array, slots: Array) -> Array:
    """`values` `[B, K, *S, H]` of `slots` `[B, K, *S]`, with the slots at or past `qlen` read from the ring (on a
    sliding-window ring: the slots holding positions at or past `qlen`)."""
    index = jnp.maximum(_slot_positions(qa, slots), 0) if qa.wraps else slots
    ring = sl.take_slots(qa.residual, jnp.mod(index, qa.spec.ring)).astype(jnp.float32)
    return jnp.where((index >= _per_head(qa.qlen, slots.ndim))[..., None], ring, values)


def _key_group_index(qa: QuantizedKV, slots: Array) -> Array:
    """The key (scale, zero) entry of each of `slots`: its slot group, or on a ring its position group's entry."""
    if qa.wraps:
        positions = jnp.maximum(_slot_positions(qa, slots), 0)
        return jnp.mod(positions // qa.spec.group_size, qa.scale.shape[2])
    return slots // qa.spec.group_size


def take(qa: QuantizedKV, slots: Array) -> Array:
    """float32 values `[B, K, *S, H]` of `slots` `[B, K, *S]` (within `[0, C)`), dequantized from what they read."""
    data = sl.take_slots(qa.data, slots)
    if qa.key_groups:
        group = _key_group_index(qa, slots)
        scale, zero = sl.take_slots(qa.scale, group), sl.take_slots(qa.zero, group)
        values = codes.asymmetric_dequantize(codes.unpack(data, qa.spec.bits), scale, zero)
    elif qa.spec.per_head_scale:
        values = _token_values(qa, data, qa.scale, None)
    else:
        zero = None if qa.zero is None else sl.take_slots(qa.zero, slots)
        values = _token_values(qa, data, sl.take_slots(qa.scale, slots), zero)
    return _ring_overlay(qa, values, slots) if qa.spec.kivi else values


def dequantize(qa: QuantizedKV, dtype: jnp.dtype | None = None) -> Array:
    """The layer's values `[B, K, C, H]` (float32 unless `dtype`); slots past each head's length hold junk."""
    c = qa.capacity
    if qa.wraps:
        values = take(qa, jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), qa.data.shape[:3]))
        return values if dtype is None else values.astype(dtype)
    if qa.key_groups:
        group = qa.spec.group_size
        per_slot = lambda s: jnp.repeat(s, group, axis=2)[:, :, :c]  # noqa: E731
        values = codes.asymmetric_dequantize(codes.unpack(qa.data, qa.spec.bits), per_slot(qa.scale),
                                             per_slot(qa.zero))
    else:
        values = _token_values(qa, qa.data, qa.scale, qa.zero)
    if qa.spec.kivi:
        slots = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), qa.data.shape[:3])
        values = _ring_overlay(qa, values, slots)
    return values if dtype is None else values.astype(dtype)


# ---- slot-preserving ops ---------------------------------------------------------------------------------------

def map_slots(qa: QuantizedKV, fn) -> QuantizedKV:
    """`fn` applied to every per-slot leaf of a per-token layout (codes, per-token scales and zeros); fp8's
    per-head scale stays. Only for `slotwise` stores."""
    per_slot = not qa.spec.per_head_scale
    return qa.replace(
        data=fn(qa.data),
        scale=fn(qa.scale) if per_slot else qa.scale,
        zero=None if qa.zero is None else fn(qa.zero),
    )


def resize(qa: QuantizedKV, capacity: int) -> QuantizedKV:
    """The store with `capacity` slots: new ones empty, cut ones dropped (exact for every layout)."""
    c = qa.capacity
    if capacity == c:
        return qa

    def fit(x: Array | None, size: int) -> Array | None:
        if x is None:
            return None
        return sl.pad_slots(x, size - x.shape[2]) if size > x.shape[2] else sl.cut_slots(x, size)

    if qa.slotwise:
        return map_slots(qa, lambda x: fit(x, capacity))
    groups = _groups(capacity, qa.spec.group_size) if qa.key_groups else capacity
    return qa.replace(data=fit(qa.data, capacity), scale=fit(qa.scale, groups), zero=fit(qa.zero, groups),
                      qlen=jnp.minimum(qa.qlen, capacity))


def append_rows(qa: QuantizedKV, x: Array, start: Array, valid: Array) -> QuantizedKV:
    """Per-token layouts: tokens `x` `[B, K, T, H]` written from slot `start` `[B, K]` (`valid` `[B, K, T]`: the
    rows that count, for fp8's first scale)."""
    fp8 = _fp8_first_scale(qa.scale, x, valid) if qa.spec.per_head_scale else None
    data, scale, zero = _token_codes(qa.spec, x, fp8)
    out = qa.replace(data=sl.write_rows(qa.data, start, data))
    if fp8 is not None:
        return out.replace(scale=fp8)
    return out.replace(scale=sl.write_rows(qa.scale, start, scale),
                       zero=None if zero is None else sl.write_rows(qa.zero, start, zero))


def write_token(qa: QuantizedKV, slot: Array, x: Array, length: Array, counted: Array) -> QuantizedKV:
    """One token per head `x` `[B, K, H]` at `slot` `[B, K]` (= the head's `length`, clipped into the buffer).

    Per-token layouts write its codes and scales into the slot. KIVI writes it into the ring and, when more than
    `residual` tokens are then pending (`counted` `[B, K]`: the token counts towards the length), flushes the
    group at `qlen`: its rows (codes and ring) are quantized together and `qlen` moves to the group's end."""
    if qa.slotwise:
        fp8 = _fp8_first_scale(qa.scale, x[:, :, None], counted[..., None]) if qa.spec.per_head_scale else None
        data, scale, zero = _token_codes(qa.spec, x, fp8)
        out = qa.replace(data=sl.put_slots(qa.data, slot, data))
        if fp8 is not None:
            return out.replace(scale=fp8)
        return out.replace(scale=sl.put_slots(qa.scale, slot, scale), zero=sl.put_slots(qa.zero, slot, zero))
    spec = qa.spec
    ring = sl.put_slots(qa.residual, jnp.mod(slot, spec.ring), x.astype(qa.residual.dtype))  # the slot's ring row
    qa = qa.replace(residual=ring)
    if qa.capacity <= spec.residual:  # never more than `residual` tokens: nothing is ever flushed
        return qa
    new_length = length + counted.astype(jnp.int32)
    flush = new_length - qa.qlen > spec.residual
    group = spec.group_size
    start = (qa.qlen // group) * group
    rows = take(qa, jnp.minimum(start[..., None] + jnp.arange(group, dtype=jnp.int32), qa.capacity - 1))
    if qa.key_groups:
        every = jnp.ones(rows.shape[:3], bool)
        q, scale, zero = _key_group_codes(spec, rows, every)  # one group: scale / zero [B, K, 1, H]
        index = jnp.where(flush, qa.qlen // group, qa.scale.shape[2])  # past the end: dropped
        out = qa.replace(scale=sl.put_slots(qa.scale, index, scale[:, :, 0]),
                         zero=sl.put_slots(qa.zero, index, zero[:, :, 0]))
        data = codes.pack(q, spec.bits)
    else:
        data, scale, zero = _token_codes(spec, rows)
        out = qa.replace(scale=sl.write_rows(qa.scale, start, scale, flush),
                         zero=sl.write_rows(qa.zero, start, zero, flush))
    return out.replace(data=sl.write_rows(qa.data, start, data, flush),
                       qlen=jnp.where(flush, start + group, qa.qlen).astype(jnp.int32))


def requantize(qa: QuantizedKV, x: Array, length: Array, *, keep_slots: bool) -> QuantizedKV:
    """`quantize` of new values `x` for the layout of `qa`: its fp8 scale carried, with `keep_slots` (the op
    left every slot where it was) KIVI's quantized prefix kept, and `qa`'s own codes wherever `x` still holds
    exactly what they dequantize to (`_keep_unchanged`)."""
    out = quantize(qa.spec, qa.role, x, length, qa.dtype, qlen_hint=qa.qlen if keep_slots else None,
                   scale_hint=qa.scale if qa.spec.per_head_scale else None)
    if qa.spec.per_head_scale or qa.wraps or x.shape[2] != qa.capacity:  # (a new capacity: slots were moved)
        return out
    return _keep_unchanged(qa, out, x)


def _keep_unchanged(old: QuantizedKV, new: QuantizedKV, x: Array) -> QuantizedKV:
    """`new` (quantized from `x`) with `old`'s codes, scales and zeros for the slots (KIVI keys: the slot groups)
    where `x` equals `old`'s dequantized values. Quantizing dequantized values is not the identity for the
    asymmetric formats: a bfloat16 zero rounded away from the minimum by more than a step leaves the group's codes
    short of the full range, and its dequantized values have another (scale, zero). Without this, every chunk of a
    prefill (and every KIVI eviction) would move the values of slots nothing touched, further each time."""
    c = old.capacity
    slots = jnp.arange(c, dtype=jnp.int32)
    same = jnp.all(x.astype(jnp.float32) == dequantize(old), axis=-1)  # [B, K, C]
    if old.spec.kivi:
        same &= slots < old.qlen[..., None]  # old codes hold only the quantized slots
    if old.key_groups:  # a group is kept when every slot it quantizes in `new` is
        group = old.spec.group_size
        fine = sl.pad_slots(same | (slots >= new.qlen[..., None]), _groups(c, group) * group - c, True)
        keep = jnp.all(fine.reshape(*fine.shape[:2], -1, group), axis=-1)  # [B, K, groups]
        per_slot = jnp.repeat(keep, group, axis=2)[:, :, :c]
        return new.replace(data=jnp.where(per_slot[..., None], old.data, new.data),
                           scale=jnp.where(keep[..., None], old.scale, new.scale),
                           zero=jnp.where(keep[..., None], old.zero, new.zero))
    pick = lambda a, b: None if a is None else jnp.where(same[..., None], a, b)  # noqa: E731
    return new.replace(data=pick(old.data, new.data), scale=pick(old.scale, new.scale), zero=pick(old.zero, new.zero))


# ---- sliding-window rings --------------------------------------------------------------------------------------

def ring_write(qa: QuantizedKV, x: Array, slots: Array, positions: Array) -> QuantizedKV:
    """Tokens `x` `[B, K, T, H]` of a ring's chunk (`kvjax.cache.ring_append`): `slots` `[B, K, T]` where each goes
    (>= C: not written), `positions` `[B, K, T]` (-1: padding). Positions run on from the ring's last one.

    Per-token layouts write codes and scales into the slots (fp8 sets its scale from the first written rows). KIVI
    writes the chunk's newest tokens into the full-precision ring and flushes every group that is then complete
    and more than `residual` positions old, as the linear layout does token by token (`write_token`)."""
    if qa.slotwise:
        written = slots < qa.capacity
        fp8 = _fp8_first_scale(qa.scale, x, written) if qa.spec.per_head_scale else None
        data, scale, zero = _token_codes(qa.spec, x, fp8)
        out = qa.replace(data=sl.scatter_rows(qa.data, slots, data))
        if fp8 is not None:
            return out.replace(scale=fp8)
        return out.replace(scale=sl.scatter_rows(qa.scale, slots, scale), zero=sl.scatter_rows(qa.zero, slots, zero))
    return _kivi_ring_write(qa, x, positions)


def _kivi_ring_write(qa: QuantizedKV, x: Array, positions: Array) -> QuantizedKV:
    spec, c, t = qa.spec, qa.capacity, x.shape[2]
    group, ring = spec.group_size, spec.ring
    top = qa.top
    new_top = top + jnp.sum(positions >= 0, axis=-1, dtype=jnp.int32)
    pending = new_top - qa.qlen
    new_qlen = qa.qlen + group * (-(-jnp.maximum(pending - spec.residual, 0) // group))
    # Groups to flush: from `qlen` (or the oldest group the window still sees) up to `new_qlen`; a chunk of T
    # tokens completes at most ceil(T / G) of them (at most `residual` positions were pending before it).
    flushes = min(-(-t // group), _groups(c + group - 1, group))
    first = jnp.maximum(qa.qlen, ((new_top - c) // group) * group)
    starts = first[..., None] + group * jnp.arange(flushes, dtype=jnp.int32)  # [B, K, F]
    active = starts < new_qlen[..., None]
    group_pos = (starts[..., None] + jnp.arange(group, dtype=jnp.int32)).reshape(*starts.shape[:2], -1)  # [B,K,F*G]
    from_chunk = sl.take_slots(x, jnp.clip(group_pos - top[..., None], 0, t - 1))
    from_ring = sl.take_slots(qa.residual, jnp.mod(group_pos, ring))
    rows = jnp.where((group_pos >= top[..., None])[..., None], from_chunk.astype(jnp.float32),
                     from_ring.astype(jnp.float32))
    live = jnp.repeat(active, group, axis=2) & (group_pos >= new_top[..., None] - c)
    code_slots = jnp.where(live, jnp.mod(group_pos, c), c)
    if qa.key_groups:
        q, scale, zero = _key_group_codes(spec, rows, jnp.ones(rows.shape[:3], bool))  # scale [B, K, F, H]
        entries = qa.scale.shape[2]
        index = jnp.where(active, jnp.mod(starts // group, entries), entries)
        out = qa.replace(data=sl.scatter_rows(qa.data, code_slots, codes.pack(q, spec.bits)),
                         scale=sl.scatter_rows(qa.scale, index, scale), zero=sl.scatter_rows(qa.zero, index, zero))
    else:
        data, scale, zero = _token_codes(spec, rows)
        out = qa.replace(data=sl.scatter_rows(qa.data, code_slots, data),
                         scale=sl.scatter_rows(qa.scale, code_slots, scale),
                         zero=sl.scatter_rows(qa.zero, code_slots, zero))
    # The chunk's tokens still pending go to the full-precision ring (at most `residual`: distinct rows).
    pending_rows = jnp.where((positions >= 0) & (positions >= new_qlen[..., None]), jnp.mod(positions, ring), ring)
    residual = sl.scatter_rows(qa.residual, pending_rows, x.astype(qa.residual.dtype))
    return out.replace(residual=residual, qlen=new_qlen.astype(jnp.int32), top=new_top.astype(jnp.int32))
