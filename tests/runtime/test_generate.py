"""Generation with the full cache against the plain forward; batching; streaming; traces; errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

import kvjax
from kvjax import methods
from kvjax.errors import ConfigError, KvjaxError
from kvjax.runtime import TRACE_COUNTS, forward, prefill


def _prompt(rng, n, vocab=96):
    return rng.integers(0, vocab, size=n).tolist()


@functools.partial(jax.jit, static_argnums=(0, 1))
def _step(config, method, weights, rope, cache, tokens, positions, budget):
    return forward.decode_step(config, weights, rope, method, cache, tokens, positions, budget)


def _manual_decode(model, state, tokens_to_feed):
    """Feeds the given tokens one by one after prefill; returns per-step logits and caches."""
    cache, logits, caches = state.cache, [np.asarray(state.logits)], []
    lengths = jnp.asarray(state.prompt_lengths)
    for i, tok in enumerate(tokens_to_feed):
        out, cache = _step(
            model.config, state.method, model.weights(), model.rope(), cache,
            jnp.asarray(tok, jnp.int32), lengths + i, state.budget,
        )
        logits.append(np.asarray(out))
        caches.append(cache)
    return logits, caches


@pytest.mark.parametrize("chunk_size", [None, 8])
def test_full_cache_decode_equals_full_forward_at_every_position(chunk_size):
    model = tiny_model()
    rng = np.random.default_rng(0)
    seq = np.array(_prompt(rng, 30))
    prompt, rest = seq[:19], seq[19:]
    state = prefill(model, prompt[None], method="full", max_new_tokens=len(rest), chunk_size=chunk_size)
    logits, _ = _manual_decode(model, state, [[t] for t in rest])
    ref, _ = model(seq[None])
    for i, step_logits in enumerate(logits):
        np.testing.assert_allclose(step_logits[0], np.asarray(ref[0, 18 + i]), atol=1e-4, rtol=1e-4)


def test_greedy_decode_equals_teacher_forced_argmax():
    model = tiny_model()
    prompt = _prompt(np.random.default_rng(1), 23)
    out = kvjax.generate(model, [prompt], method="full", max_new_tokens=12)
    seq = np.array(prompt + out.tokens[0].tolist())
    ref, _ = model(seq[None])
    np.testing.assert_array_equal(np.argmax(np.asarray(ref[0, 22:-1]), -1), out.tokens[0])
    assert out.num_tokens[0] == 12


@pytest.mark.parametrize("method,args", [("full", {}), ("streaming_llm", {"budget": 12})])
def test_batch_with_padding_equals_each_prompt_alone(method, args):
    model = tiny_model()
    rng = np.random.default_rng(2)
    prompts = [_prompt(rng, n) for n in (17, 5, 30)]
    batch = kvjax.generate(model, prompts, method=method, method_args=args, max_new_tokens=6)
    for i, p in enumerate(prompts):
        alone = kvjax.generate(model, [p], method=method, method_args=args, max_new_tokens=6)
        np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0])


def test_streaming_llm_keeps_sinks_and_recent_window_at_every_step():
    model = tiny_model()
    rng = np.random.default_rng(3)
    prompts = [_prompt(rng, 25), _prompt(rng, 14)]
    lengths = np.array([25, 14])
    method = methods.get("streaming_llm", budget=10, sink_size=4)
    state = prefill(model, prompts, method=method, max_new_tokens=8)
    assert state.cache.capacity == 11  # allocated at the budget (+1 slot for the arriving token)
    feed = [[rng.integers(0, 96)] * 2 for _ in range(8)]
    _, caches = _manual_decode(model, state, [jnp.asarray(f) for f in feed])
    for step, cache in enumerate([state.cache, *caches]):
        pos = np.asarray(cache.stacked().pos)  # [L, B, K, C]
        for b in range(2):
            newest = lengths[b] - 1 + step
            expect = sorted(set(range(4)) | set(range(newest - 5, newest + 1)))
            for layer in range(pos.shape[0]):
                for head in range(pos.shape[2]):
                    kept = sorted(p for p in pos[layer, b, head] if p >= 0)
                    assert kept == expect, (step, b, layer, head)


def test_decode_step_traces_once_for_a_whole_generation():
    model = tiny_model()
    rng = np.random.default_rng(4)
    kvjax.generate(model, [_prompt(rng, 20)], method="streaming_llm", method_args={"budget": 8}, max_new_tokens=9)
    before = dict(TRACE_COUNTS)
    kvjax.generate(model, [_prompt(rng, 27)], method="streaming_llm", method_args={"budget": 8}, max_new_tokens=9)
    assert TRACE_COUNTS["decode_step"] == before["decode_step"]  # same bucket: no retrace
    assert TRACE_COUNTS["prefill"] == before["prefill"]


def test_eos_stops_and_pads():
    model = tiny_model()
    prompt = _prompt(np.random.default_rng(5), 12)
    free = kvjax.generate(model, [prompt], max_new_tokens=8)
    eos = int(free.tokens[0, 3])
    first = int(np.argmax(free.tokens[0] == eos))
    out = kvjax.generate(model, [prompt], max_new_tokens=8, eos_token_id=eos)
    assert out.num_tokens[0] == first + 1
    np.testing.assert_array_equal(out.tokens[0, : first + 1], free.tokens[0, : first + 1])


def test_sampling_is_seeded():
    model = tiny_model()
    prompt = _prompt(np.random.default_rng(6), 12)
    a = kvjax.generate(model, [prompt], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    b = kvjax.generate(model, [prompt], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    c = kvjax.generate(model, [prompt], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=4)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    # NumPy scalars (a sweep's np.float32 values) sample as the Python floats they equal: they were refused as not
    # "a finite number >= 0".
    d = kvjax.generate(model, [prompt], max_new_tokens=10, temperature=np.float32(1.0), top_p=np.float32(0.5), seed=3)
    e = kvjax.generate(model, [prompt], max_new_tokens=10, temperature=1.0, top_p=0.5, seed=3)
    np.testing.assert_array_equal(d.tokens, e.tokens)


def test_return_cache_pos_layout():
    model = tiny_model()
    out = kvjax.generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=3, return_cache=True)
    cfg = model.config
    assert out.cache.num_layers == cfg.num_layers
    assert all(layer.pos.shape[:2] == (1, cfg.num_kv_heads) for layer in out.cache.layers)
    kept = sorted(p for p in np.asarray(out.cache.layers[0].pos)[0, 0] if p >= 0)
    assert kept == list(range(7))  # 5 prompt tokens + 2 fed back (the last token is never fed)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="nope"), "unknown method 'nope'"),
        (dict(method="streaming_llm", method_args={"budget": 0}), "budget must be a positive"),
        (dict(method="streaming_llm", method_args={"budget": -3}), "budget must be a positive"),
        (dict(method="streaming_llm", method_args={"compression_ratio": 1.0}), r"ratio must be in \[0, 1\)"),
        (dict(method="streaming_llm", method_args={"compression_ratio": -0.1}), "compression_ratio"),
        (dict(method="streaming_llm", method_args={"budget": 99999}), "exceeds the model's maximum"),
        (dict(method="streaming_llm", method_args={"window": 3}), "no hyperparameter"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(max_new_tokens=5000), "exceeds the model's maximum context"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(temperature=-1.0), "temperature"),
    ],
)
def test_bad_input_raises_before_tracing(kwargs, match):
    model = tiny_model()
    before = dict(TRACE_COUNTS)
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises((KvjaxError, ConfigError), match=match):
        kvjax.generate(model, [[1, 2, 3]], **kwargs)
    assert dict(TRACE_COUNTS) == before


@pytest.mark.parametrize(
    "ids,lengths,match",
    [
        ([[]], None, "empty prompt"),
        (np.zeros((2, 4), np.int32), [4], "prompt_lengths has 1 entries but input_ids has batch 2"),
        (np.zeros((2, 4), np.int32), [4, 0], "empty prompt"),
        (np.zeros((1, 4), np.int32), [9], "exceed the padded prompt length"),
        ([[1, 2, 500]], None, r"token ids must be in \[0, 96\)"),
        (np.zeros((1, 5000), np.int32), None, "exceeds the model's maximum context"),
    ],
)
def test_bad_prompts(ids, lengths, match):
    model = tiny_model()
    with pytest.raises(KvjaxError, match=match):
        kvjax.generate(model, ids, prompt_lengths=lengths, max_new_tokens=2)


def test_question_after_compression():
    model = tiny_model()
    rng = np.random.default_rng(7)
    contexts = [_prompt(rng, 40), _prompt(rng, 25)]
    questions = [_prompt(rng, 6), []]
    joined = [c + q for c, q in zip(contexts, questions, strict=True)]
    # With the full cache, feeding the question separately changes nothing.
    split = kvjax.generate(model, contexts, question_ids=questions, max_new_tokens=5)
    whole = kvjax.generate(model, joined, max_new_tokens=5)
    np.testing.assert_array_equal(split.tokens, whole.tokens)
    # With a compressing method, the question is kept whole after the compressed context.
    out = prefill(model, contexts, method="streaming_llm", method_args={"budget": 10},
                  question_ids=questions, max_new_tokens=3)
    pos = np.asarray(out.cache.layers[0].pos)[0, 0]
    kept = sorted(p for p in pos if p >= 0)
    assert kept == [0, 1, 2, 3, *range(34, 46)]  # sinks + window of 6 + the 6 question tokens
    np.testing.assert_array_equal(out.prompt_lengths, [46, 25])


def test_streaming_llm_short_prompt_grows_into_its_budget():
    model = tiny_model()
    prompt = _prompt(np.random.default_rng(8), 6)
    out = kvjax.generate(model, [prompt], method="streaming_llm", method_args={"budget": 10, "sink_size": 2},
                         max_new_tokens=9, return_cache=True)
    # 6 prompt tokens + 8 fed back = positions 0..13; the cache holds the budget: 2 sinks + the last 8.
    assert kvc_kept(out.cache) == [0, 1, *range(6, 14)]
    full = kvjax.generate(model, [prompt], max_new_tokens=5)
    short = kvjax.generate(model, [prompt], method="streaming_llm", method_args={"budget": 10}, max_new_tokens=5)
    np.testing.assert_array_equal(full.tokens, short.tokens)  # never over budget: identical to full


def kvc_kept(cache):
    return sorted(int(p) for p in np.asarray(cache.layers[0].pos)[0, 0] if p >= 0)


def test_bad_question_ids_raise_before_tracing():
    model = tiny_model()
    before = dict(TRACE_COUNTS)
    with pytest.raises(KvjaxError, match=r"question_ids: token ids must be in \[0, 96\), got 500"):
        prefill(model, [[1, 2, 3]], question_ids=[[4, 500]], max_new_tokens=2)
    assert dict(TRACE_COUNTS) == before


def test_a_first_generate_compiles_only_its_six_programs():
    """Every program a first call compiles costs a first call time (tracing, lowering, a compile or a cache
    load); eager jnp ops outside the jitted programs (zeros, asarray, a PRNG key) each compiled one of ~30 ms.
    A new shape compiles the empty cache, the embedding, the one prefill program every layer runs, the
    last-token pick, the final logits and the decode loop, nothing else."""
    import logging

    compiled = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Compiling "):
                compiled.append(record.getMessage().split()[1])

    model = tiny_model(3)
    prompt = _prompt(np.random.default_rng(9), 77)
    jax.clear_caches()  # as in a new process: every program this call needs is compiled (or loaded) again
    handler, logger = Record(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            kvjax.generate(model, [prompt], method="snapkv", method_args={"budget": 24, "window_size": 8},
                           max_new_tokens=5, temperature=0.7, seed=3)
    finally:
        logger.removeHandler(handler)
    assert sorted(compiled) == sorted(
        ["jit(_empty_cache)", "jit(embed)", "jit(prefill_block)", "jit(pick_last)", "jit(_final_logits)",
         "jit(_decode_loop)"]), compiled
