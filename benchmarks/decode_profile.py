"""Where a batch-1 decode step's time goes: kernels per step and per layer (from the compiled HLO, any backend),
stray copies / transposes / pads, command-buffer (CUDA graph) regions, and on an accelerator a profile.

    python benchmarks/decode_profile.py --out=/tmp/decode_profile.json            # 8B shape, 32K, full, snapkv
    python benchmarks/decode_profile.py --hlo_only --out=...                      # no profiler: HLO + timing
    python benchmarks/decode_profile.py --smoke --hlo_only --out=/tmp/dp.json     # CPU, the tiny shape, seconds

The decode loop of each `--methods` runs on a cache as a `--context`-token prefill leaves it (`throughput.py`'s
synthetic state). From the compiled loop (`jax.jit(...).lower(...).compile().as_text()`, `hlo_count.py`):

* `launches_per_step`: what one token's step launches (fusions by name, custom calls by target, copies, ...);
  `per_layer` / `outside_layers` from a second compile of the same model cut to one layer (the difference is
  one layer's launches; the rest is the embedding, final norm, logits and sampler);
* `strays`: the copies, transposes and pads among them, with the kvjax source line each comes from;
  `by_source`: every launch's kind and source line, most frequent first;
* `graphs`: XLA:GPU command-buffer regions (what they capture, what stays outside: a `while` outside means a
  host round trip per token; a Pallas custom call outside splits a region).

Unless `--hlo_only`, the loop then runs under `jax.profiler` and the trace's device plane gives the kernels of
each step (count, summed duration, the largest by total time) against the step's wall time. Under the profiler
XLA runs op by op unless `--xla_enable_command_buffers_during_profiling=true` is in XLA_FLAGS (the device
script's `graphs_profile` stage sets it; the row records XLA_FLAGS). `--hlo_only` times the loop instead
(`--repeats` runs of the compiled program, no profiler).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import importlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import bench_util as bu  # noqa: E402
import hlo_count  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import throughput  # noqa: E402

from kvjax import methods as kvm  # noqa: E402
from kvjax import tuning  # noqa: E402

gen = importlib.import_module("kvjax.runtime.generate")


def lowered_loop(model, state, new: int):
    """The decode loop `gen.decode` runs, lowered (the same static arguments and operands)."""
    return gen._decode_loop.lower(
        model.config, gen.decode_program_key(state.method), new, 0.0, 1.0, tuning.current(), model.weights(),
        model.rope(), state.cache, state.logits, np.asarray(state.prompt_lengths, np.int32), state.budget,
        np.asarray([-1], np.int32), np.int32(0), np.uint32(0))


def compiled_loop(model, state, new: int):
    """The decode loop `gen.decode` runs, compiled."""
    return lowered_loop(model, state, new).compile()


def hlo_stats(model, method, context: int, new: int, shallow: bool = True) -> dict:
    """Launches per decode step (and per layer: the same model cut to one layer compiled too), strays, graphs
    (on a GPU from XLA's thunks, `hlo_count.thunk_loop`: jaxlib 0.10's XLA forms its CUDA graphs there)."""
    state = throughput.synthetic_state(model, method, 1, context, new)
    compiled, thunks = hlo_count.compile_with_thunks(lowered_loop(model, state, new))
    text = compiled.as_text()
    del state, compiled
    layers = model.config.num_layers
    per_step = hlo_count.launches(text)
    out = dict(launches_per_step=per_step, strays=hlo_count.strays(text), graphs=hlo_count.graphs(text), thunks=thunks,
               by_source=[list(r) for r in hlo_count.by_source(text)[:40]])
    if shallow and layers > 1:
        one = bu.random_model(dataclasses.replace(model.config, num_layers=1), model.dtype)
        one_state = throughput.synthetic_state(one, method, 1, context, new)
        one_step = hlo_count.launches(compiled_loop(one, one_state, new).as_text())
        del one, one_state
        per_layer = (per_step["total"] - one_step["total"]) / (layers - 1)
        kinds = set(per_step) | set(one_step)
        out.update(per_layer=per_layer, outside_layers=one_step["total"] - per_layer,
                   per_layer_by_kind={k: (per_step.get(k, 0) - one_step.get(k, 0)) / (layers - 1) for k in kinds
                                      if k != "total" and per_step.get(k, 0) != one_step.get(k, 0)})
    return out


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


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", "--quick", dest="smoke", action="store_true", help="CPU: the tiny model, seconds.")
    p.add_argument("--methods", default="full,snapkv")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--new_tokens", type=int, default=16)
    p.add_argument("--hlo_only", action="store_true", help="No profiler: the HLO counts and a timed loop.")
    p.add_argument("--repeats", type=int, default=2, help="Timed loops with --hlo_only.")
    p.add_argument("--no_shallow", action="store_true", help="Skip the one-layer compile (no per-layer split).")
    p.add_argument("--tuning", default="", help="kvjax.tuning fields in force (throughput.py's --tuning form).")
    p.add_argument("--tunings", default=None, help="A/B in one process: `;`-separated --tuning values (an empty "
                   "one is the defaults), each a row per method.")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    args.quick = args.smoke
    rows: list[dict] = []
    result: dict = {}
    for variant in (args.tunings.split(";") if args.tunings is not None else [args.tuning]):
        with tuning.override(**throughput.parse_tuning(variant)):
            result = profile(args, variant, rows)
    return result


def _timed(model, method, context: int, new: int, repeats: int,
           decode: Callable[..., Any] | None = None) -> tuple[float | None, int]:
    """(ms per step of the decode loop, compiles seen after the first call): the median of `repeats` loops that
    compiled nothing, each on a fresh cache, after a first call that compiles. A loop that compiled (run 14's second
    call recompiled the fused program) is not timed and is run again, at most `repeats` times more; None when no
    loop ran without compiling. `decode` stands in for `gen.decode` (tests)."""
    decode = decode or gen.decode
    times, compiles = [], 0
    for i in range(2 * repeats + 1):
        state = throughput.synthetic_state(model, method, 1, context, new)
        bu.block(state.cache)
        with bu.CompileLog() as log:
            start = time.perf_counter()
            bu.block(decode(model, state, max_new_tokens=new, stop_at_eos=False)[2])
            elapsed = time.perf_counter() - start
        if i:
            compiles += log.count
            if not log.count:
                times.append(elapsed)
        if len(times) == repeats:
            break
    return (bu.median(times) / (new - 1) * 1e3 if times else None), compiles


def profile(args: argparse.Namespace, variant: str, rows: list[dict]) -> dict:
    """Rows of each method under the tuning in force (`variant`, its text), appended to `rows` and written."""
    args.model = "tiny" if args.smoke else "llama-3.1-8b"
    args.dtype = "float32" if args.smoke else "bfloat16"
    context = args.context or (64 if args.smoke else 32768)
    budget = 16 if args.smoke else args.budget
    model = bu.random_model(bu.model_config(args.model), args.dtype)
    result = {}
    for name in bu.csv_strs(args.methods):
        method = kvm.get(name, **({} if name == "full" else bu.method_args(name, budget, context)))
        row = dict(method=name, context=context, tuning=variant, xla_flags=os.environ.get("XLA_FLAGS", ""),
                   layers=model.config.num_layers,
                   **hlo_stats(model, method, context, args.new_tokens, shallow=not args.no_shallow))
        steps = args.new_tokens - 1
        if args.hlo_only:
            ms, row["timed_compiles"] = _timed(model, method, context, args.new_tokens, args.repeats)
            if ms is not None:  # every timed loop compiled: no step time (decode_choices reads none)
                row["wall_ms_per_step"] = ms
        else:
            state = throughput.synthetic_state(model, method, 1, context, args.new_tokens)
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
            row.update(wall_ms_per_step=wall / steps * 1e3)
            if events:
                busy = sum(d for _, _, d in events)
                span = max(s + d for _, s, d in events) - min(s for _, s, _ in events)
                by_name: collections.Counter[str] = collections.Counter()
                for n, _, d in events:
                    by_name[re.sub(r"[._]\d+$", "", n)] += d
                row.update(kernels_per_step=len(events) / steps,
                           kernels_per_layer=len(events) / steps / model.config.num_layers,
                           kernel_ms_per_step=busy / steps / 1e6, device_span_ms_per_step=span / steps / 1e6,
                           top_kernels_ms_per_step={n: round(d / steps / 1e6, 4) for n, d in by_name.most_common(12)})
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("by_source", "strays")}), flush=True)
        result = bu.write(args.out, "decode_profile", args, model.config, args.dtype, rows)
    return result


def main(argv: list[str]) -> None:
    run(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
