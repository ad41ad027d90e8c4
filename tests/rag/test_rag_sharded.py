"""The RAG pipeline on a device mesh: `rag.answer(..., mesh=)` / `rag.prefill_documents(..., mesh=)` give the
one-device tokens for every strategy; a bad mesh is refused before tracing; the eval CLI passes its mesh on.

The multi-device check runs in one subprocess (`rag_sharded_worker.py`) because the 8 CPU devices must be
forced with XLA_FLAGS before JAX starts (the pattern of tests/runtime/test_sharding.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import cpu_flags
import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from ragdata import DOC_IDS, LAYOUT, PREFIX, QUERY, documents, model_for

from kvjax import rag
from kvjax.errors import ConfigError
from kvjax.runtime import sharding

HERE = Path(__file__).resolve().parent
FLAGS_8 = cpu_flags.with_devices(8)
STRATEGIES = ("reuse", "recompute", "cacheblend", "epic", "samkv", "multi_infllm")


def test_a_bad_mesh_is_refused_before_tracing():
    model = model_for()
    wrong_axes = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("batch", "heads"))
    before = dict(rag.TRACE_COUNTS)
    for mesh, message in ((wrong_axes, "not \\['batch', 'heads'\\]"), ("data:1,model:1", "mesh_from_spec"),
                          (object(), "must be a jax.sharding.Mesh")):
        with pytest.raises(ConfigError, match=message):
            rag.answer(model, documents(), QUERY, prefix=PREFIX, strategy="samkv", mesh=mesh)
        with pytest.raises(ConfigError, match=message):
            rag.prefill_documents(model, DOC_IDS[:1], layout=LAYOUT, mesh=mesh)
    assert dict(rag.TRACE_COUNTS) == before
    sharding.check_mesh(None)
    sharding.check_mesh(sharding.make_mesh(1, 1))


def test_eval_runner_passes_its_mesh_to_the_rag_pipeline(monkeypatch, tmp_path):
    """`python -m kvjax.eval --mesh=...` on a multidoc task: `run_setting`'s mesh reaches both RAG calls."""
    from kvjax.eval import runner
    from kvjax.eval.results import RunDir
    from kvjax.eval.tasks.base import Sample

    mesh = sharding.make_mesh(1, 1)
    seen: dict[str, object] = {}

    def fake_prefill(model, doc_ids, **kwargs):
        seen["prefill_documents"] = kwargs.get("mesh")
        return ["doc"] * len(doc_ids)

    def fake_answer(model, docs, query_ids, **kwargs):
        seen["answer"] = kwargs.get("mesh")
        report = types.SimpleNamespace(ttft_s=0.0, context_tokens=3, query_tokens=1, kept_tokens=3.0, cache_bytes=0,
                                       sequence_ratio=1.0, recompute_ratio=0.0, layer_recompute_ratio=0.0,
                                       num_documents=len(docs))
        return types.SimpleNamespace(tokens=np.array([1]), report=report)

    monkeypatch.setattr(rag, "prefill_documents", fake_prefill)
    monkeypatch.setattr(rag, "answer", fake_answer)
    tokenizer = types.SimpleNamespace(eos_token_id=0, decode=lambda ids, skip_special_tokens=True: "x")
    encoder = types.SimpleNamespace(tokenizer=tokenizer, encode_documents=lambda s, query_aware: ([1], [[2], [3]], [4]))
    task = types.SimpleNamespace(score=lambda text, sample: {"score": 1.0})
    sample = Sample(id="s0", context="ab", question="q", answers=("x",), max_new_tokens=2, metric="score",
                    documents=("a", "b"))
    setting = runner.Setting("samkv", None, "fake", 16, rag_strategy=rag.SamKV())
    model = types.SimpleNamespace(dtype=np.float32, config=types.SimpleNamespace(head_dim=16))  # read for the bits
    runner.run_setting(model=model, encoder=encoder, task=task, samples=[sample], setting=setting,
                       run_dir=RunDir(str(tmp_path), "run"), batch_size=1, query_aware=False, seed=0, mesh=mesh)
    assert seen == {"prefill_documents": mesh, "answer": mesh}


@pytest.mark.slow
def test_sharded_rag_equals_one_device():
    """Every strategy on meshes 1xK (K = the tiny model's 2 KV heads) and 2x4 (KV heads replicated over
    model:4, query heads split), reuse and samkv on 8x1 too: same tokens as one device, the caches split where
    the mesh divides them."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FLAGS_8)
    proc = subprocess.run([sys.executable, str(HERE / "rag_sharded_worker.py")], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    k = model_for().config.num_kv_heads
    meshes = ("8x1", f"1x{k}", "2x4")
    seen = {(c["strategy"], c["mesh"]) for c in cases}
    on_8x1 = ("reuse", "samkv")  # data:8 replicates a one-example request as 2x4 does: two strategies on it
    assert seen == {(s, m) for s in STRATEGIES for m in meshes if m != "8x1" or s in on_8x1} | {
        ("samkv", f"1x{k}:one-device-docs")}
    for c in cases:
        assert c["ref"] == c["got"] and len(c["got"]) == 4, c
        assert c["logits_diff"] < 1e-4 and c["kept"][0] == c["kept"][1], c
        mesh = c["mesh"].split(":")[0]
        assert c["devices"] == (k if mesh == f"1x{k}" else 8), c
        # Every layer's buffer (decoded cache, stored document K / V) is placed alike.
        assert c["layer_specs"] == [c["cache_spec"]] and c["doc_layer_specs"] == [c["doc_spec"]], c
        if mesh == f"1x{k}":  # KV heads split over model: the decoded [B, K, C, H] and stored [K, N, H] layers
            assert c["cache_spec"] == "P(None, 'model')", c
            if c["strategy"] != "multi_infllm" and "one-device" not in c["mesh"]:
                assert c["doc_spec"] == "P('model',)", c
        else:  # a one-example request on data:8 / data:2, 2 KV heads on model:4: replicated
            assert c["cache_spec"] == "P()", c


@pytest.mark.slow
def test_sharded_rag_on_sliding_window_layers_equals_one_device():
    """The same on the tiny Gemma-3-style model (rings of an 8-token window on two of its three layers): reuse,
    CacheBlend (checked after the global layer: see the worker) and SamKV on every mesh give one device's tokens,
    logits and kept counts, the rings placed like the other layers."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FLAGS_8)
    proc = subprocess.run([sys.executable, str(HERE / "rag_sharded_worker.py"), "reuse,cacheblend,samkv", "window"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {c["strategy"] for c in cases} == {"reuse", "cacheblend", "samkv"} and len(cases) >= 8
    for c in cases:
        assert c["ref"] == c["got"] and len(c["got"]) == 4, c
        assert c["logits_diff"] < 1e-4 and c["kept"][0] == c["kept"][1], c
        assert c["layer_specs"] == [c["cache_spec"]], c
