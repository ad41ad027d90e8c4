"""kvjax's model run with a compressed cache: the decoder block composed with the per-layer step API.

Weights and cache are stored per layer (`kvjax.models.block`, `kvjax.cache.ModelCache`), so every layer
reads its own buffers where they lie:

* Prefill runs one compiled program per layer shape (`prefill_block`), called once per layer and chunk
  from Python with the layer's weights and cache (the cache donated). Compile time does not grow with
  depth, and a prompt's cost is compute-bound, so the per-layer dispatch costs nothing measurable.
* Decode (`decode_step`) unrolls the layers inside the decode loop's one program: a step is memory-bound,
  and each layer's matmuls and attention read its weights and K / V in place (a rolled scan over stacked
  arrays made XLA copy every layer's slice first: 0.94 TB/s on an H200 where per-layer buffers moved up
  to 3.1 TB/s, `shared/notes/gpu-2026-11.md`).

Names: `step.*_layer` is the attention of one layer through its cache (the per-layer step API a model calls);
`forward.*_block` is a jitted program of one whole decoder block (norms, projections, MLP) around it.

Each layer runs as the config says (`ModelConfig.layer_window`): a layer without a window through the method
(`step.prefill_layer` / `step.decode_layer`), a sliding-window layer through its ring (`step.prefill_window_layer`
/ `step.decode_window_layer`), each with its RoPE (`block.layer_rope`).

The layer inputs a method reads (`Method.layer_inputs`) are computed here from the block's weights and input
(`BLOCK_INPUTS`, `block_inputs`), inside the layer's program and only for a method that reads them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import tuning
from kvjax.cache import KVCache, ModelCache
from kvjax.methods.base import LAYER_INPUTS, Method
from kvjax.models import block
from kvjax.runtime import sharding, step

Array = jax.Array

#: How many times each jitted program body was traced (tests assert one trace per shape bucket).
TRACE_COUNTS: collections.Counter[str] = collections.Counter()


@functools.partial(jax.jit, static_argnums=0)
def embed(config: Any, weights: dict, tokens: Array) -> Array:
    """Input embeddings `[B, T, D]` of a prompt chunk (`weights`: the global ones, `block.global_weights`)."""
    return block.embed(config, weights, tokens)


#: How kvjax's decoder block gives each layer input the model passes to the step API (`LAYER_INPUTS` but those the
#: step's attention computes): from the model config, the layer's weights `lw` and its input `x` `[B, T, D]` (None
#: for an input of the weights alone, `LayerInput.weights_only`).
BLOCK_INPUTS: dict[str, Callable[[Any, dict, Array | None], Array]] = {
    # The attention input: the block computes the same norm for q / k / v, and XLA shares the two.
    "hidden": lambda config, lw, x: block.norm(config, x, lw["attn_norm"]),
    "out_proj": lambda config, lw, x: lw["o"],  # stored [N, H, D]
}


def block_inputs(config: Any, names: Iterable[str], lw: dict, x: Array | None, *,
                 decode: bool = False) -> dict[str, Array]:
    """`{name: value}` of the layer inputs among `names` (a method's `layer_inputs`) that the block gives (at decode
    only those given at decode), computed from the layer's weights `lw` and its input `x` `[B, T, D]`; with `x` None
    only those of the weights alone."""
    wanted = [name for name in sorted(names) if not LAYER_INPUTS[name].from_attention
              and (LAYER_INPUTS[name].at_decode or not decode) and (x is not None or LAYER_INPUTS[name].weights_only)]
    return {name: BLOCK_INPUTS[name](config, lw, x) for name in wanted}


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), static_argnames=("mesh",), donate_argnums=(7, 8))
def prefill_block(config: Any, method: Method, final_chunk: bool, fresh: bool, tune: tuning.Tuning, lw: dict,
                  rope: tuple, cache: KVCache, x: Array, positions: Array, budget: Array, layer: Array,
                  mesh: Any = None) -> tuple[Array, KVCache]:
    """One prompt chunk `x` `[B, T, D]` through one decoder layer without a window and its cache
    (`ModelCache.layer`): the layer's output and its new cache. One program serves every layer of a shape (`layer`
    is traced: its index among the global layers, `ModelConfig.method_layer`); `tune` is the `kvjax.tuning` in force
    (static: another tuning compiles another program); `rope`: the layer's `(inv_freq, scaling)`."""
    TRACE_COUNTS["prefill"] += 1

    def attention(q: Array, k: Array, v: Array) -> tuple[Array, KVCache]:
        return step.prefill_layer(method, cache, q, k, v, positions, budget, layer=layer, inv_freq=rope[0],
                                  num_layers=config.method_layers, final_chunk=final_chunk, fresh=fresh,
                                  rope_scaling=rope[1], **block_inputs(config, method.layer_inputs, lw, x))

    # Pallas kernels run per shard of `mesh` (a static argument); the ops read `tune` while tracing.
    with sharding.kernel_mesh(mesh), tuning.use(tune):
        x, cache = block.decoder_block(config, lw, x, positions, rope, attention)
    if mesh is not None:
        cache = sharding.constrain_cache(cache, mesh)
    return x, cache


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), static_argnames=("mesh",), donate_argnums=(6, 7))
def prefill_window_block(config: Any, window: int, fresh: bool, tune: tuning.Tuning, lw: dict, rope: tuple,
                         cache: KVCache, x: Array, positions: Array, mesh: Any = None) -> tuple[Array, KVCache]:
    """One prompt chunk `x` `[B, T, D]` through a sliding-window layer and its ring (`step.prefill_window_layer`);
    `rope`: the layer's own `(inv_freq, scaling)`."""
    TRACE_COUNTS["prefill_window"] += 1

    def attention(q: Array, k: Array, v: Array) -> tuple[Array, KVCache]:
        return step.prefill_window_layer(cache, q, k, v, positions, window=window, fresh=fresh)

    with sharding.kernel_mesh(mesh), tuning.use(tune):
        x, cache = block.decoder_block(config, lw, x, positions, rope, attention)
    if mesh is not None:
        cache = sharding.constrain_cache(cache, mesh)
    return x, cache


def prefill_chunk(config: Any, weights: dict, rope: tuple, method: Method, cache: ModelCache, tokens: Array,
                  positions: Array, budget: Array, *, final_chunk: bool = True, fresh: bool = False,
                  ring_fresh: bool | None = None, mesh: Any = None) -> tuple[Array, ModelCache]:
    """One prompt chunk `[B, T]` through every layer (see `kvjax.runtime.step.prefill_layer`): the final
    hidden states `[B, T, D]` and the cache. Each layer's cache is donated to its program. `rope`:
    `block.Ropes` (or one `(inv_freq, scaling)` pair). `fresh` is for the method's layers, `ring_fresh` (default:
    `fresh`) for the sliding-window layers' rings: empty, and the chunk starts at position 0."""
    x = embed(config, block.global_weights(weights), tokens)
    tune = tuning.current()
    ring_fresh = fresh if ring_fresh is None else ring_fresh
    for i, lw in enumerate(weights["layers"]):
        window, layer_rope = config.layer_window(i), block.layer_rope(config, rope, i)
        if window is None:
            x, layer_cache = prefill_block(config, method, final_chunk, fresh, tune, lw, layer_rope, cache.layer(i),
                                           x, positions, budget, np.int32(config.method_layer(i)), mesh=mesh)
        else:
            x, layer_cache = prefill_window_block(config, window, ring_fresh, tune, lw, layer_rope, cache.layer(i),
                                                  x, positions, mesh=mesh)
        cache = cache.with_layer(i, layer_cache)
    return x, cache


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(5,))
def replay_block(config: Any, method: Method, tune: tuning.Tuning, lw: dict, rope: tuple, cache: KVCache, x: Array,
                 positions: Array, span: Array, layer: Array, replay_gradient: Array | None = None,
                 ) -> tuple[Array, KVCache]:
    """One replay chunk `x` `[B, R, D]` through one decoder layer (`step.replay_layer`): the layer's output and its
    cache with the method's replay scores (`replay_gradient`: the rows' objective gradient norms, KVgrad's)."""
    TRACE_COUNTS["replay"] += 1

    def attention(q: Array, k: Array, v: Array) -> tuple[Array, KVCache]:
        return step.replay_layer(method, cache, q, k, v, positions, span, layer=layer, inv_freq=rope[0],
                                 num_layers=config.method_layers, replay_gradient=replay_gradient,
                                 **block_inputs(config, method.layer_inputs, lw, x))

    with tuning.use(tune):
        return block.decoder_block(config, lw, x, positions, rope, attention)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def replay_window_block(config: Any, window: int, tune: tuning.Tuning, lw: dict, rope: tuple, cache: KVCache,
                        x: Array, positions: Array) -> Array:
    """One replay chunk through a sliding-window layer (`step.replay_window_layer`): the layer's output (the ring
    is only read)."""
    TRACE_COUNTS["replay_window"] += 1

    def attention(q: Array, k: Array, v: Array) -> tuple[Array, KVCache]:
        return step.replay_window_layer(cache, q, k, v, positions, window=window)

    with tuning.use(tune):
        return block.decoder_block(config, lw, x, positions, rope, attention)[0]


def replay_chunk(config: Any, weights: dict, rope: tuple, method: Method, cache: ModelCache, tokens: Array,
                 positions: Array, span: Array, replay_gradients: list | None = None) -> ModelCache:
    """One replay chunk of a `ContextReplay` method (`[B, R]` tokens at `positions`, reconstructing the prompt
    positions `span` `[B, 2]`) through every layer: the cache with each managed layer's replay scores (every
    layer's slots unchanged; a sliding-window layer's ring is only attended). `replay_gradients`: per layer, the rows'
    objective gradient norms `[B, R]` (`replay_gradient_chunk`)."""
    x = embed(config, block.global_weights(weights), tokens)
    tune = tuning.current()
    for i, lw in enumerate(weights["layers"]):
        window, layer_rope = config.layer_window(i), block.layer_rope(config, rope, i)
        if window is not None:
            x = replay_window_block(config, window, tune, lw, layer_rope, cache.layer(i), x, positions)
            continue
        x, layer_cache = replay_block(config, method, tune, lw, layer_rope, cache.layer(i), x, positions, span,
                                      np.int32(config.method_layer(i)),
                                      None if replay_gradients is None else replay_gradients[i])
        cache = cache.with_layer(i, layer_cache)
    return cache


def replay_gradient_chunk(config: Any, weights: dict, rope: tuple, method: Method, cache: ModelCache, tokens: Array,
                          positions: Array, span: Array) -> ModelCache:
    """`replay_chunk` for a method with `replay_objective` (KVgrad): the objective, the sum of squares of the last
    layer's output over the real rows, is differentiated with respect to each layer's attention output, and each
    managed layer's scores get the rows' gradient norms.

    Layer by layer, as the prefill runs (one program per layer shape, memory of one layer at a time): a forward keeps
    each layer's input, a backward from the last layer to the first takes each layer's vector-Jacobian product (its
    forward recomputed), and `replay_chunk` then scores with the norms. The gradient passes take the ops' XLA paths,
    which have gradients (no Pallas kernel; `prefill_attention` blockwise)."""
    tune = dataclasses.replace(tuning.current(), auto_pallas=frozenset(), auto_prefill="xla")
    x, inputs = embed(config, block.global_weights(weights), tokens), []
    layers = list(enumerate(weights["layers"]))
    for i, lw in layers:
        inputs.append(x)
        x = _replay_layer_forward(config, config.layer_window(i), tune, lw, block.layer_rope(config, rope, i),
                                  cache.layer(i), x, positions)
    grad, norms = _objective_gradient(x, positions), [None] * len(layers)
    for i, lw in reversed(layers):
        grad, norms[i] = _replay_layer_backward(config, config.layer_window(i), tune, lw,
                                                block.layer_rope(config, rope, i), cache.layer(i), inputs[i],
                                                positions, grad)
    return replay_chunk(config, weights, rope, method, cache, tokens, positions, span, replay_gradients=norms)


def _replay_attention(cache: KVCache, positions: Array, window: int | None) -> Callable:
    """The replay rows' attention over a layer's cache and their own earlier tokens (`step.replay_layer`'s, or
    `step.replay_window_layer`'s on a ring), without scoring."""
    def attention(q: Array, k: Array, v: Array) -> tuple[Array, None]:
        if window is not None:
            return step.replay_window_layer(cache, q, k, v, positions, window=window)[0], None
        return step.replay_attention(cache, q, k, v, positions), None
    return attention


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _replay_layer_forward(config: Any, window: int | None, tune: tuning.Tuning, lw: dict, rope: tuple, cache: KVCache,
                          x: Array, positions: Array) -> Array:
    TRACE_COUNTS["replay_forward"] += 1
    with tuning.use(tune):
        return block.decoder_block(config, lw, x, positions, rope, _replay_attention(cache, positions, window))[0]


@jax.jit
def _objective_gradient(out: Array, positions: Array) -> Array:
    """The gradient of `sum ||out||^2` over the real rows with respect to `out`, in its dtype."""
    return jnp.where((positions >= 0)[..., None], 2.0 * out.astype(jnp.float32), 0.0).astype(out.dtype)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _replay_layer_backward(config: Any, window: int | None, tune: tuning.Tuning, lw: dict, rope: tuple,
                           cache: KVCache, x: Array, positions: Array, grad_out: Array) -> tuple[Array, Array]:
    """One layer's vector-Jacobian product: (the gradient with respect to its input, each row's norm `[B, R]` of the
    gradient with respect to its attention output), given the gradient with respect to its output."""
    TRACE_COUNTS["replay_backward"] += 1

    def layer(x: Array, delta: Array) -> Array:
        attention = _replay_attention(cache, positions, window)
        return block.decoder_block(config, lw, x, positions, rope, attention, attn_delta=delta)[0]

    with tuning.use(tune):
        _, vjp = jax.vjp(layer, x, jnp.zeros_like(x))
        grad_x, grad_attention = vjp(grad_out)
    norms = jnp.linalg.norm(grad_attention.astype(jnp.float32), axis=-1)
    return grad_x, jnp.where(positions >= 0, norms, 0.0)


def decode_step(config: Any, weights: dict, rope: tuple, method: Method, cache: ModelCache, tokens: Array,
                positions: Array, budget: Array, active: Array | None = None) -> tuple[Array, ModelCache]:
    """One token per example (`tokens`, `positions` `[B]`) through every layer, unrolled (traced inside the
    decode loop, under the caller's `kvjax.tuning.use`): logits `[B, V]` float32 and the cache. `active` `[B]`
    bool (None: every row): the rows whose token enters the cache; the others' caches stay as they were
    (`step.decode_layer`), their logits are the caller's to ignore. A layer the fused decode kernel takes under the
    tuning (`step.fuses_decode`) runs RoPE, its cache write and its attention as one op."""
    x = block.embed(config, weights, tokens[:, None])
    pos = positions[:, None]
    for i, lw in enumerate(weights["layers"]):
        layer_cache, window = cache.layer(i), config.layer_window(i)

        def attention(q: Array, k: Array, v: Array, layer_rope: tuple | None = None, query_scale: float = 1.0,
                      i: int = i, layer_cache: KVCache = layer_cache, window: int | None = window, x: Array = x,
                      lw: dict = lw, qkv: Array | None = None, qk_norm: tuple | None = None):
            if window is not None:
                return step.decode_window_layer(layer_cache, q, k, v, pos, window=window, active=active,
                                                rope=layer_rope, query_scale=query_scale, qkv=qkv, qk_norm=qk_norm)
            return step.decode_layer(method, layer_cache, q, k, v, pos, budget, layer=config.method_layer(i),
                                     inv_freq=rope[0], num_layers=config.method_layers, active=active,
                                     rope=layer_rope, query_scale=query_scale, qkv=qkv, qk_norm=qk_norm,
                                     **block_inputs(config, method.layer_inputs, lw, x, decode=True))

        # Where the fused decode kernel takes the layer, the block hands over q / k before RoPE (`block.PreRope`).
        fused = step.fuses_decode(method, layer_cache) if window is None else step.fuses_window(layer_cache)
        x, layer_cache = block.decoder_block(config, lw, x, pos, block.layer_rope(config, rope, i),
                                             block.PreRope(attention) if fused else attention)
        cache = cache.with_layer(i, layer_cache)
    return block.logits(config, weights, x[:, 0]), cache


def final_logits(config: Any, weights: dict, hidden: Array) -> Array:
    """Logits `[..., V]` float32 of final hidden states (before the final norm)."""
    return _final_logits(config, block.global_weights(weights), hidden)


@functools.partial(jax.jit, static_argnums=0)
def _final_logits(config: Any, weights: dict, hidden: Array) -> Array:
    return block.logits(config, weights, hidden)
