"""One-shot prefill attends over the chunk's own keys (`kvjax.runtime.step.prefill_layer(fresh=True)`).

Oracle: the general path, which appends the chunk to the empty cache and attends over every slot of it
(the empty ones masked). Both must leave the same cache (kept positions exact, values to float rounding)
and the same last-token logits, for evicting methods, a method that reuses the attention's log-sum-exp
(H2O), ragged batches and a sliding window.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import assert_caches_close, random_prompts, tiny_model

import kvjax
from kvjax import methods
from kvjax.runtime import forward, step

gen = importlib.import_module("kvjax.runtime.generate")  # the module, not the function it exports

CASES = {
    "full": {},
    "snapkv": {"budget": 12, "window_size": 4},
    "h2o": {"budget": 12},
    "streaming_llm": {"budget": 12, "sink_size": 2},
    "lagkv": {"budget": 12, "sink_size": 2, "lag_size": 4},
    "tova": {"budget": 12},
}


def prefill_both_ways(monkeypatch, model, prompts, name, args):
    fresh = gen.prefill(model, prompts, method=name, method_args=args or None, max_new_tokens=4)
    with monkeypatch.context() as patch:
        patch.setattr(step, "attends_own_chunk", lambda method: False)
        general = gen.prefill(model, prompts, method=name, method_args=args or None, max_new_tokens=4)
    return fresh, general


@pytest.mark.parametrize("name", sorted(CASES))
def test_fresh_prefill_equals_attention_over_the_empty_cache(monkeypatch, name):
    model = tiny_model(0)
    prompts = random_prompts(1, (37, 23))  # ragged: the second row is padded
    fresh, general = prefill_both_ways(monkeypatch, model, prompts, name, CASES[name])
    assert_caches_close(fresh.cache, general.cache, tol=2e-5, name=name)
    np.testing.assert_allclose(np.asarray(fresh.logits), np.asarray(general.logits), rtol=2e-5, atol=2e-5)


def test_fresh_prefill_with_a_sliding_window(monkeypatch):
    model = tiny_model(0, model_type="mistral", sliding_window=9)
    prompts = random_prompts(2, (41, 30))
    fresh, general = prefill_both_ways(monkeypatch, model, prompts, "full", {})
    assert_caches_close(fresh.cache, general.cache, tol=2e-5, name="window")
    np.testing.assert_allclose(np.asarray(fresh.logits), np.asarray(general.logits), rtol=2e-5, atol=2e-5)


def test_which_methods_attend_their_own_chunk():
    assert step.attends_own_chunk(methods.get("snapkv", budget=64))
    assert step.attends_own_chunk(methods.get("full"))
    assert step.attends_own_chunk(methods.get("quest", budget=32))  # sparse at decode only
    # Retrieval methods mask the cache before attention or attend by their own scheme: the general path.
    for name, args in (("infllm", {}), ("qllm", {}), ("actqkv", {})):
        assert not step.attends_own_chunk(methods.get(name, **args))


def test_fresh_prefill_refuses_a_method_that_edits_the_mask():
    model = tiny_model(0)
    method = methods.get("infllm")
    cache = gen.init_cache(method, model.config, 1, 64, model.dtype)
    tokens = jnp.zeros((1, 32), jnp.int32)
    positions = jnp.arange(32, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match="fresh prefill"):
        forward.prefill_chunk(model.config, model.weights(), model.rope(), method, cache, tokens, positions,
                              jnp.asarray([16]), fresh=True)


def test_generate_tokens_unchanged_by_the_fresh_path(monkeypatch):
    model = tiny_model(0)
    prompts = random_prompts(3, (50, 44))
    out = kvjax.generate(model, prompts, method="snapkv", method_args=CASES["snapkv"], max_new_tokens=6,
                         stop_at_eos=False)
    with monkeypatch.context() as patch:
        patch.setattr(step, "attends_own_chunk", lambda method: False)
        ref = kvjax.generate(model, prompts, method="snapkv", method_args=CASES["snapkv"], max_new_tokens=6,
                             stop_at_eos=False)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def test_one_shot_prefill_takes_the_fresh_path_and_chunked_prefill_does_not(monkeypatch):
    model = tiny_model(0)
    prompts = random_prompts(4, (40,))
    calls = []
    own = step.causal_prefix_attention  # SnapKV needs no log-sum-exp: the mask-free causal op

    def counted(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    monkeypatch.setattr(step, "causal_prefix_attention", counted)
    forward.prefill_block.clear_cache()  # trace again, so the spy sees the program
    gen.prefill(model, prompts, method="snapkv", method_args=CASES["snapkv"])
    assert calls, "one-shot prefill should attend over its own chunk"
    calls.clear()
    forward.prefill_block.clear_cache()
    gen.prefill(model, prompts, method="snapkv", method_args=CASES["snapkv"], chunk_size=16)
    assert not calls, "a chunked prefill has earlier chunks in its cache"


@pytest.mark.parametrize("name", ["full", "h2o"])
def test_fresh_prefill_traces_once_per_bucket(name):
    """Two prompt lengths of one bucket share the one-shot program (H2O: with the attention's lse)."""
    model = tiny_model(0)
    args = CASES[name] or None
    gen.prefill(model, random_prompts(5, (40,)), method=name, method_args=args)
    before = gen.TRACE_COUNTS["prefill"]
    gen.prefill(model, random_prompts(6, (37,)), method=name, method_args=args)
    assert gen.TRACE_COUNTS["prefill"] == before


@pytest.mark.parametrize("model_args", [{}, {"model_type": "mistral", "sliding_window": 9}])
def test_fused_causal_prefill_equals_the_general_path(monkeypatch, model_args):
    """The one-shot prefill through one causal `jax.nn.dot_product_attention` call per layer (no mask; the
    path `tuning.auto_causal_prefix` turns on, its XLA implementation on CPU) leaves the general path's cache
    and logits: ragged prompts and a sliding window included."""
    model = tiny_model(0, **model_args)
    prompts = random_prompts(7, (37, 23))
    calls = []
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(step, "causal_prefix_attention", functools.partial(
        step.causal_prefix_attention, implementation="dot_product_attention"))
    forward.prefill_block.clear_cache()
    forward.prefill_window_block.clear_cache()  # the sliding window's layers: rings, programs of their own
    fused, general = prefill_both_ways(monkeypatch, model, prompts, "snapkv", CASES["snapkv"])
    forward.prefill_block.clear_cache()
    forward.prefill_window_block.clear_cache()
    assert calls and all(kw["is_causal"] for kw in calls)
    assert_caches_close(fused.cache, general.cache, tol=2e-5, name="fused")
    np.testing.assert_allclose(np.asarray(fused.logits), np.asarray(general.logits), rtol=2e-5, atol=2e-5)
