"""The per-layer step API: how a decoder layer attends through a compressed cache with any method.

kvjax's own model calls these two functions from its decoder block, and so can any Flax model
(`examples/own_flax_model.py`). Each takes one layer's cache (`ModelCache.layer(i)`: its own buffers, the
cross-layer state as `state["shared"]`), the layer's post-RoPE queries `q` `[B, T, N, H]`, keys and values
`k`, `v` `[B, T, K, H]`, and returns the attention output `[B, T, N, H]` with the layer's new cache
(`ModelCache.with_layer(i, ...)` puts it back):

* `prefill_layer`: a prompt chunk is appended into `T` extra slots, the method sees the chunk before it
  attends (retrieval methods write their `attend` mask), the chunk attends over the cache, then the method
  brings the cache back to its capacity (one-shot methods compress here).
* `decode_layer`: one token per example. Depending on what the method declares (its capabilities,
  `kvjax.methods.capabilities`), the token is written in place (`decode_appends_only`), then one slot is
  evicted in place (`InPlaceEviction`), or the layer attends only a compact set of gathered slots
  (`Retrieval`), or the general path runs `method.decode` on the appended layer; attention observers
  (`AttentionObserver`) get the step's probabilities afterwards. Every path gives the same cache and output
  as the general one. Where the tuning picks the fused decode kernel (`fuses_decode`), a caller that hands over
  q / k before RoPE (`rope=`) gets the in-place path as one op: RoPE, the write and the attention together.

`Step` (`kvjax.methods.base`) carries what a hook needs besides the cache: positions, per-example budgets,
the layer index (a Python int, or traced when one program serves every layer), RoPE frequencies, and the layer
inputs the method reads (`Method.layer_inputs`). The model passes each of those by name as a keyword argument
(`hidden=`, `out_proj=`: `kvjax.methods.base.LAYER_INPUTS`; kvjax's own model computes them in
`kvjax.runtime.forward.block_inputs`), and a call without one the method reads is refused before anything runs; the
step computes the prefill attention's log-sum-exp itself.

A sliding-window layer (`ModelConfig.layer_window`: Gemma 3's local layers, Mistral / Phi-3 with a window) is not
the method's: its cache is a ring of `min(window, context)` slots (`init_cache(..., rings=)`) that
`prefill_window_layer` / `decode_window_layer` fill in place (`kvjax.cache.ring_append`), attending with the window
mask. Compression acts on the layers without a window, as the methods' papers define it on full-attention
layers; a sliding-window layer keeps exactly its window, which is already bounded.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache, ModelCache
from kvjax.errors import ConfigError
from kvjax.methods import capabilities as caps
from kvjax.methods.base import LAYER_INPUTS, CacheSpec, Method, Step
from kvjax.models.block import self_attention
from kvjax.ops import fused_decode as fd
from kvjax.ops import select
from kvjax.ops.attention import causal_prefix_attention, decode_attention, prefill_attention

Array = jax.Array


def init_cache(method: Method, spec: CacheSpec, rings: tuple[int | None, ...] | None = None) -> ModelCache:
    """An empty model cache for `method`: `spec.num_layers` layers of `spec.capacity` slots, each with its own
    buffers and the method's per-layer state, plus the method's cross-layer state (if any).

    `rings`: one entry per model layer, None for a layer the method manages, or the capacity of a sliding-window
    layer's ring (`ring_capacity`): plain K / V / positions, no method state. `spec.num_layers` then counts the
    method's layers (what its state is sized for, `ModelConfig.method_layers`)."""
    if spec.layer_capacities is not None and (len(spec.layer_capacities) != spec.num_layers
                                              or min(spec.layer_capacities) <= 0):
        raise ValueError(f"layer_capacities must give {spec.num_layers} positive sizes, got {spec.layer_capacities}")
    if min(spec.batch, spec.kv_heads, spec.capacity, spec.head_dim, spec.num_layers) <= 0:
        raise ValueError(
            f"cache dimensions must be positive, got batch={spec.batch}, kv_heads={spec.kv_heads}, "
            f"capacity={spec.capacity}, head_dim={spec.head_dim}, num_layers={spec.num_layers}"
        )
    method.check_cache_spec(spec)
    rings = (None,) * spec.num_layers if rings is None else tuple(None if r is None else int(r) for r in rings)
    managed = sum(r is None for r in rings)
    if any(r is not None and r <= 0 for r in rings) or managed not in (spec.num_layers, 0):
        raise ValueError(f"rings={rings} must give None (the method's {spec.num_layers} layers) or a positive ring "
                         "capacity for every layer")
    return _empty_cache(method, spec, rings)


def ring_capacity(window: int, context: int | None) -> int:
    """Slots of a sliding-window layer's ring: its window, or fewer when the sequence (`context` tokens at most)
    never outgrows it."""
    return window if context is None else max(1, min(window, context))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty_cache(method: Method, spec: CacheSpec, rings: tuple[int | None, ...]) -> ModelCache:
    # One compiled program for every field of every layer: eager jnp.zeros / jnp.full would each compile.
    state = dict(method.init_cache_state(spec))
    shared = state.pop(kvc.SHARED_STATE, None)

    capacities = iter(spec.layer_capacities or (spec.capacity,) * spec.num_layers)

    def layer(ring: int | None) -> KVCache:
        if ring is not None:
            quant = spec.quant if spec.quant is not None and spec.quant.quantizes_ring(ring) else None
            return kvc.init(spec.batch, spec.kv_heads, ring, spec.head_dim, spec.dtype, quant=quant, ring=True)
        one = kvc.init(spec.batch, spec.kv_heads, next(capacities), spec.head_dim, spec.dtype,
                       score=method.uses_score, attend=method.uses_attend, quant=spec.quant)
        return one.replace(state={name: jnp.array(value) for name, value in state.items()})

    return ModelCache(tuple(layer(ring) for ring in rings), shared)


def attends_own_chunk(method: Method) -> bool:
    """Whether a chunk's attention over an empty cache equals its attention over its own keys: the method
    neither rewrites attention nor edits the cache's masks before it (`before_prefill_attention`)."""
    return not caps.rewrites_attention(method) and not caps.edits_mask_before_attention(method)


def _step(cache: KVCache, positions: Array, budget: Array, layer: Any, inv_freq: Array, num_layers: int,
          final_chunk: bool = True, inputs: dict[str, Array] | None = None, rope_scaling: Any = 1.0) -> Step:
    return Step(positions=positions, budget=budget, layer=jnp.asarray(layer, jnp.int32), inv_freq=inv_freq,
                capacity=cache.capacity, num_layers=num_layers, final_chunk=final_chunk, rope_scaling=rope_scaling,
                **(inputs or {}))


def _layer_inputs(method: Method, given: dict[str, Array | None], q: Array, *, decode: bool = False,
                  attended: bool = False) -> dict[str, Array]:
    """The layer inputs a caller passed (`given`, by name; None: not passed), checked before anything runs: each
    is a layer input (`LAYER_INPUTS`) the caller may pass (one the step's attention computes only where the attention
    was already run, `attended`: `compress_layer`), with `q`'s rows where it has rows; and every input the method
    reads at this phase (`decode`) is there."""
    inputs = {name: value for name, value in given.items() if value is not None}
    for name, value in inputs.items():
        kind = LAYER_INPUTS.get(name)
        if kind is None:
            raise TypeError(f"unknown layer input {name}=; the layer inputs are {sorted(LAYER_INPUTS)}")
        if kind.from_attention and not attended:
            raise ConfigError(f"{name}= is computed by the step's own attention: do not pass it")
        if not (kind.weights_only or kind.from_attention) and value.shape[:2] != q.shape[:2]:
            raise ConfigError(f"{name}= has shape {value.shape}; its first two axes must be [B, T] of q {q.shape[:2]}")
    for name in sorted(method.layer_inputs - inputs.keys()):
        kind = LAYER_INPUTS[name]
        if not kind.from_attention and (kind.at_decode or not decode):
            raise ConfigError(f"{method.name}: reads {kind.what}; pass {name}= to the step API")
    return inputs


def _chunk_work(method: Method, cache: KVCache, q: Array, k: Array, v: Array, step: Step) -> KVCache:
    """`cache` with the chunk's keys / values appended into `T` extra slots, after `before_prefill_attention`."""
    work = kvc.append(kvc.extend(cache, q.shape[1]), k, v, step.positions)
    return method.before_prefill_attention(work, q, step) if isinstance(method, caps.Retrieval) else work


def prefill_layer(
    method: Method, cache: KVCache, q: Array, k: Array, v: Array, positions: Array, budget: Array, *,
    layer: Any, inv_freq: Array, num_layers: int, sliding_window: int | None = None, final_chunk: bool = True,
    fresh: bool = False, rope_scaling: Any = 1.0, **inputs: Array | None,
) -> tuple[Array, KVCache]:
    """One prompt chunk through one layer's cache: `(attention output [B, T, N, H], the layer's cache)`.

    `positions` `[B, T]` (-1: padding, only at the end of a row); `budget` `[B]` int32 tokens each example
    keeps (`kvjax.methods.per_example_budget`); `layer` the layer index; `final_chunk`: the prompt ends in
    this chunk. `rope_scaling`: the factor the layer's RoPE cos / sin carry (the decoder's `rope[1]`; 1.0 but for
    yarn and LongRoPE), for the hooks (`Step.rope_scaling`). `fresh`: the cache holds nothing yet and row `t` is at
    position `t` (a one-shot prefill), so the chunk attends over its own keys without scanning the cache's empty
    slots (`attends_own_chunk` methods only; same values). `inputs`: the layer inputs by name (`out_proj=` the
    layer's `W_o` `[N, H, D]`, `hidden=` its attention input `[B, T, D]` after its input norm, ...:
    `kvjax.methods.base.LAYER_INPUTS`), handed to the hooks as the `Step` fields of those names; the ones the method
    reads (`Method.layer_inputs`) are required.
    The step adds the attention's log-sum-exp for a method that reads it.

    A quantized layer (`kvc.quantization`) is dequantized into a float32 working copy for the chunk: the chunk
    attends its own keys in full precision, the method's hooks see plain arrays, and the layer it returns is
    quantized once (KIVI's prefill: full-precision attention, then quantized storage).
    """
    if kvc.quantization(cache) is not None:
        attn, out = prefill_layer(method, kvc.dequantized(cache), q, k, v, positions, budget, layer=layer,
                                  inv_freq=inv_freq, num_layers=num_layers, sliding_window=sliding_window,
                                  final_chunk=final_chunk, fresh=fresh, rope_scaling=rope_scaling, **inputs)
        return attn, kvc.requantized(out, cache)
    if fresh and not attends_own_chunk(method):
        raise ValueError(f"{method.name}: fresh prefill needs a method whose attention reads the plain cache")
    step = _step(cache, positions, budget, layer, inv_freq, num_layers, final_chunk,
                 _layer_inputs(method, inputs, q), rope_scaling)
    work = _chunk_work(method, cache, q, k, v, step)
    if caps.rewrites_attention(method):  # e.g. InfLLM's positional scheme
        attn, work = method.prefill_attention(work, q, step)
        return attn, method.prefill(work, q, step)
    want_lse = "attention_lse" in method.layer_inputs and sliding_window is None
    if fresh and not want_lse:  # positions run 0 .. length - 1: a fused causal kernel needs no mask
        attn = causal_prefix_attention(q, k, v, jnp.sum(positions >= 0, axis=1, dtype=jnp.int32),
                                       sliding_window=sliding_window)
    elif fresh:
        attn = self_attention(q, k, v, positions, sliding_window=sliding_window, return_lse=want_lse)
    else:
        attn = prefill_attention(q, positions, work.k, work.v, work.pos, kvc.valid_mask(work),
                                 sliding_window=sliding_window, return_lse=want_lse)
    if want_lse:
        attn, lse = attn
        step = dataclasses.replace(step, attention_lse=lse)
    return attn, method.prefill(work, q, step)


def replay_layer(
    method: Method, cache: KVCache, q: Array, k: Array, v: Array, positions: Array, span: Array, *,
    layer: Any, inv_freq: Array, num_layers: int, replay_gradient: Array | None = None, **inputs: Array | None,
) -> tuple[Array, KVCache]:
    """One replay chunk through one layer of a `ContextReplay` method (KVzip): the rows attend the layer's cache
    and their own earlier tokens, `method.replay_scores` reads their queries and keys, and the layer comes back with
    its slots as they were (the rows' keys are not kept) and its scores updated. `span` `[B, 2]`: the prompt
    positions the chunk reconstructs; `inputs` as in `prefill_layer`, for the rows; `replay_gradient` `[B, R]`:
    the rows' objective gradient norms (required by a method with `replay_objective`). Returns `(attention output
    [B, T, N, H], the layer)`."""
    if not caps.replays_context(method):
        raise ConfigError(f"{method.name}: has no context replay (the ContextReplay capability)")
    if kvc.quantization(cache) is not None:
        raise ConfigError(f"{method.name}: the context replay needs a cache in the model dtype (kv_dtype=None)")
    if caps.differentiates_replay(method) and replay_gradient is None:
        raise ConfigError(f"{method.name}: scores with the replay objective's gradient; pass replay_gradient=")
    budget = jnp.zeros(positions.shape[:1], jnp.int32)
    step = _step(cache, positions, budget, layer, inv_freq, num_layers, inputs=_layer_inputs(method, inputs, q))
    step = dataclasses.replace(step, replay_gradient=replay_gradient)
    return replay_attention(cache, q, k, v, positions), method.replay_scores(cache, q, k, positions, span, step)


def replay_attention(cache: KVCache, q: Array, k: Array, v: Array, positions: Array) -> Array:
    """Replay rows' attention `[B, R, N, H]` over a layer's cache and their own earlier tokens (nothing is kept)."""
    work = kvc.append(kvc.extend(cache, q.shape[1]), k, v, positions)
    return prefill_attention(q, positions, work.k, work.v, work.pos, kvc.valid_mask(work))


def replay_window_layer(
    cache: KVCache, q: Array, k: Array, v: Array, positions: Array, *, window: int,
) -> tuple[Array, KVCache]:
    """A replay chunk through a sliding-window layer: the rows attend the ring and their own earlier tokens under
    the window mask; the ring is left as it was (the replay writes nothing)."""
    work = kvc.append(kvc.extend(kvc.dequantized(cache), q.shape[1]), k, v, positions)
    attn = prefill_attention(q, positions, work.k, work.v, work.pos, kvc.valid_mask(work), sliding_window=window)
    return attn, cache


def prefill_window_layer(
    cache: KVCache, q: Array, k: Array, v: Array, positions: Array, *, window: int, fresh: bool = False,
) -> tuple[Array, KVCache]:
    """One prompt chunk through a sliding-window layer's ring (`init_cache(..., rings=)`): the chunk attends over
    the ring's earlier tokens and its own under the window mask, then its last positions are written into the ring
    (`kvjax.cache.ring_append`). `fresh`: the ring is empty and row `t` is at position `t` (a one-shot prefill), so
    the chunk attends over its own keys only. A prompt longer than the window leaves its last `window` tokens.
    A quantized ring is read dequantized (the chunk's own tokens in full precision, as on the other layers)."""
    if fresh:
        attn = causal_prefix_attention(q, k, v, jnp.sum(positions >= 0, axis=1, dtype=jnp.int32),
                                       sliding_window=window)
    else:
        work = kvc.append(kvc.extend(kvc.dequantized(cache), q.shape[1]), k, v, positions)
        attn = prefill_attention(q, positions, work.k, work.v, work.pos, kvc.valid_mask(work), sliding_window=window)
    return attn, kvc.ring_append(cache, k, v, positions)


def decode_window_layer(
    cache: KVCache, q: Array, k: Array, v: Array, positions: Array, *, window: int, active: Array | None = None,
    rope: tuple[Array, Array | float] | None = None, query_scale: float = 1.0, qkv: Array | None = None,
    qk_norm: tuple | None = None, implementation: str = "auto",
) -> tuple[Array, KVCache]:
    """One token per example through a sliding-window layer's ring: written in place over the position that left
    the window, then attended with the window mask. `q` `[B, 1, N, H]`, `k`, `v` `[B, 1, K, H]`; `positions`
    `[B, 1]`; `active` as in `decode_layer` (an inactive row's token is not written: the ring stays as it was).
    `rope`, `query_scale`, `qkv`, `qk_norm`, `implementation` as in `decode_layer`: where `fuses_window` holds, RoPE,
    the ring write and the attention run as the fused op (`ring=True`)."""
    if rope is not None:
        if fuses_window(cache, implementation):
            return fd.decode_append_attention(q, k, v, _written(positions, active), cache, inv_freq=rope[0],
                                              scaling=rope[1], query_scale=query_scale, sliding_window=window,
                                              qkv=qkv, qk_norm=qk_norm, ring=True, implementation=implementation)
        q, k = fd.head_normed(q, k, qk_norm)
        q, k = fd.rotate(q, k, positions, rope[0], rope[1], query_scale)
    cache = kvc.ring_append(cache, k, v, _written(positions, active))
    attn = decode_attention(q[:, 0], positions[:, 0], cache.k, cache.v, cache.pos, kvc.valid_mask(cache),
                            sliding_window=window)
    return attn[:, None], cache


def compress_layer(
    method: Method, cache: KVCache, q: Array, k: Array, v: Array, positions: Array, budget: Array, *,
    layer: Any, inv_freq: Array, num_layers: int, rope_scaling: Any = 1.0, **inputs: Array | None,
) -> KVCache:
    """`method.prefill` of one layer on an empty `cache` from recorded post-RoPE `q`, `k`, `v` of a one-shot
    prefill: what `prefill_layer` leaves, without attending again (`kvjax.runtime.shared_prefill`). `inputs` as in
    `prefill_layer`, and the ones the attention computes as it recorded them (`attention_lse=`, handed to the hook
    as `step.attention_lse` where given)."""
    if kvc.quantization(cache) is not None:  # as `prefill_layer`: the hook runs on a float32 working copy
        out = compress_layer(method, kvc.dequantized(cache), q, k, v, positions, budget, layer=layer,
                             inv_freq=inv_freq, num_layers=num_layers, rope_scaling=rope_scaling, **inputs)
        return kvc.requantized(out, cache)
    inputs = _layer_inputs(method, inputs, q, attended=True)
    attended = {name: value for name, value in inputs.items() if LAYER_INPUTS[name].from_attention}
    step = _step(cache, positions, budget, layer, inv_freq, num_layers,
                 inputs={name: value for name, value in inputs.items() if name not in attended},
                 rope_scaling=rope_scaling)
    work = _chunk_work(method, cache, q, k, v, step)  # as in `prefill_layer`: before the attention's inputs exist
    if attended:
        step = dataclasses.replace(step, **attended)
    return method.prefill(work, q, step)


def decode_layer(
    method: Method, cache: KVCache, q: Array, k: Array, v: Array, positions: Array, budget: Array, *,
    layer: Any, inv_freq: Array, num_layers: int, sliding_window: int | None = None, active: Array | None = None,
    rope: tuple[Array, Any] | None = None, query_scale: float = 1.0, implementation: str = "auto",
    qkv: Array | None = None, qk_norm: fd.QKNorm | None = None, **inputs: Array | None,
) -> tuple[Array, KVCache]:
    """One token per example through one layer's cache: `(attention output [B, 1, N, H], the layer's cache)`.

    `q` `[B, 1, N, H]`, `k`, `v` `[B, 1, K, H]` post-RoPE; `positions` `[B, 1]`; `inputs` as in `prefill_layer`
    (`hidden=` `[B, 1, D]`; required only where the input is given at decode, `LayerInput.at_decode`). The new token
    is appended (in place where the method allows it), the method evicts / masks / gathers, the token attends.

    `active` `[B]` bool (None: every row): a row that is not active (its sequence finished, or a free engine slot)
    keeps its cache as it was: its token is not stored (written with position -1, which counts nothing), and nothing
    the method would evict, score or record for it is kept. How that is done depends on the path, so the paths that
    write in place stay in place: the in-place paths mask the row's eviction; the retrieval path keeps the row's
    `state` / `attend`; the general path keeps the row of every leaf the method's `decode` changed, and an attention
    observer sees the row as empty (no slot to evict) and gets its score / state back. Its attention output is
    computed as usual and is the caller's to ignore.

    `rope` (None: `q` and `k` are post-RoPE): the layer's `(inv_freq, scaling)`; then `q` and `k` come before RoPE
    and before the family's `query_scale` (the decoder block's `PreRope` callback), and the step rotates them itself:
    inside the fused op where `fuses_decode(method, cache, implementation)` holds (`kvjax.ops.fused_decode`: RoPE,
    the in-place write and the attention, one Triton kernel per layer on a GPU; an inactive row's token is written
    at position -1 as on the other paths, so only its invalid slot `length` holds another key), else as the block
    would (`fused_decode.rotate`) before the paths above. `implementation` ("auto": the tuning's `auto_pallas`
    decides; "pallas": the kernel wherever `fuses_decode` allows it; "xla": never) only applies with `rope`, as
    `qkv` (the same q, k, v in the block's fused layout, which the fused op's kernel reads as they are) and
    `qk_norm` (then q and k come before their QK-norm too, which the fused op applies, or the step before RoPE).
    """
    step = _step(cache, positions, budget, layer, inv_freq, num_layers,
                 inputs=_layer_inputs(method, inputs, q, decode=True))
    written = _written(positions, active)
    if rope is not None:
        if fuses_decode(method, cache, implementation):
            evict = _eviction(method, cache, written, step, active) if caps.evicts_in_place(method) else None
            return fd.decode_append_attention(q, k, v, written, cache, inv_freq=rope[0], scaling=rope[1],
                                              query_scale=query_scale, sliding_window=sliding_window, qkv=qkv,
                                              qk_norm=qk_norm, evict=evict, implementation=implementation)
        q, k = fd.head_normed(q, k, qk_norm)
        q, k = fd.rotate(q, k, positions, rope[0], rope[1], query_scale)
    if caps.gathers(method):  # retrieval: attend a compact gathered set
        attn, out = _gathered_decode_attention(method, kvc.append_token(cache, k, v, written), q, step,
                                               layer, sliding_window)
        if active is not None:
            kept = kvc.select_rows(active, (out.state, out.attend), (cache.state, cache.attend))
            out = out.replace(state=kept[0], attend=kept[1])
        return attn[:, None], out
    evicts = caps.evicts_in_place(method)
    if method.decode_appends_only or evicts:
        cache = kvc.append_token(cache, k, v, written)
        if evicts:
            index, where = method.decode_eviction(cache, step)
            cache = kvc.evict(cache, index, where if active is None else where & active[:, None])
    else:
        appended = kvc.append(cache, k, v, written)
        cache = method.decode(appended, q, step)
        if active is not None:  # a leaf `decode` left as it was is not selected (no copy of an unchanged K / V)
            cache = kvc.select_rows(active, cache, appended)
    attn, cache = _masked_decode_attention(method, cache, q, step, sliding_window, active)
    return attn[:, None], cache


def _eviction(method: Method, cache: KVCache, written: Array, step: Step, active: Array | None
              ) -> tuple[Array, Array]:
    """The in-place eviction `(slot, where)` of `method.decode_eviction`, decided on the layer as `append_token`
    would leave it (the contract lets it read only positions, lengths and the capacity: the new token's position at
    slot `length`, the length counted), so the fused op can write the token and evict in one go."""
    slot = jnp.clip(cache.length, 0, cache.capacity - 1)
    new_pos = jnp.broadcast_to(written[:, :1], cache.length.shape).astype(jnp.int32)
    at_slot = jnp.arange(cache.capacity, dtype=jnp.int32) == slot[..., None]
    appended = cache.replace(pos=jnp.where(at_slot, new_pos[..., None], cache.pos),
                             length=cache.length + (new_pos >= 0).astype(jnp.int32))
    with select.two_reduction_argmin():  # one kernel with what it reads and feeds, where the fused op runs
        index, where = method.decode_eviction(appended, step)
    return index, where if active is None else where & active[:, None]


def fuses_window(cache: KVCache, implementation: str = "auto") -> bool:
    """Whether `decode_window_layer` given pre-RoPE q / k runs this sliding-window ring's step as the fused op:
    the op would pick its kernel (`fused_decode.uses`) and takes the ring (a model-dtype or per-token quantized
    store; KIVI's position-group ring stays on XLA)."""
    return (fd.uses(implementation) and fd.kernel_unsupported(cache, ring=True) is None
            and fd.auto_takes(cache, implementation))


def fuses_decode(method: Method, cache: KVCache, implementation: str = "auto") -> bool:
    """Whether `decode_layer` given pre-RoPE q / k (`rope=`) runs this layer's step as one fused op
    (`kvjax.ops.fused_decode.decode_append_attention`): the op would pick its kernel (`fused_decode.uses`:
    `implementation` "pallas", or "auto" with `decode_append_attention` in the current tuning's `auto_pallas`), the
    method's decode only appends or evicts in place (`decode_appends_only`: the methods
    `generate.decode_program_key` decodes as `full`; StreamingLLM, DuoAttention: `InPlaceEviction`, decided before
    the op by `_eviction`), with no retrieval gather, rewritten attention or per-query-head mask, and the kernel
    takes the layer
    (`fused_decode.kernel_unsupported`: no sliding-window ring, no `attend` mask, a model-dtype, int8, int4 or KIVI
    cache). Decided while tracing, from the layer's structure alone."""
    evicts = caps.evicts_in_place(method)
    return (fd.uses(implementation) and (method.decode_appends_only or evicts) and not caps.gathers(method)
            and not caps.rewrites_attention(method) and not caps.masks_query_heads(method)
            and not caps.observes_attention(method) and fd.kernel_unsupported(cache, evicts=evicts) is None
            and fd.auto_takes(cache, implementation))


def _written(positions: Array, active: Array | None) -> Array:
    """The positions a decode step stores its tokens at: -1 (not stored, not counted) on inactive rows."""
    return positions if active is None else jnp.where(active[:, None], positions, -1)


def _masked_decode_attention(
    method: Method, layer: KVCache, q: Array, step: Step, sliding_window: int | None, active: Array | None = None,
) -> tuple[Array, KVCache]:
    """The decode attention `[B, N, H]` over every slot of `layer` under its mask (then `method.observe`; an
    inactive row is shown to it empty and gets back everything but K / V, which an empty row never has moved)."""
    visible = caps.query_mask(method, layer, q.shape[2])
    rewrites, observes = caps.rewrites_attention(method), caps.observes_attention(method)
    keys = method.decode_keys(layer, q, step) if rewrites else layer.k
    positions = step.positions[:, 0]
    attn = decode_attention(
        q[:, 0], positions, keys, layer.v, layer.pos,
        kvc.valid_mask(layer) if visible is None else visible,
        # A method that rewrites attention (InfLLM's positions) bounds distances itself, at prefill too.
        sliding_window=None if rewrites else sliding_window,
        return_weights=observes,
    )
    if observes:
        attn, probs = attn
        # Order the attention's reads of K / V before `observe` evicts into them: a data dependency of the
        # scores on the output (+ 0 * each example's sum, exact for finite outputs) lets XLA write the
        # eviction in place instead of copying the layer's K / V every step (BENCHMARKS.md, "Eviction
        # during decode").
        before = layer
        after = 0.0 * jnp.sum(attn.astype(jnp.float32), axis=tuple(range(1, attn.ndim)))  # [B]
        probs = probs + after.reshape((-1,) + (1,) * (probs.ndim - 1))
        if layer.score is not None:
            layer = layer.replace(score=layer.score + after.reshape((-1,) + (1,) * (layer.score.ndim - 1)))
        if active is None:
            return attn, method.observe(layer, probs, step)
        # An empty row has no slot to evict (`kvc.evict` leaves a head of length 0 alone), so the row's K / V stay
        # as they are and the eviction of the active rows stays in place; its length, positions, scores and state
        # come back from before. A KIVI store is requantized whole by an eviction: its row is selected as well.
        seen = method.observe(layer.replace(length=jnp.where(active[:, None], layer.length, 0)), probs, step)
        kept = kvc.select_rows(active, seen, before)
        quant = kvc.quantization(layer)
        if quant is None or not quant.kivi:
            kept = kept.replace(k=seen.k, v=seen.v)
        layer = kept
    return attn, layer


def _gathered_decode_attention(
    method: Method, cache: KVCache, q: Array, step: Step, layer: Any, sliding_window: int | None,
) -> tuple[Array, KVCache]:
    """`method.decode_slots` picks `[B, K, W]` slots; attention over those alone; the layer's `state` and
    `attend` advanced (its K / V / positions are only read: the new token was appended in place before)."""
    window = None if caps.rewrites_attention(method) else sliding_window
    observes = caps.observes_attention(method)
    positions = step.positions[:, 0]

    def take(slots: Array) -> tuple[Array, Array, Array]:
        return kvc.take_slots(cache.k, slots), kvc.take_slots(cache.v, slots), kvc.take_slots(cache.pos, slots)

    # Each branch returns the attention and the layer's new (state, attend): the K / V buffers only feed
    # them (a branch that returned the whole cache could copy it).
    def compact(_: None) -> tuple[Array, tuple[Any, Any]]:
        out, slots, ok = method.decode_slots(cache, q, step, take)
        k, v, pos = take(slots)
        ok = ok & (pos >= 0)
        attn = decode_attention(
            q[:, 0], positions, method.slot_keys(k, pos, q, step), v, pos, ok,
            sliding_window=window, return_weights=observes,
        )
        if observes:
            attn, probs = attn
            out = method.observe_slots(out, probs, slots, pos, ok, step)
        return attn, (out.state, out.attend)

    def masked(_: None) -> tuple[Array, tuple[Any, Any]]:  # the general path's attention, K / V left in place
        attn, out = _masked_decode_attention(method, method.decode_dense(cache, q, step, take), q, step,
                                             sliding_window)
        return attn, (out.state, out.attend)

    dense = method.decode_dense_layers
    if not dense:
        attn, (state, attend) = compact(None)
    elif isinstance(layer, int | np.integer):  # the layer is known: only its branch is built
        attn, (state, attend) = (masked if layer < dense else compact)(None)
    else:
        attn, (state, attend) = jax.lax.cond(step.layer < dense, masked, compact, None)
    return attn, cache.replace(state=state, attend=attend)
