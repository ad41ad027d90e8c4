"""The decode loop on per-layer buffers (`generate.PER_LAYER_DECODE_BYTES`, `transformer.decode_step_per_layer`).

Oracle: the stacked layer scan (`transformer.decode_step`), which the same `decode` runs when the byte bound is 0.
Both must generate the same tokens and end with the same cache (integer leaves exactly, floats within rounding:
XLA may fuse the two programs differently) for every kind of decode: appending in place, evicting in place, the
general path (`method.decode`, attention observers), the retrieval methods' compact gather (with dense layers)
and cross-layer state. A second oracle: the compiled per-layer loop copies no layer of K / V, the stacked one does.
"""

import importlib
import re

import jax
import numpy as np
import pytest
from tiny import assert_caches_close, random_prompts, tiny_model

import kvjax
from kvjax import methods
from kvjax.models import transformer
from kvjax.runtime import TRACE_COUNTS

gen = importlib.import_module("kvjax.runtime.generate")  # the module (`kvjax.runtime.generate` is also the function)

SMALL = dict(n_init=2, n_local=8, block_size=4, window=8, repr_topk=2)
CASES = [
    ("full", {}),
    ("snapkv", {"budget": 12, "window_size": 4}),  # appends in place
    ("adakv", {"budget": 12, "base_args": {"window_size": 4}}),  # per-head lengths
    ("streaming_llm", {"budget": 10}),  # evicts in place
    ("h2o", {"budget": 12}),  # general path, observes attention
    ("tova", {"budget": 12}),
    ("lagkv", {"budget": 12, "sink_size": 2, "lag_size": 4}),  # compresses while decoding
    ("quest", {"budget": 12, "page_size": 4, "dense_layers": 1}),  # gathers; layer 0 dense
    ("infllm", {"topk": 2, **SMALL}),
    ("actqkv", {"topk": 2, **SMALL}),  # cross-layer state["shared"]
]


def _generate(method, prompts, limit, monkeypatch, **kw):
    monkeypatch.setitem(gen.PER_LAYER_DECODE_BYTES, jax.default_backend(), limit)
    return kvjax.generate(tiny_model(num_layers=3), prompts, method=method, max_new_tokens=9, return_cache=True, **kw)


@pytest.mark.parametrize("name,args", CASES, ids=[n for n, _ in CASES])
def test_per_layer_decode_equals_the_stacked_scan(name, args, monkeypatch):
    method = methods.get(name, **args)
    prompts = random_prompts(7, (31, 12, 40))  # ragged
    stacked = _generate(method, prompts, 0, monkeypatch)
    per_layer = _generate(method, prompts, 1 << 40, monkeypatch)
    np.testing.assert_array_equal(per_layer.tokens, stacked.tokens)
    np.testing.assert_array_equal(per_layer.num_tokens, stacked.num_tokens)
    assert_caches_close(per_layer.cache, stacked.cache, tol=1e-5, name=name)


def test_layout_follows_the_byte_bound(monkeypatch):
    model = tiny_model(num_layers=3)
    state = kvjax.prefill(model, random_prompts(1, (20,)), method="full", max_new_tokens=4)
    _, layers = transformer.split_weights(model.weights())
    needed = state.cache.nbytes + sum(w.nbytes for w in layers.values())
    backend = jax.default_backend()
    monkeypatch.setitem(gen.PER_LAYER_DECODE_BYTES, backend, needed)
    assert gen._decodes_per_layer(model.weights(), state.cache)
    monkeypatch.setitem(gen.PER_LAYER_DECODE_BYTES, backend, needed - 1)
    assert not gen._decodes_per_layer(model.weights(), state.cache)
    monkeypatch.delitem(gen.PER_LAYER_DECODE_BYTES, backend)
    assert not gen._decodes_per_layer(model.weights(), state.cache)


def test_unstack_then_stack_is_the_identity():
    model = tiny_model(num_layers=3)
    state = kvjax.prefill(model, random_prompts(2, (25, 9)), method="actqkv", method_args={"topk": 2, **SMALL},
                          max_new_tokens=4)
    glob, layer_weights, caches, shared = transformer.unstack_layers(model.weights(), state.cache)
    assert len(layer_weights) == len(caches) == 3 and shared is not None
    assert all(c.k.shape[0] == 1 for c in caches)
    _, layers = transformer.split_weights(model.weights())
    np.testing.assert_array_equal(np.asarray(layer_weights[2]["mlp_norm"]), np.asarray(layers["mlp_norm"][2]))
    again = transformer.stack_layers(caches, shared)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state.cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _compiled_decode_loop(limit: int, monkeypatch, method="full") -> tuple[str, tuple[int, ...]]:
    """The compiled decode loop's HLO text and the shape of one layer's K."""
    monkeypatch.setitem(gen.PER_LAYER_DECODE_BYTES, jax.default_backend(), limit)
    model = tiny_model(num_layers=3)
    state = kvjax.prefill(model, random_prompts(3, (50, 50)), method=method, max_new_tokens=4)
    lowered = gen._decode_loop.lower(
        model.config, state.method, 4, 0.0, 1.0, model.weights(), model.rope(), state.cache, state.logits,
        np.asarray(state.prompt_lengths, np.int32), state.budget, np.asarray([-1], np.int32), np.int32(0),
        np.uint32(0), per_layer=gen._decodes_per_layer(model.weights(), state.cache),
    )
    return lowered.compile().as_text(), tuple(state.cache.k.shape[1:])


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


def test_per_layer_loop_copies_no_layer_of_the_cache(monkeypatch):
    stacked, shape = _compiled_decode_loop(0, monkeypatch)
    assert _layer_copies(stacked, shape) > 0  # the rolled scan slices each layer's K / V out
    per_layer, shape = _compiled_decode_loop(1 << 40, monkeypatch)
    assert _layer_copies(per_layer, shape) == 0


@pytest.mark.parametrize("name", ["h2o", "tova", "ahakv"])
def test_evicting_after_attention_copies_no_layer_either(name, monkeypatch):
    # The eviction writes into the layer's K / V after the attention read them, in place (BENCHMARKS.md,
    # "Eviction during decode"); unordered, XLA copied V (H2O, TOVA) or K and V (AhaKV) every step.
    per_layer, shape = _compiled_decode_loop(1 << 40, monkeypatch, methods.get(name, budget=24))
    assert _layer_copies(per_layer, shape) == 0


def test_per_layer_decode_traces_once_per_bucket(monkeypatch):
    monkeypatch.setitem(gen.PER_LAYER_DECODE_BYTES, jax.default_backend(), 1 << 40)
    model = tiny_model(num_layers=3)
    kvjax.generate(model, random_prompts(3, (20,)), method="snapkv", method_args={"budget": 12, "window_size": 4},
                   max_new_tokens=5)
    before = TRACE_COUNTS["decode_step"]
    kvjax.generate(model, random_prompts(4, (27,)), method="snapkv", method_args={"budget": 12, "window_size": 4},
                   max_new_tokens=5)
    assert TRACE_COUNTS["decode_step"] == before
