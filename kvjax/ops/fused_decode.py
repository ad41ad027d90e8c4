"""One decode step's attention for one layer, from the new token's pre-RoPE query and key: RoPE, the cache write
and the attention as one op, so that a GPU can run them as one kernel (`kvjax.pallas.gpu_fused_decode`).

The XLA path ("xla", and "auto" wherever the tuning does not pick the kernel) is exactly the composition the
runtime's in-place decode runs today (`kvjax.runtime.step.decode_layer` for a method whose decode only appends):
(with `qk_norm`, QK-norm of q and k first, `kvjax.ops.norm.rms_norm_xla` per head as the decoder block's
`head_norm`) `kvjax.rope.apply_rope` of q and k (then the family's query scale, as `kvjax.models.block.qkv`),
`kvjax.cache.append_token` (with `evict`, then `kvjax.cache.evict`: the in-place eviction of StreamingLLM and
DuoAttention's streaming heads), `kvjax.ops.attention.decode_attention` over the layer's valid slots (or, with
`slots`, over those slots gathered, as the retrieval family's compact decode). It is the kernel's test oracle.

`implementation="pallas"` runs the Triton kernel (compiled on a GPU, interpreted elsewhere; per shard under a
mesh). "auto" picks it only where the current tuning's `auto_pallas` lists `decode_append_attention` (the GPU's
default, from the H200 run 13: `kvjax.tuning`), and for a quantized cache only where the tuning's
`auto_fused_quantized` lists its storage (the GPU's default: int8).

In the runtime's decode (`kvjax.runtime.forward.decode_step`): on a layer where `kvjax.runtime.step.fuses_decode`
holds (`uses()`, a method whose decode only appends or evicts in place, with no retrieval gather or rewritten
attention, and `kernel_unsupported(layer)` None: no `attend` mask), and on a sliding-window layer's ring where
`step.fuses_window` holds (`ring=True`: `kvjax.cache.ring_append`'s slot rule), the decoder block hands its callback
the queries and keys before RoPE and the query scale (`kvjax.models.block.PreRope`) and `step.decode_layer` (or
`decode_window_layer`) calls this op instead of RoPE + the write + its masked decode attention. An inactive row
(the decode loop's `active` mask) is written at position -1, as the XLA path writes it: nothing counted, length
and valid slots unchanged. The gathered variant (`slots`) is not wired: the runtime's retrieval path hands
`decode_slots` the layer with the new token already written, so the write cannot wait for the kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax import slots as sl
from kvjax import tuning
from kvjax._kernel_common import check_window
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.ops._impl import resolve
from kvjax.ops._shard import batch_heads_role, check_query_heads, per_shard
from kvjax.ops.attention import decode_attention
from kvjax.ops.norm import rms_norm_xla
from kvjax.quant.storage import QuantizedKV
from kvjax.rope import apply_rope

Array = jax.Array

OP = "decode_append_attention"

#: QK-norm the op applies before RoPE: `(q_weight [H], k_weight [H], eps, plus_one)`.
QKNorm = tuple[Array, Array, float, bool]
#: An in-place eviction (`kvjax.methods.capabilities.InPlaceEviction.decode_eviction` of the layer with the token
#: appended): `(slot [B, K], where [B, K] bool)`.
Evict = tuple[Array, Array]


def kernel_unsupported(layer: KVCache, slots: Array | None = None, evicts: bool = False, ring: bool = False
                       ) -> str | None:
    """Why the fused kernel cannot take this layer (None: it can). It writes K / V / positions / length itself and
    the score in XLA. A retrieval mask (`attend`) stays on the XLA path, as do scales shared by part of a
    head, KIVI with groups below 16 or on a sliding-window ring (its position groups), and on a GPU a head_dim that
    is no power of two; `evicts` (an in-place eviction follows the write) and `ring` (the layer is a
    sliding-window ring, written by `ring_append`'s slot rule) take no KIVI cache and no slot list."""
    from kvjax.pallas import gpu_fused_decode

    if layer.attend is not None:
        return "a layer with a retrieval mask (attend) stays on the XLA path"
    if isinstance(layer.k, QuantizedKV) and layer.k.wraps:
        return "a KIVI sliding-window ring (position groups) stays on the XLA path"
    if (evicts or ring) and slots is not None:
        return "an in-place eviction or a ring does not combine with a slot list"
    if (evicts or ring) and isinstance(layer.k, QuantizedKV) and layer.k.spec.kivi:
        return "an in-place eviction or a ring on a KIVI cache (which requantizes its groups) stays on the XLA path"
    h = layer.head_dim
    if jax.default_backend() == "gpu" and h & (h - 1):
        return f"compiled for GPU (Triton), head_dim must be a power of two, got {h}"
    return gpu_fused_decode.supports(layer.k, layer.v, slots is not None)


def decode_append_attention(
    q: Array,
    k: Array,
    v: Array,
    positions: Array,
    layer: KVCache,
    *,
    inv_freq: Array,
    scaling: float | Array = 1.0,
    query_scale: float = 1.0,
    sliding_window: int | None = None,
    slots: Array | None = None,
    slots_ok: Array | None = None,
    qkv: Array | None = None,
    qk_norm: QKNorm | None = None,
    evict: Evict | None = None,
    ring: bool = False,
    implementation: str = "auto",
) -> tuple[Array, KVCache]:
    """The new token through one layer's cache: `(attention output [B, 1, N, H], the layer with the token written)`.

    `q` `[B, 1, N, H]` and `k` `[B, 1, K, H]` before RoPE (after any QK-norm), `v` `[B, 1, K, H]`, `positions`
    `[B, 1]` (-1: a padding row, written but not counted, as `append_token` does); `inv_freq` `[H / 2]` and
    `scaling` (a float or a traced scalar) the layer's RoPE, `query_scale` the family's query scale
    (`ModelConfig.query_scale`).
    `slots` `[B, K, W]` with `slots_ok` `[B, K, W]`: attend only those slots of the written layer (a listed slot
    counts once per listing), else every valid slot. `qkv` `[B, 1, K, G + 2, H]`: the same q, k and v in the
    decoder block's fused layout, where the caller has them so (the kernel reads that operand; the XLA path ignores
    it). `qk_norm`: q and k come before their QK-norm, which the op applies (the kernel inside, on the `qkv` rows).
    `evict` `(slot, where)` `[B, K]`: after the write, each head where `where` holds (and the token counts) drops
    `slot` for it, as `kvjax.cache.evict` (the token moves into the evicted slot, the length stays). `ring`: the layer
    is a sliding-window ring, written by `kvjax.cache.ring_append` (position `p` at slot `p % C`; give
    `sliding_window`).
    `implementation`: see the module docstring.
    """
    if q.ndim != 4 or q.shape[1] != 1 or k.shape[1] != 1:
        raise ConfigError(f"{OP}: one token per example ([B, 1, heads, head_dim]), got q {q.shape} and k {k.shape}")
    if (slots is None) != (slots_ok is None):
        raise ConfigError(f"{OP}: slots and slots_ok go together")
    if (evict is not None or ring) and slots is not None:
        raise ConfigError(f"{OP}: an in-place eviction or a ring does not combine with a slot list")
    if evict is not None and ring:
        raise ConfigError(f"{OP}: a ring evicts by its slot rule, not `evict`")
    if evict is not None:  # an uncounted token (a padding or finished row) evicts nothing
        evict = (jnp.clip(evict[0], 0, layer.capacity - 1).astype(jnp.int32), evict[1] & (positions[:, :1] >= 0))
    check_window(OP, sliding_window)
    check_query_heads(OP, q.shape[2], layer.num_kv_heads)
    if resolve(OP, implementation) == "pallas":
        why = kernel_unsupported(layer, slots, evict is not None, ring)
        if why is None and auto_takes(layer, implementation):
            return _decode_append_kernel(q, k, v, positions, layer, inv_freq, scaling, query_scale,
                                         sliding_window, slots, slots_ok, qkv, qk_norm, evict, ring)
        if implementation == "pallas":
            raise ConfigError(f"{OP}: implementation='pallas': {why}")
    q, k = head_normed(q, k, qk_norm)
    return _xla(q, k, v, positions, layer, inv_freq, scaling, query_scale, sliding_window, slots, slots_ok,
                "xla" if implementation == "xla" else "auto", evict, ring)


def head_normed(q: Array, k: Array, qk_norm: QKNorm | None) -> tuple[Array, Array]:
    """q and k after their QK-norm (each head over head_dim; as they were without one)."""
    if qk_norm is None:
        return q, k
    q_weight, k_weight, eps, plus_one = qk_norm
    return rms_norm_xla(q, q_weight, eps, plus_one), rms_norm_xla(k, k_weight, eps, plus_one)


def rotate(q: Array, k: Array, positions: Array, inv_freq: Array, scaling: float, query_scale: float
           ) -> tuple[Array, Array]:
    """The post-RoPE q and k the decoder block hands to attention (`kvjax.models.block.qkv`'s last steps)."""
    q, k = apply_rope(q, positions, inv_freq, scaling), apply_rope(k, positions, inv_freq, scaling)
    if query_scale != 1.0:
        q = (q.astype(jnp.float32) * query_scale).astype(q.dtype)
    return q, k


def _xla(q: Array, k: Array, v: Array, positions: Array, layer: KVCache, inv_freq: Array, scaling: float,
         query_scale: float, sliding_window: int | None, slots: Array | None, slots_ok: Array | None,
         attention: str, evict: Evict | None = None, ring: bool = False) -> tuple[Array, KVCache]:
    q, k = rotate(q, k, positions, inv_freq, scaling, query_scale)
    layer = kvc.ring_append(layer, k, v, positions) if ring else kvc.append_token(layer, k, v, positions)
    if evict is not None:
        layer = kvc.evict(layer, *evict)
    if slots is None:
        keys, values, pos, ok = layer.k, layer.v, layer.pos, kvc.valid_mask(layer)
    else:
        safe = jnp.clip(slots, 0, layer.capacity - 1)
        keys, values = kvc.take_slots(layer.k, safe), kvc.take_slots(layer.v, safe)
        pos = kvc.take_slots(layer.pos, safe)
        ok = slots_ok & (slots >= 0) & (slots < layer.capacity) & kvc.take_slots(kvc.valid_mask(layer), safe)
    out = decode_attention(q[:, 0], positions[:, 0], keys, values, pos, ok, sliding_window=sliding_window,
                           implementation=attention)
    return out[:, None], layer


@functools.partial(jax.jit, static_argnames=("tune", "backend", "k_tree", "v_tree", "query_scale", "sliding_window",
                                              "norm", "ring"))
def _kernel_once(q: Array, k_new: Array, v_new: Array, position: Array, inv: Array, scale: Array, pos: Array,
                 length: Array, listed: Array | None, fused: Array | None, norms: tuple | None, into: Array | None,
                 *leaves: Array, tune: tuning.Tuning, backend: str, k_tree: Any, v_tree: Any, query_scale: float,
                 sliding_window: int | None, norm: tuple[float, bool] | None, ring: bool) -> tuple:
    """The kernel on one layer's arrays, jitted: a decode step calls it once per layer on arrays of one shape, and
    jax traces and lowers it (the Pallas kernel's Triton IR) once, not once per layer. Keyed by everything the
    kernel reads besides its arrays: the tuning in force and the backend (compiled or interpreted) too."""
    from kvjax.pallas import gpu_fused_decode

    del backend  # in the key only
    nk = k_tree.num_leaves
    with tuning.use(tune):
        kk = jax.tree.unflatten(k_tree, leaves[:nk])
        vv = jax.tree.unflatten(v_tree, leaves[nk:])
        out, kk, vv, pos, length = gpu_fused_decode.decode_append_attention(
            q, k_new, v_new, position, inv, kk, vv, pos, length, scaling=scale, query_scale=query_scale,
            sliding_window=sliding_window, slots=listed, qkv=fused,
            qk_norm=None if norms is None else (*norms, *norm), evict=into, ring=ring)
    return out, pos, length, *jax.tree.leaves(kk), *jax.tree.leaves(vv)


def _decode_append_kernel(q: Array, k: Array, v: Array, positions: Array, layer: KVCache, inv_freq: Array,
                          scaling: float, query_scale: float, sliding_window: int | None, slots: Array | None,
                          slots_ok: Array | None, qkv: Array | None = None,
                          qk_norm: QKNorm | None = None, evict: Evict | None = None, ring: bool = False
                          ) -> tuple[Array, KVCache]:
    batch, kv = layer.length.shape
    listed = None if slots is None else jnp.where(slots_ok, slots, -1).astype(jnp.int32)
    k_leaves, k_tree = jax.tree.flatten(layer.k)
    v_leaves, v_tree = jax.tree.flatten(layer.v)
    nk, nv = len(k_leaves), len(v_leaves)

    statics = dict(tune=tuning.current(), backend=jax.default_backend(), k_tree=k_tree, v_tree=v_tree,
                   query_scale=float(query_scale), sliding_window=sliding_window,
                   norm=None if qk_norm is None else (float(qk_norm[2]), bool(qk_norm[3])), ring=ring)

    def call(*arrays: Array | tuple | None) -> tuple:
        return _kernel_once(*arrays, **statics)

    leaves = (*k_leaves, *v_leaves)
    into = None if evict is None else jnp.where(evict[1], evict[0], -1).astype(jnp.int32)
    args = (q[:, 0], k[:, 0], v[:, 0], positions[:, 0], inv_freq, jnp.asarray(scaling, jnp.float32), layer.pos,
            layer.length, listed, None if qkv is None else qkv[:, 0], None if qk_norm is None else qk_norm[:2], into,
            *leaves)
    roles = ("bh.", "bh.", "bh.", "b", None, None, "bh.", "bh", None if listed is None else "bh.",
             None if qkv is None else "bh..", None, None if into is None else "bh",
             *(batch_heads_role(x.ndim) for x in leaves))
    out_roles = ("bh.", "bh.", "bh", *(batch_heads_role(x.ndim) for x in leaves))
    out, pos, length, *new = per_shard(call, args, roles, out_roles, batch=batch, heads=kv)
    if ring:  # `ring_append`: slot p % C, nothing for a padding row
        p = jnp.broadcast_to(positions[:, :1], layer.length.shape)
        slot = jnp.where(p >= 0, jnp.mod(p, layer.capacity), layer.capacity)
    else:
        slot = jnp.clip(layer.length, 0, layer.capacity - 1)
    score = sl.put_slots(layer.score, slot, 0.0)
    if into is not None and score is not None:  # the evicted slot's score is the token's: 0
        score = sl.put_slots(score, jnp.where(into >= 0, into, layer.capacity), 0.0)
    written = layer.replace(k=jax.tree.unflatten(k_tree, new[:nk]), v=jax.tree.unflatten(v_tree, new[nk:nk + nv]),
                            pos=pos, length=length, score=score)
    return out[:, None], written


def auto_takes(layer: KVCache, implementation: str = "auto") -> bool:
    """Whether `implementation` hands the kernel this layer's storage: "pallas" any; "auto" a model-dtype cache, or
    a quantized one (int8, fp8, int4, KIVI) whose scheme the tuning's `auto_fused_quantized` lists."""
    return (implementation == "pallas" or not isinstance(layer.k, QuantizedKV)
            or layer.k.spec.scheme in tuning.current().auto_fused_quantized)


def uses(implementation: str = "auto") -> bool:
    """Whether `decode_append_attention(implementation=...)` would pick the kernel (for a layer it supports, and
    under "auto" whose storage `auto_takes`) under the current tuning: what a caller checks before handing it
    pre-RoPE queries and keys."""
    return resolve(OP, implementation) == "pallas"
