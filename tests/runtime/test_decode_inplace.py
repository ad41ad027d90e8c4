"""Decode fast path: methods whose decode only appends write the new token in place into the layer's buffers.

The fast path must give the tokens, logits and cache of the general path (`append`, `method.decode` on the
appended layer), which a subclass overriding `decode` forces: tokens, positions and lengths exactly, floats
within rounding (the two are different programs, which XLA may fuse differently; one decode step is bit for
bit). The in-place writes themselves (`kvc.append_token`, `kvc.evict`) are checked against `kvc.append` and a
NumPy reference of the eviction.
"""

import dataclasses

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
from kvjax.methods import capabilities as caps
from kvjax.methods.base import CacheSpec, Method, Step
from kvjax.runtime import TRACE_COUNTS, forward, step

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


def _random_layer_cache(rng: np.random.Generator, *, batch=3, heads=2, capacity=7, dim=4) -> KVCache:
    length = rng.integers(0, capacity + 1, size=(batch, heads)).astype(np.int32)
    length[0, 1] = capacity  # a full head: `append` clamps its write onto the last slot
    slots = np.arange(capacity)
    pos = np.where(slots < length[..., None], rng.integers(0, 50, size=(batch, heads, capacity)), -1)
    return KVCache(
        k=jnp.asarray(rng.normal(size=(batch, heads, capacity, dim)), jnp.float32),
        v=jnp.asarray(rng.normal(size=(batch, heads, capacity, dim)), jnp.float32),
        pos=jnp.asarray(pos, jnp.int32),
        length=jnp.asarray(length),
        score=jnp.asarray(rng.normal(size=pos.shape), jnp.float32),
        attend=jnp.asarray(rng.random(size=pos.shape) < 0.5),
        state={"per_layer": jnp.arange(batch, dtype=jnp.int32), kvc.SHARED_STATE: {"left": jnp.int32(5)}},
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_append_token_equals_append(seed):
    rng = np.random.default_rng(seed)
    cache = _random_layer_cache(rng)
    k = jnp.asarray(rng.normal(size=(3, 1, 2, 4)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(3, 1, 2, 4)), jnp.float32)
    positions = jnp.asarray([[40], [-1], [9]], jnp.int32)  # the middle example is padding
    assert_trees_equal(jax.jit(kvc.append_token)(cache, k, v, positions), kvc.append(cache, k, v, positions))


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
        assert len(np.unique(np.asarray(fast.cache.stacked().length))) > 1


def test_fast_path_step_logits_are_bit_identical():
    model = tiny_model()
    method = methods.get("snapkv", **ARGS["snapkv"])
    state = kvjax.prefill(model, random_prompts(2, (19, 8)), method=method, max_new_tokens=4)
    decode = jax.jit(forward.decode_step, static_argnums=(0, 3))
    args = (model.weights(), model.rope())
    tokens, positions = jnp.asarray([3, 7], jnp.int32), jnp.asarray(state.prompt_lengths)
    fast_logits, fast_cache = decode(model.config, *args, method, state.cache, tokens, positions, state.budget)
    slow_logits, slow_cache = decode(
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


def _empty(config, method: Method, capacity: int = 64):
    return step.init_cache(method, CacheSpec(batch=2, kv_heads=config.num_kv_heads, capacity=capacity,
                                             num_heads=config.num_heads, head_dim=config.head_dim,
                                             num_layers=config.num_layers, dtype=jnp.float32))


def test_fast_path_writes_no_layer_sized_buffer():
    model = tiny_model()
    config = model.config
    cache = _empty(config, methods.get("full"))
    layer_elems = 2 * config.num_kv_heads * 64 * config.head_dim

    def writes(method: Method) -> list[int]:
        jaxpr = jax.make_jaxpr(forward.decode_step, static_argnums=(0, 3))(
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

    # One token per (example, KV head) per layer: nothing is written back whole (the per-layer buffers are
    # updated where they lie; `test_decode_layout.py` checks the compiled loop for copies).
    assert max(writes(methods.get("full"))) == 2 * config.num_kv_heads * config.head_dim
    assert layer_elems not in writes(methods.get("full"))


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
    forced = type(f"{cls.__name__}GeneralDecode", (cls,), {"evicts_in_place": False})
    return forced(**{f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init})


def test_which_methods_evict_in_place():
    assert caps.evicts_in_place(methods.get("streaming_llm", budget=12))
    assert not caps.evicts_in_place(methods.get("streaming_llm", budget=12, rerotate=True))  # rewrites keys
    assert not caps.evicts_in_place(general_path(methods.get("streaming_llm", budget=12)))
    for name in ("full", "snapkv", "h2o", "tova", "lagkv"):
        assert not caps.evicts_in_place(methods.get(name, **ARGS.get(name, {"budget": 12}))), name


def _evict_reference(cache: KVCache, slot: np.ndarray, where: np.ndarray | None) -> dict[str, np.ndarray]:
    """NumPy `evict`: per head with a slot to drop, the last valid slot moves into the victim's place and the
    last slot is cleared (pos -1, score 0, attend True); the length drops by one."""
    out = {name: np.array(getattr(cache, name)) for name in ("k", "v", "pos", "score", "attend", "length")}
    empty = {"pos": -1, "score": 0.0, "attend": True}
    for b in range(slot.shape[0]):
        for h in range(slot.shape[1]):
            last = int(out["length"][b, h]) - 1
            if last < 0 or (where is not None and not where[b, h]):
                continue
            victim = min(max(int(slot[b, h]), 0), cache.capacity - 1)
            for name in ("k", "v", "pos", "score", "attend"):
                out[name][b, h, victim] = out[name][b, h, last]
                if name in empty:
                    out[name][b, h, last] = empty[name]
            out["length"][b, h] = last
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_evict_equals_the_numpy_reference(seed):
    rng = np.random.default_rng(10 + seed)
    cache = _random_layer_cache(rng)
    length = np.asarray(cache.length)
    slot = rng.integers(0, 7, size=length.shape).astype(np.int32)
    slot[0, 0] = max(int(length[0, 0]) - 1, 0)  # the victim is the last slot itself
    where = rng.random(size=length.shape) < 0.7
    where[0, 0] = True
    for w in (where, None):
        got = jax.jit(kvc.evict)(cache, jnp.asarray(slot), None if w is None else jnp.asarray(w))
        for name, expect in _evict_reference(cache, slot, w).items():
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), expect, err_msg=name)
        assert_trees_equal(got.state, cache.state)


@pytest.mark.parametrize("case", sorted(EVICTING))
def test_in_place_eviction_generates_the_same_tokens_and_cache_as_the_general_path(case):
    model = tiny_model()
    prompts = random_prompts(11, (17, 5, 30))  # ragged; the 5-token prompt grows into its budget before evicting
    method = methods.get("streaming_llm", **EVICTING[case])
    assert caps.evicts_in_place(method)
    fast = kvjax.generate(model, prompts, method=method, max_new_tokens=9, return_cache=True)
    slow = kvjax.generate(model, prompts, method=general_eviction_path(method), max_new_tokens=9, return_cache=True)
    np.testing.assert_array_equal(fast.tokens, slow.tokens)
    np.testing.assert_array_equal(fast.num_tokens, slow.num_tokens)
    assert_caches_close(fast.cache, slow.cache, tol=1e-5, name=case)
    # The ring did evict: the 30-token prompt's heads hold their budget, not the whole history.
    assert int(np.asarray(fast.cache.stacked().length).max()) <= fast.cache.capacity - 1 < 30 + 9


def test_in_place_eviction_writes_no_layer_sized_buffer():
    model = tiny_model()
    config = model.config
    method = methods.get("streaming_llm", budget=63)
    cache = _empty(config, method)
    jaxpr = jax.make_jaxpr(forward.decode_step, static_argnums=(0, 3))(
        config, model.weights(), model.rope(), method, cache, jnp.zeros(2, jnp.int32), jnp.full(2, 70, jnp.int32),
        jnp.full(2, 63, jnp.int32),
    )
    assert max(_cache_writes(jaxpr.jaxpr)) == 2 * config.num_kv_heads * config.head_dim
