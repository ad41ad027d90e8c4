"""The slot count planned from the device's memory (`kvjax/engine/sizing.py`). Oracle: what a job holds at its
peak, counted from the arrays a prefill really allocates (`stages.allocate`), must fit the memory it was planned
in."""

from __future__ import annotations

import jax
from golden_cases import METHODS
from tiny import tiny_model

from kvjax import methods
from kvjax.engine import Engine, Request, sizing
from kvjax.runtime import stages


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_a_context_replays_whole_prompt_is_planned_for(monkeypatch):
    """KVzip's prompt pass holds the whole prompt's cache (its replay compacts it afterwards): at a 2,048-token
    bucket and a budget of 12, that is some fifty slots' caches, which the slot count left out (it planned a
    prefill's cache as at most a slot's), so the slots and one long prefill overran the memory they were sized in."""
    model = tiny_model(num_layers=2)
    method = methods.get("kvzip", **METHODS["kvzip"])
    kwargs = dict(method=method, max_prompt_tokens=2000, max_new_tokens=4, share_prompts=False)
    longest = Request(id="long", tokens=(1,) * 2000, max_new_tokens=4)
    probe = Engine(model, slots=1, **kwargs)
    prompt_pass = _bytes(stages.allocate(model, probe._plan([longest])).cache)  # what the prefill allocates
    slot = probe.layout.slot_bytes()
    assert prompt_pass > 20 * slot
    per_slot = sizing.per_slot_bytes(model.config, slot)
    weights = _bytes(model.weights())
    activations = sizing.prefill_bytes(model.config, probe.layout.bucket, 1, 0)  # a cache of 0 bytes: the rest
    limit = weights + sizing.HEADROOM + activations + prompt_pass + 2 * slot + 64 * per_slot
    monkeypatch.setattr(sizing, "device_bytes", lambda: limit)
    engine = Engine(model, slots=None, memory_fraction=1.0, **kwargs)
    assert 1 < engine.slots
    assert weights + sizing.HEADROOM + activations + prompt_pass + engine.slots * per_slot <= limit
