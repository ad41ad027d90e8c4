"""Requests that repeat a prompt (one context, several questions; one prompt, several requests) share its prompt
pass: the engine holds the last prompt pass and a prefill whose prompt rows equal it runs only its question.

Oracle: the same job with `share_prompts=False` (every request its own prompt pass), bit for bit in tokens,
log-probabilities, kept positions and kept counts; the prompt passes counted (fewer, and exactly one per change of
prompt rows in the order the prefills ran); a method that reads the question inside the prompt (Quest) shares only
when the question is the same too.
"""

from __future__ import annotations

import numpy as np
import pytest
from golden_cases import METHODS
from tiny import random_prompts, tiny_gemma3, tiny_model

from kvjax import methods
from kvjax.engine import Engine, Request
from kvjax.errors import KvjaxError
from kvjax.runtime import stages

EOS = 33
NEW = 8


def _job() -> list[Request]:
    """Contexts a, b, c with questions; a question's context listed together, then again later, and c twice with
    no question (sampled, other seeds)."""
    a, b, c = (tuple(p) for p in random_prompts(3, (40, 55, 30)))
    q = [tuple(p) for p in random_prompts(4, (5, 9, 7, 6))]
    sampled = dict(temperature=0.9, logprobs=True)
    return [
        Request(id="a1", tokens=a, question=q[0], max_new_tokens=NEW, logprobs=True),
        Request(id="a2", tokens=a, question=q[1], max_new_tokens=NEW, logprobs=True),
        Request(id="a3", tokens=a, question=q[2], max_new_tokens=NEW, seed=1, **sampled),
        Request(id="b1", tokens=b, question=q[0], max_new_tokens=NEW, logprobs=True),
        Request(id="b2", tokens=b, question=q[3], max_new_tokens=NEW, logprobs=True),
        Request(id="a4", tokens=a, question=q[3], max_new_tokens=NEW, logprobs=True),
        Request(id="c1", tokens=c, max_new_tokens=NEW, seed=2, **sampled),
        Request(id="c2", tokens=c, max_new_tokens=NEW, seed=3, **sampled),
        Request(id="a5", tokens=a, question=q[0], max_new_tokens=NEW, logprobs=True),  # a1's question again
    ]


def _run(model, method, requests, share, monkeypatch):
    """{id: completion}, the prompt passes run and the prompt rows of each prefill, in order."""
    passes, rows = [], []
    through, after = stages.through_prompt, stages.after_prompt
    monkeypatch.setattr(stages, "through_prompt", lambda *a, **k: passes.append(1) or through(*a, **k))
    monkeypatch.setattr(stages, "after_prompt", lambda m, plan, run: rows.append(
        (plan.tokens.tobytes(), plan.lengths.tobytes())) or after(m, plan, run))
    engine = Engine(model, method=method, max_prompt_tokens=64, max_question_tokens=9, max_new_tokens=NEW, steps=3,
                    slots=3, sampling=True, keep_positions=True, share_prompts=share)
    done = {c.id: c for c in engine.run(requests)}
    assert engine._held is None  # freed with the job
    return done, len(passes), rows


def _same(a, b, name):
    assert a.tokens == b.tokens and a.positions == b.positions, name
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs), err_msg=name)
    assert (a.kept_tokens, a.kept_generated_tokens, a.finish_reason) == (b.kept_tokens, b.kept_generated_tokens,
                                                                         b.finish_reason), name


CASES = [("snapkv", "llama"), ("tova", "llama"), ("quest", "llama"), ("kvzip", "llama"), ("snapkv", "sliding")]


@pytest.mark.parametrize("name,family", CASES)
def test_shared_prompt_passes_give_the_unshared_answers(name, family, monkeypatch):
    model = tiny_gemma3(num_layers=3, window=16, eos_token_ids=(EOS,)) if family == "sliding" else \
        tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get(name, **METHODS[name])
    requests = _job()
    alone, alone_passes, _ = _run(model, method, requests, False, monkeypatch)
    shared, shared_passes, rows = _run(model, method, requests, True, monkeypatch)
    assert alone_passes == len(requests)
    for request in requests:
        _same(shared[request.id], alone[request.id], f"{name} {family} {request.id}")
    changes = 1 + sum(rows[i] != rows[i - 1] for i in range(1, len(rows)))
    assert shared_passes == changes, (shared_passes, changes)
    if name == "quest":  # the question is in the prompt rows: only c2 after c1 shares (and a5 never follows a1)
        assert shared_passes == len(requests) - 1
    else:  # a1-a3, b1-b2, c1-c2 share at least (a4 and a5 also follow their context's prefill unless reordered)
        assert shared_passes <= len(requests) - 4, shared_passes


def test_a_held_prompt_pass_is_not_reused_under_another_tuning():
    """The tuning is read when a prompt pass is traced: a prefill under another tuning (a caller may change it between
    two `next()` calls of one run) runs its own prompt pass, even for the same prompt rows."""
    from kvjax import tuning
    from kvjax.engine.engine import _prompt_key

    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    engine = Engine(model, method=methods.get("snapkv", **METHODS["snapkv"]), max_prompt_tokens=64,
                    max_question_tokens=9, max_new_tokens=NEW, slots=2)
    group = _job()[:2]  # one context, two questions
    key = _prompt_key(engine._plan(group))
    assert key == _prompt_key(engine._plan(group))
    with tuning.override(prefill_blocks=(64, 64)):
        assert _prompt_key(engine._plan(group)) != key


def test_share_prompts_is_checked():
    model = tiny_model(num_layers=2)
    with pytest.raises(KvjaxError, match="share_prompts must be True or False, got 'yes'"):
        Engine(model, max_prompt_tokens=8, max_new_tokens=2, slots=1, share_prompts="yes")


def test_sizing_plans_for_the_held_prompt_pass():
    """The held prompt pass is one more prefill cache beside the slots: the slot count plans for it."""
    from kvjax.engine import sizing

    model = tiny_model(num_layers=2)
    slot = 1 << 20
    assert sizing.prefill_bytes(model.config, 64, 2, slot, held=True) - \
        sizing.prefill_bytes(model.config, 64, 2, slot) == 2 * slot
    limit = 64 * slot
    with_held = sizing.slots_for_memory(model, slot, bucket=64, prefill_batch=1, limit=limit + (1 << 30), held=True,
                                          fraction=1.0)
    without = sizing.slots_for_memory(model, slot, bucket=64, prefill_batch=1, limit=limit + (1 << 30), fraction=1.0)
    assert 0 < with_held < without
