"""Sharding: mesh parsing, partition specs, distributed init; sharded generation equals one device.

The multi-device checks run in one subprocess (`sharded_worker.py`) because the 8 CPU devices must be
forced with XLA_FLAGS before JAX starts; the worker also gets XLA's fast-compile CPU flags, since it
compiles every (method, mesh) program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cpu_flags
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from tiny import tiny_model

from kvjax import cache as kvc
from kvjax.cache import ModelCache
from kvjax.errors import ConfigError
from kvjax.runtime import sharding

HERE = Path(__file__).resolve().parent
FLAGS_8 = cpu_flags.with_devices(8)


def _mesh(data: int, model: int) -> AbstractMesh:
    return AbstractMesh((data, model), sharding.AXES)


def _worker_cases(*modes: str) -> list[dict]:
    """The JSON cases `sharded_worker.py` prints, run with `modes` on 8 forced CPU devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FLAGS_8)
    proc = subprocess.run([sys.executable, str(HERE / "sharded_worker.py"), *modes], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_parse_mesh():
    assert sharding.parse_mesh("data:2,model:4") == {"data": 2, "model": 4}
    assert sharding.parse_mesh(" model:8 ") == {"data": 1, "model": 8}
    for bad in ("", "data", "data:x", "data:0", "batch:2", "data:2,data:4", "data:2;model:2"):
        with pytest.raises(ConfigError):
            sharding.parse_mesh(bad)


def test_make_mesh_needs_enough_devices():
    with pytest.raises(ConfigError, match="needs 64 devices"):
        sharding.make_mesh(8, 8)
    mesh = sharding.make_mesh(1, 1)
    assert mesh.axis_names == sharding.AXES and mesh.size == 1


def test_weight_specs_split_heads_and_mlp_on_model():
    mesh = _mesh(2, 4)
    # The fused qkv [D, K, G + 2, H] splits K (whole GQA groups), the fused gate_up [D, 2, F] splits F.
    assert sharding.weight_spec("qkv", (64, 4, 4, 16), mesh) == P(None, "model", None, None)
    assert sharding.weight_spec("qkv_bias", (4, 4, 16), mesh) == P("model", None, None)
    assert sharding.weight_spec("o", (8, 16, 64), mesh) == P("model", None, None)
    assert sharding.weight_spec("gate_up", (64, 2, 96), mesh) == P(None, None, "model")
    assert sharding.weight_spec("gate_up_bias", (2, 96), mesh) == P(None, "model")
    assert sharding.weight_spec("down", (96, 64), mesh) == P("model", None)
    assert sharding.weight_spec("embed", (96, 64), mesh) == P("model", None)
    assert sharding.weight_spec("attn_norm", (64,), mesh) == P(None)
    # A KV-head count the model axis does not divide is replicated (correct, just not split).
    assert sharding.weight_spec("qkv", (64, 2, 6, 16), mesh) == P(None, None, None, None)
    assert sharding.weight_spec("qkv", (64, 4, 4, 16), _mesh(8, 1)) == P(None, None, None, None)


def test_weight_shardings_follow_the_per_layer_pytree():
    model = tiny_model()
    shardings = sharding.weight_shardings(model.weights(), _mesh(4, 2))  # the tiny model's 2 KV heads on model
    assert len(shardings["layers"]) == model.config.num_layers
    assert shardings["layers"][1]["qkv"].spec == P(None, "model", None, None)
    assert shardings["embed"].spec == P("model", None)


def test_cache_specs_put_batch_on_data_and_kv_heads_on_model():
    state = {"sel": jnp.zeros((4, 4, 8), jnp.int32)}
    layer = kvc.init(4, 4, 8, 16, jnp.float32, score=True, state=state)
    cache = ModelCache((layer, layer), {"left": jnp.zeros((4,), jnp.int32)})
    specs = sharding.cache_specs(cache, _mesh(2, 4))
    for one in specs.layers:
        assert one.k == one.v == P("data", "model", None, None)
        assert one.pos == one.score == P("data", "model", None)
        assert one.length == P("data", "model")
        assert one.attend is None
        assert one.state["sel"] == P("data", None, None)
    assert specs.shared["left"] == P("data")
    odd = sharding.cache_specs(kvc.init(3, 4, 8, 16, jnp.float32), _mesh(2, 4))
    assert odd.k == P(None, "model", None, None)  # a batch of 3 stays whole on data:2


def test_distributed_init_only_when_launched_that_way(monkeypatch):
    for var in ("KVJAX_DISTRIBUTED", "JAX_COORDINATOR_ADDRESS", "KVJAX_NUM_PROCESSES", "KVJAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert sharding.maybe_initialize_distributed() is False
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1")
    monkeypatch.setenv("KVJAX_DISTRIBUTED", "0")
    assert sharding.maybe_initialize_distributed() is False
    monkeypatch.setenv("KVJAX_DISTRIBUTED", "1")
    monkeypatch.setenv("KVJAX_NUM_PROCESSES", "two")
    with pytest.raises(ConfigError, match="KVJAX_NUM_PROCESSES"):
        sharding.maybe_initialize_distributed()


def test_eval_cli_rejects_a_bad_mesh():
    """Checked before any device is used, so the CLI runs in this process (tests/cli_inprocess.py)."""
    from cli_inprocess import run_eval

    for flag, message in (("--mesh=data:two", "is not an integer"),
                          ("--mesh=data:3", "not a multiple of the mesh's data axis")):
        proc = run_eval(flag, "--batch_size=4", "--dry_run")
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
    # RAG strategies answer one sample at a time: their batch size need not divide the data axis.
    proc = run_eval("--mesh=data:3", "--batch_size=4", "--dry_run", "--method=samkv", "--task=multidoc/hotpotqa")
    assert proc.returncode == 0 and "runs planned" in proc.stdout, proc.stderr


@pytest.mark.slow
def test_sharded_generation_equals_one_device():
    """Meshes 8x1, 1x4 (the tiny model's 4 KV heads) and 2x4 for full and snapkv; 2x4 (batch and KV heads both
    split) for lagkv, sagekv, ahakv, actqkv and merging; 1x4 and 2x4 for samkv (kvjax.rag with a sharded model);
    snapkv on a KIVI-2 cache, the eval CLI's --mesh, and the engine (slots on data) against generate of each prompt
    alone (and, for two sampled answers per prompt, against the engine on one device).
    The fused projections really are split on `model` (whole GQA groups of qkv per shard)."""
    cases = _worker_cases()
    seen = {(c["method"], c["mesh"]) for c in cases}
    methods = ("full", "snapkv", "lagkv", "sagekv", "ahakv", "actqkv", "merging", "samkv")
    meshes = {"full": ("8x1", "1x4", "2x4"), "snapkv": ("8x1", "1x4", "2x4"), "samkv": ("1x4", "2x4")}
    assert seen == {(m, mesh) for m in methods for mesh in meshes.get(m, ("2x4",))} | {
        ("cli:snapkv", "2x4"), ("snapkv:kivi2", "2x4"), ("engine:snapkv", "2x4"), ("engine:tova", "2x4"),
        ("engine:samples", "2x4"), ("engine:shared", "2x4")}
    for c in cases:
        assert c["ref"] == c["got"], c  # token lists (ragged where a stop string ends answers)
        assert c.get("stopped", 1) > 0, c  # some sampled answers end at their stop string
        if c["method"] == "engine:shared":  # each prompt's second request reused its pass, on the engine's weights
            assert c["passes"] == len(c["ref"]) // 2 and c["held_is_engines"], c
        if c["method"] in (*methods[:-1], "snapkv:kivi2", "engine:snapkv", "engine:tova", "engine:samples",
                           "engine:shared"):
            # The cache really is split: batch over data, KV heads over model.
            want = {"8x1": "P('data',)", "1x4": "P(None, 'model')", "2x4": "P('data', 'model')"}
            assert c["cache_spec"] == want[c["mesh"]], c
            assert c["devices"] == (4 if c["mesh"] == "1x4" else 8)
        if "weight_shards" in c:
            # The fused qkv [D, K, G + 2, H] (8 query heads over 4 KV heads, D 64, H 16) holds whole KV-head
            # groups per `model` shard; gate_up [D, 2, F] the matching columns of gate and up.
            split = 4 if c["mesh"] in ("1x4", "2x4") else 1
            assert c["weight_shards"] == {"qkv": [64, 4 // split, 4, 16], "gate_up": [64, 2, 96 // split]}, c


def test_sharded_qwen3_and_gemma3_equal_one_device():
    """SnapKV on a tiny Qwen3 and on a Gemma-3-style model (its local layer a ring of 16, sharded like any layer's
    cache) on a 2x4 mesh (batch on data, KV heads on model): the same greedy tokens as one device."""
    cases = _worker_cases("families")
    assert {(c["method"], c["mesh"]) for c in cases} == {("qwen3:snapkv", "2x4"), ("gemma3:snapkv", "2x4")}
    for c in cases:
        assert np.array_equal(np.asarray(c["ref"]), np.asarray(c["got"])), c
        assert c["cache_spec"] == "P('data', 'model')" and c["devices"] == 8, c
        if c["method"].startswith("gemma3"):
            assert c["capacities"][0] == 16, c  # the local layer's ring


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_prompt_store_on_a_mesh_answers_as_without_one():
    """The engine's prompt store with the slots on `data` and the KV heads on `model` (2x4): the passes computed
    and written by a first job, read back by its repeats and by a second job over the store, placed as the passes
    it computes; the tokens those of the job on the mesh without a store. A mesh's passes are its own files."""
    cases = {c["method"]: c for c in _worker_cases("store")}
    assert set(cases) == {"store:first", "store:again"}
    for c in cases.values():
        assert c["ref"] == c["got"], c
        assert c["placed_alike"] and c["own_key"], c
        # A prefill is one request: its batch of 1 is whole on every `data` shard, its KV heads split on `model`.
        assert c["cache_spec"] == "P(None, 'model', None, None)" and c["devices"] == 8, c
    assert (cases["store:first"]["computed"], cases["store:first"]["read"]) == (4, 4)
    assert (cases["store:again"]["computed"], cases["store:again"]["read"]) == (0, 8)


def test_a_compressed_context_on_a_mesh_answers_as_on_one_device():
    """`compress_context` / `ask` with the KV heads on `model` and the questions on `data` (2x4), SnapKV with the
    model's dtype and with KIVI-2: the tokens of one device's context; a context saved on the mesh answers on one
    device, and one saved on one device answers when loaded onto the mesh."""
    cases = {c["method"]: c for c in _worker_cases("contexts")}
    assert set(cases) == {"context:snapkv", "context:snapkv:kivi2"}
    for c in cases.values():
        assert c["ref"] == c["got"] == c["from_mesh"] == c["onto_mesh"], c
        # the context: one row, its KV heads on `model`; the four questions' rows split on `data` too
        assert c["context_spec"] in ("P(None, 'model')", "P(None, 'model', None, None)") and c["placed_alike"], c
        assert c["cache_spec"].startswith("P('data', 'model'") and c["devices"] == 8, c
        assert [(spec[:16], on) for spec, on in c["asked"]] == [("P('data', 'model", True)], c


@pytest.mark.slow
def test_two_processes_over_jax_distributed():
    """The docs/scale.md launch recipe on one machine: two processes, two CPU devices each, gloo collectives."""
    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                   XLA_FLAGS=FLAGS_8.replace("count=8", "count=2"), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   KVJAX_NUM_PROCESSES="2", KVJAX_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py")], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr[-4000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert sorted(o["process_index"] for o in outs) == [0, 1]
    for o in outs:
        assert o["initialized"] and o["process_count"] == 2 and o["device_count"] == 4 and o["multi_process"]
        assert o["local"] and o["global_mesh"], o


def test_every_weight_of_every_family_has_a_layout():
    """Each weight a model of any family loads (biases, QK-norm, Gemma's post norms included) has a spec."""
    from kvjax.models.loader import param_shapes
    from kvjax.models.presets import available, preset_config

    mesh = _mesh(1, 2)
    for preset in available():
        for name, shape in param_shapes(preset_config(preset)).items():
            sharding.weight_spec(name.rsplit(".", 1)[-1], shape, mesh)
    biased = tiny_model(seed=0, qkv_bias=True, o_bias=True, mlp_bias=True)  # Llama's attention_bias + mlp_bias
    # attn_norm, qkv, qkv_bias, o, o_bias, mlp_norm, gate_up, gate_up_bias, down, down_bias
    assert len(sharding.weight_shardings(biased.weights(), sharding.make_mesh(1, 1))["layers"][0]) == 10


def test_a_weight_without_a_layout_is_refused():
    """An unknown weight name (a new family's weight missing from the layout table) is an error naming it, not
    silently replicated."""
    with pytest.raises(ConfigError, match="'router'") as e:
        sharding.weight_spec("router", (64, 8), _mesh(2, 4))
    assert "\n" not in str(e.value)
    weights = dict(tiny_model(seed=0).weights())
    weights["router"] = jnp.zeros((64, 8))
    with pytest.raises(ConfigError, match="'router'"):
        sharding.shard_weights(weights, sharding.make_mesh(1, 1))
