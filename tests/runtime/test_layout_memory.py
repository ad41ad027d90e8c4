"""The compiled generation programs hold no second copy of the weights or the cache (XLA's memory analysis).

Oracle: the byte counts of the arrays themselves. The decode loop takes the weights and the cache as its
arguments, updates the donated cache in place (its whole size aliased to the output) and needs less scratch
than one layer's keys, so no layer of K / V is ever copied; the prefill program of a layer takes that layer's
weights and cache, never the model's.
"""

import importlib

import jax
import numpy as np
import pytest
from tiny import random_prompts, tiny_model

import kvjax
from kvjax import tuning
from kvjax.models import block
from kvjax.runtime import forward

gen = importlib.import_module("kvjax.runtime.generate")

CASES = {
    "full": {},
    "snapkv": {"budget": 512, "window_size": 8},
    "streaming_llm": {"budget": 512},
    "h2o": {"budget": 512},
    "quest": {"budget": 512, "page_size": 16, "dense_layers": 1},
}


def _state(name):
    model = tiny_model(num_layers=3)
    state = kvjax.prefill(model, random_prompts(3, (1500, 1400)), method=name, method_args=CASES[name] or None,
                          max_new_tokens=8)
    return model, state


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_loop_updates_the_cache_in_place_and_copies_nothing(name):
    model, state = _state(name)
    lowered = gen._decode_loop.lower(
        model.config, state.method, 8, 0.0, 1.0, tuning.current(), model.weights(), model.rope(), state.cache,
        state.logits, np.asarray(state.prompt_lengths, np.int32), state.budget, np.asarray([-1], np.int32),
        np.int32(0), np.uint32(0),
    )
    memory = lowered.compile().memory_analysis()
    weights = sum(x.nbytes for x in jax.tree.leaves(model.weights()))
    cache = state.cache.nbytes
    small = 64 << 10  # logits, positions, tokens, RNG state
    assert memory.argument_size_in_bytes <= weights + cache + small
    assert memory.alias_size_in_bytes == cache  # the donated cache is the output cache
    assert memory.temp_size_in_bytes < state.cache.layers[0].k.nbytes  # no layer of K / V copied


def test_a_layer_prefill_program_holds_one_layer():
    model, state = _state("snapkv")
    weights = model.weights()
    config, rope = model.config, model.rope()
    x = np.zeros((2, 64, config.hidden_size), np.float32)
    positions = np.tile(np.arange(64, dtype=np.int32), (2, 1))
    lowered = forward.prefill_block.lower(
        config, state.method, True, True, tuning.current(), weights["layers"][1], rope, state.cache.layer(1), x,
        positions, state.budget, np.int32(1),
    )
    memory = lowered.compile().memory_analysis()
    one_layer = sum(w.nbytes for w in jax.tree.leaves(weights["layers"][1])) + state.cache.layers[1].nbytes
    # Another layer's weights (or the global ones) would exceed this by far more than the scalars' slack.
    inputs = one_layer + x.nbytes + positions.nbytes + rope[0].nbytes + (1 << 10)
    assert memory.argument_size_in_bytes <= inputs
    assert inputs - one_layer < min(sum(w.nbytes for w in jax.tree.leaves(block.global_weights(weights))),
                                    sum(w.nbytes for w in jax.tree.leaves(weights["layers"][0])))
