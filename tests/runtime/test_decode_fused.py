"""The fused decode kernel inside the runtime's decode (`kvjax.runtime.step.fuses_decode`: RoPE of the new q / k,
the in-place cache write and the attention as one `kvjax.ops.fused_decode` op; interpret mode here) against the XLA
path the runtime takes without it: from one prefill, `kvjax.decode` with the kernel forced on (the tuning's
`auto_pallas` lists `decode_append_attention`) must give the XLA decode's greedy tokens, token counts and kept
positions exactly, its caches' valid keys / values within float rounding, and one step's logits within 1e-4. One
row finishes early (an EOS id chosen from the XLA run's own tokens), so an inactive row goes through the kernel for
the remaining steps.

Cases: `full`; SnapKV (compressed at prefill, decode only appends); an int8 cache (the kernel writes codes and
scales); SnapKV over an int4 cache (packed codes, scales and zeros); a KIVI-2 cache whose groups flush during
the decode (the kernel quantizes them); StreamingLLM at a budget under the prompts, on a model-dtype and an int8
cache, and DuoAttention's streaming heads (every step evicts in place: the kernel writes the token into the
evicted slot); GQA (the tiny model has 4 query heads over 2 KV heads); a Gemma-3-like model (a model-dtype and an
int8 cache), whose sliding-window ring (`ring=True`: the token over the position that left the window) and global
layer take the kernel with its query scale and QK-norm; that Gemma-3-like model and StreamingLLM with an int8 cache
whose values are read and written as int16 pairs (`Tuning.gpu_int8_pairs`). The trace check counts the kernel's
calls in one decode step's jaxpr (its `pallas_call` by name: interpret mode lowers the kernel to plain XLA ops, so
the HLO shows no custom call off a GPU) with the knob on and off, and on an fp8 cache and KIVI's ring, which stay on
XLA.
The engine's case (inactive slots, slot reuse) is in tests/engine/test_engine.py.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from golden_cases import kept
from learned_files import duo_pattern
from tiny import random_prompts, tiny_gemma3, tiny_model

import kvjax
from kvjax import cache as kvc
from kvjax import methods, tuning
from kvjax.ops import fused_decode as fd
from kvjax.pallas import gpu_fused_decode
from kvjax.runtime import forward

gen = importlib.import_module("kvjax.runtime.generate")  # the package re-exports a function of that name

NEW = 6


def kernel_on():
    """The runtime's switch: `decode_append_attention` added to the tuning's `auto_pallas`, quantized caches too."""
    return tuning.override(auto_pallas=tuning.current().auto_pallas | {fd.OP}, auto_fused_quantized=True)


def _copy(state):
    return dataclasses.replace(state, cache=jax.tree.map(jnp.copy, state.cache))


def _valid_close(got, want, tol):
    """Per layer: positions and lengths exactly; keys / values (dequantized) within `tol` on the valid slots."""
    for a, b in zip(got.layers, want.layers, strict=True):
        np.testing.assert_array_equal(np.asarray(a.pos), np.asarray(b.pos))
        np.testing.assert_array_equal(np.asarray(a.length), np.asarray(b.length))
        ok = np.asarray(kvc.valid_mask(b))[..., None]
        a, b = kvc.dequantized(a), kvc.dequantized(b)
        for x, y in ((a.k, b.k), (a.v, b.v)):
            np.testing.assert_allclose(np.where(ok, np.asarray(x, np.float32), 0),
                                       np.where(ok, np.asarray(y, np.float32), 0), atol=tol, rtol=tol)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _step_logits(config, method, tune, weights, rope, cache, tokens, positions, budget):
    """One decode step's logits (no donation: the same cache serves both tunings)."""
    with tuning.use(tune):
        return forward.decode_step(config, weights, rope, method, cache, tokens, positions, budget)[0]


def _first_step_logits(model, state, tune=None):
    args = (model.weights(), state.rope or model.rope(), state.cache, jnp.argmax(state.logits, -1).astype(jnp.int32),
            jnp.asarray(state.prompt_lengths, jnp.int32), state.budget)
    method = gen.decode_program_key(state.method)
    want = _step_logits(model.config, method, tuning.current(), *args)
    with kernel_on(), tuning.override(**(tune or {})):
        got = _step_logits(model.config, method, tuning.current(), *args)
    return np.asarray(got), np.asarray(want)


CASES = {
    "full": dict(model=lambda: tiny_model(), method=("full", {}), kv_dtype=None, kernels=2),
    "snapkv": dict(model=lambda: tiny_model(), method=("snapkv", {"budget": 10, "window_size": 3}), kv_dtype=None,
                   kernels=2),
    "int8": dict(model=lambda: tiny_model(), method=("full", {}), kv_dtype="int8", kernels=2),
    "int4": dict(model=lambda: tiny_model(), method=("snapkv", {"budget": 10, "window_size": 3}), kv_dtype="int4",
                 kernels=2),
    # a 12-token budget under 13-19-token prompts: every step evicts the oldest non-sink token in place
    "streaming_llm": dict(model=lambda: tiny_model(), method=("streaming_llm", {"budget": 12}), kv_dtype=None,
                          kernels=2),
    "streaming_llm_int8": dict(model=lambda: tiny_model(), method=("streaming_llm", {"budget": 12}), kv_dtype="int8",
                               kernels=2),
    # streaming heads (sinks 2 + recent 6) evict in place, retrieval heads append (a generated head pattern)
    "duo_attention": dict(model=lambda: tiny_model(), method=("duo_attention", lambda: {
        "patterns": duo_pattern(2, 2), "head_compression_ratio": 0.5}), kv_dtype=None, kernels=2),
    # groups of 16 behind a 16-token ring: the 13-16-token prompts flush a group within the 6 steps
    "kivi2": dict(model=lambda: tiny_model(), method=("full", {}), kv_dtype="kivi2:group_size=16:residual=16",
                  kernels=2),
    # its sliding-window ring (8 slots, wrapped by the 13-19-token prompts) and its global layer both take it
    "gemma3": dict(model=lambda: tiny_gemma3(window=8), method=("full", {}), kv_dtype=None, kernels=2),
    "gemma3_int8": dict(model=lambda: tiny_gemma3(window=8), method=("full", {}), kv_dtype="int8", kernels=2),
    # int8 codes read and written as int16 pairs (`Tuning.gpu_int8_pairs`): Gemma 3's ring, QK-norm and global layer;
    # StreamingLLM's in-place eviction
    "gemma3_int8_pairs": dict(model=lambda: tiny_gemma3(window=8), method=("full", {}), kv_dtype="int8", kernels=2,
                              tune=dict(gpu_int8_pairs=True)),
    "streaming_llm_int8_pairs": dict(model=lambda: tiny_model(), method=("streaming_llm", {"budget": 12}),
                                     kv_dtype="int8", kernels=2, tune=dict(gpu_int8_pairs=True)),
    # fp8: one power-of-two scale per head, set at prefill and kept; SnapKV's compressed cache
    "fp8": dict(model=lambda: tiny_model(), method=("snapkv", {"budget": 10, "window_size": 3}), kv_dtype="fp8",
                kernels=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_with_the_fused_kernel_equals_the_xla_decode(case, monkeypatch):
    spec = CASES[case]
    model = spec["model"]()
    assert model.config.num_heads != model.config.num_kv_heads  # GQA in every case
    if case.startswith("gemma3"):
        assert model.config.query_scale != 1.0 and model.config.layer_window(0) is not None
    args = spec["method"][1]
    method = methods.get(spec["method"][0], **(args() if callable(args) else args))
    prompts = random_prompts(5, (13, 19))
    state = kvjax.prefill(model, prompts, method=method, max_new_tokens=NEW, kv_dtype=spec["kv_dtype"])
    free, _, _ = gen.decode(model, _copy(state), max_new_tokens=NEW, stop_at_eos=False)
    # An EOS id row 1 emits at its 3rd token and row 0 not before its 5th: row 1 is then inactive for 3 steps.
    eos = int(free[1, 2])
    assert eos not in free[1, :2].tolist() and eos not in free[0, :4].tolist(), (case, free)
    want = gen.decode(model, _copy(state), max_new_tokens=NEW, eos_token_id=eos)

    calls = []
    once = fd._kernel_once
    monkeypatch.setattr(fd, "_kernel_once", lambda *a, **kw: calls.append(kw["tune"]) or once(*a, **kw))
    with kernel_on(), tuning.override(**spec.get("tune", {})):
        got = gen.decode(model, _copy(state), max_new_tokens=NEW, eos_token_id=eos)
    assert len(calls) == spec["kernels"], calls  # one trace of the loop's body: each layer's kernel call
    assert all(t.gpu_int8_pairs == ("tune" in spec) for t in calls)  # the kernel traced under the case's tuning

    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist(), (case, got[0], want[0])
    assert want[1].tolist() == [NEW, 3], want[1]
    assert kept(got[2]) == kept(want[2])
    if spec["kv_dtype"] and spec["kv_dtype"].startswith("kivi"):  # the kernel flushed groups where XLA did
        qlens = [(np.asarray(a.k.qlen), np.asarray(b.k.qlen), np.asarray(c.k.qlen))
                 for a, b, c in zip(got[2].layers, want[2].layers, state.cache.layers, strict=True)]
        assert all(np.array_equal(g, w) for g, w, _ in qlens) and any((w > s).any() for _, w, s in qlens), qlens
    _valid_close(got[2], want[2], 2e-2 if spec["kv_dtype"] else 1e-5)
    # The first step's logits (the query scale and the attention, which greedy tokens of a tiny model hide).
    got_logits, want_logits = _first_step_logits(model, state, spec.get("tune"))
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-4, rtol=1e-4)


def _kernel_calls(jaxpr) -> int:
    """`pallas_call`s of the fused kernel (by name) in `jaxpr`, each call site of a sub-jaxpr counted (the layers
    share one jitted kernel call, `fused_decode._kernel_once`, whose jaxpr jax prints once)."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            count += eqn.params["name"] == "kvjax_gpu_decode_append_attention"
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    count += _kernel_calls(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    count += _kernel_calls(sub)
    return count


def _decode_step_kernels(model, method, kv_dtype=None) -> int:
    """Calls of the fused kernel in one traced decode step (the loop body) of `model`."""
    cache = jax.eval_shape(lambda: gen.init_cache(method, model.config, 2, 32, model.dtype, kv_dtype))
    tokens = jax.ShapeDtypeStruct((2,), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda c, t, p, b, a: forward.decode_step(
        model.config, model.weights(), model.rope(), method, c, t, p, b, active=a))(
        cache, tokens, tokens, tokens, jax.ShapeDtypeStruct((2,), bool))
    return _kernel_calls(jaxpr.jaxpr)


@pytest.mark.parametrize("model_fn,distinct", [(lambda: tiny_model(num_layers=4), 1),
                                               (lambda: tiny_gemma3(window=8), 2)], ids=["llama", "gemma3"])
def test_the_kernel_is_traced_once_per_distinct_layer(model_fn, distinct, monkeypatch, fresh_kernel_traces):
    """Layers of one shape share one jitted kernel call (`fused_decode._kernel_once`): a decode step traces and
    lowers the Pallas kernel once for them, not once per layer (an 8B step's lowering for an H200: 3.1 -> 1.0 s,
    KIVI-2's 10.2 -> 1.2 s). Four Llama layers: one trace; Gemma's ring and global layer: two. A tuning of this test
    alone (the split target) keeps earlier tests' traces out of the count."""
    model, traced = model_fn(), []
    kernel = gpu_fused_decode.decode_append_attention
    monkeypatch.setattr(gpu_fused_decode, "decode_append_attention",
                        lambda *a, **kw: traced.append(1) or kernel(*a, **kw))
    with kernel_on(), tuning.override(gpu_target_programs=7):
        calls = _decode_step_kernels(model, methods.get("full"))
    assert calls == model.config.num_layers and len(traced) == distinct, (calls, traced)


def test_the_knob_puts_the_kernel_in_the_decode_step():
    model, full = tiny_model(), methods.get("full")
    with tuning.use(tuning.default("cpu")):
        assert _decode_step_kernels(model, full) == 0  # the CPU default
    with tuning.override(auto_pallas=frozenset({"decode_attention"})):  # another op's kernel: not this one
        assert _decode_step_kernels(model, full) == 0
    with kernel_on():
        assert _decode_step_kernels(model, full) == model.config.num_layers
        assert _decode_step_kernels(model, full, "int8") == model.config.num_layers
        assert _decode_step_kernels(model, full, "int4") == model.config.num_layers
        assert _decode_step_kernels(tiny_gemma3(window=8), full) == 2  # the ring and the global layer
        # KIVI's global layer takes it; its ring takes it while the ring stays in the model dtype (a window within
        # the residual), and stays on XLA once quantized (KIVI's position groups)
        assert _decode_step_kernels(tiny_gemma3(window=8), full, "kivi2") == 2
        assert _decode_step_kernels(tiny_gemma3(window=8), full, "kivi2:group_size=16:residual=16") == 1
        assert _decode_step_kernels(model, full, "kivi2") == model.config.num_layers
        assert _decode_step_kernels(model, full, "fp8") == model.config.num_layers
        # a layout the kernel refuses stays on XLA: scales shared by part of a head
        assert _decode_step_kernels(model, full, "int8:channel_group=8") == 0
        # A method that evicts in place (StreamingLLM) takes it, its eviction decided before the write; one that
        # observes attention (H2O) or re-rotates its sinks keeps its own path.
        assert _decode_step_kernels(model, methods.get("streaming_llm", budget=12)) == model.config.num_layers
        assert _decode_step_kernels(model, methods.get("streaming_llm", budget=12, rerotate=True)) == 0
        assert _decode_step_kernels(model, methods.get("h2o", budget=12)) == 0


def test_auto_takes_a_quantized_cache_only_when_the_tuning_says_so():
    """With the kernel listed and no `auto_fused_quantized` storage, a model-dtype cache takes it and an int8 /
    int4 / fp8 / KIVI cache stays on XLA; True brings them all in, a set only the storages listed. The GPU's default
    lists int8 alone (run 13: the kernel 1.81x the XLA path on it; run 14: its compiled tests passed)."""
    model, full = tiny_model(), methods.get("full")
    with tuning.override(auto_pallas=tuning.current().auto_pallas | {fd.OP}, auto_fused_quantized=False):
        assert _decode_step_kernels(model, full) == model.config.num_layers
        for kv_dtype in ("int8", "int4", "fp8", "kivi2"):
            assert _decode_step_kernels(model, full, kv_dtype) == 0, kv_dtype
        assert _decode_step_kernels(tiny_gemma3(window=8), full, "int8") == 0  # its ring too
        with tuning.override(auto_fused_quantized=True):
            assert _decode_step_kernels(model, full, "int8") == model.config.num_layers
        with tuning.override(auto_fused_quantized={"int4"}):  # per storage: the one listed, not the others
            assert _decode_step_kernels(model, full, "int4") == model.config.num_layers
            assert _decode_step_kernels(model, full, "int8") == 0
    gpu = tuning.default("gpu")
    assert gpu.auto_pallas >= {fd.OP} and gpu.auto_fused_quantized == {"int8"}
    with tuning.use(dataclasses.replace(tuning.current(), auto_pallas=gpu.auto_pallas,
                                        auto_fused_quantized=gpu.auto_fused_quantized)):
        assert _decode_step_kernels(model, full, "int8") == model.config.num_layers
        assert _decode_step_kernels(model, full, "int4") == 0


@pytest.mark.parametrize("model_fn", [tiny_model, lambda: tiny_gemma3(window=8)], ids=["llama", "gemma3"])
def test_decode_with_the_norm_kernel_too_equals_the_xla_decode(model_fn, monkeypatch):
    """The hidden-state RMSNorms on their Triton kernel (`kvjax.ops.norm`, `rms_norm` listed beside the fused
    decode kernel: the 12-launch layer of the compile for an H200) give the XLA decode's greedy tokens and logits,
    Llama's and Gemma's (`1 + weight`) conventions."""
    from kvjax.ops import norm as norm_ops
    from kvjax.pallas import gpu_norm

    model = model_fn()
    state = kvjax.prefill(model, random_prompts(4, (13, 19)), method="full", max_new_tokens=NEW)
    want = gen.decode(model, _copy(state), max_new_tokens=NEW, stop_at_eos=False)
    calls = []
    kernel = gpu_norm.rms_norm
    monkeypatch.setattr(gpu_norm, "rms_norm", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    with tuning.override(auto_pallas=tuning.current().auto_pallas | {fd.OP, norm_ops.OP}):
        got = gen.decode(model, _copy(state), max_new_tokens=NEW, stop_at_eos=False)
    norms = sum(1 for name in model.weights()["layers"][0] if name.endswith("_norm") and "q_" not in name
                and "k_" not in name)
    assert len(calls) == model.config.num_layers * norms + 1, calls  # every hidden norm and the final one, traced once
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    np.testing.assert_allclose(np.asarray(got[2].layers[0].k, np.float32), np.asarray(want[2].layers[0].k, np.float32),
                               rtol=1e-5, atol=1e-5)
