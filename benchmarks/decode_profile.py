"""Where a batch-1 decode step's time goes on an accelerator: kernels per step, device-busy time, top kernels.

    python benchmarks/decode_profile.py --out=/tmp/decode_profile.json            # 8B shape, 32K, full
    python benchmarks/decode_profile.py --smoke --out=/tmp/decode_profile.json    # CPU, the tiny shape

The decode loop of `--method` runs on a cache as a `--context`-token prefill leaves it (`throughput.py`'s
synthetic state) under `jax.profiler`; the trace's device plane gives the kernels of each step (count, summed
duration, the largest by total time) against the step's wall time, so the gap between the bytes a step must
read and its time splits into kernel time and idle time between kernels (launches, host work). The compiled
loop's HLO gives the number of fusions and library calls per step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib
import json
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import bench_util as bu  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import throughput  # noqa: E402

from kvjax import methods as kvm  # noqa: E402
from kvjax import tuning  # noqa: E402

gen = importlib.import_module("kvjax.runtime.generate")


def hlo_ops(model, state, new: int) -> dict[str, int]:
    """Fusions / custom calls / other instructions in the compiled loop's body computations."""
    lowered = gen._decode_loop.lower(
        model.config, state.method, new, 0.0, 1.0, tuning.current(), model.weights(), model.rope(), state.cache,
        state.logits, np.asarray(state.prompt_lengths, np.int32), state.budget, np.asarray([-1], np.int32),
        np.int32(0), np.uint32(0))
    text = lowered.compile().as_text()
    counts: collections.Counter[str] = collections.Counter()
    bodies = set(re.findall(r"body=%([\w.-]+)", text))
    inside = False
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.-]+) ", line)
        if header:
            inside = header[2] in bodies
            continue
        if inside:
            m = re.search(r"= \S+ (fusion|custom-call|all-reduce|copy|dynamic-update-slice|scatter|gather)\(", line)
            if m:
                counts[m[1]] += 1
    return dict(counts)


def device_events(trace_dir: str) -> tuple[list[tuple[str, float, float]], dict[str, int]]:
    """(name, start_ns, duration_ns) of the kernels on the device planes' stream lines, and the event count of
    every device line (what the trace held)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return [], {}
    data = jax.profiler.ProfileData.from_file(files[0])
    lines: dict[str, list] = {}
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                lines[f"{plane.name}/{line.name}"] = [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    streams = [k for k in lines if "stream" in k.lower()]
    out = [e for k in (streams or list(lines)) for e in lines[k]]
    return out, {k: len(v) for k, v in lines.items()}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--methods", default="full,snapkv")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--new_tokens", type=int, default=16)
    p.add_argument("--tuning", default="", help="kvjax.tuning fields in force (throughput.py's --tuning form).")
    args = p.parse_args(argv)
    with tuning.override(**throughput.parse_tuning(args.tuning)):
        profile(args)


def profile(args: argparse.Namespace) -> None:
    args.quick = args.smoke
    args.model = "tiny" if args.smoke else "llama-3.1-8b"
    args.dtype = "float32" if args.smoke else "bfloat16"
    context = args.context or (64 if args.smoke else 32768)
    budget = 16 if args.smoke else args.budget
    model = bu.random_model(bu.model_config(args.model), args.dtype)
    rows = []
    for name in bu.csv_strs(args.methods):
        method = kvm.get(name, **({} if name == "full" else bu.method_args(name, budget, context)))
        state = throughput.synthetic_state(model, method, 1, context, args.new_tokens)
        row = dict(method=name, context=context, tuning=args.tuning,
                   hlo_ops_per_step=hlo_ops(model, state, args.new_tokens))
        bu.block(gen.decode(model, state, max_new_tokens=args.new_tokens, stop_at_eos=False)[2])  # compile
        state = throughput.synthetic_state(model, method, 1, context, args.new_tokens)
        bu.block(state.cache)
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                start = time.perf_counter()
                bu.block(gen.decode(model, state, max_new_tokens=args.new_tokens, stop_at_eos=False)[2])
                wall = time.perf_counter() - start
            try:
                events, row["trace_lines"] = device_events(trace_dir)
            except Exception as e:  # noqa: BLE001  (the trace format is the profiler's; recorded, not fatal)
                events, row["trace_error"] = [], f"{type(e).__name__}: {str(e)[:300]}"
        steps = args.new_tokens - 1
        row.update(wall_ms_per_step=wall / steps * 1e3)
        if events:
            busy = sum(d for _, _, d in events)
            span = max(s + d for _, s, d in events) - min(s for _, s, _ in events)
            by_name: collections.Counter[str] = collections.Counter()
            for n, _, d in events:
                by_name[re.sub(r"[._]\d+$", "", n)] += d
            row.update(kernels_per_step=len(events) / steps, kernel_ms_per_step=busy / steps / 1e6,
                       device_span_ms_per_step=span / steps / 1e6,
                       top_kernels_ms_per_step={n: round(d / steps / 1e6, 4) for n, d in by_name.most_common(12)})
        rows.append(row)
        print(json.dumps(row), flush=True)
        bu.write(args.out, "decode_profile", args, model.config, args.dtype, rows)


if __name__ == "__main__":
    main(sys.argv[1:])
