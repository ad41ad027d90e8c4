"""Sweep cost: every (method, budget) cell prefilled on its own vs one shared prefill forward per sample.

    python benchmarks/sweep.py --out=benchmarks/results/sweep.json
    python benchmarks/sweep.py --quick --out=/tmp/sweep.json

For each context length, a sweep of one-shot cells (`--methods` x `--budgets`) over `--samples` prompts
with `--new_tokens` greedy tokens each, run two ways, alternated in every repeat after one warm-up call
of each (compiles excluded): *per cell* (`kvjax.prefill` + `kvjax.decode` per cell and sample, what the
eval CLI does with `--shared_prefill=no`) and *shared* (`shared_prefill.record` once per sample, then
`prefill_from` + `decode` per cell, the CLI's default for such sweeps). Reported: wall and process CPU
seconds of the whole sweep (median over repeats), their ratio, and whether both gave the same tokens.
"""

from __future__ import annotations

import functools
import importlib
import sys
import time
from typing import Any

import bench_util as bu
import numpy as np

from kvjax import methods as kvm
from kvjax.runtime import shared_prefill

gen = importlib.import_module("kvjax.runtime.generate")

DEFAULT_METHODS = ("snapkv", "streaming_llm", "knorm", "h2o", "tova", "lagkv")


def _timed(fn: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _per_cell(model: Any, prompts: list, cells: list, new: int) -> list[np.ndarray]:
    out = []
    for ids in prompts:
        for method in cells:
            state = gen.prefill(model, ids, method=method, max_new_tokens=new)
            out.append(gen.decode(model, state, max_new_tokens=new, stop_at_eos=False)[0])
    return out


def _shared(model: Any, prompts: list, cells: list, new: int) -> list[np.ndarray]:
    out = []
    for ids in prompts:
        rec = shared_prefill.record(model, ids)
        for method in cells:
            state = shared_prefill.prefill_from(model, rec, method, max_new_tokens=new)
            out.append(gen.decode(model, state, max_new_tokens=new, stop_at_eos=False)[0])
    return out


def run(argv: list[str]) -> dict:
    p = bu.parser(__doc__.splitlines()[0])
    p.add_argument("--contexts", default=None, help="Comma list of prompt lengths (default 2048,8192).")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--budgets", default=None, help="Comma list of budgets (default 256,1024).")
    p.add_argument("--samples", type=int, default=None, help="Prompts per sweep (default 2).")
    p.add_argument("--new_tokens", type=int, default=None, help="Greedy tokens per cell and sample (default 32).")
    args = p.parse_args(argv)
    model_name, dtype, repeats = bu.resolve_common(args)
    contexts = bu.csv_ints(args.contexts or ("256" if args.quick else "2048,8192"))
    budgets = bu.csv_ints(args.budgets or ("64" if args.quick else "256,1024"))
    samples = args.samples or (1 if args.quick else 2)
    new = args.new_tokens or (4 if args.quick else 32)
    config = bu.model_config(model_name)
    model = bu.random_model(config, dtype)
    rng = np.random.default_rng(0)
    rows = []
    for context in contexts:
        cells = [
            kvm.get(name, **bu.method_args(name, budget, context))
            for name in bu.csv_strs(args.methods) for budget in budgets if budget < context
        ]
        assert all(shared_prefill.shares_prefill(m) for m in cells)
        prompts = [rng.integers(0, config.vocab_size, size=(1, context)).astype(np.int32) for _ in range(samples)]

        per_cell = functools.partial(_per_cell, model, prompts, cells, new)
        shared = functools.partial(_shared, model, prompts, cells, new)
        first = {"per_cell": _timed(per_cell)[1:], "shared": _timed(shared)[1:]}  # compiles included
        times: dict[str, list[tuple[float, float]]] = {"per_cell": [], "shared": []}
        tokens: dict[str, list[np.ndarray]] = {}
        for _ in range(repeats):
            for name, fn in (("per_cell", per_cell), ("shared", shared)):
                tokens[name], wall, cpu = _timed(fn)
                times[name].append((wall, cpu))
        same = sum(np.array_equal(a, b) for a, b in zip(tokens["per_cell"], tokens["shared"], strict=True))
        med = {k: (bu.median([w for w, _ in v]), bu.median([c for _, c in v])) for k, v in times.items()}
        row = {
            "context": context, "cells": len(cells), "samples": samples, "new_tokens": new,
            "per_cell_wall_s": med["per_cell"][0], "shared_wall_s": med["shared"][0],
            "per_cell_cpu_s": med["per_cell"][1], "shared_cpu_s": med["shared"][1],
            "wall_ratio": med["shared"][0] / med["per_cell"][0], "cpu_ratio": med["shared"][1] / med["per_cell"][1],
            "first_per_cell_wall_s": first["per_cell"][0], "first_shared_wall_s": first["shared"][0],
            "same_tokens": f"{same}/{len(tokens['shared'])}",
        }
        rows.append(row)
        print(
            f"{context:6d} tokens, {len(cells)} cells x {samples} samples: per cell {row['per_cell_wall_s']:.2f} s "
            f"wall / {row['per_cell_cpu_s']:.2f} s CPU, shared {row['shared_wall_s']:.2f} s / "
            f"{row['shared_cpu_s']:.2f} s -> {row['wall_ratio']:.2f}x wall, {row['cpu_ratio']:.2f}x CPU; "
            f"same tokens {row['same_tokens']}",
            flush=True,
        )
    return bu.write(args.out, "sweep", args, config, dtype, rows, methods=bu.csv_strs(args.methods), budgets=budgets)


if __name__ == "__main__":
    run(sys.argv[1:])
