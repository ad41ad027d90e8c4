"""The method protocol, for every registered method (`kvjax.methods.available()`), through the per-layer step API.

Oracle: the protocol's invariants (kvjax/methods/base.py, docs/design.md), on random post-RoPE q / k / v of a
ragged batch run through `step.prefill_layer` (a one-shot prompt and a chunked one where the method allows it)
and then `step.decode_layer` over every layer with the cross-layer state carried:

* every layer's cache comes back at its static capacity; valid slots are packed at the front (`slot < length`
  exactly where `pos >= 0`) and never exceed the capacity;
* the kept positions are positions the example really had, each at most once, and within the example's budget
  plus its generated tokens where the method has a budget on the prompt;
* the attention output is finite and zero-free for real queries; traced (jit) equals eager for one method of each
  kind (eager runs op by op, ~2/3 of the check's time; the hooks have no tracer-dependent branch);
* decode keeps every slot a method attends in its cache (capacity never grows), and the step appends the token.
"""

import dataclasses
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from golden_cases import METHODS, every_method

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods import capabilities as caps
from kvjax.methods.base import CacheSpec, per_example_budget
from kvjax.methods.scorer import ScoringMethod
from kvjax.runtime import step

B, N, K, H, LAYERS = 3, 4, 2, 16, 2
LENGTHS = np.array([37, 12, 40])
NEW = 4
#: The layers' output projection W_o `[N, H, D]` (read by the output-aware methods through `Step.out_proj`).
OUT_PROJ = jnp.asarray(np.random.default_rng(5).normal(size=(N, H, 24)) / np.sqrt(N * H), jnp.float32)
#: The width of the layers' hidden states (`Step.hidden`, read by KVzap: its generated weights take 64).
D = 64


def _inputs(rng: np.random.Generator, t: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    q = jnp.asarray(rng.normal(size=(B, t, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, t, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, t, K, H)), jnp.float32)
    return q, k, v


def _hidden(q: jax.Array) -> jax.Array:
    """Hidden states `[B, T, D]` for the queries' rows (a fixed function of them, so reruns agree)."""
    flat = q.reshape(q.shape[0], q.shape[1], -1)
    return jnp.tile(flat, (1, 1, -(-D // flat.shape[-1])))[..., :D]


def _check_layer(cache, seen: list[set[int]], name: str) -> None:
    pos, length = np.asarray(cache.pos), np.asarray(cache.length)
    slots = np.arange(cache.capacity)
    assert (length <= cache.capacity).all(), name
    for b in range(B):
        for h in range(K):
            valid = slots < length[b, h]
            assert ((pos[b, h] >= 0) == valid).all(), f"{name}: valid slots not packed at the front"
            kept = pos[b, h][valid].tolist()
            assert len(kept) == len(set(kept)), f"{name}: a position kept twice"
            assert set(kept) <= seen[b], f"{name}: a position the example never had"


@jax.jit(static_argnums=(0, 7))
def _prefill(method, cache, q, k, v, positions, budget, final, layer, inv_freq):
    return step.prefill_layer(method, cache, q, k, v, positions, budget, layer=layer, inv_freq=inv_freq,
                              num_layers=LAYERS, final_chunk=final, out_proj=OUT_PROJ, hidden=_hidden(q))


@jax.jit(static_argnums=(0,))
def _decode(method, cache, q, k, v, positions, budget, layer, inv_freq):
    return step.decode_layer(method, cache, q, k, v, positions, budget, layer=layer, inv_freq=inv_freq,
                             num_layers=LAYERS, hidden=_hidden(q))


def _run(name: str, chunk: int | None, eager: bool = False) -> None:
    method = methods.get(name, **METHODS[name])
    rng = np.random.default_rng(3)
    bucket = 48
    capacity = method.capacity(bucket, NEW)
    spec = CacheSpec(batch=B, kv_heads=K, capacity=capacity, num_heads=N, head_dim=H, num_layers=LAYERS,
                     dtype=jnp.float32)
    cache = step.init_cache(method, spec)
    budget = jnp.asarray(per_example_budget(method, LENGTHS))
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    window = chunk or method.prefill_window() or bucket
    seen = [set(range(n)) for n in LENGTHS]
    for start in range(0, bucket, window):
        positions = np.arange(start, start + window)[None].repeat(B, 0)
        positions = jnp.asarray(np.where(positions < LENGTHS[:, None], positions, -1), jnp.int32)
        final = start + window >= bucket
        for layer in range(LAYERS):
            q, k, v = _inputs(rng, window)
            args = (cache.layer(layer), q, k, v, positions, budget)
            out, layer_cache = _prefill(method, *args, final, jnp.int32(layer), inv_freq)
            if eager and start == 0 and layer == 0:  # traced equals eager (hooks are pure functions of inputs)
                eager_out, _ = step.prefill_layer(method, *args, layer=0, inv_freq=inv_freq, num_layers=LAYERS,
                                                  final_chunk=final, out_proj=OUT_PROJ, hidden=_hidden(q))
                np.testing.assert_allclose(np.asarray(out), np.asarray(eager_out), atol=1e-5, rtol=1e-5,
                                           err_msg=name)
            real = np.asarray(positions) >= 0
            assert np.isfinite(np.asarray(out)).all(), name
            assert (np.abs(np.asarray(out)).sum((-1, -2))[real] > 0).all(), f"{name}: a real query attended nothing"
            assert layer_cache.capacity == capacity, f"{name}: prefill left {layer_cache.capacity} slots"
            cache = cache.with_layer(layer, layer_cache)
            _check_layer(layer_cache, seen, f"{name} prefill layer {layer}")
    for i in range(NEW):
        positions = jnp.asarray((LENGTHS + i)[:, None], jnp.int32)
        for b in range(B):
            seen[b].add(int(LENGTHS[b] + i))
        for layer in range(LAYERS):
            q, k, v = _inputs(rng, 1)
            out, layer_cache = _decode(method, cache.layer(layer), q, k, v, positions, budget, jnp.int32(layer),
                                       inv_freq)
            assert out.shape == (B, 1, N, H) and np.isfinite(np.asarray(out)).all(), name
            assert layer_cache.capacity == capacity, f"{name}: decode changed the capacity"
            cache = cache.with_layer(layer, layer_cache)
            _check_layer(layer_cache, seen, f"{name} decode {i} layer {layer}")
            if not caps.observes_attention(method):  # observers may evict after the token attended
                newest = np.asarray(layer_cache.pos) == np.asarray(positions)[:, :, None]
                assert newest.any(-1).all(), f"{name}: the new token is not in the cache"
    if isinstance(method, ScoringMethod):  # one-shot scorers
        # Keep at most the budget of the prompt (per layer, the layer's budget is at most the example's
        # largest), plus every generated token.
        most = np.asarray([method.max_layer_budget(int(n)) for n in LENGTHS])
        for layer in cache.layers:
            pos = np.asarray(layer.pos)
            for b in range(B):
                prompt_kept = ((pos[b] >= 0) & (pos[b] < LENGTHS[b])).sum(-1)
                assert (prompt_kept <= max(most[b], 1)).all(), f"{name}: kept {prompt_kept} > {most[b]}"


def test_every_method_has_protocol_arguments():
    assert sorted(METHODS) == methods.available()


@pytest.mark.parametrize("name", every_method(METHODS))
def test_protocol_one_shot(name):
    _run(name, None)


@pytest.mark.parametrize("name", ["snapkv", "streaming_llm", "h2o", "quest", "ahakv", "dms", "kvzap", "finch",
                                  "chunkkv", "entropy_gated_chunkkv"])
def test_protocol_chunked(name):
    _run(name, 16)


#: One method of each kind of hook: a one-shot scorer, a lag-relative evictor, a decode-time observer, block
#: retrieval, probe-query retrieval, a threshold wrapper over a learned scorer, a query-statistics scorer.
EAGER = ("snapkv", "lagkv", "h2o", "quest", "actqkv", "dms", "expected_attention")


@pytest.mark.parametrize("name", EAGER)
def test_traced_equals_eager(name):
    _run(name, None, eager=True)


@pytest.mark.parametrize("name", every_method(METHODS))
def test_hyperparameters_are_static_and_hashable(name):
    """A method is a frozen dataclass of static hyperparameters: hashable (a jit static argument) and equal to a
    rebuilt copy, and its fields are what `hyperparameters()` reports."""
    method = methods.get(name, **METHODS[name])
    again = methods.get(name, **METHODS[name])
    assert hash(method) == hash(again) and method == again
    assert set(method.hyperparameters()) == {f.name for f in dataclasses.fields(method)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        method.budget = 3  # type: ignore[misc]


def _number_fields(name: str) -> list[str]:
    """The hyperparameters of `name` typed as floats (`float`, `float | None`), from its dataclass."""
    cls = methods.method_class(name)
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if "float" in str(hints[f.name])]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_number_hyperparameters_refuse_nan_infinities_and_bools(name):
    """Every float hyperparameter of every method refuses NaN, +-inf and True with a `ConfigError` naming it, when the
    method is built (no NaN reaches a score, no bool passes as 1)."""
    methods.get(name, **METHODS[name])  # the other hyperparameters are fine
    for field in _number_fields(name):
        for bad in (math.nan, math.inf, -math.inf, True):
            with pytest.raises(ConfigError, match=field):
                methods.get(name, **{**METHODS[name], field: bad})
