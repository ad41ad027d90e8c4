"""Bad inputs to the Python API: every one a kvjax error naming the argument and the bad value, raised
before anything is traced (oracle: the error type, the message, and `TRACE_COUNTS` unchanged).

Before the shared check (`kvjax.validation`), `model(ids)` returned logits for out-of-vocabulary ids
(JAX clamps out-of-range gathers), float ids were silently truncated, `model([])` divided by zero,
`compression_ratio="0.5"` raised a bare TypeError and `eos_token_id="x"` a bare ValueError.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

import kvjax
from kvjax import methods, rag
from kvjax.errors import ConfigError, KvjaxError
from kvjax.runtime.generate import TRACE_COUNTS, decode, prefill

V = 96  # the tiny model's vocabulary


def _traces() -> dict:
    return {**TRACE_COUNTS, **{f"rag:{k}": v for k, v in rag.TRACE_COUNTS.items()}}


def _refused(call, error: type[Exception], *named: str) -> str:
    """`call()` raises `error` (a kvjax error) whose message names every string in `named`; nothing traced."""
    assert issubclass(error, KvjaxError)
    before = _traces()
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for text in named:
        assert text in message, (text, message)
    assert _traces() == before
    return message


# ---- model(ids): the plain forward ----
@pytest.mark.parametrize(
    "ids,named",
    [
        ([[1, V + 104]], ["input_ids", str(V + 104), f"[0, {V})"]),  # out of vocabulary: was clamped
        ([[3, -1]], ["input_ids", "-1"]),  # negative: was clamped
        ([[1.5, 2.0]], ["input_ids", "float64", "1.5"]),  # float: was truncated
        (np.array([[1.0, 2.0]], np.float32), ["input_ids", "float32"]),
        ([], ["input_ids", "empty"]),  # was ZeroDivisionError
        ([[]], ["input_ids[0]", "empty"]),
        ("hello", ["input_ids", "'hello'", "tokenize"]),
        ([[1, 2], [3]], ["input_ids", "[2, 1]"]),  # ragged rows without padding
        (np.zeros((1, 2, 3), np.int32), ["input_ids", "(1, 2, 3)"]),
    ],
)
def test_model_call_refuses_bad_token_ids(ids, named):
    model = tiny_model()
    _refused(lambda: model(ids), KvjaxError, *named)


def test_model_call_still_accepts_good_ids():
    model = tiny_model()
    logits, _ = model([[1, 2, V - 1]])
    assert logits.shape == (1, 3, V)
    np.testing.assert_array_equal(np.asarray(model(np.array([1, 2, V - 1], np.int64))[0]), np.asarray(logits))
    # Inside the caller's jit the ids are tracers: the forward still runs (their values are not checkable).
    traced = jax.jit(lambda t: model(t)[0])(jnp.asarray([[1, 2, V - 1]], jnp.int32))
    np.testing.assert_allclose(np.asarray(traced), np.asarray(logits), rtol=1e-5, atol=1e-5)


# ---- generate / prefill / decode ----
@pytest.mark.parametrize(
    "kwargs,error,named",
    [
        (dict(input_ids=[[1.5, 2.0]]), KvjaxError, ["input_ids[0]", "1.5"]),  # was truncated to [1, 2]
        (dict(input_ids=[[1, 2, V]]), KvjaxError, ["input_ids", str(V)]),
        (dict(question_ids=[[1.5]]), KvjaxError, ["question_ids", "1.5"]),  # was truncated
        (dict(question_ids=[[4, 500]]), KvjaxError, ["question_ids", "500"]),
        (dict(eos_token_id="x"), KvjaxError, ["eos_token_id", "'x'"]),  # was a bare ValueError
        (dict(eos_token_id=[2, "x"]), KvjaxError, ["eos_token_id", "'x'"]),
        (dict(eos_token_id=10_000), KvjaxError, ["eos_token_id", "10000"]),  # never generated: silent no-op
        (dict(seed="a"), KvjaxError, ["seed", "'a'"]),  # was a JAX TypeError
        (dict(seed=2**32, temperature=1.0), KvjaxError, ["seed", str(2**32)]),  # drew as seed 0
        (dict(seed=-1, temperature=1.0), KvjaxError, ["seed", "-1"]),  # drew as seed 2**32 - 1
        (dict(temperature="1"), KvjaxError, ["temperature", "'1'"]),
        (dict(temperature=float("nan")), KvjaxError, ["temperature", "nan"]),  # was accepted: emitted token 0
        (dict(temperature=float("inf")), KvjaxError, ["temperature", "inf"]),
        (dict(top_p=True), KvjaxError, ["top_p", "True"]),  # was taken as top_p=1.0
        (dict(stop_at_eos="False"), KvjaxError, ["stop_at_eos", "'False'"]),  # a truthy string: stopped at EOS
        (dict(return_cache="no"), KvjaxError, ["return_cache", "'no'"]),  # returned the cache
        (dict(top_p=float("nan")), KvjaxError, ["top_p", "nan"]),
        (dict(max_new_tokens="2"), KvjaxError, ["max_new_tokens", "'2'"]),
        (dict(max_new_tokens=True), KvjaxError, ["max_new_tokens", "True"]),  # prefill took it as 1
        (dict(chunk_size=True), KvjaxError, ["chunk_size", "True"]),  # was taken as chunks of 1 token
        (dict(prompt_lengths=["a"], input_ids=np.array([[1, 2]])), KvjaxError, ["prompt_lengths", "'a'"]),
        (dict(prompt_lengths=np.array([5])), KvjaxError, ["prompt_lengths [5]", "lengths [3]"]),  # was [np.int64(3)]
        (dict(method=3), ConfigError, ["method", "int"]),
        (dict(method="snapkv", method_args=[1]), ConfigError, ["method_args", "list"]),  # was a TypeError
        (dict(method="snapkv", method_args=dict(compression_ratio="0.5")), ConfigError,
         ["compression_ratio", "'0.5'"]),  # was TypeError: '<=' not supported
        (dict(method="snapkv", method_args=dict(budget=True)), ConfigError, ["budget", "True"]),
    ],
)
def test_generate_refuses_bad_arguments(kwargs, error, named):
    model = tiny_model()
    args = dict(input_ids=[[1, 2, 3]], max_new_tokens=2)
    args.update(kwargs)
    _refused(lambda: kvjax.generate(model, args.pop("input_ids"), **args), error, *named)


def test_generate_takes_eos_ids_as_a_numpy_array():
    """`eos_token_id` as a NumPy array (a tokenizer's ids; before: refused as "not a token id") stops where the same
    ids as a list stop, and a float array is still refused."""
    model = tiny_model()
    free = kvjax.generate(model, [[1, 2, 3]], max_new_tokens=6, stop_at_eos=False)
    eos = int(np.asarray(free.tokens)[0, 2])  # a token the answer emits at its third step
    as_list = kvjax.generate(model, [[1, 2, 3]], max_new_tokens=6, eos_token_id=[eos, V - 1])
    as_array = kvjax.generate(model, [[1, 2, 3]], max_new_tokens=6, eos_token_id=np.array([eos, V - 1]))
    np.testing.assert_array_equal(np.asarray(as_array.tokens), np.asarray(as_list.tokens))
    np.testing.assert_array_equal(np.asarray(as_array.num_tokens), np.asarray(as_list.num_tokens))
    assert int(np.asarray(as_list.num_tokens)[0]) < 6  # the id stopped the answer
    _refused(lambda: kvjax.generate(model, [[1, 2, 3]], max_new_tokens=2, eos_token_id=np.array([1.5])),
             KvjaxError, "eos_token_id")


def test_prefill_and_decode_refuse_bad_arguments():
    model = tiny_model()
    _refused(lambda: prefill(model, [[2.5]]), KvjaxError, "input_ids[0]", "2.5")
    _refused(lambda: prefill(model, []), KvjaxError, "input_ids", "empty")
    state = prefill(model, [[1, 2, 3]], max_new_tokens=2)
    _refused(lambda: decode(model, state, max_new_tokens=2, eos_token_id="x"), KvjaxError, "eos_token_id")
    _refused(lambda: decode(model, state, max_new_tokens=0), KvjaxError, "max_new_tokens", "0")
    _refused(lambda: decode(model, state, max_new_tokens=2, stop_at_eos=0), KvjaxError, "stop_at_eos", "0")
    # More new tokens than the cache was prefilled for: was accepted, the cache overran and the tokens were wrong.
    _refused(lambda: decode(model, state, max_new_tokens=3), KvjaxError, "max_new_tokens=3", "2 new tokens")
    # The refused calls left the state usable.
    tokens, count, _ = decode(model, state, max_new_tokens=2)
    assert tokens.shape == (1, 2) and int(count[0]) == 2
    # Its cache was donated to that decode: a second one was XLA's "Buffer has been deleted or donated".
    _refused(lambda: decode(model, state, max_new_tokens=2), KvjaxError, "donated", "prefill again")


# ---- methods.get: hyperparameter types ----
@pytest.mark.parametrize(
    "name,args,named",
    [
        ("snapkv", dict(compression_ratio="0.5"), ["compression_ratio", "'0.5'", "str"]),
        ("snapkv", dict(budget="8"), ["budget", "'8'"]),
        ("snapkv", dict(budget=8.5), ["budget", "8.5"]),
        ("snapkv", dict(budget=True), ["budget", "True", "bool"]),  # was 'window_size=32 must be smaller than True'
        ("streaming_llm", dict(budget=64, sink_size="4"), ["sink_size", "'4'"]),
        ("h2o", dict(budget=[64]), ["budget", "[64]"]),
    ],
)
def test_methods_get_refuses_wrong_types(name, args, named):
    _refused(lambda: methods.get(name, **args), ConfigError, name, *named)


def test_methods_get_still_takes_ints_for_floats():
    assert methods.get("snapkv", compression_ratio=0).compression_ratio == 0
    assert methods.get("snapkv", budget=np.int64(64)).budget == 64


# ---- kvjax.rag ----
def test_rag_entry_points_refuse_bad_ids_and_arguments():
    model = tiny_model()
    _refused(lambda: rag.prefill_documents(model, [[1.5, 2.0]]), KvjaxError, "documents[0]", "1.5")  # was truncated
    _refused(lambda: rag.prefill_documents(model, [[1, 500]]), KvjaxError, "documents[0]", "500")
    _refused(lambda: rag.prefill_documents(model, [[]]), KvjaxError, "documents[0]", "empty")
    docs = rag.prefill_documents(model, [[1, 2, 3, 4]], analyze=False)
    before = [np.asarray(d.k).copy() for d in docs]
    _refused(lambda: rag.answer(model, docs, [1.5], strategy="reuse"), KvjaxError, "query_ids", "1.5")
    _refused(lambda: rag.answer(model, docs, [500], strategy="reuse"), KvjaxError, "query_ids", "500")
    _refused(lambda: rag.answer(model, docs, [], strategy="reuse"), KvjaxError, "query_ids")
    _refused(lambda: rag.answer(model, docs, [1], strategy="reuse", eos_token_id="x"), KvjaxError,
             "eos_token_id", "'x'")  # was a bare ValueError
    _refused(lambda: rag.answer(model, docs, [1], strategy="reuse", prefix=[0.5]), KvjaxError, "prefix", "0.5")
    # Each of these was a bare TypeError from inside answer (`**` of a list, iterating one document, len() of an int).
    _refused(lambda: rag.answer(model, docs, [1], strategy="reuse", strategy_args=[1]), ConfigError, "strategy_args",
             "list")
    _refused(lambda: rag.answer(model, docs[0], [1], strategy="reuse"), KvjaxError, "documents", "DocumentCache")
    _refused(lambda: rag.answer(model, docs, [1], strategy="reuse", prefix=3), KvjaxError, "prefix", "shape ()")
    _refused(lambda: rag.answer(model, docs, [1], strategy="reuse", stop_at_eos="no"), KvjaxError, "stop_at_eos")
    _refused(lambda: rag.answer(model, docs, [1], strategy="cacheblend", strategy_args=dict(recompute_ratio="0.1")),
             ConfigError, "recompute_ratio", "'0.1'")
    assert all(np.array_equal(np.asarray(d.k), b) for d, b in zip(docs, before, strict=True))


def test_chunk_size_past_the_prompt_is_the_whole_prompt():
    """`chunk_size` is capped at the prompt's bucket: 10M on a 5-token prompt gives the one-shot prefill's cache and
    logits, not a cache of 10M slots (the eval CLI's `--chunk_size=10000000` tried to allocate 59 GB)."""
    model = tiny_model()
    one_shot = prefill(model, [[1, 2, 3, 4, 5]], max_new_tokens=2)
    huge = prefill(model, [[1, 2, 3, 4, 5]], max_new_tokens=2, chunk_size=10_000_000)
    assert huge.cache.capacity == one_shot.cache.capacity < 64
    np.testing.assert_array_equal(np.asarray(huge.logits), np.asarray(one_shot.logits))


def test_prefill_documents_takes_a_generator_and_refuses_a_non_list():
    """A generator of documents prefills as the list does (`len()` of it was a bare TypeError); a number or a string
    is one KvjaxError naming it."""
    model = tiny_model()
    lists = [[1, 2, 3, 4], [5, 6, 7]]
    want = rag.prefill_documents(model, lists, analyze=False)
    got = rag.prefill_documents(model, (d for d in lists), analyze=False)
    assert [d.length for d in got] == [4, 3]
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.k + a.v, b.k + b.v, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    _refused(lambda: rag.prefill_documents(model, 5), KvjaxError, "documents", "5")
    _refused(lambda: rag.prefill_documents(model, "abc"), KvjaxError, "documents", "'abc'")


def test_prefill_documents_refuses_a_layout_that_is_not_a_block_layout_and_a_non_bool_analyze():
    """`layout={"block_size": 4}` (the manifest's spelling) was an AttributeError from inside; `analyze="no"` is a
    truthy string, so the statistics were computed for a caller who asked for none."""
    model = tiny_model()
    _refused(lambda: rag.prefill_documents(model, [[1, 2, 3]], layout={"block_size": 4}), KvjaxError, "layout",
             "BlockLayout", "dict")
    _refused(lambda: rag.prefill_documents(model, [[1, 2, 3]], analyze="no"), KvjaxError, "analyze", "'no'")
    assert not rag.prefill_documents(model, [[1, 2, 3]], analyze=np.bool_(False))[0].analyzed
