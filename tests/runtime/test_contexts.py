"""Compress a context once, ask it many questions (`kvjax.compress_context`, `kvjax.ask`), from memory or a file.

Oracle: `kvjax.generate` of the context with each question (`question_ids`), the same method and sizes: the same
tokens and, per layer, example and KV head, the same kept positions; a batch of questions asked at once gives each
question's tokens. A saved and loaded context holds the same arrays, bit for bit, and answers the same. The file
refuses another model, a damaged byte and a foreign file; `ask` refuses a question or an answer longer than the
context was sized for.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from golden_cases import FEW, LAYERS, METHODS, every_method, kept
from tiny import assert_trees_equal, full_disk_for_safetensors, random_prompts, tiny_gemma3, tiny_model

import kvjax
from kvjax import methods
from kvjax.errors import CheckpointError, ConfigError, KvjaxError
from kvjax.methods import capabilities as caps
from kvjax.runtime import contexts, forward, pass_file

NEW = 6
CONTEXT = 40
QUESTIONS = (5, 14, 3)


def _prompts(seed: int = 0, length: int = CONTEXT):
    return random_prompts(seed, (length,))[0], random_prompts(seed + 1, QUESTIONS)


def _asks_alone(name: str) -> bool:
    return not caps.question_in_prompt(methods.get(name, **METHODS[name]))


def _check_equals_generate(model, method, kv_dtype=None, chunk_size=None, length=CONTEXT):
    """Each question alone: the same tokens and kept positions as generate; all at once: the same tokens."""
    context_ids, questions = _prompts(length=length)
    context = kvjax.compress_context(model, context_ids, method=method, max_new_tokens=NEW, max_question_tokens=16,
                                     kv_dtype=kv_dtype, chunk_size=chunk_size)
    want = [kvjax.generate(model, [context_ids], method=method, max_new_tokens=NEW, question_ids=[q],
                           kv_dtype=kv_dtype, chunk_size=chunk_size, return_cache=True) for q in questions]
    for q, ref in zip(questions, want, strict=True):
        got = kvjax.ask(model, context, [q], return_cache=True)
        np.testing.assert_array_equal(got.tokens, ref.tokens)
        np.testing.assert_array_equal(got.prompt_lengths, ref.prompt_lengths)
        assert kept(got.cache) == kept(ref.cache)
    together = kvjax.ask(model, context, questions)
    np.testing.assert_array_equal(together.tokens, np.concatenate([r.tokens for r in want]))
    return context


@pytest.mark.parametrize("name", every_method([m for m in METHODS if _asks_alone(m)], ci=FEW))
def test_ask_equals_generate_with_the_question(name):
    model = tiny_model(num_layers=LAYERS.get(name, 3))
    _check_equals_generate(model, methods.get(name, **METHODS[name]))


@pytest.mark.parametrize("kv_dtype", ["int8", "kivi2"])
def test_quantized_context_equals_generate(kv_dtype):
    _check_equals_generate(tiny_model(), methods.get("snapkv", **METHODS["snapkv"]), kv_dtype=kv_dtype)


@pytest.mark.parametrize("window", [8, 128])
def test_sliding_window_context_and_chunked_prefill_equal_generate(window):
    """Gemma 3's sliding-window rings, sized for the question and answer (a window of 128 holds the whole sequence
    of a 64-token context, so its ring is only as long as the context, question and answer), and a prefill in
    chunks of 16."""
    _check_equals_generate(tiny_gemma3(num_layers=3, window=window), methods.get("knorm", budget=12), chunk_size=16,
                           length=64)


def test_context_survives_asks_and_traces_once():
    """`ask` works on a copy (the question pass and decode donate theirs): the context's arrays are unchanged and
    usable after two batches, and a second batch of the same shape compiles nothing."""
    model = tiny_model()
    context_ids, questions = _prompts(3)
    context = kvjax.compress_context(model, context_ids, method="h2o", method_args={"budget": 12}, max_new_tokens=NEW,
                                     max_question_tokens=16)
    before = jax.tree.map(np.asarray, (context.cache, context.last_hidden))
    first = kvjax.ask(model, context, questions)
    traces = dict(forward.TRACE_COUNTS), contexts._rows._cache_size()
    second = kvjax.ask(model, context, questions[::-1])
    assert (dict(forward.TRACE_COUNTS), contexts._rows._cache_size()) == traces
    np.testing.assert_array_equal(second.tokens, first.tokens[::-1])
    assert_trees_equal(jax.tree.map(np.asarray, (context.cache, context.last_hidden)), before)


def test_method_record_round_trips_every_method():
    """Every registered method's hyperparameters come back equal from the file's JSON (tuples, base_args, paths)."""
    assert set(METHODS) == set(methods.available())
    for name, args in METHODS.items():
        method = methods.get(name, **args)
        record = json.loads(json.dumps(pass_file.method_record(method)))
        assert pass_file.method_from_record(record) == method, name


@pytest.mark.parametrize("case", ["bf16", "int4", "fp8_rings", "wrapper_kivi", "kvzip"])
def test_saved_context_loads_bit_for_bit(tmp_path, case):
    model, method, kv_dtype = {
        "bf16": (tiny_model(dtype=jnp.bfloat16), methods.get("snapkv", **METHODS["snapkv"]), None),
        "int4": (tiny_model(), methods.get("knorm", compression_ratio=0.5), "int4"),
        "fp8_rings": (tiny_gemma3(num_layers=3, window=8), methods.get("streaming_llm", budget=10), "fp8"),
        "wrapper_kivi": (tiny_model(), methods.get("adakv", **METHODS["adakv"]), "kivi2"),
        "kvzip": (tiny_model(), methods.get("kvzip", **METHODS["kvzip"]), None),
    }[case]
    context_ids, questions = _prompts(5)
    context = kvjax.compress_context(model, context_ids, method=method, max_new_tokens=NEW, max_question_tokens=16,
                                     kv_dtype=kv_dtype)
    path = tmp_path / "context.safetensors"
    kvjax.save_context(context, path)
    loaded = kvjax.load_context(path, model)
    assert loaded.method == context.method and loaded.plan.capacity == context.plan.capacity
    assert jax.tree.structure(loaded.cache) == jax.tree.structure(context.cache)
    assert_trees_equal(jax.tree.map(np.asarray, (loaded.cache, loaded.last_hidden)),
                       jax.tree.map(np.asarray, (context.cache, context.last_hidden)))
    np.testing.assert_array_equal(loaded.tokens, context_ids)
    np.testing.assert_array_equal(kvjax.ask(model, loaded, questions).tokens,
                                  kvjax.ask(model, context, questions).tokens)
    # The file is the compressed cache at its real size, plus its metadata, tokens and one hidden state.
    extra = path.stat().st_size - context.nbytes
    assert 0 < extra < 16_384, extra


def test_file_refusals(tmp_path, monkeypatch):
    model = tiny_model()
    context_ids, _ = _prompts(7)
    context = kvjax.compress_context(model, context_ids, method="knorm", method_args={"budget": 12},
                                     max_new_tokens=NEW, max_question_tokens=8)
    path = tmp_path / "c.safetensors"
    kvjax.save_context(context, path)
    with pytest.raises(CheckpointError, match="already exists"):
        kvjax.save_context(context, path)
    with pytest.raises(CheckpointError, match="different model"):
        kvjax.load_context(path, tiny_model(seed=1))
    with pytest.raises(CheckpointError, match="different model"):
        kvjax.ask(tiny_model(seed=1), context, [[1, 2]])
    damaged = bytearray(path.read_bytes())
    damaged[-3] ^= 0xFF  # a byte of the last array
    (tmp_path / "d.safetensors").write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="checksum"):
        kvjax.load_context(tmp_path / "d.safetensors", model)
    (tmp_path / "e.safetensors").write_bytes(b"not a file of arrays")
    with pytest.raises(CheckpointError, match="not a readable kvjax context file"):
        kvjax.load_context(tmp_path / "e.safetensors", model)
    with pytest.raises(CheckpointError, match="does not exist"):
        kvjax.load_context(tmp_path / "missing.safetensors", model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors", "d.safetensors", "e.safetensors"]
    full_disk_for_safetensors(monkeypatch)  # a save that runs out of space: one CheckpointError, nothing left
    with pytest.raises(CheckpointError, match=r"cannot save the context to .*f\.safetensors: .*File too large"):
        kvjax.save_context(context, tmp_path / "f.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors", "d.safetensors", "e.safetensors"]


def test_ask_and_compress_refusals():
    model = tiny_model()
    context_ids, _ = _prompts(9)
    context = kvjax.compress_context(model, context_ids, method="knorm", method_args={"budget": 12},
                                     max_new_tokens=NEW, max_question_tokens=8)
    with pytest.raises(ConfigError, match="question 1 has 9 tokens.*max_question_tokens=8"):
        kvjax.ask(model, context, [[1], [2] * 9])
    with pytest.raises(ConfigError, match=f"max_new_tokens=7 exceeds the {NEW}"):
        kvjax.ask(model, context, [[1]], max_new_tokens=7)
    with pytest.raises(KvjaxError, match="questions"):
        kvjax.ask(model, context, [[1, 500]])
    with pytest.raises(KvjaxError, match="return_cache must be True or False, got 'no'"):  # returned the cache
        kvjax.ask(model, context, [[1]], return_cache="no")
    with pytest.raises(ConfigError, match="reads the question inside its prompt"):
        kvjax.compress_context(model, context_ids, method="quest", method_args=METHODS["quest"], max_new_tokens=NEW)
    with pytest.raises(ConfigError, match="one list of token ids"):
        kvjax.compress_context(model, "some text", method="knorm", method_args={"budget": 12}, max_new_tokens=NEW)
    with pytest.raises(KvjaxError, match="max_question_tokens"):
        kvjax.compress_context(model, context_ids, method="knorm", method_args={"budget": 12}, max_new_tokens=NEW,
                               max_question_tokens=-1)
    for tokens, message in (([1.5, 2.0], r"the context must hold integer token ids"),  # said input_ids[0]
                            ([], r"the context is empty"), ([1, 500], r"the context: token ids must be in \[0, 96\)")):
        with pytest.raises(KvjaxError, match=message):
            kvjax.compress_context(model, tokens, method="knorm", method_args={"budget": 12}, max_new_tokens=NEW)
    with pytest.raises(KvjaxError, match="maximum context"):
        kvjax.compress_context(tiny_model(max_position_embeddings=64), context_ids, method="knorm",
                               method_args={"budget": 12}, max_new_tokens=NEW, max_question_tokens=32)
    with pytest.raises(ConfigError, match="must be a jax.sharding.Mesh"):
        kvjax.compress_context(model, context_ids, method="knorm", method_args={"budget": 12}, max_new_tokens=NEW,
                               mesh="data:2")


def test_a_mesh_across_processes_is_refused(tmp_path, monkeypatch):
    """A context is kept and saved whole by one process (tests/runtime/test_sharding.py runs one on a mesh)."""
    from jax.sharding import Mesh

    from kvjax.runtime import sharding

    mesh = sharding.make_mesh(1, 1)
    monkeypatch.setattr(Mesh, "is_multi_process", property(lambda self: True))
    model = tiny_model()
    with pytest.raises(ConfigError, match="does not run on a mesh that spans processes"):
        kvjax.compress_context(model, _prompts(9)[0], method="knorm", method_args={"budget": 12},
                               max_new_tokens=NEW, mesh=mesh)
    with pytest.raises(ConfigError, match="does not run on a mesh that spans processes"):
        kvjax.load_context(tmp_path / "c.safetensors", model, mesh=mesh)


def test_saved_file_names_no_pickle(tmp_path):
    """The file is plain safetensors: its header is JSON, its metadata names the method and the model."""
    model = tiny_model()
    context = kvjax.compress_context(model, _prompts(11)[0], method="snapkv", method_args=METHODS["snapkv"],
                                     max_new_tokens=NEW, max_question_tokens=8)
    path = pathlib.Path(tmp_path / "c.safetensors")
    kvjax.save_context(context, path)
    raw = path.read_bytes()
    header = json.loads(raw[8: 8 + int.from_bytes(raw[:8], "little")])
    meta = json.loads(header["__metadata__"]["kvjax"])
    assert meta["format"] == "kvjax.context" and meta["method"]["name"] == "snapkv"
    assert meta["fingerprint"] == context.fingerprint and meta["max_question_tokens"] == 8
