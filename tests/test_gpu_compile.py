"""XLA:GPU's compile of the 8B-shaped decode step for an H200, on this CPU machine (`benchmarks/gpu_compile.py`).

The compile runs in a subprocess (jax's CUDA plugin, compile-only, from `make gpu-compile`, which `make test`
runs; on a GPU machine jax's own CUDA plugin serves). What it checks are properties of the kernels XLA:GPU emits
that BENCHMARKS.md and kvjax.tuning claim, each of which an XLA or kvjax change could break:

* the fused q|k|v and gate|up projections: four weight GEMMs per layer, plus the two attention dots on the XLA
  path, or two Triton calls in their place with the fused decode kernel (the kernel, its split merge), and with
  the weight-product kernel four Triton calls in place of the GEMMs, with the norms, the activation product and the
  residual adds inside them;
* the padded copy of the cache in run 12's profile (`loop_pad_fusion`) is the slot axis padded for the `p V`
  dot, and `cache_slot_multiple=256` removes it at 32K;
* the launches per layer stay within what this version of the code compiles to (a ceiling: issue 57 cuts them);
* XLA's buffer assignment: the cache written in place, nothing held twice;
* XLA's thunks: the loop body one CUDA graph with the Pallas kernels inside, the loop captured only with +WHILE;
* int8, int4, KIVI-2 and fp8 caches on the fused path: the same six Triton calls per layer, nothing copied;
  StreamingLLM's in-place eviction on it too (one more kernel per layer), and Gemma 3's rings and post-norms.

KIVI-2's and fp8's whole-step compile and StreamingLLM's on the XLA path are `slow` (`make test-all`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The XLA path (the GPU's default before run 13 put the fused decode and RMSNorm kernels in its `auto_pallas`).
XLA = "auto_pallas=block_sparse_decode_attention"
XLA_256 = XLA + ",cache_slot_multiple=256"
FUSED = "auto_pallas=decode_append_attention+block_sparse_decode_attention"
FUSED_NORM = FUSED + "+rms_norm"
FUSED_LINEAR = FUSED_NORM + "+linear"
TUNINGS = [XLA, XLA_256, FUSED, FUSED_NORM, FUSED_LINEAR]
#: Launches per layer today (jax 0.10.2's XLA, compile-only H200): the XLA path, the fused decode kernel's, with
#: the RMSNorm kernel too (issue 57's bar: 12), and with the weight-product kernel (norms, the activation product and
#: the residual adds fused into the products).
CEILING = {XLA: 26.1, FUSED: 14.0, FUSED_NORM: 12.0, FUSED_LINEAR: 6.0}


def _compile(tmp_path_factory, tunings: list[str], xla_flags: str = "", kv_dtypes: str = "model",
             methods: str = "full", model: str = "llama-3.1-8b", per_layer: bool = True) -> dict[str, dict]:
    """Rows by tuning (by storage too, `(tuning, kv_dtype)`, when `kv_dtypes` names more than one); without
    `per_layer`, the whole step's counts only (one compile a row, not two)."""
    out = tmp_path_factory.mktemp("gpu_compile") / "gpu_compile.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags, PYTHONPATH=str(ROOT / "benchmarks"))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_compile.py"), f"--methods={methods}", "--target=h200",
           f"--tunings={';'.join(tunings)}", f"--kv_dtypes={kv_dtypes}", f"--model={model}", f"--out={out}",
           *([] if per_layer else ["--no_per_layer"])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    if model == "llama-3.1-8b":
        assert result["model"]["num_layers"] == 32 and result["model"]["hidden_size"] == 4096
    if "," in kv_dtypes:
        return {(row["tuning"], row["kv_dtype"]): row for row in result["rows"]}
    return {row["tuning"]: row for row in result["rows"]}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    return _compile(tmp_path_factory, TUNINGS)


def _pads(row: dict) -> list[str]:
    return [s["shape"] for s in row["strays"] if s["op"] == "pad"]


def test_the_compile_is_xla_gpu_for_an_h200(rows):
    assert rows[XLA]["launches_per_step"]["gemm_fusion_dot"] > 0  # Triton GEMM fusions: XLA:CPU has none
    for row in rows.values():
        assert row["device_kind"] == "NVIDIA H200"
        launches = row["launches_per_step"]  # with every kernel on, no XLA GEMM is left: Triton custom calls only
        assert launches.get("gemm_fusion_dot", 0) + launches.get("custom-call:__gpu$xla.gpu.triton", 0) > 0


def test_one_weight_gemm_per_projection_group_and_the_fused_kernel_replaces_the_attention_dots(rows):
    assert rows[XLA]["per_layer_by_kind"]["gemm_fusion_dot"] == 6  # q|k|v, o, gate|up, down; q K^T, p V
    fused = rows[FUSED]["per_layer_by_kind"]
    assert fused["gemm_fusion_dot"] == 4
    assert fused["custom-call:__gpu$xla.gpu.triton"] == 2  # the fused decode kernel and its split merge
    assert "loop_exponential_fusion" not in fused  # XLA's merge (exp, weighted sum, slice) is gone
    assert "loop_slice_fusion" not in fused and "copy" not in fused  # q / k / v not sliced out, no length copy
    # The two hidden norms on their kernel: a reduction and a scale each become one call.
    normed = rows[FUSED_NORM]["per_layer_by_kind"]
    assert normed["custom-call:__gpu$xla.gpu.triton"] == 4 and "input_reduce_fusion" not in normed
    # The weight products on their kernel, the norms, the activation product and the residual adds inside them, and
    # the decode kernel reading the q|k|v projection as it is: a layer is its six Triton calls, no XLA fusion left.
    assert rows[FUSED_LINEAR]["per_layer_by_kind"] == {"custom-call:__gpu$xla.gpu.triton": 6}
    # The LM head on the same kernel with the final norm inside: outside the layers one launch fewer than with XLA's
    # GEMM and the norm kernel beside it, and no XLA GEMM anywhere in the step.
    assert rows[FUSED_LINEAR]["outside_layers"] == rows[FUSED_NORM]["outside_layers"] - 1
    assert "gemm_fusion_dot" not in rows[FUSED_LINEAR]["launches_per_step"]


def test_the_padded_copy_is_the_slot_axis_and_a_slot_multiple_of_256_removes_it(rows):
    slots = 32768 + 16  # the 32K prompt's bucket and the 16 decoded tokens
    padded = -(-slots // 256) * 256
    assert f"bf16[8,{padded},128]{{2,1,0}}" in _pads(rows[XLA])  # every KV head's V, padded: a copy per layer
    assert rows[XLA]["per_layer_by_kind"]["loop_pad_fusion"] == 2
    assert _pads(rows[XLA_256]) == []
    assert rows[XLA_256]["per_layer"] < rows[XLA]["per_layer"]


def test_launches_per_layer_stay_under_todays(rows):
    for tuning, ceiling in CEILING.items():
        assert rows[tuning]["per_layer"] <= ceiling, (tuning, rows[tuning]["per_layer_by_kind"])


def _argument_bytes(tuning_text: str) -> int:
    """The loop's arguments as kvjax allocates them: the 8B-shaped weights and the `full` cache at 1 x 32K."""
    import importlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_util as bu
    import compile_8b
    import throughput

    from kvjax import methods as kvm
    from kvjax import tuning

    gen = importlib.import_module("kvjax.runtime.generate")
    config = bu.model_config("llama-3.1-8b")
    with tuning.use(tuning.default("gpu")), tuning.override(**throughput.parse_tuning(tuning_text)):
        capacity = gen.cache_capacity(kvm.get("full"), 32768, 16)
    cache = jax.eval_shape(lambda: gen.init_cache(kvm.get("full"), config, 1, capacity, jnp.bfloat16))
    leaves = jax.tree.leaves(compile_8b.abstract_weights(config, jnp.bfloat16)) + jax.tree.leaves(cache)
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)


def test_the_cache_is_updated_in_place_and_no_layer_is_held_twice(rows):
    """XLA:GPU's buffer assignment: the outputs (the cache) alias their arguments (donated, written in place), the
    arguments are the weights and the cache kvjax allocates (plus the step's logits), and the temporaries hold no
    copy of a weight or a layer's K / V beyond run 12's padded V, which the slot multiple and the fused path drop."""
    for tuning_text, row in rows.items():
        mem = row["memory"]
        assert mem["alias_gb"] == mem["output_gb"] > 4.3, tuning_text
        assert abs(mem["argument_gb"] - _argument_bytes(tuning_text) / 1e9) < 0.002, tuning_text
    padded_v = 8 * (-(-(32768 + 16) // 256) * 256) * 128 * 2 / 1e9  # one layer's V, padded: 0.068 GB
    assert padded_v <= rows[XLA]["memory"]["temp_gb"] < 2 * padded_v
    assert rows[XLA_256]["memory"]["temp_gb"] < 0.01
    for tuning_text in (FUSED, FUSED_NORM, FUSED_LINEAR):
        assert rows[tuning_text]["memory"]["temp_gb"] < 0.01, tuning_text


def test_the_loop_body_is_one_cuda_graph_and_while_captures_the_loop(tmp_path_factory, rows):
    """XLA:GPU's thunks (`hlo_count.thunk_loop`): by default the token loop's body is one command-buffer region
    holding every launch, the Pallas calls included (they do not split it), and the loop itself is not captured (a
    host round trip per token); `--xla_gpu_enable_command_buffer=+WHILE` captures it. The thunks' launches are
    the HLO's count."""
    for row in rows.values():
        thunks = row["thunks"]
        assert thunks["launches"] == row["launches_per_step"]["total"]
        assert thunks["body_regions"] == 1 and thunks["in_graphs"] == thunks["launches"]
        assert not thunks["loop_captured"]
    captured = _compile(tmp_path_factory, [FUSED], "--xla_gpu_enable_command_buffer=+WHILE",
                        per_layer=False)[FUSED]["thunks"]
    assert captured["loop_captured"]
    assert captured["in_graphs"] == captured["launches"] == rows[FUSED]["thunks"]["launches"]


def _assert_quantized_steps_are_bf16s(tmp_path_factory, rows, kv_dtypes: tuple[str, ...]) -> None:
    quantized = FUSED_LINEAR + ",auto_fused_quantized=true"  # "auto" takes a quantized cache only when told
    quantized_rows = _compile(tmp_path_factory, [quantized], kv_dtypes=",".join(kv_dtypes), per_layer=False)
    bf16 = rows[FUSED_LINEAR]["launches_per_step"]  # six Triton calls a layer (the test above)
    for kv_dtype in kv_dtypes:
        row = quantized_rows[(quantized, kv_dtype)]
        assert row["launches_per_step"] == bf16, (kv_dtype, row["launches_per_step"])
        mem = row["memory"]
        assert mem["alias_gb"] == mem["output_gb"] > 0.5 and mem["temp_gb"] < 0.01, (kv_dtype, mem)
        assert row["thunks"]["body_regions"] == 1 and row["thunks"]["in_graphs"] == row["thunks"]["launches"]


def test_quantized_caches_take_the_fused_path_whole(tmp_path_factory, rows):
    """int8 and int4 caches (KIVI-2 and fp8: the test below): the fused decode kernel writes and dequantizes them in
    place (int4's packed codes and zeros), so the step is the same launches as bf16's, a layer its six Triton calls,
    where XLA's write of int4 made 22. The cache aliased, nothing held twice. The whole step is compared, so each
    storage compiles once, not once more cut to one layer."""
    _assert_quantized_steps_are_bf16s(tmp_path_factory, rows, ("int8", "int4"))


@pytest.mark.slow
def test_kivi2_and_fp8_caches_take_the_fused_path_whole(tmp_path_factory, rows):
    """As above for KIVI-2 (the kernel quantizes its ring and flushes a group in place; XLA's write made 37 launches;
    KIVI's moved `qlen` is written by the merge kernel, after every split read it: written by the decode kernel's
    split 0 it raced with them) and fp8. `slow`: KIVI-2's kernels take half a minute of XLA:GPU's compile here; CI
    keeps both kernels lowered for CUDA (`test_fused_decode_kernel_lowers_for_kivi2_and_fp8`) and their
    interpret-mode results against the XLA path (tests/pallas/test_pallas_gpu_fused_decode.py)."""
    _assert_quantized_steps_are_bf16s(tmp_path_factory, rows, ("kivi2", "fp8"))


def test_in_place_eviction_takes_the_fused_path(tmp_path_factory):
    """StreamingLLM 1024 (evicts in place): its eviction decided in XLA before the fused kernel, which writes the token
    into the evicted slot. With the argmin as two reductions (`select.two_reduction_argmin`) the eviction is one
    kernel with the positions it reads and the slot it feeds: 7 per layer, nothing copied (it was 9: the select, the
    (value, index) reduction and the slot's select)."""
    fused = _compile(tmp_path_factory, [FUSED_LINEAR], methods="streaming_llm")[FUSED_LINEAR]
    assert fused["per_layer_by_kind"].pop("custom-call:__gpu$xla.gpu.triton") == 6
    assert sum(fused["per_layer_by_kind"].values()) == 1 and fused["per_layer"] == 7.0, fused["per_layer_by_kind"]
    assert fused["memory"]["temp_gb"] < 0.01 and fused["memory"]["alias_gb"] == fused["memory"]["output_gb"]


@pytest.mark.slow
def test_in_place_eviction_on_the_xla_path_is_batched_over_the_layers(tmp_path_factory):
    """The XLA path (no fused kernel) keeps the (value, index) reduction, which XLA batches over the layers: 4
    launches per step for the 32 layers' evictions, 28.2 per layer in all. `slow`: the GPU's default is the fused
    path (the test above)."""
    xla = _compile(tmp_path_factory, [XLA], methods="streaming_llm")[XLA]
    evictions = [n for n, _, source in xla["by_source"] if "select.py" in source and "_first_extreme" in source]
    assert sum(evictions) <= 4 and xla["per_layer"] <= 28.2, (evictions, xla["per_layer_by_kind"])


def test_gemma3_rings_and_post_norms_take_the_fused_path(tmp_path_factory):
    """Gemma-3-1B (5 of 6 layers 512-token rings; QK-norm; post-attention and post-MLP norms before the residual
    adds): its rings take the fused decode kernel (`ring=True`) like its global layers, and each post-norm adds the
    residual in the norm kernel, so every layer is 8 Triton calls and nothing else; its tied LM head runs on the
    weight-product kernel."""
    row = _compile(tmp_path_factory, [FUSED_LINEAR], model="gemma-3-1b")[FUSED_LINEAR]
    assert row["per_layer_by_kind"] == {"custom-call:__gpu$xla.gpu.triton": 8}, row["per_layer_by_kind"]
    assert row["memory"]["temp_gb"] < 0.01 and row["memory"]["alias_gb"] == row["memory"]["output_gb"]
    # The tied LM head (the 262,144 x 640 embedding table read as it lies) is the weight-product kernel too.
    assert "gemm_fusion_dot" not in row["launches_per_step"] and row["outside_layers"] == 9


def test_every_weight_product_tile_compiles_for_an_h200_as_one_launch(tmp_path):
    """`weight_products.py --compile_for=h200`: each of the 8B layer's products and the LM head (its final norm
    fused, float32 logits) at 1 and 16 rows, at every tile the
    device command times, compiles through Triton for the card (a tile over its shared memory would fail here) to
    one launch, where XLA's product with its norm, activation product or residual add takes two to four."""
    out = tmp_path / "weight_products.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "benchmarks"))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "weight_products.py"), "--compile_for=h200", f"--out={out}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 5 * 2 * (1 + 5)  # products x rows x (XLA + the default tiles)
    assert all(r["compiled"] for r in rows), [r for r in rows if not r["compiled"]]
    for r in rows:
        if r["impl"] == "xla":
            assert 2 <= r["launches"]["total"] <= 4, r
        else:
            assert r["launches"] == {"custom-call:__gpu$xla.gpu.triton": 1, "total": 1}, r
