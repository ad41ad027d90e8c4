"""Per-layer cache sizes rounded up onto a few (`Tuning.layer_slack`) against every layer at its own size.

    python benchmarks/layer_sizes.py --out=benchmarks/results/layer_sizes_smollm2.json
    python benchmarks/layer_sizes.py --quick --out=/tmp/layer_sizes.json

The model's shape is SmolLM2-135M's (30 layers; `--quick`: the tiny shape with 6 layers) unless `--model` names another.

A method with per-layer capacities (`Method.layer_capacities`: LU-KV, `per_layer`) compiles one prefill program per
distinct layer size. Each row is one cold generation (JAX's caches cleared, the persistent compilation cache off) of
`--batch` random prompts of up to `--context` tokens on the model's shape with random weights, at one
`layer_slack`: distinct sizes, prefill programs traced, XLA compilations and their seconds, wall seconds, the slots
per KV head and example summed over the layers, and the slots, compile seconds and tokens against the first value's
run (`--layer_slack`'s default starts at 0: every layer at its own size). LU-KV reads a seeded budget curve whose
heads keep 0.3x-1.7x the mean share (so the layers differ); `per_layer` takes ratios spread evenly over 0.1-0.9
across the layers, over SnapKV. The first row is SnapKV at ratio 0.5 (every layer one size) in the same process: the
compile floor the others are measured against (`compile_s_vs_snapkv`).
"""

from __future__ import annotations

import sys
import tempfile
import time

import bench_util as bu
import compile_time
import jax
import numpy as np

import kvjax
from kvjax import methods as kvm
from kvjax import tuning
from kvjax.methods.lukv import seeded_curve, write_budget_curve
from kvjax.runtime.compile_cache import enable_compilation_cache
from kvjax.runtime.forward import TRACE_COUNTS


def _methods(config, folder: str) -> dict:
    curve = write_budget_curve(f"{folder}/curve.npy", seeded_curve(config.method_layers, config.num_kv_heads))
    ratios = np.linspace(0.1, 0.9, config.method_layers).round(4).tolist()
    return {"snapkv": kvm.get("snapkv", compression_ratio=0.5),
            "lukv": kvm.get("lukv", compression_ratio=0.5, curve=str(curve)),
            "per_layer": kvm.get("per_layer", compression_ratios=ratios, base="snapkv")}


def _pass(model, method, prompts: list[list[int]], new: int, slack: float) -> tuple[dict, np.ndarray]:
    jax.clear_caches()
    traces, events, counts = dict(TRACE_COUNTS), dict(compile_time._EVENTS), dict(compile_time._COUNTS)
    start = time.perf_counter()
    with tuning.override(layer_slack=slack):
        out = kvjax.generate(model, prompts, method=method, max_new_tokens=new, stop_at_eos=False, return_cache=True)
        tokens = np.asarray(out.tokens)
    wall = time.perf_counter() - start
    sizes = [layer.capacity for layer in out.cache.layers]
    row = dict(layer_slack=slack, distinct_sizes=len(set(sizes)), sizes=sizes, slots=sum(sizes),
               prefill_programs=TRACE_COUNTS["prefill"] - traces.get("prefill", 0),
               xla_compilations=compile_time._COUNTS[compile_time._COMPILE] - counts.get(compile_time._COMPILE, 0),
               compile_s=compile_time._EVENTS[compile_time._COMPILE] - events.get(compile_time._COMPILE, 0.0),
               wall_s=wall)
    return row, tokens


def run(argv: list[str] | None = None) -> dict:
    enable_compilation_cache(None)  # this measures compiling: nothing read back from an earlier run's disk cache
    p = bu.parser(__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=None, help="Longest prompt (default 1000; quick 100).")
    p.add_argument("--batch", type=int, default=2, help="Prompts per generation.")
    p.add_argument("--layer_slack", default="0,0.02,0.05,0.1,0.2", help="Values of Tuning.layer_slack (0: every size).")
    p.add_argument("--methods", default="lukv,per_layer", help="Methods with per-layer capacities.")
    args = p.parse_args(argv)
    compile_time._register()
    args.model = args.model or (None if args.quick else "smollm2-135m")
    model_name, dtype, _ = bu.resolve_common(args)
    context = args.context or (100 if args.quick else 1000)
    config = bu.tiny_config(num_layers=6) if model_name == "tiny" else bu.model_config(model_name)
    model = bu.random_model(config, dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, int(n)).tolist()
               for n in rng.integers(context // 2, context + 1, args.batch)]
    values = [float(v) for v in args.layer_slack.split(",")]
    new = 4 if args.quick else 8
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        found = _methods(config, folder)
        floor, _ = _pass(model, found["snapkv"], prompts, new, 0.0)
        floor.update(method="snapkv", compile_s_vs_snapkv=1.0)
        rows.append(floor)
        print(f"snapkv    one size: XLA compiles {floor['xla_compilations']:3d}  compile {floor['compile_s']:6.1f} s  "
              f"wall {floor['wall_s']:6.1f} s", flush=True)
        for name in bu.csv_strs(args.methods):
            reference = None
            for value in values:
                row, tokens = _pass(model, found[name], prompts, new, value)
                if reference is None:
                    reference = (row, tokens)
                row.update(method=name, slots_vs_first=row["slots"] / reference[0]["slots"],
                           compile_s_vs_first=row["compile_s"] / reference[0]["compile_s"],
                           compile_s_vs_snapkv=row["compile_s"] / floor["compile_s"],
                           same_tokens_as_first=bool(np.array_equal(tokens, reference[1])))
                rows.append(row)
                print(f"{name:9s} layer_slack={value:<5g} sizes {row['distinct_sizes']:3d}  prefill programs "
                      f"{row['prefill_programs']:3d}  XLA compiles {row['xla_compilations']:3d}  compile "
                      f"{row['compile_s']:6.1f} s  wall {row['wall_s']:6.1f} s  slots x{row['slots_vs_first']:.3f}  "
                      f"same tokens {row['same_tokens_as_first']}", flush=True)
    return bu.write(args.out, "layer_sizes", args, config, dtype, rows, context=context, batch=args.batch,
                    max_new_tokens=new)


if __name__ == "__main__":
    run(sys.argv[1:])
