"""The engine's prompt passes kept on disk (`Engine(prompt_store=DIR)`): read back by later prefills and jobs.

Oracle: the same job without a store (every prompt pass computed), bit for bit in tokens, log-probabilities, kept
positions and kept counts; the prompt passes computed counted (a context's questions spread through the job compute
its pass once; a second engine over the same store computes none); another method's or model's passes are other
files; a damaged file is computed again, with a warning, and replaced.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from golden_cases import METHODS
from tiny import full_disk_for_safetensors, random_prompts, tiny_gemma3, tiny_model

from kvjax import methods
from kvjax.engine import Engine, Request
from kvjax.errors import ConfigError
from kvjax.runtime import stages

EOS = 33
NEW = 8


def _job() -> list[Request]:
    """Contexts a and b (of one length: only their tokens tell them apart), their questions interleaved (a, b, a, b,
    a), and c twice sampled with no question."""
    a, b, c = (tuple(p) for p in random_prompts(13, (40, 40, 30)))
    q = [tuple(p) for p in random_prompts(14, (5, 9, 7))]
    sampled = dict(temperature=0.9, logprobs=True)
    return [
        Request(id="a1", tokens=a, question=q[0], max_new_tokens=NEW, logprobs=True),
        Request(id="b1", tokens=b, question=q[1], max_new_tokens=NEW, logprobs=True),
        Request(id="a2", tokens=a, question=q[1], max_new_tokens=NEW, logprobs=True),
        Request(id="b2", tokens=b, question=q[2], max_new_tokens=NEW, logprobs=True),
        Request(id="a3", tokens=a, question=q[2], max_new_tokens=NEW, seed=1, **sampled),
        Request(id="c1", tokens=c, max_new_tokens=NEW, seed=2, **sampled),
        Request(id="c2", tokens=c, max_new_tokens=NEW, seed=3, **sampled),
    ]


def _run(model, method, requests, monkeypatch, store=None, kv_dtype=None, max_bytes=None):
    """({id: completion}, prompt passes computed, the engine)."""
    passes = []
    through = stages.through_prompt
    monkeypatch.setattr(stages, "through_prompt", lambda *a, **k: passes.append(1) or through(*a, **k))
    engine = Engine(model, method=method, max_prompt_tokens=64, max_question_tokens=9, max_new_tokens=NEW, steps=3,
                    slots=2, sampling=True, keep_positions=True, prompt_store=store, kv_dtype=kv_dtype,
                    prompt_store_max_bytes=max_bytes)
    return {c.id: c for c in engine.run(requests)}, len(passes), engine


def _same(a, b, name):
    assert a.tokens == b.tokens and a.positions == b.positions, name
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs), err_msg=name)
    assert (a.kept_tokens, a.kept_generated_tokens, a.finish_reason) == (b.kept_tokens, b.kept_generated_tokens,
                                                                         b.finish_reason), name


CASES = [("snapkv", "llama", None), ("kvzip", "llama", None), ("quest", "llama", None), ("snapkv", "sliding", None),
         ("knorm", "llama", "kivi2")]


@pytest.mark.parametrize("name,family,kv_dtype", CASES)
def test_stored_prompt_passes_give_the_computed_answers(name, family, kv_dtype, tmp_path, monkeypatch):
    model = tiny_gemma3(num_layers=3, window=16, eos_token_ids=(EOS,)) if family == "sliding" else \
        tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get(name, **METHODS[name])
    requests = _job()
    plain, plain_passes, _ = _run(model, method, requests, monkeypatch, kv_dtype=kv_dtype)
    first, first_passes, engine = _run(model, method, requests, monkeypatch, tmp_path, kv_dtype)
    again, again_passes, rerun = _run(model, method, requests, monkeypatch, tmp_path, kv_dtype)
    for request in requests:
        _same(first[request.id], plain[request.id], f"{name} {family} first {request.id}")
        _same(again[request.id], plain[request.id], f"{name} {family} again {request.id}")
    files = len(list(tmp_path.glob("*.safetensors")))
    assert first_passes == engine.store.written == files  # each distinct prompt pass computed once
    assert engine.store.read == plain_passes - first_passes  # the others read back
    assert again_passes == 0 and rerun.store.read == plain_passes and rerun.store.written == 0
    if name == "quest":  # the question is in its prompt rows: only c2 repeats a prompt pass (held after c1)
        assert files == len(requests) - 1 and engine.store.read == 0
    else:  # three contexts; a and b alternate, so only the store lets their later questions skip the pass
        assert files == 3 and engine.store.read == 3


def test_other_settings_are_other_files(tmp_path, monkeypatch):
    requests = _job()[:1]
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    for budget in (12, 16):
        _run(model, methods.get("knorm", budget=budget), requests, monkeypatch, tmp_path)
    _run(tiny_model(num_layers=2, seed=1, eos_token_ids=(EOS,)), methods.get("knorm", budget=12), requests,
         monkeypatch, tmp_path)
    _, passes, engine = _run(model, methods.get("knorm", budget=16), requests, monkeypatch, tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3 and passes == 0 and engine.store.read == 1


def test_a_damaged_file_is_computed_again(tmp_path, monkeypatch, caplog):
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get("snapkv", **METHODS["snapkv"])
    requests = _job()[:1]
    want, _, _ = _run(model, method, requests, monkeypatch, tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvjax.engine.prompt_store"):
        got, passes, engine = _run(model, method, requests, monkeypatch, tmp_path)
    assert passes == 1 and engine.store.written == 1 and "checksum" in caplog.text
    _same(got["a1"], want["a1"], "recomputed")
    _, passes, _ = _run(model, method, requests, monkeypatch, tmp_path)
    assert passes == 0  # replaced by a good one


def test_an_unwritable_store_warns_and_the_job_goes_on(tmp_path, monkeypatch, caplog):
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    (tmp_path / "file").write_text("x")  # the store's folder would be under a file: every write fails
    with caplog.at_level(logging.WARNING, logger="kvjax.engine.prompt_store"):
        done, passes, engine = _run(model, methods.get("knorm", budget=12), _job()[:2], monkeypatch,
                                    tmp_path / "file" / "store")
    assert set(done) == {"a1", "b1"} and passes == 2 and engine.store.written == 0
    assert caplog.text.count("cannot write") == 2


def test_a_full_disk_warns_and_the_job_goes_on(tmp_path, monkeypatch, caplog):
    """A write that runs out of space (safetensors raises its own error, not an OSError) is warned and skipped like
    any unwritable store: the answers are the job's without a store, and no file or temporary file is left."""
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get("knorm", budget=12)
    plain, _, _ = _run(model, method, _job()[:2], monkeypatch)
    full_disk_for_safetensors(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvjax.engine.prompt_store"):
        got, passes, engine = _run(model, method, _job()[:2], monkeypatch, tmp_path)
    assert passes == 2 and engine.store.written == 0 and caplog.text.count("cannot write") == 2
    assert "File too large" in caplog.text and list(tmp_path.iterdir()) == []
    for request in ("a1", "b1"):
        _same(got[request], plain[request], f"full disk {request}")


def test_a_file_names_the_rings_and_rope_a_pass_reads(tmp_path):
    """Plans of one prompt whose sequences differ (the engine's question and answer room): another file where a
    sliding-window ring's size differs; the same file where no ring or RoPE value does (a global-attention model)."""
    from kvjax.engine.prompt_store import PromptStore

    prompt = random_prompts(15, (40,))
    for model, same in ((tiny_gemma3(num_layers=3, window=128), False), (tiny_model(num_layers=2), True)):
        store = PromptStore(tmp_path, model, methods.get("knorm", budget=12), None)
        plan = stages.plan(model.config, prompt, method=store.method, max_new_tokens=NEW)
        short, long = (dataclasses.replace(plan, ring_context=n, rope_length=n) for n in (70, 90))
        assert (store.path(short) == store.path(long)) is same


def test_a_file_where_the_store_goes_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        Engine(tiny_model(num_layers=2), max_prompt_tokens=8, max_new_tokens=2, slots=1, prompt_store=tmp_path / "f")


def _pass_names(model, method, request, monkeypatch, folder) -> str:
    """The name of `request`'s prompt-pass file (a one-request job into its own store)."""
    _run(model, method, [request], monkeypatch, folder)
    (path,) = folder.glob("*.safetensors")
    return path.name


def test_a_sized_store_removes_the_least_recently_used_passes(tmp_path, monkeypatch):
    """A store sized for two of the job's three passes: a, b, a, b, a are written or read, then c's write removes b
    (read less recently than a, though written after it: removing the oldest written would remove a), and the
    folder's other files stay. The answers are the job's without a store."""
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get("snapkv", **METHODS["snapkv"])
    requests = _job()
    names = {r.id[0]: _pass_names(model, method, r, monkeypatch, tmp_path / f"one_{r.id}")
             for r in (requests[0], requests[1], requests[5])}
    size = (tmp_path / "one_a1" / names["a"]).stat().st_size
    assert {(tmp_path / f"one_{i}" / names[i[0]]).stat().st_size for i in ("b1", "c1")} == {size}
    store = tmp_path / "store"
    store.mkdir()
    (store / "notes.txt").write_text("not a pass")
    (store / "context.safetensors").write_bytes(b"x" * 3 * size)  # a saved context, say: not the store's
    plain, _, _ = _run(model, method, requests, monkeypatch)
    got, passes, engine = _run(model, method, requests, monkeypatch, store, max_bytes=size * 5 // 2)
    for request in requests:
        _same(got[request.id], plain[request.id], f"sized {request.id}")
    assert passes == 3 and engine.store.written == 3 and engine.store.read == 3 and engine.store.removed == 1
    assert sorted(p.name for p in store.iterdir()) == sorted([names["a"], names["c"], "notes.txt",
                                                              "context.safetensors"])
    assert sum(f[2] for f in engine.store.pass_files()) <= size * 5 // 2
    # Again over {a, c}: a read; b computed, removing c (a was used since); a, b, a read; c computed, removing b.
    _, passes, rerun = _run(model, method, requests, monkeypatch, store, max_bytes=size * 5 // 2)
    assert passes == 2 and rerun.store.read == 4 and rerun.store.removed == 2
    assert {f[1] for f in rerun.store.pass_files()} == {names["a"], names["c"]}


def test_a_partial_pass_a_killed_writer_left_is_removed_and_no_other_file(tmp_path):
    """A writer killed mid-write leaves `.<name>.kvjax-tmp-<pid>`, which no size bound counts: it stayed for good, so
    a sized folder grew past its size with each kill. Opening the store removes such a file once its writer is gone
    and it has not been written for `ABANDONED_AFTER_S`; a live writer's, a fresh one and other files stay."""
    import os
    import subprocess
    import sys
    import time

    from kvjax.engine.prompt_store import ABANDONED_AFTER_S, PromptStore

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # that process has exited
    name = "0" * 40 + ".safetensors"
    old = time.time() - 2 * ABANDONED_AFTER_S
    files = {"abandoned": f".{name}.kvjax-tmp-{dead_pid}", "live_writer": f".{name}.kvjax-tmp-{os.getpid()}",
             "fresh": f".{'1' * 40}.safetensors.kvjax-tmp-{dead_pid}", "other": f".notes.kvjax-tmp-{dead_pid}"}
    for kind, file in files.items():
        (tmp_path / file).write_bytes(b"x" * 64)
        if kind != "fresh":
            os.utime(tmp_path / file, (old, old))
    store = PromptStore(tmp_path, tiny_model(num_layers=2), methods.get("knorm", budget=12), None)
    assert store.abandoned == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f for k, f in files.items() if k != "abandoned")


def test_a_pass_larger_than_the_store_is_not_kept(tmp_path, monkeypatch, caplog):
    model = tiny_model(num_layers=2, eos_token_ids=(EOS,))
    method = methods.get("knorm", budget=12)
    requests = _job()[:2]
    plain, _, _ = _run(model, method, requests, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvjax.engine.prompt_store"):
        got, passes, engine = _run(model, method, requests, monkeypatch, tmp_path, max_bytes=1000)
    assert passes == 2 and engine.store.written == 0 and engine.store.too_large == 2
    assert not list(tmp_path.glob("*.safetensors")) and caplog.text.count("is larger than the store's") == 1
    for request in requests:
        _same(got[request.id], plain[request.id], f"too large {request.id}")


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1G"])
def test_a_bad_store_size_is_refused(tmp_path, bad):
    with pytest.raises(ConfigError, match="prompt_store_max_bytes must be a positive number of bytes"):
        Engine(tiny_model(num_layers=2), max_prompt_tokens=8, max_new_tokens=2, slots=1, prompt_store=tmp_path,
               prompt_store_max_bytes=bad)
    with pytest.raises(ConfigError, match="give prompt_store too"):
        Engine(tiny_model(num_layers=2), max_prompt_tokens=8, max_new_tokens=2, slots=1, prompt_store_max_bytes=10)


def test_a_mesh_across_processes_is_refused(tmp_path):
    """Passes are read and written whole by one process (`tests/runtime/test_sharding.py` runs a store on a
    one-process mesh)."""
    from types import SimpleNamespace

    from kvjax.engine.prompt_store import PromptStore

    with pytest.raises(ConfigError, match="does not run on a mesh that spans processes"):
        PromptStore(tmp_path, tiny_model(num_layers=2), methods.get("knorm", budget=12), None,
                    mesh=SimpleNamespace(is_multi_process=True, shape={"data": 2, "model": 1}))
