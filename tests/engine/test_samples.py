"""Several sampled answers per prompt (`Request.samples`): one prefill, its cache copied into one slot per sample.

Oracles: each sample of a request of n equals that sample run as a request of its own (`samples=(i,)`: its own
prefill, another slot, other neighbours), bit for bit (tokens, log-probabilities, kept positions); sample 0 equals
the request of one sample; the prompt is prefilled once per request (counted); the admission policy against a
hand-worked queue; refusals name the request.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from golden_cases import METHODS
from tiny import random_prompts, tiny_model

from kvjax import methods
from kvjax.engine import Engine, Request, schedule
from kvjax.errors import KvjaxError
from kvjax.runtime import stages

EOS = 33
NEW = 10
SAMPLED = dict(max_new_tokens=NEW, temperature=0.9, top_p=0.95, logprobs=True)


def _engine(model, method, **kwargs):
    return Engine(model, method=method, max_prompt_tokens=64, max_new_tokens=NEW, steps=3, sampling=True,
                  keep_positions=True, **kwargs)


def _same(a, b, name):
    assert a.tokens == b.tokens and a.positions == b.positions, name
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs), err_msg=name)
    assert (a.kept_tokens, a.kept_generated_tokens, a.finish_reason) == (b.kept_tokens, b.kept_generated_tokens,
                                                                         b.finish_reason), name


@pytest.mark.parametrize("name", ["snapkv", "tova"])
def test_samples_share_one_prefill_and_each_equals_its_own_request(name, monkeypatch):
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get(name, **METHODS[name])
    prompts = random_prompts(21, (35, 58, 47))
    shared = [Request(id=i, tokens=tuple(p), seed=10 + i, samples=3, **SAMPLED) for i, p in enumerate(prompts)]
    prefills = []
    run = stages.through_prompt
    monkeypatch.setattr(stages, "through_prompt", lambda *a, **k: prefills.append(1) or run(*a, **k))
    engine = _engine(model, method, slots=4)  # a request of 3 waits until 3 slots are free
    done = list(engine.run(shared))
    assert len(prefills) == len(shared)  # one prefill per prompt, not per sample
    assert sorted((c.id, c.sample) for c in done) == [(i, s) for i in range(3) for s in range(3)]
    for i in range(3):  # the samples draw differently
        assert len({tuple(c.tokens) for c in done if c.id == i}) > 1, i

    alone = [Request(id=(r.id, s), tokens=r.tokens, seed=r.seed, samples=(s,), **SAMPLED)
             for r in shared[::-1] for s in range(3)]  # another order, so other slots and neighbours
    prefills.clear()
    engine.share_prompts = False  # each its own prompt pass (alone's neighbours share their prompts)
    want = {c.id: c for c in engine.run(alone)}
    assert len(prefills) == len(alone)
    for c in done:
        _same(c, want[(c.id, c.sample)], f"{name} request {c.id} sample {c.sample}")

    single = [Request(id=r.id, tokens=r.tokens, seed=r.seed, **SAMPLED) for r in shared]
    for c in engine.run(single):  # sample 0 is what a request of one sample draws
        assert c.sample is None
        _same(c, next(d for d in done if (d.id, d.sample) == (c.id, 0)), f"{name} request {c.id}")


def test_greedy_requests_beside_sampled_ones_are_unchanged():
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get("snapkv", **METHODS["snapkv"])
    prompts = random_prompts(5, (40, 60))
    greedy = [Request(id=f"g{i}", tokens=tuple(p), max_new_tokens=NEW) for i, p in enumerate(prompts)]
    sampled = [Request(id=f"s{i}", tokens=tuple(p), seed=i, samples=2, **SAMPLED) for i, p in enumerate(prompts)]
    alone = {c.id: c.tokens for c in _engine(model, method, slots=2).run(greedy)}
    mixed = {c.id: c.tokens for c in _engine(model, method, slots=3).run(sampled[:1] + greedy + sampled[1:])
             if c.sample is None}
    assert mixed == alone


def test_admission_takes_a_requests_samples_together_and_passes_none_over():
    width = {"a": 3, "b": 1, "c": 2, "d": 1}
    waiting = deque("abcd")
    admit = lambda free, bound=10**6: schedule.admit(waiting, free, bound, lambda r: 64, width=width.get)  # noqa: E731
    assert admit(2) == [] and list(waiting) == list("abcd")  # "a" needs 3 slots; "b" does not pass it
    assert admit(5) == ["a", "b"] and list(waiting) == list("cd")  # "c" would need a 6th slot
    assert admit(1) == [] and admit(3) == ["c", "d"]
    waiting.extend("ab")
    assert admit(4, bound=64) == ["a"]  # the prefill bound still applies after the first request


def test_refusals_name_the_request():
    model = tiny_model(num_layers=2)
    engine = _engine(model, "full", slots=2)
    bad = {"3 samples need as many slots at once; the engine has 2": dict(samples=3, temperature=1.0),
           r"samples must be an integer in \[1, ": dict(samples=0, temperature=1.0),
           "distinct sample indices": dict(samples=(1, 1), temperature=1.0),
           "samples must be": dict(samples=True, temperature=1.0),
           "2 identical greedy answers; give a temperature > 0": dict(samples=2)}
    for message, settings in bad.items():
        with pytest.raises(KvjaxError, match=f"request 'q': .*{message}"):
            list(engine.run([Request(id="q", tokens=(1, 2, 3), max_new_tokens=2, **settings)]))
    (done,) = engine.run([Request(id="q", tokens=(1, 2, 3), max_new_tokens=2, samples=(5,))])  # one index: greedy
    assert done.sample == 5


def test_an_insert_of_n_samples_holds_one_prefill_row_not_n():
    """XLA's buffer assignment of the insert that copies one prefill row into 8 slots: its temporaries stay near
    one slot's cache (the row laid into slot shape, one row in flight), not 8 (a gather of the row 8 times)."""
    from kvjax.engine import slots as sl

    model = tiny_model(num_layers=2)
    engine = _engine(model, "full", slots=8)
    engine._allocate()
    request = Request(id=0, tokens=tuple(range(1, 40)), samples=8, **SAMPLED)
    prefilled = stages.run(model, engine._plan([request]), None)
    source, index = np.zeros(8, np.int32), np.arange(8, dtype=np.int32)
    rows = engine._rows([request], prefilled, source, list(range(8)))
    compiled = sl.insert.lower(engine.layout, engine.cache, engine.state, prefilled.cache, rows, source,
                               index).compile()
    temp, slot = compiled.memory_analysis().temp_size_in_bytes, engine.layout.slot_bytes()
    assert temp < 3 * slot, (temp, slot)


def test_a_prefill_batch_of_requests_with_different_sample_counts(monkeypatch):
    """Four requests of 2, 1, 3 and 2 samples prefilled as one batch of 4 rows, gathered into 8 slots (`source`
    0, 0, 1, 2, 2, 2, 3, 3). Oracle: the same batch of four run once per sample index s, each request drawing only
    its sample min(s, n - 1), so every run prefills the very same rows with the same program."""
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get("snapkv", **METHODS["snapkv"])
    prompts, counts = random_prompts(31, (40, 44, 50, 60)), (2, 1, 3, 2)
    prefills = []
    run = stages.through_prompt
    monkeypatch.setattr(stages, "through_prompt", lambda *a, **k: prefills.append(1) or run(*a, **k))
    engine = _engine(model, method, slots=8, prefill_batch=4, prefill_tokens=256)
    requests = [Request(id=i, tokens=tuple(p), seed=i, samples=n, **SAMPLED)
                for i, (p, n) in enumerate(zip(prompts, counts, strict=True))]
    done = {(c.id, c.sample or 0): c for c in engine.run(requests)}
    assert len(prefills) == 1 and len(done) == sum(counts)
    for s in range(max(counts)):
        alone = {c.id: c for c in engine.run([Request(id=r.id, tokens=r.tokens, seed=r.seed,
                                                      samples=(min(s, r.samples - 1),), **SAMPLED)
                                              for r in requests])}
        for i, n in enumerate(counts):
            if s < n:
                _same(done[(i, s)], alone[i], f"request {i} sample {s}")
