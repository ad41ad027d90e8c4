"""The decoder shared by Llama 2/3/3.x, Mistral and Qwen2/2.5, as pure functions over weights.

Weights are a flat dict in kvjax's layout (see `kvjax.models.loader`): layer weights are stacked on
a leading `[L]` axis and the layers run in a `lax.scan`, so compile time does not grow with depth.
The families differ only in config flags: q/k/v biases (Qwen2), o / MLP biases (Llama
`attention_bias` / `mlp_bias`), tied embeddings, sliding window (Mistral v0.1), RoPE scaling.

Three entry points:
* `forward`: plain full-sequence logits, no cache (parity with Hugging Face).
* `prefill_chunk`: one chunk of the prompt through every layer, appending to the cache and calling
  the method's `prefill` hook per layer.
* `decode_step`: one token per example, calling the method's `decode` hook per layer (methods
  whose decode only appends write the token in place into the stacked cache).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.methods.base import Method, Step
from kvjax.ops.attention import causal_prefix_attention, decode_attention, prefill_attention
from kvjax.rope import apply_rope

Array = jax.Array
Weights = dict[str, Array]

LAYER_PREFIX = "layers."

# How many layers one iteration of the decode step's layer scan runs, per backend (`lax.scan(unroll=)`;
# True: all). Read when a decode step is traced. Inside a rolled scan XLA:GPU copies each layer's slice of
# the stacked weights and K / V out before the GEMM that reads it. On an H200 (Llama-3-8B shape, bf16, 32K
# cached tokens) unrolling all 32 layers cut `full`'s decode step from 22.0 to 19.9 ms but raised its compile
# from 3.3 to 8.9 s, so every backend stays rolled by default (BENCHMARKS.md, "Pallas kernels and the
# accelerator"); set `DECODE_UNROLL["gpu"] = True` for long generations.
DECODE_UNROLL: dict[str, int | bool] = {}


def decode_unroll() -> int | bool:
    """The decode step's `lax.scan` unroll on the default backend (`DECODE_UNROLL`)."""
    return DECODE_UNROLL.get(jax.default_backend(), 1)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """RMSNorm as Hugging Face Llama: statistics in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


#: Rows (tokens x batch) per MLP pass, per backend. On CPU a long prompt's `[rows, intermediate]`
#: activations fall out of cache, so the MLP maps over 512-row slices: 22% faster at 4K tokens on
#: SmolLM2-135M's shapes, one thread (issue 24). Accelerators run it whole.
MLP_ROWS: dict[str, int] = {"cpu": 512}


def _mlp(lw: Weights, x: Array) -> Array:
    """SwiGLU MLP of `[B, T, D]`; on backends in `MLP_ROWS` a long input goes through in row slices."""
    rows = MLP_ROWS.get(jax.default_backend())
    b, t, d = x.shape
    if rows is None or b * t <= rows or (b * t) % rows:
        return _mlp_rows(lw, x)
    slices = x.reshape(b * t // rows, 1, rows, d)
    return jax.lax.map(lambda xs: _mlp_rows(lw, xs), slices).reshape(b, t, d)


def _mlp_rows(lw: Weights, x: Array) -> Array:
    gate = jnp.einsum("btd,df->btf", x, lw["gate"])
    up = jnp.einsum("btd,df->btf", x, lw["up"])
    if "gate_bias" in lw:
        gate, up = gate + lw["gate_bias"], up + lw["up_bias"]
    out = jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, lw["down"])
    return out + lw["down_bias"] if "down_bias" in lw else out


def _qkv(lw: Weights, h: Array, positions: Array, rope: tuple[Array, float]) -> tuple[Array, ...]:
    q = jnp.einsum("btd,dnh->btnh", h, lw["q"])
    k = jnp.einsum("btd,dkh->btkh", h, lw["k"])
    v = jnp.einsum("btd,dkh->btkh", h, lw["v"])
    if "q_bias" in lw:
        q, k, v = q + lw["q_bias"], k + lw["k_bias"], v + lw["v_bias"]
    inv_freq, scaling = rope
    return apply_rope(q, positions, inv_freq, scaling), apply_rope(k, positions, inv_freq, scaling), v


def _out_proj(lw: Weights, attn: Array) -> Array:
    out = jnp.einsum("btnh,nhd->btd", attn, lw["o"])
    return out + lw["o_bias"] if "o_bias" in lw else out


def split_weights(weights: Weights) -> tuple[Weights, Weights]:
    """(global weights, stacked per-layer weights with the `layers.` prefix stripped)."""
    layer = {k[len(LAYER_PREFIX) :]: v for k, v in weights.items() if k.startswith(LAYER_PREFIX)}
    rest = {k: v for k, v in weights.items() if not k.startswith(LAYER_PREFIX)}
    return rest, layer


def _embed(weights: Weights, tokens: Array) -> Array:
    return jnp.take(weights["embed"], tokens, axis=0)


def _logits(config: Any, weights: Weights, x: Array) -> Array:
    x = rms_norm(x, weights["final_norm"], config.rms_norm_eps)
    head = weights["embed"].T if config.tie_word_embeddings else weights["lm_head"]
    return jnp.einsum("...d,dv->...v", x, head, preferred_element_type=jnp.float32)


def forward(
    config: Any, weights: Weights, rope: tuple[Array, float], tokens: Array, positions: Array,
    attention: Any = None,
) -> Array:
    """Full-sequence logits `[B, T, V]` (float32) with causal attention and no cache.

    `attention(q, k, v, valid)` (`q` `[B, T, N, H]`, `k`/`v` `[B, T, K, H]`, `valid` `[B, T]`) replaces the
    blockwise prefill attention (training uses a tiled one that is cheaper to differentiate).
    """
    glob, layers = split_weights(weights)
    x = _embed(glob, tokens)
    valid = positions >= 0

    def blockwise(q: Array, k: Array, v: Array, valid: Array) -> Array:
        return self_attention(config, q, k, v, positions)

    attend = blockwise if attention is None else attention

    def body(x: Array, lw: Weights) -> tuple[Array, None]:
        h = rms_norm(x, lw["attn_norm"], config.rms_norm_eps)
        q, k, v = _qkv(lw, h, positions, rope)
        x = x + _out_proj(lw, attend(q, k, v, valid))
        x = x + _mlp(lw, rms_norm(x, lw["mlp_norm"], config.rms_norm_eps))
        return x, None

    x, _ = jax.lax.scan(body, x, layers)
    return _logits(config, glob, x)


def self_attention(
    config: Any, q: Array, k: Array, v: Array, positions: Array, *, return_lse: bool = False
) -> Array | tuple[Array, Array]:
    """Causal attention of a chunk over its own keys only (`k`, `v` `[B, T, K, H]`, -1 positions masked):
    `forward`'s attention and a one-shot prefill's (whose cache held nothing before the chunk)."""
    kv_heads = k.shape[2]
    k_pos = jnp.broadcast_to(positions[:, None, :], (positions.shape[0], kv_heads, positions.shape[1]))
    return prefill_attention(
        q, positions, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), k_pos, k_pos >= 0,
        sliding_window=config.sliding_window, return_lse=return_lse,
    )


def attends_own_chunk(method: Method) -> bool:
    """Whether a chunk's attention over an empty cache equals its attention over its own keys: the method
    neither rewrites attention nor edits the cache's masks before it (`before_prefill_attention`)."""
    return not method.rewrites_attention and type(method).before_prefill_attention is Method.before_prefill_attention


def _layer_slice(cache: KVCache, i: Array) -> KVCache:
    """Layer `i` of the stacked cache; `state["shared"]` (no `[L]` axis) is passed through whole."""
    per_layer, shared = kvc.split_shared(cache)
    one = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), per_layer)
    return kvc.join_shared(one, shared)


def _layer_write(cache: KVCache, layer_cache: KVCache, i: Array) -> KVCache:
    """Writes layer `i` back; the layer's `state["shared"]` replaces the carried one."""
    per_layer, _ = kvc.split_shared(cache)
    one, shared = kvc.split_shared(layer_cache)
    out = jax.tree.map(
        lambda full, x: jax.lax.dynamic_update_index_in_dim(full, x.astype(full.dtype), i, 0),
        per_layer,
        one,
    )
    return kvc.join_shared(out, shared)


def prefill_chunk(
    config: Any,
    weights: Weights,
    rope: tuple[Array, float],
    method: Method,
    cache: KVCache,
    tokens: Array,
    positions: Array,
    budget: Array,
    *,
    final_chunk: bool = True,
    fresh: bool = False,
) -> tuple[Array, KVCache]:
    """Runs one prompt chunk `[B, T]` through every layer; returns hidden states `[B, T, D]`.

    Each layer appends the chunk's keys / values into `T` extra slots, lets
    `method.before_prefill_attention` see the chunk's queries (retrieval methods write the `attend`
    mask there), attends over the whole cache, then lets `method.prefill` bring the cache back to
    its static capacity. `fresh`: the cache holds nothing yet (a one-shot prefill, row `t` at position
    `t` and -1 after each prompt's end), so each layer attends over the chunk's own keys and never scans
    the cache's empty slots (`attends_own_chunk` methods only; same values).
    """
    if fresh and not attends_own_chunk(method):
        raise ValueError(f"{method.name}: fresh prefill needs a method whose attention reads the plain cache")
    glob, layers = split_weights(weights)
    x = _embed(glob, tokens)

    def body(carry: tuple[Array, KVCache], xs: tuple[Weights, Array]):
        x, cache = carry
        lw, i = xs
        h = rms_norm(x, lw["attn_norm"], config.rms_norm_eps)
        q, k, v = _qkv(lw, h, positions, rope)
        work, step = _chunk_work(config, rope, method, cache, i, q, k, v, positions, budget, final_chunk)
        if method.rewrites_attention:  # e.g. InfLLM's positional scheme
            attn, work = method.prefill_attention(work, q, step)
        else:
            want_lse = method.uses_attention_lse and config.sliding_window is None
            if fresh and not want_lse:  # positions run 0 .. length - 1: a fused causal kernel needs no mask
                attn = causal_prefix_attention(q, k, v, jnp.sum(positions >= 0, axis=1, dtype=jnp.int32),
                                               sliding_window=config.sliding_window)
            elif fresh:
                attn = self_attention(config, q, k, v, positions, return_lse=want_lse)
            else:
                attn = prefill_attention(
                    q, positions, work.k, work.v, work.pos, kvc.valid_mask(work),
                    sliding_window=config.sliding_window, return_lse=want_lse,
                )
            if want_lse:
                attn, lse = attn
                step = dataclasses.replace(step, attention_lse=lse)
        cache = _layer_write(cache, method.prefill(work, q, step), i)
        x = x + _out_proj(lw, attn)
        x = x + _mlp(lw, rms_norm(x, lw["mlp_norm"], config.rms_norm_eps))
        return (x, cache), None

    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
    (x, cache), _ = jax.lax.scan(body, (x, cache), (layers, layer_ids))
    return x, cache


def _chunk_work(
    config: Any, rope: tuple[Array, float], method: Method, cache: KVCache, i: Array, q: Array, k: Array,
    v: Array, positions: Array, budget: Array, final_chunk: bool,
) -> tuple[KVCache, Step]:
    """Layer `i` of `cache` with the chunk's keys / values appended into `T` extra slots, after
    `method.before_prefill_attention`, and the `Step` its prefill hooks see."""
    work = kvc.append(kvc.extend(_layer_slice(cache, i), q.shape[1]), k, v, positions)
    step = Step(
        positions=positions, budget=budget, layer=i, inv_freq=rope[0],
        capacity=cache.capacity, num_layers=config.num_layers, final_chunk=final_chunk,
    )
    return method.before_prefill_attention(work, q, step), step


def prefill_record(
    config: Any, weights: Weights, rope: tuple[Array, float], tokens: Array, positions: Array,
    return_lse: bool = False,
) -> tuple[Array, tuple[tuple[Array, Array, Array], Array | None]]:
    """A one-shot prefill into an empty cache, with no compression: hidden states `[B, T, D]` and every
    layer's post-RoPE queries `[L, B, T, N, H]`, keys and values `[L, B, T, K, H]` (for
    `compress_recorded` to replay any one-shot method's hooks), and with `return_lse` (no sliding window)
    the attention's row log-sum-exp `[L, B, K, G, T]` (else None). Each layer attends over the prompt's
    own keys (`self_attention`), as `prefill_chunk` does over an empty cache: the same values up to float
    rounding (XLA may order the sums differently in the two programs)."""
    if return_lse and config.sliding_window is not None:
        raise ValueError("prefill_record: return_lse needs a model without a sliding window")
    glob, layers = split_weights(weights)

    def body(x: Array, lw: Weights) -> tuple[Array, tuple[tuple[Array, Array, Array], Array | None]]:
        h = rms_norm(x, lw["attn_norm"], config.rms_norm_eps)
        q, k, v = _qkv(lw, h, positions, rope)
        attn = self_attention(config, q, k, v, positions, return_lse=return_lse)
        attn, lse = attn if return_lse else (attn, None)
        x = x + _out_proj(lw, attn)
        x = x + _mlp(lw, rms_norm(x, lw["mlp_norm"], config.rms_norm_eps))
        return x, ((q, k, v), lse)

    return jax.lax.scan(body, _embed(glob, tokens), layers)


def compress_recorded(
    config: Any, rope: tuple[Array, float], method: Method, cache: KVCache, recorded: tuple[Array, Array, Array],
    positions: Array, budget: Array, lse: Array | None = None,
) -> KVCache:
    """`method.prefill` of every layer on an empty `cache` given `prefill_record`'s queries / keys /
    values: what `prefill_chunk` leaves after a one-shot prefill (cross-layer state carried the same way).
    `lse`: the recorded log-sum-exp, handed to the hooks as `step.attention_lse` when given."""

    def body(cache: KVCache, xs: tuple[Array, ...]) -> tuple[KVCache, None]:
        (q, k, v), layer_lse, i = xs
        work, step = _chunk_work(config, rope, method, cache, i, q, k, v, positions, budget, True)
        if layer_lse is not None:
            step = dataclasses.replace(step, attention_lse=layer_lse)
        return _layer_write(cache, method.prefill(work, q, step), i), None

    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
    cache, _ = jax.lax.scan(body, cache, (recorded, lse, layer_ids))
    return cache


def decode_step(
    config: Any,
    weights: Weights,
    rope: tuple[Array, float],
    method: Method,
    cache: KVCache,
    tokens: Array,
    positions: Array,
    budget: Array,
) -> tuple[Array, KVCache]:
    """One token per example (`tokens`, `positions`: `[B]`); returns logits `[B, V]` float32.

    When `method.decode_appends_only`, each layer writes its new token in place into the stacked
    cache and attends over the layer read from it (with `method.decode_evicts_in_place` it then
    evicts the slot `method.decode_eviction` picks, in place too); otherwise the layer is sliced out,
    appended to, transformed by `method.decode` and written back whole. All give the same cache and logits.
    """
    glob, layers = split_weights(weights)
    x = _embed(glob, tokens[:, None])

    def body(carry: tuple[Array, KVCache], xs: tuple[Weights, Array]):
        x, cache = carry
        lw, i = xs
        return _decode_layer(config, rope, method, x, cache, i, lw, i, positions, budget), None

    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
    (x, cache), _ = jax.lax.scan(body, (x, cache), (layers, layer_ids), unroll=decode_unroll())
    return _logits(config, glob, x[:, 0]), cache


def unstack_layers(weights: Weights, cache: KVCache) -> tuple[Weights, list[Weights], list[KVCache], Any]:
    """(global weights, each layer's weights, each layer's cache with a `[1]` layer axis, `state["shared"]`).

    The layout `decode_step_per_layer` runs on: every layer's weights and K / V are buffers of their own."""
    glob, layers = split_weights(weights)
    per_layer, shared = kvc.split_shared(cache)
    num_layers = cache.k.shape[0]
    layer_weights = [{name: w[i] for name, w in layers.items()} for i in range(num_layers)]
    caches = [jax.tree.map(lambda x, i=i: x[i : i + 1], per_layer) for i in range(num_layers)]
    return glob, layer_weights, caches, shared


def stack_layers(caches: Sequence[KVCache], shared: Any) -> KVCache:
    """The stacked cache back from `unstack_layers`' per-layer caches and shared state."""
    return kvc.join_shared(jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *caches), shared)


def decode_step_per_layer(
    config: Any,
    glob: Weights,
    layer_weights: Sequence[Weights],
    rope: tuple[Array, float],
    method: Method,
    caches: Sequence[KVCache],
    shared: Any,
    tokens: Array,
    positions: Array,
    budget: Array,
) -> tuple[Array, list[KVCache], Any]:
    """`decode_step` over per-layer buffers (`unstack_layers`): the same logits and cache, layer by layer.

    Inside a rolled layer scan XLA copies each layer's slice of the stacked weights and K / V out before
    the matmuls read it (three times the bytes a decode step needs); here each layer reads its own
    buffers and writes its token in place. The layers are unrolled, so it compiles slower."""
    x = _embed(glob, tokens[:, None])
    out = []
    for i, (lw, layer_cache) in enumerate(zip(layer_weights, caches, strict=True)):
        x, layer_cache = _decode_layer(
            config, rope, method, x, kvc.join_shared(layer_cache, shared), jnp.int32(0), lw, jnp.int32(i),
            positions, budget,
        )
        layer_cache, shared = kvc.split_shared(layer_cache)
        out.append(layer_cache)
    return _logits(config, glob, x[:, 0]), out, shared


def _decode_layer(
    config: Any, rope: tuple[Array, float], method: Method, x: Array, cache: KVCache, slot: Array,
    lw: Weights, layer_id: Array, positions: Array, budget: Array,
) -> tuple[Array, KVCache]:
    """Layer `layer_id` of the model on `x` `[B, 1, D]`; its K / V are at index `slot` of the stacked `cache`."""
    pos2 = positions[:, None]
    evicts = method.decode_evicts_in_place
    gathers = method.decode_gathers
    in_place = method.decode_appends_only or evicts or gathers
    h = rms_norm(x, lw["attn_norm"], config.rms_norm_eps)
    q, k, v = _qkv(lw, h, pos2, rope)
    step = Step(
        positions=pos2, budget=budget, layer=layer_id, inv_freq=rope[0],
        capacity=cache.capacity, num_layers=config.num_layers,
    )
    if gathers:  # retrieval: attend a compact gathered set, write back only state and attend
        cache = kvc.append_token_in_layer(cache, slot, k, v, pos2)
        attn, cache = _gathered_decode_attention(config, method, cache, slot, q, positions, step)
    else:
        if in_place:
            cache = kvc.append_token_in_layer(cache, slot, k, v, pos2)
            if evicts:
                index, where = method.decode_eviction(_layer_slice(cache, slot), step)
                cache = kvc.evict_in_layer(cache, slot, index, where)
            layer = _layer_slice(cache, slot)
        else:
            layer = method.decode(kvc.append(_layer_slice(cache, slot), k, v, pos2), q, step)
        # In place, the layer's K / V are still those of the stack: a kernel may read them there.
        attn, layer = _masked_decode_attention(config, method, layer, q, positions, step,
                                               stacked=(cache, slot) if in_place else None)
        if not in_place:
            cache = _layer_write(cache, layer, slot)
    x = x + _out_proj(lw, attn[:, None])
    x = x + _mlp(lw, rms_norm(x, lw["mlp_norm"], config.rms_norm_eps))
    return x, cache


def _masked_decode_attention(
    config: Any, method: Method, layer: KVCache, q: Array, positions: Array, step: Step,
    stacked: tuple[KVCache, Array] | None = None,
) -> tuple[Array, KVCache]:
    """The decode attention over every slot of `layer` under its mask (then `method.observe`).
    `stacked`: `(cache, i)` when `layer` is layer `i` of `cache` unchanged, so that the attention may read
    K / V from the stack (`decode_attention(layer=)`: in place on a GPU kernel, a slice elsewhere)."""
    visible = method.query_mask(layer, config.num_heads)
    keys, values, index = layer.k, layer.v, None
    if method.rewrites_attention:
        keys = method.decode_keys(layer, q, step)
    elif stacked is not None and not method.observes_attention:
        keys, values, index = stacked[0].k, stacked[0].v, stacked[1]
    attn = decode_attention(
        q[:, 0], positions, keys, values, layer.pos,
        kvc.valid_mask(layer) if visible is None else visible,
        # A method that rewrites attention (InfLLM's positions) bounds distances itself, at prefill too.
        sliding_window=None if method.rewrites_attention else config.sliding_window,
        return_weights=method.observes_attention, layer=index,
    )
    if method.observes_attention:
        attn, probs = attn
        # Order the attention's reads of K / V before `observe` evicts into them: a data dependency of the
        # scores on the output (+ 0 * each example's sum, exact for finite outputs) lets XLA write the
        # eviction in place instead of copying the layer's K / V every step (BENCHMARKS.md, "Eviction
        # during decode").
        after = 0.0 * jnp.sum(attn.astype(jnp.float32), axis=tuple(range(1, attn.ndim)))  # [B]
        probs = probs + after.reshape((-1,) + (1,) * (probs.ndim - 1))
        if layer.score is not None:
            layer = layer.replace(score=layer.score + after.reshape((-1,) + (1,) * (layer.score.ndim - 1)))
        layer = method.observe(layer, probs, step)
    return attn, layer


def _gathered_decode_attention(
    config: Any, method: Method, cache: KVCache, i: Array, q: Array, positions: Array, step: Step
) -> tuple[Array, KVCache]:
    """`method.decode_slots` picks `[B, K, W]` slots of layer `i`; attention over those alone; the layer's
    `state` and `attend` written back (its K / V / positions were appended in place before)."""

    window = None if method.rewrites_attention else config.sliding_window

    def take(slots: Array) -> tuple[Array, Array, Array]:
        return kvc.take_slots_in_layer(cache, i, slots)

    # Each branch returns the attention and the layer's new (state, attend); the stacked K / V only feed
    # them (a cond that returned the whole cache could copy it).
    def compact(_: None) -> tuple[Array, tuple[Any, Any]]:
        layer, slots, ok = method.decode_slots(_layer_slice(cache, i), q, step, take)
        k, v, pos = take(slots)
        ok = ok & (pos >= 0)
        attn = decode_attention(
            q[:, 0], positions, method.slot_keys(k, pos, q, step), v, pos, ok,
            sliding_window=window, return_weights=method.observes_attention,
        )
        if method.observes_attention:
            attn, probs = attn
            layer = method.observe_slots(layer, probs, slots, pos, ok, step)
        return attn, (layer.state, layer.attend)

    def masked(_: None) -> tuple[Array, tuple[Any, Any]]:  # the general path's attention, K / V left in place
        layer = method.decode_dense(_layer_slice(cache, i), q, step, take)
        attn, layer = _masked_decode_attention(config, method, layer, q, positions, step)
        return attn, (layer.state, layer.attend)

    if method.decode_dense_layers:
        attn, (state, attend) = jax.lax.cond(step.layer < method.decode_dense_layers, masked, compact, None)
    else:
        attn, (state, attend) = compact(None)
    return attn, _state_write(cache, _layer_slice(cache, i).replace(state=state, attend=attend), i)


def _state_write(cache: KVCache, layer: KVCache, i: Array) -> KVCache:
    """Writes layer `i`'s `state` and `attend` back into the stacked cache (its K / V / pos / length untouched)."""
    per_layer, _ = kvc.split_shared(cache)
    one, shared = kvc.split_shared(layer)
    state = jax.tree.map(
        lambda full, x: jax.lax.dynamic_update_index_in_dim(full, x.astype(full.dtype), i, 0),
        per_layer.state, one.state,
    )
    attend = per_layer.attend
    if attend is not None and one.attend is not None:
        attend = jax.lax.dynamic_update_index_in_dim(attend, one.attend, i, 0)
    return kvc.join_shared(per_layer.replace(state=state, attend=attend), shared)


def final_logits(config: Any, weights: Weights, hidden: Array) -> Array:
    """Logits `[..., V]` float32 of final hidden states (before the final norm)."""
    glob, _ = split_weights(weights)
    return _logits(config, glob, hidden)
