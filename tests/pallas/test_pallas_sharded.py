"""Pallas kernels under a device mesh run per shard (`jax.shard_map`, batch on `data`, KV heads on `model`)
and equal the single-device XLA result; `generate` with every op forced to its kernel gives the same
tokens on a 2x4 mesh as on one device.

The multi-device checks run in subprocesses (`sharded_kernels_worker.py`) because the 8 CPU devices must
be forced with XLA_FLAGS before JAX starts; the mesh-free behaviour of the helper is checked here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cpu_flags
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from kvjax import cache as kvc
from kvjax.ops import _shard
from kvjax.runtime import sharding

HERE = Path(__file__).resolve().parent
FLAGS_8 = cpu_flags.with_devices(8)
OPS = ("decode_attention", "window_scores", "accumulated_scores", "pool1d", "topk_keep", "keep_top", "page_scores",
       "representative_scores", "decode_append_attention")


def _worker(what: str) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FLAGS_8)
    proc = subprocess.run([sys.executable, str(HERE / "sharded_kernels_worker.py"), what], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_a_mesh_the_kernel_is_called_as_is():
    calls = []

    def kernel(x, y):
        calls.append((x.shape, y))
        return x + 1

    x = jnp.zeros((2, 4, 3))
    assert _shard.current_mesh() is None
    assert float(_shard.per_shard(kernel, (x, None), ("bh.", None), "bh.", batch=2, heads=4)[0, 0, 0]) == 1.0
    with sharding.kernel_mesh(sharding.make_mesh(1, 1)):  # one device: no shard_map either
        assert _shard.current_mesh() is not None
        _shard.per_shard(kernel, (x, None), ("bh.", None), "bh.", batch=2, heads=4)
    assert _shard.current_mesh() is None
    assert calls == [((2, 4, 3), None)] * 2


def test_split_rule_is_the_runtime_one():
    mesh = AbstractMesh((2, 4), sharding.AXES)
    assert _shard.split_axis(mesh, "data", 6) == "data" and _shard.split_axis(mesh, "model", 8) == "model"
    assert _shard.split_axis(mesh, "data", 3) is None and _shard.split_axis(mesh, "model", 2) is None
    assert _shard.split_axis(AbstractMesh((8,), ("data",)), "model", 4) is None  # no such axis: whole
    # The cache of 3 examples with 4 KV heads on data:2,model:4 is laid out the way kernels are split.
    assert sharding.cache_specs(kvc.init(3, 4, 8, 16, jnp.float32), mesh).k == P(None, "model", None, None)
    assert _shard._spec("bh..", _shard.split_axis(mesh, "data", 3), _shard.split_axis(mesh, "model", 4)) == P(
        None, "model", None, None)
    assert [_shard.rows_role(n) for n in (1, 2, 3, 4)] == [".", "b.", "bh.", "bh.."]


def test_context_mesh_is_read_and_roles_must_fit():
    with jax.set_mesh(sharding.make_mesh(1, 1)):  # JAX's context mesh is read too
        assert _shard.current_mesh().axis_names == sharding.AXES
    with sharding.kernel_mesh(AbstractMesh((2, 1), sharding.AXES)):
        with pytest.raises(ValueError, match="does not fit"):
            _shard.per_shard(lambda x: x, (jnp.zeros((2, 4)),), ("bh.",), "bh.", batch=2, heads=4)


@pytest.mark.slow
def test_kernels_under_a_mesh_equal_one_device_xla():
    """Meshes 2x4, 8x1, 1x4 (1x8 for decode attention: model does not divide the 4 KV heads), batch 8,
    GQA 2:1, ragged per-head lengths, padding query rows, per-query-head masks, per-row scales."""
    rows = _worker("ops")
    failed = [f"{r['case']} on {r['mesh']}:\n{r['error']}" for r in rows if not r["ok"]]
    assert not failed, "\n\n".join(failed)
    seen = {(r["case"].split("[")[0], r["mesh"]) for r in rows}
    assert seen >= {(op, mesh) for op in OPS for mesh in ("2x4", "8x1", "1x4")} | {("decode_attention", "1x8")}
    for r in rows:
        assert r["per_shard"] and all(r["per_shard"]), r  # every pallas_call sits inside a shard_map
    # Per-shard blocks: decode attention's q [8, 8, 16] is [B / data, N / model, H] (all of it on 1x8).
    shapes = {r["mesh"]: r["shard_shapes"][0] for r in rows if r["case"] == "decode_attention"}
    assert shapes == {"2x4": [4, 2, 16], "8x1": [1, 8, 16], "1x4": [8, 2, 16], "1x8": [8, 8, 16]}
    # The fused decode kernel: the new token's q [8, 8, 16] like decode attention's, its cache written per shard.
    shapes = {r["mesh"]: r["shard_shapes"][0] for r in rows if r["case"] == "decode_append_attention"}
    assert shapes == {"2x4": [4, 2, 16], "8x1": [1, 8, 16], "1x4": [8, 2, 16]}
    # Quest's q [8, 4, 2, 16] splits like the cache; the representatives' probe [8, 128] spans every query
    # head, so it splits on `data` only.
    shapes = {r["mesh"]: r["shard_shapes"][0] for r in rows if r["case"] == "page_scores[mean,live]"}
    assert shapes == {"2x4": [4, 1, 2, 16], "8x1": [1, 4, 2, 16], "1x4": [8, 1, 2, 16]}
    shapes = {r["mesh"]: r["shard_shapes"][0] for r in rows if r["case"] == "representative_scores[dot]"}
    assert shapes == {"2x4": [4, 128], "8x1": [1, 128], "1x4": [8, 128]}
    (context,) = [r for r in rows if r["case"] == "decode_attention[jax.set_mesh]"]
    assert context["shard_shapes"] == [[4, 2, 16]]
    (nested,) = [r for r in rows if r["case"] == "decode_attention[inside shard_map]"]
    assert nested["shard_shapes"] == [[4, 2, 16]]  # the caller's shard_map only: no second one inside


def test_generate_with_kernels_on_a_mesh_equals_one_device():
    (row,) = _worker("generate")
    assert row["got"] == row["one"], row
    assert row["one"] == row["xla"], row  # the kernels pick the same slots and tokens as XLA here
    # With every op on its kernel the model's decode runs the fused one (RoPE, append and attention) in
    # place of decode_attention, and every hidden-state RMSNorm runs the norm kernel.
    assert {name.split(".")[0] for name in row["wrapped"]} >= {
        "_decode_append_kernel", "_column_kernel_per_shard", "pool1d", "topk_keep", "gather_kept", "rms_norm"}
