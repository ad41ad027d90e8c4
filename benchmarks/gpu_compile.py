"""What XLA:GPU compiles a decode step into for an H100 / H200, on a machine without one.

    make gpu-compile                      # once: jax's CUDA plugin, compile-only, into .gpu-compile-site
    python benchmarks/gpu_compile.py --out=/tmp/gpu_compile.json                  # 8B shape, 1 x 32K, full + SnapKV
    python benchmarks/gpu_compile.py --tunings=";cache_slot_multiple=256" --methods=full --out=...
    python benchmarks/gpu_compile.py --smoke --out=/tmp/gpu_compile.json          # the tiny shape, seconds

XLA compiles for a GPU it is only told about: a compile-only CUDA topology built from a target description (SM
count, shared memory, bandwidth, ...: `TARGETS`, from the cards' public specifications), so the optimized HLO of
the decode loop (`generate._decode_loop`, from abstract weights and cache as `compile_8b.py` builds them) is
XLA:GPU's own: its fusions, GEMM fusions, split-K reductions, pads and Pallas Triton custom calls. Without the
card there is no autotuning, so a GEMM's tiling (and with it a split-K reduction or a pad) is XLA's default
choice; measured against run 11's profile on an H200 (BENCHMARKS.md) the counts agree within 3 kernels per step.

Per method and tuning variant (`--tunings`, `throughput.py`'s form; the variants start from the GPU defaults,
`tuning.default("gpu")`): `launches_per_step` (`hlo_count.launches` of the whole model), `per_layer` and
`per_layer_by_kind` (the same model cut to one layer compiled too: the difference over the other layers),
`strays` (pads, copies, transposes with their shapes), `by_source` (kind and kvjax line of each launch), `memory`
(XLA's buffer assignment) and `thunks` (`hlo_count.thunk_loop`: the token loop's body in XLA:GPU's thunk sequence,
dumped by the compile, where jaxlib 0.10's XLA forms its command buffers: the launches inside CUDA-graph regions
and outside, and whether the loop itself is captured; the HLO shows no regions, `graphs`).

kvjax chooses its GPU paths with `jax.default_backend()`; this process runs on the CPU backend, so for tracing
`jax.default_backend` is pointed at "gpu" (the Pallas kernels then lower for Triton, not interpret mode).
`--target=attached` compiles for the process's own GPU instead (on a GPU machine: autotuned, the reference the
compile-only counts are checked against).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Where `make gpu-compile` installs jax's CUDA plugin (compile-only use); on sys.path before jax is imported.
SITE = Path(os.environ.get("KVJAX_GPU_COMPILE_SITE", Path(__file__).resolve().parents[1] / ".gpu-compile-site"))
if SITE.is_dir() and str(SITE) not in sys.path:
    sys.path.insert(0, str(SITE))

import bench_util as bu  # noqa: E402
import compile_8b  # noqa: E402
import hlo_count  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import throughput  # noqa: E402

from kvjax import methods as kvm  # noqa: E402
from kvjax import tuning  # noqa: E402

gen = importlib.import_module("kvjax.runtime.generate")

#: Compile targets, from NVIDIA's published specifications (SXM parts): the fields of XLA's
#: `GpuTargetConfigProto.gpu_device_info` that its fusion and GEMM heuristics read; the memory as nvidia-smi
#: reports it (the H200's in BENCHMARKS.md's runs 10-12).
_HOPPER = dict(
    compute_capability=(9, 0), core_count=132, fpus_per_core=128, clock_rate_ghz=1.98, threads_per_warp=32,
    threads_per_block_limit=1024, threads_per_core_limit=2048, shared_memory_per_block=48 << 10,
    shared_memory_per_block_optin=227 << 10, shared_memory_per_core=228 << 10, registers_per_core_limit=65536,
    registers_per_block_limit=65536, l2_cache_size=50 << 20,
    # What XLA reads to decide whether CUDA graphs may hold a `while` (conditional nodes need CUDA >= 12.3): the
    # H200 of runs 10-12 had driver 580 (CUDA 13.0) under a CUDA 12 build of jaxlib.
    driver_version="13.0.0", runtime_version="12.9.0",
)
TARGETS: dict[str, dict[str, Any]] = {
    "h100": dict(_HOPPER, name="NVIDIA H100 80GB HBM3", memory_bandwidth=3.35e12, device_memory_size=81559 << 20),
    "h200": dict(_HOPPER, name="NVIDIA H200", memory_bandwidth=4.8e12, device_memory_size=143771 << 20),
}


def target_config(name: str) -> str:
    """`TARGETS[name]` as the text-format `GpuTargetConfigProto` that XLA's compile-only CUDA topology reads."""
    t = TARGETS[name]
    major, minor = t["compute_capability"]
    ints = ("threads_per_block_limit", "threads_per_warp", "shared_memory_per_block", "shared_memory_per_block_optin",
            "shared_memory_per_core", "threads_per_core_limit", "core_count", "fpus_per_core",
            "registers_per_core_limit", "registers_per_block_limit", "l2_cache_size", "device_memory_size")
    info = [f"cuda_compute_capability {{ major: {major} minor: {minor} }}"]
    info += [f"{k}: {int(t[k])}" for k in ints]
    info += ["block_dim_limit_x: 2147483647", "block_dim_limit_y: 65535", "block_dim_limit_z: 65535",
             f"memory_bandwidth: {int(t['memory_bandwidth'])}", f"clock_rate_ghz: {t['clock_rate_ghz']}",
             f"driver_version: \"{t['driver_version']}\"", f"runtime_version: \"{t['runtime_version']}\""]
    body = "\n  ".join(info)
    major, minor, patch = t["runtime_version"].split(".")
    return (f"gpu_device_info {{\n  {body}\n}}\nplatform_name: \"CUDA\"\n"
            f"dnn_version_info {{ major: 9 minor: 8 patch: 0 }}\n"
            f"runtime_version {{ major: {major} minor: {minor} patch: {patch} }}\n"
            f"device_description_str: \"{t['name']}\"\n")


def device_memory(target: str, device: Any) -> float:
    """Bytes of device memory: the target's, or the attached GPU's allocator limit."""
    if target != "attached":
        return float(TARGETS[target]["device_memory_size"])
    return float((device.memory_stats() or {}).get("bytes_limit", 0))


def gpu_device(target: str) -> Any:
    """The device to compile for: a compile-only CUDA device of `TARGETS[target]`, or ("attached") this process's
    GPU. A missing plugin is named with the command that installs it."""
    if target == "attached":
        devices = [d for d in jax.devices() if d.platform == "gpu"]
        if not devices:
            raise SystemExit(f"gpu_compile: --target=attached needs a GPU; this process has {jax.devices()}")
        return devices[0]
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc("", "cuda", target_config=target_config(target), topology="1x1x1")
    except Exception as e:  # noqa: BLE001  (no plugin: jax raises RuntimeError / NotImplementedError)
        raise SystemExit(f"gpu_compile: no compile-only CUDA backend ({type(e).__name__}: {str(e)[:200]}); "
                         f"run `make gpu-compile` (jax's CUDA plugin into {SITE})") from None
    return topology.devices[0]


@contextlib.contextmanager
def traced_for_gpu(device: Any) -> Iterator[None]:
    """kvjax's GPU paths while tracing for a compile-only device (the module docstring); restored after. The device
    is also the context's abstract device: jax 0.11's Pallas Triton lowering asks it for the compute capability,
    which this process's default device (the CPU) does not have."""
    real = jax.default_backend
    if device.platform != "gpu" or real() == "gpu":
        yield
        return
    jax.default_backend = lambda: "gpu"
    abstract = jax.sharding.AbstractDevice(device_kind=device.device_kind, platform="cuda",
                                           num_cores=getattr(device, "core_count", None))
    try:
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=abstract)):
            yield
    finally:
        jax.default_backend = real


def lower_decode(config: Any, method: Any, tune: tuning.Tuning, device: Any, context: int, batch: int, new: int,
                 dtype: Any, kv_dtype: str | None = None) -> Any:
    """The decode loop `gen.decode` runs after a `context`-token prefill, lowered for `device` from abstract weights
    and cache (nothing is allocated)."""
    on = jax.sharding.SingleDeviceSharding(device)

    def place(tree: Any) -> Any:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=on), tree)

    with tuning.use(tune), traced_for_gpu(device):
        bucket = gen.bucket_length(context)
        quant = gen.resolve_kv_dtype(kv_dtype, config.head_dim)
        capacity = gen.cache_capacity(method, bucket, new, quantized=quant is not None)
        cache = place(jax.eval_shape(lambda: gen.init_cache(method, config, batch, capacity, dtype, quant)))
        weights = place(compile_8b.abstract_weights(config, dtype))
        return compile_8b.lower_decode_loop(config, gen.decode_program_key(method), tune, weights, cache, batch, new,
                                            sharding=on)


def compile_decode(config: Any, method: Any, tune: tuning.Tuning, device: Any, context: int, batch: int, new: int,
                   dtype: Any, kv_dtype: str | None = None) -> Any:
    """`lower_decode`'s program compiled."""
    return lower_decode(config, method, tune, device, context, batch, new, dtype, kv_dtype).compile()


def memory(compiled: Any) -> dict[str, float]:
    """XLA's buffer assignment of a compiled program, GB: its arguments (weights, cache, logits), outputs (the cache
    aliases its argument: donated), temporaries, and the peak they add up to on the device."""
    m = compiled.memory_analysis()
    sizes = {k: getattr(m, f"{k}_size_in_bytes") for k in ("argument", "output", "alias", "temp")}
    sizes["peak"] = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
    return {f"{k}_gb": round(v / 1e9, 3) for k, v in sizes.items()}


def largest_batch(config: Any, method: Any, tune: tuning.Tuning, device: Any, context: int, new: int, dtype: Any,
                  kv_dtype: str | None, limit: float, cap: int = 4096) -> dict[str, Any]:
    """The largest batch whose compiled decode loop peaks within `limit` bytes (`memory`'s peak: weights, cache,
    logits and XLA's temporaries), and the peaks at it and one more. The peak is affine in the batch: predicted
    from batches 1 and 2, then the prediction is compiled and moved until it fits and one more does not."""
    def peak(b: int) -> float:
        return memory(compile_decode(config, method, tune, device, context, b, new, dtype, kv_dtype))["peak_gb"] * 1e9

    one, two = peak(1), peak(2)
    if one > limit:
        return dict(largest_batch=0, peak_gb_at_1=round(one / 1e9, 3))
    batch = int(min(cap, max(1, 1 + (limit - one) // max(two - one, 1.0))))
    at = peak(batch)
    while at > limit and batch > 1:
        batch -= 1
        at = peak(batch)
    above = peak(batch + 1) if batch < cap else None
    while above is not None and above <= limit and batch < cap:
        batch, at = batch + 1, above
        above = peak(batch + 1) if batch < cap else None
    return dict(largest_batch=batch, peak_gb=round(at / 1e9, 3),
                peak_gb_one_more=None if above is None else round(above / 1e9, 3))


def stats(config: Any, method: Any, tune: tuning.Tuning, device: Any, context: int, batch: int, new: int,
          dtype: Any, kv_dtype: str | None = None, per_layer: bool = True) -> dict[str, Any]:
    """Launches per step of the whole model, per layer (against the model cut to one layer, a second compile:
    `per_layer=False` skips it), strays, sources."""
    start = time.perf_counter()
    lowered = lower_decode(config, method, tune, device, context, batch, new, dtype, kv_dtype)
    compiled, thunks = hlo_count.compile_with_thunks(lowered)
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    step = hlo_count.launches(text)
    out: dict[str, Any] = dict(launches_per_step=step, compile_s=round(seconds, 2), memory=memory(compiled),
                               thunks=thunks, graphs=hlo_count.graphs(text),
                               strays=hlo_count.strays(text), by_source=[list(r) for r in hlo_count.by_source(text)])
    layers = config.num_layers
    if layers > 1 and per_layer:
        # the model cut to its first layer (a model mixing sliding-window and global layers: per layer is their mean)
        first = dataclasses.replace(config, num_layers=1,
                                    layer_types=config.layer_types[:1] if config.layer_types else None)
        one = hlo_count.launches(compile_decode(first, method, tune, device, context, batch, new, dtype,
                                                kv_dtype).as_text())
        out["per_layer"] = round((step["total"] - one["total"]) / (layers - 1), 2)
        out["outside_layers"] = round(one["total"] - out["per_layer"], 2)
        out["per_layer_by_kind"] = {k: round((step.get(k, 0) - one.get(k, 0)) / (layers - 1), 2)
                                    for k in sorted(set(step) | set(one)) if k != "total"
                                    and step.get(k, 0) != one.get(k, 0)}
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", "--quick", dest="smoke", action="store_true", help="The tiny model (2 layers), seconds.")
    p.add_argument("--target", default="h200", choices=[*TARGETS, "attached"])
    p.add_argument("--model", default=None, help="A preset or tiny / small (default llama-3.1-8b; tiny with --smoke).")
    p.add_argument("--methods", default="full,snapkv")
    p.add_argument("--context", type=int, default=None, help="Prompt tokens (default 32768; 64 with --smoke).")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--budget", type=int, default=None, help="Compressing methods' budget (1024; 16 with --smoke).")
    p.add_argument("--new_tokens", type=int, default=16)
    p.add_argument("--kv_dtypes", default="model", help="Cache storage: model (the weights' dtype), int8, kivi2, ...")
    p.add_argument("--largest_batch", action="store_true", help="Also the largest batch whose compiled step peaks "
                   "within --memory_fraction of the target's memory (a few more compiles per row).")
    p.add_argument("--memory_fraction", type=float, default=0.9)
    p.add_argument("--no_per_layer", dest="per_layer", action="store_false", help="Skip the second compile (the model "
                   "cut to one layer) that the per-layer counts come from: the whole step's counts only.")
    p.add_argument("--tunings", default="", help="`;`-separated variants of kvjax.tuning fields over the GPU "
                   "defaults (throughput.py's --tuning form; an empty variant is the defaults).")
    args = p.parse_args(argv)
    args.model = args.model or ("tiny" if args.smoke else "llama-3.1-8b")
    args.dtype = "bfloat16"
    args.context = args.context or (64 if args.smoke else 32768)
    args.budget = args.budget or (16 if args.smoke else 1024)
    args.quick = args.smoke
    for name in bu.csv_strs(args.methods):  # an unknown method or tuning field fails here, before any compile
        try:
            kvm.get(name, **bu.method_args(name, args.budget, args.context))
        except (ValueError, KeyError) as e:
            p.error(f"--methods: {e}")
    known = {f.name for f in dataclasses.fields(tuning.Tuning)}
    for variant in args.tunings.split(";"):
        unknown = sorted(set(throughput.parse_tuning(variant)) - known)
        if unknown:
            p.error(f"--tunings: unknown kvjax.tuning field(s) {', '.join(unknown)}")
    return args


def run(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    variants = [throughput.parse_tuning(v) for v in args.tunings.split(";")]
    base = tuning.default("gpu")
    tunes = [dataclasses.replace(base, **v) for v in variants]  # a bad field fails before anything compiles
    device = gpu_device(args.target)
    config = bu.model_config(args.model)
    rows, result = [], {}
    for text, tune in zip(args.tunings.split(";"), tunes, strict=True):
        for name in bu.csv_strs(args.methods):
            for kv_dtype in bu.csv_strs(args.kv_dtypes):
                method = kvm.get(name, **bu.method_args(name, args.budget, args.context))
                row = dict(method=name, tuning=text, kv_dtype=kv_dtype, context=args.context, batch=args.batch,
                           target=args.target, device_kind=device.device_kind, layers=config.num_layers,
                           **stats(config, method, tune, device, args.context, args.batch, args.new_tokens,
                                   jnp.bfloat16, None if kv_dtype == "model" else kv_dtype, args.per_layer))
                if args.largest_batch:
                    limit = args.memory_fraction * device_memory(args.target, device)
                    row.update(memory_limit_gb=round(limit / 1e9, 3), **largest_batch(
                        config, method, tune, device, args.context, args.new_tokens, jnp.bfloat16,
                        None if kv_dtype == "model" else kv_dtype, limit))
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("method", "tuning", "kv_dtype", "per_layer", "compile_s",
                                                      "largest_batch", "peak_gb", "thunks") if k in row}
                                 | {"per_step": row["launches_per_step"]["total"],
                                    "peak_gb_at_batch": row["memory"]["peak_gb"]}), flush=True)
                result = bu.write(args.out, "gpu_compile", args, config, args.dtype, rows,
                                  jax_version=jax.__version__, target=args.target)
    return result


def main(argv: list[str]) -> None:
    run(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
