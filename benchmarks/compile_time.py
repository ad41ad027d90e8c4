"""Compile time and number of compiled programs of a length-bucketed evaluation.

    python benchmarks/compile_time.py --out=benchmarks/results/compile_time.json
    python benchmarks/compile_time.py --quick --out=/tmp/compile_time.json

An evaluation pass generates for prompts of `--num_prompts` different lengths, one at a time (as
`python -m kvjax.eval` does with `--batch_size=1`). `bucketed` is the runtime as shipped (prompts
right-padded to a power-of-two bucket, `kvjax.runtime.bucket_length`); `exact` pads to the exact
length instead (one program per length, what a runtime without buckets compiles). Counted per
method: traces of the prefill and decode-loop bodies (`kvjax.runtime.TRACE_COUNTS`), XLA
compilations and their seconds (`jax.monitoring` compile events), and the wall time of the pass.
Every figure is also given as a ratio against `full` bucketed in the same run. The persistent compilation
cache is off here (first-call cost with a cold / warm cache: `vs_kvpress.py`).
"""

from __future__ import annotations

import collections
import importlib
import sys
import time
from typing import Any
from unittest import mock

import bench_util as bu
import jax
import numpy as np
from jax import monitoring

from kvjax import methods as kvm
from kvjax.runtime.compile_cache import enable_compilation_cache

gen = importlib.import_module("kvjax.runtime.generate")
stages = importlib.import_module("kvjax.runtime.stages")

_EVENTS: collections.Counter[str] = collections.Counter()
_COUNTS: collections.Counter[str] = collections.Counter()
_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def _listen(event: str, duration: float, **_: Any) -> None:
    _EVENTS[event] += duration
    _COUNTS[event] += 1


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        monitoring.register_event_duration_secs_listener(_listen)
        _registered = True


def _exact(n: int, minimum: int = 16, multiple: int = 1) -> int:
    """No buckets: the prompt's own length (rounded up to the chunk multiple)."""
    return -(-max(n, 1) // multiple) * multiple


def _pass(model: Any, method: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    jax.clear_caches()  # every pass compiles from scratch
    traces = dict(gen.TRACE_COUNTS)
    events, counts = dict(_EVENTS), dict(_COUNTS)
    start = time.perf_counter()
    for p in prompts:
        gen.generate(model, [p], method=method, max_new_tokens=new, stop_at_eos=False)
    wall = time.perf_counter() - start

    def delta(now: dict, before: dict, key: str) -> float:
        return now.get(key, 0) - before.get(key, 0)

    prefill = delta(gen.TRACE_COUNTS, traces, "prefill")
    decode = delta(gen.TRACE_COUNTS, traces, "decode_step")
    return dict(prefill_programs=int(prefill), decode_programs=int(decode), programs=int(prefill + decode),
                xla_compilations=int(delta(_COUNTS, counts, _COMPILE)), compile_s=delta(_EVENTS, events, _COMPILE),
                trace_lower_s=delta(_EVENTS, events, _TRACE) + delta(_EVENTS, events, _LOWER), wall_s=wall)


def run(argv: list[str] | None = None) -> dict:
    enable_compilation_cache(None)  # this measures compiling: no programs loaded from an earlier run's disk cache
    p = bu.parser(__doc__.splitlines()[0])
    p.add_argument("--num_prompts", type=int, default=None, help="Prompts of distinct lengths (default 20; quick 4).")
    p.add_argument("--min_len", type=int, default=None, help="Shortest prompt (default 40; quick 5).")
    p.add_argument("--max_len", type=int, default=None, help="Longest prompt (default 1000; quick 40).")
    p.add_argument("--budget", type=int, default=None, help="snapkv budget (default 32; quick 8).")
    p.add_argument("--methods", default=None, help="Methods besides full (default snapkv).")
    args = p.parse_args(argv)
    _register()
    model_name, dtype, _ = bu.resolve_common(args)
    n = args.num_prompts or (4 if args.quick else 20)
    lo, hi = args.min_len or (5 if args.quick else 40), args.max_len or (40 if args.quick else 1000)
    budget = args.budget or (8 if args.quick else 32)
    names = bu.csv_strs(args.methods) if args.methods else ["snapkv"]
    config = bu.model_config(model_name)
    model = bu.random_model(config, dtype)
    rng = np.random.default_rng(0)
    lengths = sorted(rng.choice(np.arange(lo, hi + 1), size=n, replace=False).tolist())
    order = rng.permutation(n)  # an eval meets lengths in no particular order
    prompts = [rng.integers(0, config.vocab_size, lengths[i]).tolist() for i in order]
    new = 4 if args.quick else 8
    rows = []
    baseline = None
    for variant in ("bucketed", "exact"):
        for name in ["full", *names]:
            method = kvm.get(name, **bu.method_args(name, budget, hi))
            if variant == "bucketed":
                row = _pass(model, method, prompts, new)
            else:
                with mock.patch.object(stages, "bucket_length", _exact):  # where the plan buckets
                    row = _pass(model, method, prompts, new)
            row.update(method=name, variant=variant, num_prompts=n, distinct_lengths=len(set(lengths)),
                       buckets=sorted({gen.bucket_length(x) for x in lengths}) if variant == "bucketed" else None)
            if baseline is None:
                baseline = row
            row["programs_vs_full_bucketed"] = row["programs"] / baseline["programs"]
            row["compile_s_vs_full_bucketed"] = row["compile_s"] / baseline["compile_s"]
            row["wall_s_vs_full_bucketed"] = row["wall_s"] / baseline["wall_s"]
            rows.append(row)
            print(f"{variant:8s} {name:8s} programs {row['programs']:3d} (prefill {row['prefill_programs']}, decode "
                  f"{row['decode_programs']})  XLA compiles {row['xla_compilations']:3d}  compile "
                  f"{row['compile_s']:6.2f} s  wall {row['wall_s']:6.2f} s", flush=True)
    return bu.write(args.out, "compile_time", args, config, dtype, rows, lengths=lengths)


if __name__ == "__main__":
    run(sys.argv[1:])
