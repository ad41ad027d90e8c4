"""The compiled generation programs hold no second copy of the weights or the cache (XLA's memory analysis).

Oracle: the byte counts of the arrays themselves. The decode loop takes the weights and the cache as its
arguments, updates the donated cache in place (its whole size aliased to the output) and needs less scratch
than one layer's keys, so no layer of K / V is ever copied; the prefill program of a layer takes that layer's
weights and cache, never the model's.
"""

import importlib
import re

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



def _materialized(hlo: str) -> dict[str, tuple[str, str, list[str]]]:
    """The instructions of an optimized HLO module outside fused computations: name -> (opcode, op_name metadata,
    operand names)."""
    called = set(re.findall(r"calls=(%[\w.-]+)", hlo))
    out, inside = {}, False
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?(%[\w.-]+) .*\{$", line)
        if header:
            inside = header.group(1) in called
            continue
        m = re.match(r"\s+(?:ROOT )?(%[\w.-]+) = \S+(?: \S+)*? ([\w-]+)\((.*?)\)(?:, |$)", line)
        if m and not inside:
            op_name = re.search(r'op_name="([^"]*)"', line)
            out[m.group(1)] = (m.group(2), op_name.group(1) if op_name else "", re.findall(r"%[\w.-]+", m.group(3)))
    return out


def test_fused_projections_are_read_in_place_by_the_decode_loop():
    """Each layer's q / k / v come from one product with the fused `qkv`, gate / up from one with `gate_up`, split
    on the activations after it. Oracle: the decode loop's optimized HLO, with one such product per layer and
    projection and no other q / k / v or gate / up product, each reading its weight straight from the loop's
    arguments (a parameter or a view of one, never a copy or a slice); its scratch below one layer's `gate_up`;
    its arguments the weights and the cache with nothing beside them."""
    model = tiny_model(num_layers=2, hidden_size=256, intermediate_size=1024, num_heads=8, num_kv_heads=2,
                       head_dim=64)
    state = kvjax.prefill(model, random_prompts(3, (24, 17)), method="full", max_new_tokens=4)
    lowered = gen._decode_loop.lower(
        model.config, state.method, 4, 0.0, 1.0, tuning.current(), model.weights(), model.rope(), state.cache,
        state.logits, np.asarray(state.prompt_lengths, np.int32), state.budget, np.asarray([-1], np.int32),
        np.int32(0), np.uint32(0),
    )
    compiled = lowered.compile()
    layer = model.weights()["layers"][0]
    assert set(layer) >= {"qkv", "gate_up"} and not set(layer) & {"q", "k", "v", "gate", "up"}
    ops = _materialized(compiled.as_text())
    for einsum in ("btd,dkgh->btkgh", "btd,dsf->btsf"):
        products = [name for name, (_, op_name, _) in ops.items() if op_name.endswith(f"/{einsum}/dot_general")]
        assert len(products) == model.config.num_layers, (einsum, products)
        for name in products:
            weight = ops[name][2][-1]
            while ops.get(weight, ("parameter",))[0] == "bitcast":
                weight = ops[weight][2][0]
            assert ops.get(weight, ("parameter",))[0] in ("parameter", "get-tuple-element"), (name, ops.get(weight))
    assert not [op_name for _, op_name, _ in ops.values() if re.search(r"/btd,d[nk]h->bt[nk]h/|/btd,df->btf/", op_name)]
    memory = compiled.memory_analysis()
    weights = sum(x.nbytes for x in jax.tree.leaves(model.weights()))
    assert memory.temp_size_in_bytes < layer["gate_up"].nbytes
    assert memory.argument_size_in_bytes <= weights + state.cache.nbytes + (64 << 10)
