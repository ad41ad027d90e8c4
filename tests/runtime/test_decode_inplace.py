"""Decode fast path: methods whose decode only appends write the new token in place into the stacked cache.

The fast path must give the tokens, logits and cache of the general path (slice the layer out, `append`,
`method.decode`, write the layer back), which a subclass overriding `decode` forces: tokens, positions and
lengths exactly, floats within rounding (the two are different programs, which XLA may fuse differently; one
step of the stacked scan is bit for bit).
"""

import dataclasses
import importlib

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import assert_caches_close, assert_trees_equal, random_prompts, tiny_model

import kvjax
from kvjax import cache as kvc
from kvjax import methods
from kvjax.cache import KVCache
from kvjax.methods.base import Method, Step
from kvjax.models import transformer
from kvjax.runtime import TRACE_COUNTS

FAST = ["full", "snapkv", "pyramidkv", "adakv", "lagkv"]
ARGS = {
    "full": {},
    "snapkv": {"budget": 12, "window_size": 4},
    "pyramidkv": {"budget": 12, "window_size": 4},
    "adakv": {"budget": 12, "base_args": {"window_size": 4}},
    # LagKV without decode-time compression only appends at decode (it used to take the general path).
    "lagkv": {"budget": 12, "sink_size": 2, "lag_size": 4, "compress_decode": False},
}


def general_path(method: Method) -> Method:
    """The same method with a trivially overridden `decode`, which sends decode down the general path."""

    def decode(self: Method, cache: KVCache, q: jax.Array, step: Step) -> KVCache:
        return cache

    cls = type(method)
    forced = type(f"{cls.__name__}GeneralDecode", (cls,), {"decode": decode})
    return forced(**{f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init})






def test_which_methods_take_the_fast_path():
    for name in ("full", "snapkv", "pyramidkv", "knorm", "adakv", "lagkv"):
        assert methods.get(name, **ARGS.get(name, {"budget": 12})).decode_appends_only, name
    # Eviction at decode, attention observers and per-query-head masks keep the general path.
    for name in ("streaming_llm", "h2o", "tova", "sagekv", "lagkv"):
        assert not methods.get(name, budget=12).decode_appends_only, name
    assert not general_path(methods.get("full")).decode_appends_only
    assert not general_path(methods.get("lagkv", **ARGS["lagkv"])).decode_appends_only


def _random_stacked_cache(rng: np.random.Generator, *, layers=3, batch=3, heads=2, capacity=7, dim=4) -> KVCache:
    length = rng.integers(0, capacity + 1, size=(layers, batch, heads)).astype(np.int32)
    length[1, 0, 1] = capacity  # a full head: `append` clamps its write onto the last slot
    slots = np.arange(capacity)
    pos = np.where(slots < length[..., None], rng.integers(0, 50, size=(layers, batch, heads, capacity)), -1)
    return KVCache(
        k=jnp.asarray(rng.normal(size=(layers, batch, heads, capacity, dim)), jnp.float32),
        v=jnp.asarray(rng.normal(size=(layers, batch, heads, capacity, dim)), jnp.float32),
        pos=jnp.asarray(pos, jnp.int32),
        length=jnp.asarray(length),
        score=jnp.asarray(rng.normal(size=pos.shape), jnp.float32),
        attend=jnp.asarray(rng.random(size=pos.shape) < 0.5),
        state={"per_layer": jnp.arange(layers, dtype=jnp.int32), kvc.SHARED_STATE: {"left": jnp.int32(5)}},
    )


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_append_token_in_layer_equals_slice_append_write(layer):
    rng = np.random.default_rng(layer)
    cache = _random_stacked_cache(rng)
    k = jnp.asarray(rng.normal(size=(3, 1, 2, 4)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(3, 1, 2, 4)), jnp.float32)
    positions = jnp.asarray([[40], [-1], [9]], jnp.int32)  # the middle example is padding
    i = jnp.int32(layer)
    expect = transformer._layer_write(cache, kvc.append(transformer._layer_slice(cache, i), k, v, positions), i)
    got = jax.jit(kvc.append_token_in_layer)(cache, i, k, v, positions)
    assert_trees_equal(got, expect)


@pytest.mark.parametrize("name", FAST)
def test_fast_path_generates_the_same_tokens_and_cache_as_the_general_path(name):
    model = tiny_model()  # GQA: 4 query heads over 2 KV heads
    prompts = random_prompts(1, (17, 5, 30))  # ragged, one prompt shorter than the budget
    method = methods.get(name, **ARGS[name])
    assert method.decode_appends_only
    fast = kvjax.generate(model, prompts, method=method, max_new_tokens=7, return_cache=True)
    slow = kvjax.generate(model, prompts, method=general_path(method), max_new_tokens=7, return_cache=True)
    np.testing.assert_array_equal(fast.tokens, slow.tokens)
    np.testing.assert_array_equal(fast.num_tokens, slow.num_tokens)
    assert_caches_close(fast.cache, slow.cache, tol=1e-5, name=name)
    if name == "adakv":  # per-KV-head lengths differ, so the slots written differ per head
        assert len(np.unique(np.asarray(fast.cache.length))) > 1


def test_fast_path_step_logits_are_bit_identical():
    model = tiny_model()
    method = methods.get("snapkv", **ARGS["snapkv"])
    state = kvjax.prefill(model, random_prompts(2, (19, 8)), method=method, max_new_tokens=4)
    step = jax.jit(transformer.decode_step, static_argnums=(0, 3))
    args = (model.weights(), model.rope())
    tokens, positions = jnp.asarray([3, 7], jnp.int32), jnp.asarray(state.prompt_lengths)
    fast_logits, fast_cache = step(model.config, *args, method, state.cache, tokens, positions, state.budget)
    slow_logits, slow_cache = step(
        model.config, *args, general_path(method), state.cache, tokens, positions, state.budget
    )
    np.testing.assert_array_equal(np.asarray(fast_logits), np.asarray(slow_logits))
    assert_trees_equal(fast_cache, slow_cache)


def _cache_writes(jaxpr: jax.extend.core.Jaxpr) -> list[int]:
    """Element counts of every update written by a dynamic_update_slice / scatter, sub-jaxprs included."""
    sizes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dynamic_update_slice":
            sizes.append(int(np.prod(eqn.invars[1].aval.shape)))
        elif eqn.primitive.name.startswith("scatter"):
            sizes.append(int(np.prod(eqn.invars[2].aval.shape)))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            sizes += _cache_writes(sub)
    return sizes


def test_fast_path_writes_no_layer_sized_buffer():
    model = tiny_model()
    config = model.config
    cache = kvc.init(2, config.num_kv_heads, 64, config.head_dim, jnp.float32, num_layers=config.num_layers)
    layer_elems = 2 * config.num_kv_heads * 64 * config.head_dim

    def writes(method: Method) -> list[int]:
        jaxpr = jax.make_jaxpr(transformer.decode_step, static_argnums=(0, 3))(
            config,
            model.weights(),
            model.rope(),
            method,
            cache,
            jnp.zeros(2, jnp.int32),
            jnp.full(2, 5, jnp.int32),
            jnp.full(2, 64, jnp.int32),
        )
        return _cache_writes(jaxpr.jaxpr)

    full = methods.get("full")
    assert max(writes(full)) == 2 * config.num_kv_heads * config.head_dim  # one token per (example, KV head)
    assert max(writes(general_path(full))) == layer_elems  # the general path writes each layer back


def test_fast_path_decode_traces_once():
    model = tiny_model()
    prompts = random_prompts(3, (20,)), random_prompts(4, (27,))  # same length bucket
    kvjax.generate(model, prompts[0], method="snapkv", method_args=ARGS["snapkv"], max_new_tokens=5)
    before = TRACE_COUNTS["decode_step"]
    kvjax.generate(model, prompts[1], method="snapkv", method_args=ARGS["snapkv"], max_new_tokens=5)
    assert TRACE_COUNTS["decode_step"] == before


# ---- in-place eviction (StreamingLLM: append, then evict the oldest non-sink slot) -------------------------

EVICTING = {
    "budget": {"budget": 10},
    "ratio": {"compression_ratio": 0.5},
    "no_sinks": {"budget": 6, "sink_size": 0},
}


def general_eviction_path(method: Method) -> Method:
    """The same method (its own `decode`) with the in-place eviction switched off: the general path."""
    cls = type(method)
    forced = type(f"{cls.__name__}GeneralDecode", (cls,), {"decode_evicts_in_place": False})
    return forced(**{f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init})


def test_which_methods_evict_in_place():
    assert methods.get("streaming_llm", budget=12).decode_evicts_in_place
    assert not methods.get("streaming_llm", budget=12, rerotate=True).decode_evicts_in_place  # rewrites keys
    assert not general_path(methods.get("streaming_llm", budget=12)).decode_evicts_in_place
    for name in ("full", "snapkv", "h2o", "tova", "lagkv"):
        assert not methods.get(name, **ARGS.get(name, {"budget": 12})).decode_evicts_in_place, name


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_evict_in_layer_equals_slice_evict_write(layer):
    rng = np.random.default_rng(10 + layer)
    cache = _random_stacked_cache(rng)
    length = np.asarray(cache.length[layer])
    slot = jnp.asarray(rng.integers(0, 7, size=length.shape), jnp.int32)
    slot = slot.at[0, 0].set(max(int(length[0, 0]) - 1, 0))  # the victim is the last slot itself
    where = jnp.asarray(rng.random(size=length.shape) < 0.7).at[0, 0].set(True)
    i = jnp.int32(layer)
    for w in (where, None):
        expect = transformer._layer_write(cache, kvc.evict(transformer._layer_slice(cache, i), slot, w), i)
        got = jax.jit(kvc.evict_in_layer)(cache, i, slot, w)
        assert_trees_equal(got, expect)


@pytest.mark.parametrize("case", sorted(EVICTING))
def test_in_place_eviction_generates_the_same_tokens_and_cache_as_the_general_path(case):
    model = tiny_model()
    prompts = random_prompts(11, (17, 5, 30))  # ragged; the 5-token prompt grows into its budget before evicting
    method = methods.get("streaming_llm", **EVICTING[case])
    assert method.decode_evicts_in_place
    fast = kvjax.generate(model, prompts, method=method, max_new_tokens=9, return_cache=True)
    slow = kvjax.generate(model, prompts, method=general_eviction_path(method), max_new_tokens=9, return_cache=True)
    np.testing.assert_array_equal(fast.tokens, slow.tokens)
    np.testing.assert_array_equal(fast.num_tokens, slow.num_tokens)
    assert_caches_close(fast.cache, slow.cache, tol=1e-5, name=case)
    # The ring did evict: the 30-token prompt's heads hold their budget, not the whole history.
    assert int(np.asarray(fast.cache.length).max()) <= fast.cache.capacity - 1 < 30 + 9


def test_in_place_eviction_writes_no_layer_sized_buffer():
    model = tiny_model()
    config = model.config
    method = methods.get("streaming_llm", budget=63)
    cache = kvc.init(2, config.num_kv_heads, 64, config.head_dim, jnp.float32, num_layers=config.num_layers)
    jaxpr = jax.make_jaxpr(transformer.decode_step, static_argnums=(0, 3))(
        config, model.weights(), model.rope(), method, cache, jnp.zeros(2, jnp.int32), jnp.full(2, 70, jnp.int32),
        jnp.full(2, 63, jnp.int32),
    )
    assert max(_cache_writes(jaxpr.jaxpr)) == 2 * config.num_kv_heads * config.head_dim
    slow = jax.make_jaxpr(transformer.decode_step, static_argnums=(0, 3))(
        config, model.weights(), model.rope(), general_eviction_path(method), cache, jnp.zeros(2, jnp.int32),
        jnp.full(2, 70, jnp.int32), jnp.full(2, 63, jnp.int32),
    )
    assert max(_cache_writes(slow.jaxpr)) == 2 * config.num_kv_heads * 64 * config.head_dim


@pytest.mark.parametrize("name", ["full", "streaming_llm", "infllm"])
def test_unrolled_layer_scan_generates_the_same_tokens_and_cache(monkeypatch, name):
    """`transformer.DECODE_UNROLL` (layers per iteration of the decode step's layer scan) changes how XLA lays
    the loop out, never the result: in-place, evicting and gathering decode paths alike."""
    model = tiny_model()
    prompts = random_prompts(3, (17, 5, 30))
    args = {"full": {}, "streaming_llm": {"budget": 12},
            "infllm": {"topk": 2, "block_size": 4, "n_init": 4, "n_local": 8, "repr_topk": 2}}[name]
    method = methods.get(name, **args)
    # The knob shapes the stacked layer scan, which CPUs leave for per-layer buffers by default.
    generate_module = importlib.import_module("kvjax.runtime.generate")
    monkeypatch.setitem(generate_module.PER_LAYER_DECODE_BYTES, jax.default_backend(), 0)
    rolled = kvjax.generate(model, prompts, method=method, max_new_tokens=6, return_cache=True)
    monkeypatch.setitem(transformer.DECODE_UNROLL, jax.default_backend(), True)
    assert transformer.decode_unroll() is True
    jax.clear_caches()  # the knob is read when the decode step is traced
    unrolled = kvjax.generate(model, prompts, method=method, max_new_tokens=6, return_cache=True)
    np.testing.assert_array_equal(unrolled.tokens, rolled.tokens)
    np.testing.assert_allclose(np.asarray(unrolled.cache.k), np.asarray(rolled.cache.k), atol=2e-5)  # fusion rounding
    np.testing.assert_array_equal(np.asarray(unrolled.cache.pos), np.asarray(rolled.cache.pos))
