"""The engine's admission policy (`kvjax/engine/schedule.py`): by default every free slot is filled before a decode
call; a `prefill_tokens` bound admits the oldest request past it and no other; none is ever passed over. The policy
alone on worked queues, then the slots each decode call of a real engine runs, traced by hand from the policy, and
the same tokens under either policy."""

from __future__ import annotations

import weakref
from collections import deque

import jax
from tiny import random_prompts, tiny_model

from kvjax.engine import Engine, Request, schedule
from kvjax.runtime import stages


def _admit(waiting, free, bound=None, cost=None):
    return schedule.admit(waiting, free, bound, cost or (lambda r: 64))


def test_without_a_bound_every_free_slot_is_filled_in_arrival_order():
    waiting = deque("abcdef")
    assert _admit(waiting, 4) == list("abcd") and list(waiting) == list("ef")
    assert _admit(waiting, 0) == [] and _admit(waiting, 5) == list("ef") and not waiting


def test_a_bound_admits_the_oldest_past_it_and_stops_at_the_first_request_over_it():
    cost = {"a": 512, "b": 64, "c": 32, "d": 16}.get
    waiting = deque("abcd")
    assert _admit(waiting, 4, bound=128, cost=cost) == ["a"]  # alone past the bound: it would otherwise wait forever
    assert _admit(waiting, 4, bound=128, cost=cost) == ["b", "c", "d"]  # 112 tokens
    waiting = deque("bac")
    assert _admit(waiting, 4, bound=128, cost=cost) == ["b"]  # "c" fits the bound but does not pass "a"


def test_groups_keep_arrival_order_within_a_shape_in_powers_of_two():
    shape = {"a": 64, "b": 128, "c": 64, "d": 64, "e": 128, "f": 64, "g": 64, "h": 64}.get
    assert schedule.groups(list("abcdefgh"), shape, 4) == [list("acdf"), list("gh"), list("be")]
    assert schedule.groups(list("abcdefgh"), shape, 1) == [[r] for r in "acdfghbe"]


def _live_after_each_call(prefill_tokens):
    """The live slots after each decode call, and each request's tokens: six requests of 12 tokens (no stop id), one
    length bucket (64), through 4 slots decoding 3 tokens per call."""
    model = tiny_model(num_layers=2)
    requests = [Request(id=f"r{i}", tokens=tuple(p), max_new_tokens=12)
                for i, p in enumerate(random_prompts(3, (35, 41, 47, 52, 58, 60)))]
    engine = Engine(model, method="snapkv", method_args={"budget": 40, "window_size": 4}, max_prompt_tokens=60,
                    max_new_tokens=12, slots=4, steps=3, prefill_tokens=prefill_tokens, eos_token_id=())
    calls: list = []
    tokens = {c.id: c.tokens for c in engine.run(requests, progress=calls.append)}
    return [p.live for p in calls], tokens


def test_each_decode_call_runs_the_slots_the_policy_admitted():
    filled, tokens = _live_after_each_call(None)
    # Four admitted at once; each ends after 4 calls; the last two take their place.
    assert filled == [4, 4, 4, 0, 2, 2, 2, 0]
    bounded, bounded_tokens = _live_after_each_call(64)
    # One 64-token bucket per call: r0..r3 admitted at calls 1-4, r4 and r5 as r0 and r1 end.
    assert bounded == [1, 2, 3, 3, 3, 3, 2, 1, 0]
    assert tokens == bounded_tokens and all(len(t) == 12 for t in tokens.values())


def test_a_prefill_is_dropped_before_the_next_one_runs(monkeypatch):
    """Filling every free slot runs several prefills between two decode calls; the slot count plans memory for one
    prefill's cache and activations beside the slots, so each is freed once inserted."""
    through, after, held = stages.through_prompt, stages.after_prompt, []

    def tracked_through(*args, **kwargs):  # a new prompt pass: every earlier one and its prefill freed
        assert all(ref() is None for ref in held), "an earlier group's prefill is still alive"
        state = through(*args, **kwargs)
        held.extend(weakref.ref(x) for x in (state, *jax.tree.leaves(state.cache)))
        return state

    def tracked_after(*args, **kwargs):
        state = after(*args, **kwargs)
        held.extend(weakref.ref(x) for x in (state, *jax.tree.leaves(state.cache)))
        return state

    monkeypatch.setattr(stages, "through_prompt", tracked_through)
    monkeypatch.setattr(stages, "after_prompt", tracked_after)
    _live_after_each_call(None)
    assert len(held) > 8
