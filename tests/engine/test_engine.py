"""The continuous-batching engine against `kvjax.generate` of each prompt alone (tests/engine/engine_refs.py).

Every registered method runs five requests of mixed lengths (one prefill bucket, so the reference shares the
engine's prefill programs and the test stays cheap) through two slots: three requests wait for a slot, every slot is
reused, answers end at different steps (an EOS id the tiny random model emits). Each request must give the greedy
tokens and the kept positions of `generate` alone (a float near-tie excepted and named). Separate tests: a request's
output does not depend on its neighbours (bit for bit), the per-request settings (limit, stop ids, question layouts,
log-probabilities, sampling), the programs a job compiles, and refusals.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_refs import compare
from golden_cases import LAYERS, METHODS, every_method
from tiny import random_prompts, tiny_gemma3, tiny_model

import kvjax
from kvjax import methods
from kvjax.engine import Engine, Request
from kvjax.errors import ConfigError, KvjaxError
from kvjax.runtime import TRACE_COUNTS

EOS = 33  # emitted by the tiny random model at various steps of these answers
LENGTHS = (35, 41, 47, 52, 58)  # one bucket (64)
NEW = 12


def _requests(lengths=LENGTHS, seed=21, new=NEW, **settings):
    return [Request(id=f"r{i}", tokens=tuple(p), max_new_tokens=new, **settings)
            for i, p in enumerate(random_prompts(seed, lengths))]


def _engine(model, method, requests, **kwargs):
    kwargs.setdefault("slots", 2)
    kwargs.setdefault("steps", 3)
    return Engine(model, method=method, max_prompt_tokens=max(len(r.tokens) for r in requests),
                  max_question_tokens=max(len(r.question) for r in requests),
                  max_new_tokens=max(r.max_new_tokens for r in requests), keep_positions=True, **kwargs)


#: `decoding` over SnapKV rather than its default KNorm: KNorm ranks a token's layer-0 keys by their norm, which RoPE
#: keeps, so a generated token that repeats a prompt token ties with it exactly and float rounding (the slots' decode
#: program against `generate`'s batch of one) breaks the tie either way. That is a tie in the method's scores, not
#: in the engine; the float-tie allowance here covers logits only.
ARGS = {**METHODS, "decoding": {**METHODS["decoding"], "base": "snapkv", "base_args": {"window_size": 2}}}


@pytest.mark.parametrize("name", every_method(METHODS))
def test_every_method_matches_generate_alone(name):
    assert set(METHODS) == set(methods.available())  # every registered method has arguments here
    model = tiny_model(num_layers=LAYERS.get(name, 2), eos_token_ids=(EOS,))
    method = methods.get(name, **ARGS[name])
    requests = _requests()
    done = list(_engine(model, method, requests).run(requests))
    ties = compare(model, method, requests, done)
    assert len(ties) <= 1, ties


@pytest.mark.parametrize("kv_dtype", ["int8", "kivi4"])
def test_quantized_storage_matches_generate_alone(kv_dtype):
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get("tova", **METHODS["tova"])
    requests = _requests()
    done = list(_engine(model, method, requests, kv_dtype=kv_dtype).run(requests))
    assert len(compare(model, method, requests, done, kv_dtype=kv_dtype)) <= 1


@pytest.mark.parametrize("name", ["snapkv", "h2o"])
def test_a_sliding_window_model_matches_generate_alone(name):
    """Gemma-3-like: two rings and a global layer the method manages; the slots' rings are sized for the longest
    sequence, each request's prefill writes into rings of that size."""
    model = tiny_gemma3(num_layers=3, window=16, eos_token_ids=(39,))
    method = methods.get(name, **METHODS[name])
    requests = _requests()
    done = list(_engine(model, method, requests).run(requests))
    assert len(compare(model, method, requests, done)) <= 1


@pytest.mark.parametrize("name", ["snapkv", "streaming_llm"])
def test_the_fused_decode_kernel_matches_generate_alone(name, monkeypatch, fresh_kernel_traces):
    """The engine's decode with the fused decode kernel forced on (`decode_append_attention` in the tuning's
    `auto_pallas`; interpret mode) against `generate` alone on the XLA path: SnapKV, and StreamingLLM (which evicts
    in place: inactive slots must evict nothing), on a Gemma-3-like model (its global layer takes the kernel, the
    rings stay on XLA); five requests through two slots, so slots wait inactive, finish at different steps and are
    reused."""
    from kvjax import tuning
    from kvjax.ops import fused_decode
    from kvjax.pallas import gpu_fused_decode

    calls = []
    kernel = gpu_fused_decode.decode_append_attention
    monkeypatch.setattr(gpu_fused_decode, "decode_append_attention",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    model = tiny_gemma3(num_layers=3, window=16, eos_token_ids=(39,))
    method = methods.get(name, **METHODS[name])
    requests = _requests()
    with tuning.override(auto_pallas=tuning.current().auto_pallas | {fused_decode.OP}):
        done = list(_engine(model, method, requests).run(requests))
    assert calls  # the decode program traced the kernel
    assert len({len(c.tokens) for c in done}) > 1  # answers end at different steps
    ties = compare(model, method, requests, done)
    assert len(ties) <= 1, ties  # a float near-tie, named (none here on CPU, jax 0.10.2)


def test_a_request_does_not_depend_on_its_neighbours():
    """The same requests among other neighbours, in another order, another slot: bit for bit the same tokens,
    log-probabilities and kept positions."""
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get("tova", **METHODS["tova"])
    first = _requests(logprobs=True)
    others = [Request(id=f"o{i}", tokens=tuple(p), max_new_tokens=NEW, logprobs=True)
              for i, p in enumerate(random_prompts(5, (60, 38, 50)))]
    second = [first[4], others[0], first[2], others[1], first[0], others[2]]
    engine = _engine(model, method, first + others)
    a = {c.id: c for c in engine.run(first)}
    assert len({len(c.tokens) for c in a.values()}) > 1  # answers end at different steps: slots free at different times
    b = {c.id: c for c in engine.run(second)}
    for rid in ("r0", "r2", "r4"):
        assert a[rid].tokens == b[rid].tokens and a[rid].positions == b[rid].positions, rid
        np.testing.assert_array_equal(np.asarray(a[rid].logprobs), np.asarray(b[rid].logprobs), err_msg=rid)


def test_a_run_its_caller_stops_early_leaves_no_slot_generating():
    """A caller that stops iterating `run()` after the first completion: the request still in its slot stops on
    the device too (the next run's steps are not spent on it), and the next run answers as a fresh engine does."""
    model = tiny_model(num_layers=2, eos_token_ids=())
    method = methods.get("tova", **METHODS["tova"])
    first = [Request(id=i, tokens=tuple(p), max_new_tokens=new)
             for i, (p, new) in enumerate(zip(random_prompts(21, LENGTHS[:3]), (3, 12, 12), strict=True))]
    second = _requests(lengths=LENGTHS[3:])
    engine = _engine(model, method, first + second)
    run = engine.run(first)
    assert next(run).id == 0  # request 1 is still generating in the other slot
    assert np.asarray(engine.state.active).sum() == 1
    run.close()
    assert not np.asarray(engine.state.active).any()
    again = {c.id: c.tokens for c in engine.run(second)}
    fresh = {c.id: c.tokens for c in _engine(model, method, first + second).run(second)}
    assert again == fresh


def test_an_insert_that_fails_after_its_slots_were_donated_leaves_the_engine_usable(monkeypatch):
    """An insert that fails once it holds the donated slots (out of memory on a device), with no slot live yet, left
    the engine holding deleted arrays: every later run failed. The next run now allocates fresh slots and answers
    as a fresh engine does. A stand-in insert deletes what it was handed and raises, as a failed donated call."""
    from kvjax.engine import engine as engine_module

    model = tiny_model(num_layers=2, eos_token_ids=())
    requests = _requests(lengths=LENGTHS[:3])
    engine = _engine(model, "full", requests)
    insert = engine_module.sl.insert

    def failing(layout, cache, state, *args, **kwargs):
        for x in jax.tree.leaves((cache, state)):
            if isinstance(x, jax.Array):
                x.delete()
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (a stand-in)")

    monkeypatch.setattr(engine_module.sl, "insert", failing)
    with pytest.raises(RuntimeError, match="stand-in"):
        list(engine.run(requests))
    monkeypatch.setattr(engine_module.sl, "insert", insert)
    again = {c.id: c.tokens for c in engine.run(requests)}
    assert again == {c.id: c.tokens for c in _engine(model, "full", requests).run(requests)}


def test_a_run_started_while_another_is_unfinished_is_refused():
    """Two runs of one engine share its slots: a second run started while the first still holds a request in a
    slot would overwrite it, and the first would go on to hand out another request's tokens. The second is refused;
    the first then answers as it does alone, and once it has ended a new run answers as a fresh engine does."""
    model = tiny_model(num_layers=2, eos_token_ids=())
    first = [Request(id=i, tokens=tuple(p), max_new_tokens=new)
             for i, (p, new) in enumerate(zip(random_prompts(21, LENGTHS[:2]), (2, 12), strict=True))]
    second = _requests(lengths=LENGTHS[2:])
    alone = {c.id: c.tokens for c in _engine(model, "full", first + second).run(first)}
    engine = _engine(model, "full", first + second)
    run = engine.run(first)
    assert next(run).id == 0  # request 1 is still generating in the other slot
    with pytest.raises(KvjaxError, match="previous run is still in progress"):
        next(engine.run(second))
    assert [(c.id, c.tokens) for c in run] == [(1, alone[1])]
    fresh = {c.id: c.tokens for c in _engine(model, "full", first + second).run(second)}
    assert {c.id: c.tokens for c in engine.run(second)} == fresh


def test_kept_positions_are_read_without_copying_the_cache(monkeypatch):
    """`keep_positions` reads each layer's kept positions when a slot finishes; it fetched every layer whole (keys
    and values of every slot) to the host to take them: a copy of the whole slot cache per decode call that
    finished a request. Oracle: what a run fetches to the host is less than one copy of the slots' keys and values,
    and the positions are the same as before (the kept positions of `generate` alone)."""
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get("full")
    requests = _requests(lengths=LENGTHS[:3])
    engine = _engine(model, method, requests)
    fetched = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: fetched.append(x) or real(x))
    done = list(engine.run(requests))
    monkeypatch.undo()
    kv = sum(layer.k.nbytes + layer.v.nbytes for layer in engine.cache.layers)
    assert sum(a.nbytes for a in jax.tree.leaves(fetched)) < kv
    assert compare(model, method, requests, done) == []


def test_per_request_limits_stop_ids_and_logprobs():
    model = tiny_model(num_layers=3, eos_token_ids=())
    method = methods.get("snapkv", **METHODS["snapkv"])
    prompts = random_prompts(21, LENGTHS)
    plain = [Request(id=i, tokens=tuple(p), max_new_tokens=12) for i, p in enumerate(prompts)]
    free = {c.id: c for c in _engine(model, method, plain).run(plain)}
    # A stop id each request meets at its 4th token, a limit of 6 on another, log-probabilities on all.
    requests = [Request(id=i, tokens=tuple(p), max_new_tokens=6 if i == 1 else 12, logprobs=True,
                        stop_ids=() if i == 1 else (free[i].tokens[3],)) for i, p in enumerate(prompts)]
    done = {c.id: c for c in _engine(model, method, requests).run(requests)}
    for i, c in done.items():
        if i == 1:
            assert c.tokens == free[1].tokens[:6] and c.finish_reason == "length"
        else:
            stop = free[i].tokens.index(free[i].tokens[3])
            assert c.tokens == free[i].tokens[: stop + 1] and c.finish_reason == "stop"
        assert len(c.logprobs) == len(c.tokens) and all(x <= 0 for x in c.logprobs)
    # The log-probability of a greedy token is the log-softmax of its logits: the first one from the prefill.
    state = kvjax.prefill(model, [prompts[0]], method=method, max_new_tokens=12)
    want = float(jax.nn.log_softmax(state.logits[0])[done[0].tokens[0]])
    assert abs(done[0].logprobs[0] - want) < 1e-5
    assert compare(model, method, [r for r in requests if r.id == 1], [done[1]]) == []


@pytest.mark.parametrize("name", ["snapkv", "quest", "qllm"])
def test_questions_take_the_methods_layout(name):
    """Fed after the compressed prompt (SnapKV), read as the end of the prompt (Quest), and also before it (Q-LLM)."""
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get(name, **METHODS[name])
    questions = random_prompts(11, (5, 0, 7, 3, 6))
    requests = [Request(id=f"r{i}", tokens=tuple(p), question=tuple(q), max_new_tokens=NEW)
                for i, (p, q) in enumerate(zip(random_prompts(21, LENGTHS), questions, strict=True))]
    done = list(_engine(model, method, requests).run(requests))
    assert len(compare(model, method, requests, done)) <= 1


def test_sampling_is_reproducible_and_greedy_requests_are_unchanged():
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get("snapkv", **METHODS["snapkv"])
    greedy = _requests()
    sampled = [Request(id=f"s{i}", tokens=r.tokens, max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=i)
               for i, r in enumerate(greedy)]
    engine = _engine(model, method, greedy, sampling=True)
    first = {c.id: c.tokens for c in engine.run(greedy + sampled)}
    again = {c.id: c.tokens for c in engine.run(sampled[::-1])}
    assert all(first[k] == again[k] for k in again)  # the draw is the request's own: seed and step
    plain = {c.id: c.tokens for c in _engine(model, method, greedy).run(greedy)}
    assert all(first[k] == plain[k] for k in plain)
    assert any(first[s.id] != first[g.id] for s, g in zip(sampled, greedy, strict=True))


def test_a_job_compiles_one_prefill_and_insert_per_bucket_and_one_decode():
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get("h2o", budget=20)
    requests = _requests(lengths=(20, 30, 60, 100, 120, 25, 50), seed=4)
    engine = _engine(model, method, requests, slots=3)
    before = dict(TRACE_COUNTS)
    list(engine.run(requests))
    traced = {k: TRACE_COUNTS[k] - before.get(k, 0) for k in TRACE_COUNTS}
    buckets = 3  # 32, 64, 128
    assert traced["engine_decode"] == 1
    assert traced["engine_insert"] <= buckets
    assert traced["prefill"] <= buckets  # one per-layer program per bucket (every layer has one shape)
    again = dict(TRACE_COUNTS)
    list(engine.run(_requests(lengths=(22, 33, 61, 99), seed=5)))  # the same buckets: nothing new
    assert dict(TRACE_COUNTS) == again


def test_requests_of_numpy_values_run_as_their_python_values():
    """A tokenizer's ids are often a NumPy array, and `kvjax.generate` takes them: a request of NumPy tokens,
    question, stop ids, limit, seed and samples runs (it was refused as "tokens holds np.int64(28); token ids are
    integers"), each field held as Python ints, and answers as the same request of Python values."""
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    prompt, question = random_prompts(21, (LENGTHS[0], 5))
    python = dict(tokens=tuple(prompt), question=tuple(question), max_new_tokens=NEW, stop_ids=(7,), seed=3)
    numpy = dict(tokens=np.asarray(prompt), question=np.asarray(question, np.int32), max_new_tokens=np.int64(NEW),
                 stop_ids=np.asarray([7]), seed=np.uint32(3))
    requests = [Request(id="np", logprobs=True, **numpy), Request(id="py", logprobs=True, **python)]
    assert all(type(t) is int for t in requests[0].tokens + requests[0].question + requests[0].stop_ids)
    done = {c.id: c for c in _engine(model, "full", requests).run(requests)}
    assert (done["np"].tokens, done["np"].logprobs) == (done["py"].tokens, done["py"].logprobs)
    sampled = Request(id="s", tokens=np.asarray(prompt), max_new_tokens=np.int32(4), temperature=0.7,
                      samples=np.int64(2))
    _engine(model, "full", requests, sampling=True).check(sampled)  # was refused: "samples must be an integer..."
    assert (sampled.samples, sampled.sample_indices, type(sampled.max_new_tokens)) == (2, (0, 1), int)


def test_refusals_name_the_request():
    model = tiny_model(num_layers=3)
    with pytest.raises(ConfigError, match="samkv is a multi-context strategy"):
        Engine(model, method="samkv", max_prompt_tokens=64, max_new_tokens=4)
    for fraction in (0, -0.5, 1.5, float("nan"), True, "0.9"):  # else a GPU's slot count is planned on it silently
        with pytest.raises(KvjaxError, match=r"memory_fraction must be in \(0, 1\], got"):
            Engine(model, method="full", max_prompt_tokens=64, max_new_tokens=4, memory_fraction=fraction)
    engine = Engine(model, method="full", max_prompt_tokens=64, max_new_tokens=4, slots=2)
    bad = {"empty prompt": Request(id="a", tokens=(), max_new_tokens=2),
           "max_new_tokens=9": Request(id="a", tokens=(1, 2), max_new_tokens=9),
           "exceeds the engine's max_prompt_tokens": Request(id="a", tokens=(1,) * 65, max_new_tokens=2),
           "token ids are integers": Request(id="a", tokens=(1, 500), max_new_tokens=2),
           "sampling=False": Request(id="a", tokens=(1, 2), max_new_tokens=2, temperature=0.5),
           r"seed must be an integer in \[0, 2\*\*32\), got 4294967296": Request(  # drew as seed 0
               id="a", tokens=(1, 2), max_new_tokens=2, seed=2**32),
           # These two were Python's TypeError from Request itself, naming no field; a string was read letter by letter.
           "stop_ids must be a sequence of token ids, got int 5": Request(id="a", tokens=(1, 2), max_new_tokens=2,
                                                                          stop_ids=5),
           "tokens must be a sequence of token ids, got str 'ab'": Request(id="a", tokens="ab", max_new_tokens=2)}
    for message, request in bad.items():
        with pytest.raises(KvjaxError, match=message):
            list(engine.run([request]))
    # Checked before anything runs: keep_positions="no" kept positions (it was read as truthy); a progress that is no
    # function failed only after the first decode call, its slots' work lost.
    with pytest.raises(KvjaxError, match="keep_positions must be True or False, got 'no'"):
        Engine(model, method="full", max_prompt_tokens=64, max_new_tokens=4, slots=2, keep_positions="no")
    with pytest.raises(KvjaxError, match="progress must be a function of a Progress .*, got str"):
        list(engine.run([Request(id="a", tokens=(1, 2), max_new_tokens=2)], progress="bar"))
    # None is no question and no stop ids, as it is no stop strings
    assert Request(id="a", tokens=(1,), max_new_tokens=1, question=None, stop_ids=None, stop=None) == \
        Request(id="a", tokens=(1,), max_new_tokens=1)
    with pytest.raises(KvjaxError, match="appears twice"):
        list(engine.run([Request(id="x", tokens=(1,), max_new_tokens=1)] * 2))
    with pytest.raises(KvjaxError, match=r"request id \['q', 1\] must be hashable .*, got list"):  # was a TypeError
        list(engine.run([Request(id=["q", 1], tokens=(1,), max_new_tokens=1)]))


def test_sizes_no_request_could_run_with_are_refused_at_construction():
    """A `max_prompt_tokens` past the model's context sized every slot for prompts no request may have (the
    engine took 10**6 on a 4,096-token model and allocated slots of a 1M-token bucket); a budget past the context was
    refused only by the first run, after its slots were allocated. Both are refused when the engine is built, naming
    the value; a method whose attention stays within a window may go past the context, as in `generate`."""
    model = tiny_model(num_layers=2)
    with pytest.raises(KvjaxError, match=r"max_prompt_tokens=5000: no request could run with it: prompt of 5000"):
        Engine(model, max_prompt_tokens=5000, max_new_tokens=4, slots=1)
    with pytest.raises(KvjaxError, match=r"max_new_tokens=4096: no request could run with it: prompt of 1 tokens"):
        Engine(model, max_prompt_tokens=64, max_new_tokens=4096, slots=1)
    with pytest.raises(ConfigError, match="budget=5000 exceeds the model's maximum context of 4096"):
        Engine(model, method="snapkv", method_args={"budget": 5000}, max_prompt_tokens=64, max_new_tokens=4, slots=1)
    Engine(model, max_prompt_tokens=4095, max_new_tokens=4095, slots=1)  # 4,095 + 1 and 1 + 4,095 tokens run
    Engine(model, method=methods.get("infllm", **METHODS["infllm"]), max_prompt_tokens=5000, max_new_tokens=4,
           slots=1)
