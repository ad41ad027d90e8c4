"""Every benchmark script in `--quick` mode (tiny model), in one subprocess a group; then the claims they back.

The subprocess gets XLA's fast-compile CPU flags (the quick runs are compile-bound; results are only
checked for structure and for the memory bound, which comes from XLA's buffer assignment).

`BENCHMARKS` run in CI: the scripts the GPU command runs (benchmarks/device_gpu.sh), and `decode`'s analytic
speedups and `memory`'s chunked-prefill bound, claims no other test checks. `CPU_BENCHMARKS` back figures measured
on the CPU VM whose properties CI checks at the runtime level (buckets: tests/runtime/test_fresh_prefill.py and
tests/engine/test_engine.py; the shared sweep: tests/eval/test_sweep.py; merged layer sizes:
tests/runtime/test_layer_sizes.py; a context asked twice: tests/runtime/test_contexts.py; the engine's samplers:
tests/engine/test_engine.py), so their quick runs (70 s of the CI tier) are `slow`: `make test-all` runs them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import cpu_flags
import pytest

from kvjax import tuning

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ("decode", "memory", "decode_profile", "fused_decode", "throughput", "engine", "weight_products",
              "fused_kernel_tiles")
CPU_BENCHMARKS = ("compression_overhead", "compile_time", "sweep", "layer_sizes", "ask_context", "engine_step")
FAST_COMPILE = cpu_flags.FAST_COMPILE

_RUNNER = """
import importlib, sys
sys.path.insert(0, {bench!r})
out = {out!r}
extra = {{"decode": ["--compare_general"],
          "decode_profile": ["--hlo_only", "--methods=full", "--repeats=1"],
          "fused_decode": ["--impls=xla,pallas,runtime,runtime_pallas", "--kv_dtypes=model", "--no_hlo"],
          "throughput": ["--kv_dtypes=model,int8", "--plan=1x64:full"],
          "fused_kernel_tiles": ["--tiles=16:4:2:4,16:4:2:4:pairs,16:4:2:4:pairs:f16", "--contexts=48,64"],
          "engine": ["--methods=decoding:int8", "--workloads=long_generations,rollouts"],
          "layer_sizes": ["--layer_slack=0,0.1", "--methods=lukv"]}}
for name in {names!r}:
    module = importlib.import_module(name)
    argv = ["--out=" + out + "/" + name + ".json", *extra.get(name, [])]
    if name == "throughput":  # its run() is the plan runner; main() parses the flags
        module.main(["--smoke", *argv])
    else:
        module.run(["--quick", *argv])
"""


def _run_quick(tmp_path_factory, names: tuple[str, ...]) -> dict[str, dict]:
    """`names`' quick runs in one subprocess: their JSON results by name."""
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    code = _RUNNER.format(bench=str(ROOT / "benchmarks"), out=str(out), names=list(names))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in names}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    return _run_quick(tmp_path_factory, BENCHMARKS)


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory) -> dict[str, dict]:
    return _run_quick(tmp_path_factory, CPU_BENCHMARKS)


def _assert_rows_and_machine(results: dict[str, dict]) -> None:
    for name, result in results.items():
        assert result["benchmark"] == name
        assert result["rows"], name
        assert result["machine"]["backend"] == "cpu" and result["machine"]["cpu"], name
        assert result["model"]["name"] == "tiny" and result["quick"] is True


def test_every_benchmark_writes_rows_and_names_the_machine(results):
    _assert_rows_and_machine(results)


@pytest.mark.slow
def test_every_cpu_benchmark_writes_rows_and_names_the_machine(cpu_results):
    _assert_rows_and_machine(cpu_results)


@pytest.mark.slow
def test_prefill_figures_are_ratios_against_full_from_the_same_run(cpu_results):
    rows = cpu_results["compression_overhead"]["rows"]
    full = [r for r in rows if r["method"] == "full"]
    assert full and all(r["prefill_ratio"] == 1.0 for r in full)
    snap = [r for r in rows if r["method"] == "snapkv"]
    assert snap and all(r["hook_fraction"] > 0 and r["prefill_ratio"] > 0 for r in snap)


def test_decode_figures_are_ratios_against_full_from_the_same_run(results):
    dec = results["decode"]["rows"]
    assert [r["speedup"] for r in dec if r["method"] == "full"] == [1.0]
    for r in dec:
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["ideal_speedup"] >= 1.0
    # --compare_general: the in-place decode rows (full and snapkv append only) also timed on the general path
    assert all(r["decode_path"] == "in_place" and r["general_step_ms"] > 0 and r["in_place_speedup"] > 0
               for r in dec)
    (snapkv,) = [r for r in dec if r["method"] == "snapkv"]
    assert snapkv["kv_read_bytes"] < [r for r in dec if r["method"] == "full"][0]["kv_read_bytes"]
    analytic = results["decode"]["analytic"]
    assert {r["context"] for r in analytic} == {32768, 131072}
    assert all(r["ideal_speedup"] > 1 for r in analytic)


def test_engine_and_static_batching_run_the_same_requests(results):
    """benchmarks/engine.py (the GPU stage's plumbing, on the tiny model): both paths generate every request's
    answer, the ratio is taken within the run, the compile seconds are counted apart."""
    rows = [r for r in results["engine"]["rows"] if r["workload"] == "long_generations"]
    assert {r["path"] for r in rows} == {"engine", "static"} and {r["method"] for r in rows} == {"decoding:int8"}
    engine, static = sorted(rows, key=lambda r: r["path"])
    assert engine["tokens"] == static["tokens"] > 0 and engine["requests"] == static["requests"] == 8
    for r in rows:
        assert 0 < r["compile_s"] < r["wall_s"] and r["programs"] > 0 and 0 < r["prefill_share"] < 1
        assert r["steady_tokens_per_s"] > r["tokens_per_s"] > 0 and r["cache_bytes"] > 0
    (ratio,) = [r for r in results["engine"]["ratios"] if r["workload"] == "long_generations"]
    assert ratio["tokens_per_s"] == engine["tokens_per_s"] / static["tokens_per_s"]


def test_rollouts_share_a_prefill_and_draw_what_separate_requests_draw(results):
    """benchmarks/engine.py's rollouts (3 prompts x 3 samples on the tiny model): the engine's shared prefill, each
    sample as a request of its own, and static batches of the prompts' copies all generate every answer; the first two
    draw the same tokens; both ratios are taken within the run."""
    rows = {r["path"]: r for r in results["engine"]["rows"] if r["workload"] == "rollouts"}
    assert set(rows) == {"engine", "separate", "static"}
    assert rows["engine"]["requests"] == rows["separate"]["requests"] == rows["static"]["requests"] == 9
    assert rows["engine"]["tokens"] == rows["separate"]["tokens"] == rows["static"]["tokens"] > 0
    assert rows["separate"]["same_tokens"] is True
    ratios = {r["against"]: r for r in results["engine"]["ratios"] if r["workload"] == "rollouts"}
    assert ratios["separate"]["tokens_per_s"] == rows["engine"]["tokens_per_s"] / rows["separate"]["tokens_per_s"]
    assert ratios["static"]["tokens_per_s"] == rows["engine"]["tokens_per_s"] / rows["static"]["tokens_per_s"]


@pytest.mark.slow
def test_engine_step_times_both_paths_for_every_sampler(cpu_results):
    rows = cpu_results["engine_step"]["rows"]
    assert [r["setting"] for r in rows] == ["greedy", "sampled", "nucleus"]
    for r in rows:
        assert r["generate_step_s"] > 0 and r["engine_step_s"] > 0
        assert r["engine_over_generate"] == r["engine_step_s"] / r["generate_step_s"]


@pytest.mark.slow
def test_sweep_times_both_ways_on_the_same_cells(cpu_results):
    (row,) = cpu_results["sweep"]["rows"]
    assert row["cells"] == 6 and row["per_cell_cpu_s"] > 0 and row["shared_cpu_s"] > 0
    assert row["same_tokens"].endswith("/6")


def test_chunked_prefill_peak_memory_is_bounded_by_budget_plus_chunk(results):
    mem = results["memory"]
    rows = [r for r in mem["rows"] if r["method"] == "snapkv"]
    chunked = {r["multiple_of_budget"]: r for r in rows if r["mode"] == "chunked"}
    one_shot = {r["multiple_of_budget"]: r for r in rows if r["mode"] == "one_shot"}
    assert set(chunked) == {4, 16}
    small, large = chunked[4], chunked[16]
    budget, new, chunk = large["budget"], large["new_tokens"], large["chunk"]
    # The cache is allocated at budget + new tokens, whatever the prompt length...
    assert small["capacity"] == large["capacity"] == budget + new
    assert small["cache"] == large["cache"]
    # ...and XLA's buffer assignment of the chunk program does not depend on the prompt length either.
    for key in ("argument", "output", "alias", "temp", "peak"):
        assert small[key] == large[key], key
    # One shot grows with the prompt; the chunked peak stays below it.
    assert one_shot[16]["non_weight_peak"] > one_shot[4]["non_weight_peak"] > large["non_weight_peak"]
    assert large["kv_slots_bound"] == budget + new + chunk
    # The arrays really held between chunks, from running it at 4x and 16x the budget.
    measured = [r for r in mem["measured"] if r["method"] == "snapkv"]
    assert [r["prompt"] for r in measured] == [4 * budget, 16 * budget]
    assert {r["capacity"] for r in measured} == {budget + new}
    assert measured[0]["cache_bytes"] == measured[1]["cache_bytes"]
    assert all(r["kept_tokens"] == budget for r in measured)


@pytest.mark.slow
def test_length_buckets_compile_fewer_programs(cpu_results):
    rows = {(r["variant"], r["method"]): r for r in cpu_results["compile_time"]["rows"]}
    lengths = cpu_results["compile_time"]["lengths"]
    for method in ("full", "snapkv"):
        bucketed, exact = rows[("bucketed", method)], rows[("exact", method)]
        assert bucketed["prefill_programs"] == len(bucketed["buckets"]) < len(lengths) == exact["prefill_programs"]
    # A compressing method's decode cache does not depend on the prompt bucket: one decode program.
    assert rows[("bucketed", "snapkv")]["decode_programs"] == 1


@pytest.mark.slow
def test_a_layer_slack_compiles_one_prefill_per_merged_size(cpu_results):
    rows = {(r["method"], r["layer_slack"]): r for r in cpu_results["layer_sizes"]["rows"]}
    assert rows[("snapkv", 0.0)]["prefill_programs"] == rows[("snapkv", 0.0)]["distinct_sizes"] == 1
    for method in ("lukv",):  # (per_layer's grouping: tests/engine/test_engine_layer_sizes.py)
        exact, merged = rows[(method, 0.0)], rows[(method, 0.1)]
        assert exact["distinct_sizes"] == exact["prefill_programs"] == 6 and exact["slots_vs_first"] == 1.0
        assert merged["prefill_programs"] == merged["distinct_sizes"] < 6
        assert all(m >= e for m, e in zip(merged["sizes"], exact["sizes"], strict=True))
        assert 1.0 < merged["slots_vs_first"] <= 1.1 and merged["same_tokens_as_first"]


@pytest.mark.slow
def test_a_context_compressed_once_answers_as_generate_does(cpu_results):
    result = cpu_results["ask_context"]
    for row in result["rows"]:
        assert row["same_answers"] == result["questions"] and row["same_from_file"], row["method"]
        assert row["cache_bytes"] < row["file_bytes"] < row["full_cache_bytes"], row["method"]
        assert row["generate_s"] > 0 and row["speedup"] > 0
    for row in result["store_rows"]:  # the second job reads every prompt pass the first one wrote
        assert row["same_answers"] and row["passes_computed"] == 0, row["method"]
        assert row["passes_written"] == 2 and row["passes_read"] == result["questions"], row["method"]


def test_synthetic_full_state_has_the_layout_of_a_real_prefill():
    """Long-context decode rows time `full` on a random cache; it must be the cache prefill would build."""
    import jax
    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_util as bu
    import decode as decode_bench

    gen = importlib.import_module("kvjax.runtime.generate")  # the package re-exports a function of that name
    model = bu.random_model(bu.tiny_config(), "float32")
    context, new, batch = 40, 5, 2
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, context))
    real = gen.prefill(model, ids, method="full", max_new_tokens=new)
    fake = decode_bench.synthetic_full_state(model, batch, context, new)
    real_leaves, real_tree = jax.tree.flatten(real.cache)
    fake_leaves, fake_tree = jax.tree.flatten(fake.cache)
    assert real_tree == fake_tree
    for a, b in zip(real_leaves, fake_leaves, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert fake.cache.num_layers == model.config.num_layers
    for real_layer, fake_layer in zip(real.cache.layers, fake.cache.layers, strict=True):
        np.testing.assert_array_equal(real_layer.pos, fake_layer.pos)
        np.testing.assert_array_equal(real_layer.length, fake_layer.length)
        filled = np.asarray(fake_layer.pos) >= 0
        for kv in (fake_layer.k, fake_layer.v):
            assert np.all(np.asarray(kv)[~filled] == 0) and np.all(np.asarray(kv)[filled] != 0)
    # Each layer holds its own random keys (a layer's buffers are not another's).
    assert not np.array_equal(np.asarray(fake.cache.layers[0].k), np.asarray(fake.cache.layers[1].k))
    np.testing.assert_array_equal(real.prompt_lengths, fake.prompt_lengths)
    np.testing.assert_array_equal(real.budget, fake.budget)
    assert fake.logits.shape == real.logits.shape and fake.logits.dtype == real.logits.dtype
    # It decodes like any prefilled state.
    tokens, _, _ = gen.decode(model, fake, max_new_tokens=new, stop_at_eos=False)
    assert np.asarray(tokens).shape[:2] == (batch, new)


def test_synthetic_states_of_one_shape_compile_their_fill_once():
    """`throughput.synthetic_state` runs before every timed repeat: its per-layer fill is compiled once per shape
    and storage, not once per state (a function defined inside it was new at every call)."""
    import jax

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_util as bu
    import throughput

    from kvjax import methods as kvm

    model = bu.random_model(bu.tiny_config(), "float32")
    throughput._layer_filler.cache_clear()
    for kv_dtype in (None, None, "int8", "int8"):
        state = throughput.synthetic_state(model, kvm.get("full"), 2, 40, 5, kv_dtype=kv_dtype)
        jax.block_until_ready(state.cache)
    fills = [throughput._layer_filler(40, 40, 16, jax.numpy.dtype("float32"), q)
             for q in (None, state.cache.layers[0].k.spec)]
    assert throughput._layer_filler.cache_info().currsize == 2
    assert [f._cache_size() for f in fills] == [1, 1]  # both layers of every state: one program per storage


def test_decode_profile_counts_a_steps_launches_per_layer(results):
    """`decode_profile.py --hlo_only`: launches of the compiled decode step from its HLO, split into the layers and
    the rest by a second compile of the model cut to one layer, with the stray copies and their source lines."""
    (row,) = results["decode_profile"]["rows"]
    per_step = row["launches_per_step"]
    assert per_step["total"] == sum(v for k, v in per_step.items() if k != "total")
    assert row["per_layer"] > 0 and row["outside_layers"] > 0
    assert per_step["total"] == row["per_layer"] * row["layers"] + row["outside_layers"]
    # Every layer writes the new token: the append's slot writes are among the launches, traced to their line.
    assert any("put_slots" in where for _, _, where in row["by_source"])
    assert row["graphs"]["regions"] == 0 and row["graphs"]["loops"] >= 1  # no command buffers on CPU
    assert any("cache.py" in where or "ops/attention.py" in where for _, _, where in row["by_source"])
    assert all(s["op"] in ("copy", "transpose", "pad") for s in row["strays"])
    assert row["wall_ms_per_step"] > 0


def test_fused_decode_kernel_inside_the_model_gives_the_xla_tokens(results):
    """`fused_decode.py`: the fused kernel (interpret mode here) in a decode loop over the tiny model's layers
    gives the XLA path's logits and greedy tokens, and `kvjax.decode` with the kernel forced on (`runtime_pallas`,
    the GPU A/B's switch) gives the runtime's own tokens, which the harness's XLA loop gives too."""
    rows = {r["impl"]: r for r in results["fused_decode"]["rows"]}
    assert set(rows) == {"xla", "pallas", "runtime", "runtime_pallas"}, rows
    assert all("error" not in r and "skipped" not in r for r in rows.values()), rows
    assert rows["pallas"]["logits_max_rel_err"] < 1e-5 and rows["pallas"]["same_argmax"]
    assert rows["pallas"]["same_tokens_as_xla"] and rows["pallas"]["step_ms"] > 0
    assert len(rows["xla"]["tokens"]) == rows["xla"]["new_tokens"]
    assert rows["runtime_pallas"]["same_tokens_as_runtime"] and rows["runtime_pallas"]["step_ms"] > 0
    assert rows["runtime"]["tokens"] == rows["xla"]["tokens"]


def test_fused_kernel_tiles_time_the_tunings_tile_first_and_count_the_bytes_a_call_reads(results, tmp_path, capsys):
    """`fused_kernel_tiles.py`: per storage, the tuning's tile and the others at the sweep's context, the tuning's
    and the sweep's fastest at the other; each call's output within bf16 rounding of the XLA path's; the bytes a
    call reads are the layer's keys, values (int8: codes and one float scale per token) and positions up to the
    context; `--print_best` names the fastest sweep tile as tuning text."""
    result = results["fused_kernel_tiles"]
    config = result["model"]
    per_token = config["num_kv_heads"] * 4  # the position, int32
    want = {"model": per_token + 2 * config["num_kv_heads"] * config["head_dim"] * 2,
            "int8": per_token + 2 * config["num_kv_heads"] * (config["head_dim"] + 2)}  # codes + a bf16 scale
    for storage in ("model", "int8"):
        rows = [r for r in result["rows"] if r["kv_dtype"] == storage]
        assert all("error" not in r and r["us"] > 0 and r["max_rel_err"] < 2e-2 for r in rows), rows
        sweep = [r for r in rows if r["sweep"]]
        # pairs: int8's codes as int16 (only); f16: 8-bit codes attended with float16 dots (only)
        others = ["16:4:2:4"] + ["16:4:2:4:pairs", "16:4:2:4:pairs:f16"] * (storage == "int8")
        assert [r["tile"] for r in sweep][1:] == others and sweep[0]["tuned"] and sweep[0]["vs_tuned"] == 1.0
        assert sweep[0]["tile"] == "64:4:2:256"  # the CPU tuning's tile, a quantized cache's too
        other = [r for r in rows if not r["sweep"]]
        assert {r["context"] for r in other} == {48} and other[0]["tuned"]
        fastest = min(sweep, key=lambda r: r["us"])["tile"]
        assert [r["tile"] for r in other] == ["64:4:2:256"] + ([fastest] if fastest != "64:4:2:256" else [])
        for r in rows:
            assert r["read_bytes"] == r["context"] * want[storage], (storage, r["read_bytes"])
    fkt = _fused_kernel_tiles()
    best = fkt.best(result["rows"], "int8")
    assert best["tuning_text"].startswith(f"gpu_quantized_block_k={best['tile'].split(':')[0]},")
    assert best["tuning_text"].endswith(f"gpu_int8_pairs={str(':pairs' in best['tile']).lower()},"
                                        f"gpu_f16_dots={str(best['tile'].endswith(':f16')).lower()}")
    pairs = next(r for r in result["rows"] if r["tile"] == "16:4:2:4:pairs")
    assert fkt.parse_tile(pairs["tile"]) == fkt.Tile(16, 4, 2, 4, pairs=True)
    assert fkt.parse_tile(pairs["tile"]).applied(tuning.default("cpu"), True).gpu_int8_pairs
    tuned = next(r for r in result["rows"] if r["kv_dtype"] == "int8" and r["sweep"] and r["tuned"])
    for rows, printed in ((result["rows"], best["tuning_text"] * (not best["tuned"])), ([tuned], "")):
        (tmp_path / "tiles.json").write_text(json.dumps({"rows": rows}))
        fkt.run(["--print_best", "int8", str(tmp_path / "tiles.json")])
        assert capsys.readouterr().out == printed + "\n"  # nothing for the tuning's own tile


def _fused_kernel_tiles():
    """`benchmarks/fused_kernel_tiles.py` as a module."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fused_kernel_tiles

    return fused_kernel_tiles


def _sweeps(fkt, texts: tuple[str, ...], storages: tuple) -> dict:
    """The tile labels each storage's sweep runs from `texts` under the GPU's tuning (the tuning's tile first)."""
    tiles = [fkt.parse_tile(t) for t in texts]
    return {s: [t.label for t in fkt._tiles(tiles, tuning.default("gpu"), s)] for s in storages}


def test_fused_kernel_tiles_cvt_tiles_time_sub_byte_codes_without_the_unpack_assembly():
    """`:cvt`: a sub-byte storage's tile with `Tuning.gpu_unpack_asm` off (the kernels' `cvt` a code), for the
    A/B of `kvjax.pallas.gpu_unpack`; int8 and the model dtype skip it, as non-int8 storages skip `:pairs`."""
    fkt = _fused_kernel_tiles()
    gpu = tuning.default("gpu")
    tile = fkt.parse_tile("128:4:2:256:cvt")
    assert tile == fkt.Tile(128, 4, 2, 256, cvt=True) and tile.label == "128:4:2:256:cvt"
    assert not tile.applied(gpu, True).gpu_unpack_asm and tile.applied(gpu, True).gpu_quantized_block_k == 128
    assert fkt.parse_tile("128:4:2:256").applied(gpu, True).gpu_unpack_asm
    assert tile.tuning_text(True).endswith("gpu_int8_pairs=false,gpu_unpack_asm=false,gpu_f16_dots=false")
    assert _sweeps(fkt, ("64:4:2:256", "128:4:2:256:cvt", "128:4:2:256:pairs"), ("int4", "kivi2", "int8", None)) == {
        "int4": ["128:4:2:256", "64:4:2:256", "128:4:2:256:cvt"],
        "kivi2": ["128:4:2:256", "64:4:2:256", "128:4:2:256:cvt"],
        "int8": ["128:4:2:256", "64:4:2:256", "128:4:2:256:pairs"], None: ["64:4:2:256"]}
    assert fkt.tuned_tile(dataclasses.replace(gpu, gpu_unpack_asm=False), "int4").cvt
    with pytest.raises(ValueError, match=":pairs / :cvt"):
        fkt.parse_tile("128:4:2:256:fast")


def test_fused_kernel_tiles_f16_tiles_time_8bit_codes_with_float16_dots():
    """`:f16`: an int8 or fp8 storage's tile with `Tuning.gpu_f16_dots` on, for its A/B; sub-byte storages and the
    model dtype skip it."""
    fkt = _fused_kernel_tiles()
    gpu = tuning.default("gpu")
    tile = fkt.parse_tile("128:4:2:256:pairs:f16")
    assert tile == fkt.Tile(128, 4, 2, 256, pairs=True, f16=True) and tile.label == "128:4:2:256:pairs:f16"
    assert tile.applied(gpu, True).gpu_f16_dots and tile.applied(gpu, True).gpu_int8_pairs
    assert not fkt.parse_tile("128:4:2:256:pairs").applied(dataclasses.replace(gpu, gpu_f16_dots=True),
                                                           True).gpu_f16_dots
    assert "128:4:2:256:pairs:f16" in fkt.TILES.split(",")
    assert _sweeps(fkt, ("64:4:2:256", "128:4:2:256:f16", "128:4:2:256:cvt"), ("fp8", "int8", "int4", None)) == {
        "fp8": ["128:4:2:256", "64:4:2:256", "128:4:2:256:f16"],
        "int8": ["128:4:2:256", "64:4:2:256", "128:4:2:256:f16"],
        "int4": ["128:4:2:256", "64:4:2:256", "128:4:2:256:cvt"], None: ["64:4:2:256"]}
    assert fkt.tuned_tile(dataclasses.replace(gpu, gpu_f16_dots=True), "fp8").f16
    assert not fkt.tuned_tile(dataclasses.replace(gpu, gpu_f16_dots=True), "int4").f16


def test_fused_kernel_tiles_bytes_tiles_time_int4_codes_a_byte_at_a_time():
    """`:bytes`: an int4 storage's tile with `Tuning.gpu_int4_pairs` off (its codes read a byte at a time), for the
    A/B of int4's int16 pairs; other storages skip it."""
    fkt = _fused_kernel_tiles()
    gpu = tuning.default("gpu")
    tile = fkt.parse_tile("128:4:2:256:bytes")
    assert tile == fkt.Tile(128, 4, 2, 256, bytes=True) and tile.label == "128:4:2:256:bytes"
    assert not tile.applied(gpu, True).gpu_int4_pairs
    assert fkt.parse_tile("128:4:2:256").applied(gpu, True).gpu_int4_pairs
    assert _sweeps(fkt, ("64:4:2:256", "128:4:2:256:bytes", "128:4:2:256:cvt"), ("int4", "kivi2", "int8")) == {
        "int4": ["128:4:2:256", "64:4:2:256", "128:4:2:256:bytes", "128:4:2:256:cvt"],
        "kivi2": ["128:4:2:256", "64:4:2:256", "128:4:2:256:cvt"], "int8": ["128:4:2:256", "64:4:2:256"]}
    assert fkt.tuned_tile(dataclasses.replace(gpu, gpu_int4_pairs=False), "int4").bytes
    assert not fkt.tuned_tile(gpu, "int4").bytes and not fkt.tuned_tile(dataclasses.replace(
        gpu, gpu_int4_pairs=False), "kivi2").bytes


def test_weight_products_time_xla_and_the_kernel_on_the_same_products(results):
    """`weight_products.py`: every product at 1 and 16 rows, XLA's and each tile's (interpret mode here), the
    kernel's result within bf16 rounding of XLA's, bandwidth as a fraction of the copy bandwidth of the same run."""
    result = results["weight_products"]
    rows = result["rows"]
    assert result["copy_bytes_per_s"] > 0 and not result.get("cut_short")
    tiles = len(result["tiles"])
    for product in ("qkv", "o", "gate_up", "down"):
        for count in (1, 16):
            cell = [r for r in rows if r["product"] == product and r["rows"] == count]
            assert [r["impl"] for r in cell][0] == "xla" and len(cell) == 1 + tiles, cell
            assert all(r["us"] > 0 and 0 < r["copy_fraction"] for r in cell)
            assert all(r["max_rel_err"] < 2e-2 for r in cell[1:]), cell
            assert {r["fused"] for r in cell} == {"norm" if product in ("qkv", "gate_up") else "residual" if
                                                  product == "o" else "activation+residual"}


def test_throughput_runs_a_quantized_cache(results):
    """`throughput.py --kv_dtypes`: the same plan on an int8 cache holds fewer bytes and decodes."""
    rows = {r["kv_dtype"]: r for r in results["throughput"]["rows"]}
    assert set(rows) == {"model", "int8"}
    assert rows["int8"]["cache_bytes"] < rows["model"]["cache_bytes"] and rows["int8"]["tokens_per_s"] > 0
    # A second, untimed call before the repeats, its compiles counted: none here, and none in the repeats.
    for row in rows.values():
        assert row["decode_second_s"] > 0 and len(row["repeat_ms"]) == 2
        assert row["second_call_compiles"] == 0 == row["repeat_compiles"], row


def test_compile_log_counts_the_backend_compiles_of_its_block():
    """`bench_util.CompileLog`: a jitted function's first call compiles once inside the block, a cached call not at
    all, and a compile after the block is not counted."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_util as bu

    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    x = jnp.arange(7.0)
    with bu.CompileLog() as first:
        jax.block_until_ready(f(x))
    with bu.CompileLog() as cached:
        jax.block_until_ready(f(x))
    assert first.count == 1 and first.seconds > 0
    assert cached.count == 0 and cached.seconds == 0.0
    jax.block_until_ready(f(jnp.arange(9.0)))  # a new shape, outside every block
    assert first.count == 1 and cached.count == 0


def test_xla_flags_plus_adds_to_the_default_command_buffers_and_a_list_replaces_them():
    """`--xla_gpu_enable_command_buffer=+WHILE` keeps XLA's default command types and adds WHILE; a plain list
    replaces them (what issue 57's graph variants rely on), read back from the options XLA compiled with."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import xla_flags

    today, plus, plain, unroll, no_split, off = xla_flags.effective_all(
        ["", xla_flags.VARIANTS["while"], "--xla_gpu_enable_command_buffer=WHILE", xla_flags.VARIANTS["while_unroll"],
         xla_flags.VARIANTS["no_split_k"], xla_flags.VARIANTS["no_graphs"]])
    defaults = set(today["command_buffer_types"])
    assert {"FUSION", "CUSTOM_CALL"} <= defaults and "WHILE" not in defaults, today
    assert set(plus["command_buffer_types"]) == defaults | {"WHILE"}, plus
    assert plain["command_buffer_types"] == ["WHILE"], plain
    assert unroll["xla_gpu_command_buffer_unroll_loops"] == "true" and "FUSION" in unroll["command_buffer_types"]
    assert no_split["xla_gpu_experimental_force_split_k"] == "1" != today.get("xla_gpu_experimental_force_split_k")
    assert off["command_buffer_types"] == [], off  # the empty set: no command buffers at all


def test_hlo_count_reads_command_buffer_regions():
    """`hlo_count.graphs` on XLA:GPU's shape of a program after command-buffer scheduling (regions outlined as
    `command_buffer` computations called from the step; a `while` captured inside one, a Triton custom call
    outside): what each region captures and what runs outside."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hlo_count

    text = """HloModule m

%fused_computation (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %pad.1 = f32[4]{0} pad(f32[4]{0} %p0, f32[] %p0), padding=0_0
}

%command_buffer (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %loop_pad_fusion = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%fused_computation
  ROOT %gemm = f32[4]{0} custom-call(f32[4]{0} %loop_pad_fusion), custom_call_target="__cublas$gemm"
}

%body (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  %call.1 = f32[4]{0} call(f32[4]{0} %b), to_apply=%command_buffer
  ROOT %triton = f32[4]{0} custom-call(f32[4]{0} %call.1), custom_call_target="__gpu$xla.gpu.triton"
}

%cond (c: f32[4]) -> pred[] {
  %c = f32[4]{0} parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %while.1 = f32[4]{0} while(f32[4]{0} %x), condition=%cond, body=%body
}
"""
    assert hlo_count.launches(text) == {"custom-call:__cublas$gemm": 1, "custom-call:__gpu$xla.gpu.triton": 1,
                                        "loop_pad_fusion": 1, "total": 3}
    graphs = hlo_count.graphs(text)
    assert graphs["regions"] == 1 and graphs["loops"] == 1 and graphs["loops_in_regions"] == 0
    assert graphs["captured"] == {"loop_pad_fusion": 1, "custom-call:__cublas$gemm": 1}
    assert graphs["outside"] == {"custom-call:__gpu$xla.gpu.triton": 1}
    (stray,) = hlo_count.strays(text)
    assert stray["kind"] == "loop_pad_fusion" and stray["op"] == "pad"
