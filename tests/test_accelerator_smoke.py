"""`benchmarks/accelerator.py --smoke` on CPU (kernels in interpret mode, the tests' tiny model), in one
subprocess with XLA's fast-compile CPU flags: every part writes its rows, each kernel equals its XLA
reference, the end-to-end ratios are against `full` of the same run, and `report.py` renders it all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
FAST_COMPILE = cpu_flags.FAST_COMPILE


def test_accelerator_smoke_runs_every_part(tmp_path):
    out = tmp_path / "accelerator.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "accelerator.py"), "--smoke", "--methods=full,snapkv",
           "--prefill_repeats=0", f"--out={out}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "accelerator" and r["smoke"] and r["machine"]["backend"] == "cpu"
    assert r["bandwidth"]["bytes_per_s"] > 0
    ops = {(row["op"], row["context"]) for row in r["kernels"]}
    assert ops == {(op, c) for op in ("decode_attention", "block_sparse_decode_attention") for c in (128, 256)}
    for row in r["kernels"]:
        assert row["equal"] and row["max_rel_err"] <= row["tolerance"], row
        assert row["xla_ms"] > 0 and row["kernel_ms"] > 0 and 0 < row["kernel_copy_fraction"]
        assert row["loop_xla_ms"] > 0 and row["loop_kernel_ms"] > 0 and row["loop_kernel_bytes_per_s"] > 0
    sparse = [row for row in r["kernels"] if row["op"] == "block_sparse_decode_attention"]
    assert all(row["attended_tokens"] < row["context"] for row in sparse)
    assert [row["num_stages"] for row in r["tune"]] == [1, 2]
    assert all(row["max_rel_err"] <= 2e-2 and row["kernel_ms"] > 0 for row in r["tune"]), r["tune"]  # bf16
    (prefill,) = r["prefill"]
    assert prefill["context"] == 256 and prefill["equal"] and prefill["xla_ms"] > 0 and prefill["fused_ms"] > 0
    assert prefill["causal_equal"] and prefill["causal_ms"] > 0  # the one-shot prefill's one causal call
    rows = {row["method"]: row for row in r["e2e"]}
    assert set(rows) == {"full", "snapkv"}
    assert rows["full"]["speedup"] == 1.0 and rows["full"]["ideal_speedup"] == 1.0
    assert rows["snapkv"]["kv_bytes_per_step"] < rows["full"]["kv_bytes_per_step"]
    assert rows["snapkv"]["ideal_speedup"] > 1.0 and rows["snapkv"]["tokens_per_s"] > 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    table = report.accelerator(r)
    assert "| decode_attention | 256 |" in table and "| 128 | snapkv | 32 |" in table
    assert "| 32 | 4 | 2 | auto |" in table and "| 256 |" in table.split("Prefill attention")[1]
    assert "per-layer buffers: XLA / kernel ms per layer" in table


def test_layer_slicing_layouts_compute_the_same_loop(tmp_path):
    """`benchmarks/layer_slicing.py`: its four layouts of a stacked-layer loop are one function (checked here
    against a NumPy loop), and `--smoke` writes a timed row per (part, layout) with the HLO it compiled."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import jax.numpy as jnp
    import layer_slicing
    import numpy as np

    rng = np.random.default_rng(0)
    stacks = tuple(jnp.asarray(rng.standard_normal((3, 8, 8)), jnp.float32) for _ in range(2))
    x = jnp.asarray(rng.standard_normal((1, 8)), jnp.float32)

    def layer(x, a, b):
        return jnp.tanh(x @ a) @ b

    want = np.asarray(x)
    for a, b in zip(*(np.asarray(s) for s in stacks), strict=True):
        want = np.tanh(want @ a) @ b

    for layout in layer_slicing.LAYOUTS:
        fn = layer_slicing._loop(layout, layer, stacks, x)
        got = fn(*layer_slicing._args(layout, stacks, x))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=layout)

    out, hlo = tmp_path / "slicing.json", tmp_path / "hlo"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "layer_slicing.py"), "--smoke", f"--out={out}", f"--hlo_dir={hlo}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["part"], r["layout"]) for r in rows} == {
        (p, lay) for p in ("mlp", "attention") for lay in layer_slicing.LAYOUTS}
    assert all(r["ms"] > 0 and r["bytes_per_s"] > 0 for r in rows)
    assert len(list(hlo.glob("*.hlo.txt"))) == len(rows)
    import report

    assert report.layer_slicing(result).count("| mlp |") == len(layer_slicing.LAYOUTS)
