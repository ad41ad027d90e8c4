"""The decode loop runs on per-layer buffers: weights and K / V of each layer are arrays of their own, read and
written where they lie.

Oracles: the compiled decode loop's HLO (no slice or copy of a layer's K / V inside the loop, for every kind of
decode: appending in place, evicting in place, the general path with attention observers, the retrieval methods'
compact gather), the buffers themselves (no two layers share one, no array has a layer axis) and the trace
counter (one compile per shape bucket).
"""

import importlib
import re

import jax
import numpy as np
import pytest
from tiny import random_prompts, tiny_model

import kvjax
from kvjax import methods, tuning
from kvjax.runtime import TRACE_COUNTS

gen = importlib.import_module("kvjax.runtime.generate")  # the module (`kvjax.runtime.generate` is also the function)

SMALL = dict(n_init=2, n_local=8, block_size=4, window=8, repr_topk=2)
CASES = {
    "full": {},
    "snapkv": {"budget": 24, "window_size": 4},  # appends in place
    "streaming_llm": {"budget": 24},  # evicts in place
    "h2o": {"budget": 24},  # general path, observes attention
    "tova": {"budget": 24},
    "ahakv": {"budget": 24},
    "quest": {"budget": 24, "page_size": 4, "dense_layers": 1},  # gathers; layer 0 dense
    "infllm": {"topk": 2, **SMALL},  # gathers, rewrites positions, observes
}


def _compiled_decode_loop(method) -> tuple[str, tuple[int, ...]]:
    """The compiled decode loop's HLO text and the shape of one layer's K."""
    model = tiny_model(num_layers=3)
    state = kvjax.prefill(model, random_prompts(3, (50, 50)), method=method, max_new_tokens=4)
    lowered = gen._decode_loop.lower(
        model.config, state.method, 4, 0.0, 1.0, tuning.current(), model.weights(), model.rope(), state.cache,
        state.logits, np.asarray(state.prompt_lengths, np.int32), state.budget, np.asarray([-1], np.int32),
        np.int32(0), np.uint32(0),
    )
    return lowered.compile().as_text(), tuple(state.cache.layers[0].k.shape)


def _layer_copies(hlo: str, shape: tuple[int, ...]) -> int:
    """Slices and copies inside the loop that make a buffer of one layer's K / V shape (the token's in-place
    scatter / dynamic-update-slice into a layer does not count)."""
    dims = ",".join(map(str, shape))
    made = re.compile(rf"^\s*(ROOT )?%(?P<name>[\w.-]+) = f32\[(1,)?{dims}\]")
    copying = re.compile(r"(?<!update-)(?<!update_)slice|copy")
    return sum(1 for line in _loop_lines(hlo) if (m := made.match(line)) and copying.search(m["name"]))


def _loop_lines(hlo: str) -> list[str]:
    """The lines of the while loop's body computation(s) (copies that XLA inserts carry no op name)."""
    bodies = set(re.findall(r"body=%([\w.-]+)", hlo))
    lines, inside = [], False
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.-]+) ", line)
        if header:
            inside = header[2] in bodies
        elif inside or "/while/body/" in line:
            lines.append(line)
    return lines


def test_the_copy_detector_sees_a_layer_copy():
    """The oracle itself: a loop that slices a layer's K out of a stacked array is caught."""
    k = np.zeros((3, 2, 2, 56, 16), np.float32)

    def loop(k):
        def body(carry):
            i, acc = carry
            return i + 1, acc + jax.lax.dynamic_index_in_dim(k, i % 3, 0, keepdims=False).sum()
        return jax.lax.while_loop(lambda c: c[0] < 4, body, (0, 0.0))[1]

    hlo = jax.jit(loop).lower(k).compile().as_text()
    assert _layer_copies(hlo, (2, 2, 56, 16)) > 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_loop_copies_no_layer_of_the_cache(name):
    hlo, shape = _compiled_decode_loop(methods.get(name, **CASES[name]))
    assert _layer_copies(hlo, shape) == 0


def test_each_layer_owns_its_buffers():
    model = tiny_model(num_layers=3)
    weights = model.weights()
    out = kvjax.generate(model, random_prompts(2, (20, 9)), method="actqkv", method_args={"topk": 2, **SMALL},
                         max_new_tokens=4, return_cache=True)
    cache = out.cache
    assert cache.num_layers == len(weights["layers"]) == 3
    assert cache.shared is not None  # ActQKV's cross-layer state, stored once
    for layers in (cache.layers, weights["layers"]):
        pointers = [x.unsafe_buffer_pointer() for layer in layers for x in jax.tree.leaves(layer)]
        assert len(set(pointers)) == len(pointers)  # no two layers (or fields) share a buffer
    assert all(layer.k.shape == (2, 2, cache.capacity, 16) for layer in cache.layers)  # no layer axis


def test_decode_traces_once_per_bucket():
    model = tiny_model(num_layers=3)
    kvjax.generate(model, random_prompts(3, (20,)), method="snapkv", method_args={"budget": 12, "window_size": 4},
                   max_new_tokens=5)
    before = TRACE_COUNTS["decode_step"], TRACE_COUNTS["prefill"]
    kvjax.generate(model, random_prompts(4, (27,)), method="snapkv", method_args={"budget": 12, "window_size": 4},
                   max_new_tokens=5)
    assert (TRACE_COUNTS["decode_step"], TRACE_COUNTS["prefill"]) == before


def test_prefill_compiles_one_program_for_every_layer():
    """Prefill runs one per-layer program (the layer index is traced): its compile does not grow with depth."""
    for layers in (2, 5):
        model = tiny_model(num_layers=layers)
        before = TRACE_COUNTS["prefill"]
        kvjax.prefill(model, random_prompts(5, (33,)), method="snapkv", method_args={"budget": 12, "window_size": 4},
                      max_new_tokens=2)
        assert TRACE_COUNTS["prefill"] - before == 1, layers
