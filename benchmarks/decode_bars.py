"""Issue 57's closing figures, read from one device command's results: each figure, its bar, what every variant
measured, and whether the best one meets it (else the fraction reached).

    python benchmarks/decode_bars.py OUT                 # OUT: the device command's folder (device_gpu.sh's $OUT)
    python benchmarks/decode_bars.py OUT --smoke         # the SMOKE=1 shapes (checks the plumbing; bars moot)

It reads what the stages wrote, each optional (a figure whose file or row is missing says so):
* `bars.json` (throughput.py, the stage `bars`): 1 x 32K `full` / SnapKV / StreamingLLM at budget 1024, 16 x 8K
  and 1 x 128K `full`, a timed 32K prefill, under today's defaults and with every kernel, row by row;
* `bars_old.json` (main before issue 57, the stage `bars_old`): the "today" that prefill is held to;
* `quant_cache.json` (`quant57`): bf16 against int8 at 1 x 32K, and the largest batch of each storage at 32K;
* `quant_blocks.json` (`quant_blocks`): bf16 against int8 at 1 x 32K under each block size tried;
* `graphs_today.json` (decode_profile.py --hlo_only): launches per decode step of the compiled loop;
* `graphs_profile.json` (decode_profile.py under the profiler, graphs on): kernels the GPU ran per step, and where
  the step's time goes (the kernels, the gaps between them, the rest; the largest kernels), printed under the table.

Under the table: the card each file's `machine` names (the bars are an H200's), repeats that disagree, slow second
calls. Writes `bars.md` into OUT and prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any

OLD = "before issue 57"


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The bars' shapes: 1 x `short` and 1 x `long` tokens, `multi_batch` x `multi_context`, and the budget."""

    short: int = 32768
    long: int = 129024
    multi_batch: int = 16
    multi_context: int = 8192
    budget: int = 1024


SMOKE_SHAPES = Shapes(short=64, long=128, multi_batch=4, multi_context=64, budget=16)


def load(out: str, name: str) -> list[dict[str, Any]]:
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in json.load(f).get("rows", []) if "error" not in r and "skipped" not in r]


def model_layers(out: str, name: str) -> int:
    """The layer count of the model a result file measured (0 without the file)."""
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return int(json.load(f).get("model", {}).get("num_layers", 0))


def size(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else f"{tokens:,}"


KERNEL_NAMES = {"decode_append_attention": "fused decode", "rms_norm": "norm", "linear": "products",
                "decode_attention": "dense attention", "block_sparse_decode_attention": "block-sparse attention"}


def kernel_ops(tuning: str) -> list[str] | None:
    """The `auto_pallas` ops a variant's tuning text lists, in order, the block-sparse kernel aside (the retrieval
    family's, measured before issue 57); None when the text sets no `auto_pallas`."""
    for field in tuning.split(","):
        name, _, value = field.partition("=")
        if name.strip() == "auto_pallas":
            return [op for op in value.split("+") if op and op != "block_sparse_decode_attention"]
    return None


def label(tuning: str) -> str:
    """A variant's short name: `defaults`, or its kernels (`auto_pallas`) and other tuning fields."""
    if not tuning:
        return "defaults"
    ops = kernel_ops(tuning)
    parts = [] if ops is None else [" + ".join(KERNEL_NAMES.get(op, op) for op in ops) or "XLA path"]
    return ", ".join(parts + [f.strip() for f in tuning.split(",") if f.partition("=")[0].strip() != "auto_pallas"])


def number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def pick(rows: list[dict[str, Any]], method: str, batch: int | None, context: int,
         budget: int | None = None) -> dict[str, dict[str, Any]]:
    """tuning label -> the row of `method` at `batch` x `context` (batch None: the largest batch that fit)."""
    out = {}
    for r in rows:
        if (r["method"] == method and r["context"] == context and r.get("budget") == budget
                and r.get("kv_dtype", "model") == "model"
                and (r.get("auto_batch") if batch is None else (not r.get("auto_batch") and r["batch"] == batch))):
            out[label(r.get("tuning", ""))] = r
    return out


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str
    bar: str
    values: dict[str, float]  # variant -> measured
    met: Callable[[float], bool]
    unit: str
    fraction: Callable[[float], float] | None = None  # measured / bar, for a figure not met
    notes: dict[str, str] = dataclasses.field(default_factory=dict)  # variant -> e.g. its share of read bandwidth

    def row(self) -> str:
        if not self.values:
            return f"| {self.name} | {self.bar} | not measured | - |"
        cells = ", ".join(f"{k}: {number(v)}{self.unit}" + (f" ({self.notes[k]})" if k in self.notes else "")
                          for k, v in self.values.items())
        best_key = max(self.values, key=lambda k: (self.met(self.values[k]), self.score(self.values[k])))
        best = self.values[best_key]
        if self.met(best):
            verdict = f"**met** ({best_key})"
        elif self.fraction:
            verdict = f"not met: {self.fraction(best):.0%} of the bar ({best_key})"
        else:
            verdict = f"not met ({best_key})"
        return f"| {self.name} | {self.bar} | {cells} | {verdict} |"

    def score(self, value: float) -> float:
        return self.fraction(value) if self.fraction else 0.0


def figures(out: str, shapes: Shapes) -> list[Figure]:
    bars, old = load(out, "bars.json"), load(out, "bars_old.json")
    quant = load(out, "quant_cache.json")
    graphs, profile = load(out, "graphs_today.json"), load(out, "graphs_profile.json")
    s, b = shapes, shapes.budget

    def tok_s(method: str, bar: float, budget: int | None, batch: int, context: int, name: str) -> Figure:
        rows = pick(bars, method, batch, context, budget)
        return Figure(name, f">= {bar:g} tok/s", {v: r["tokens_per_s"] for v, r in rows.items()},
                      lambda x: x >= bar, " tok/s", lambda x: x / bar, read_share(rows))

    out_figures = [
        tok_s("full", 130, None, 1, s.short, f"1 x {size(s.short)} `full`"),
        tok_s("snapkv", 160, b, 1, s.short, f"1 x {size(s.short)} SnapKV {b}"),
        tok_s("streaming_llm", 160, b, 1, s.short, f"1 x {size(s.short)} StreamingLLM {b}"),
        tok_s("full", 70, None, 1, s.long, f"1 x {size(s.long)} `full`"),
    ]
    multi = pick(bars, "full", s.multi_batch, s.multi_context)
    out_figures.append(Figure(f"{s.multi_batch} x {size(s.multi_context)} `full`",
                              ">= 3.4 TB/s", {v: r["tb_per_s"] for v, r in multi.items()},
                              lambda x: x >= 3.4, " TB/s", lambda x: x / 3.4, read_share(multi)))
    out_figures.append(launches_figure(graphs, profile, s.short))
    out_figures.append(prefill_figure(bars, old, s.short))
    out_figures.extend(quant_figures(quant, s.short, load(out, "quant_blocks.json")))
    return out_figures


def read_share(rows: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each variant's bytes per step over its step time, as a share of the read bandwidth throughput.py measured."""
    return {v: f"{r['fraction_of_read_bandwidth']:.0%} of read BW" for v, r in rows.items()
            if r.get("fraction_of_read_bandwidth")}


def launches_figure(graphs: list[dict[str, Any]], profile: list[dict[str, Any]], context: int) -> Figure:
    """Kernels per layer per decode step: the compiled loop's launches (`graphs_today`) and what the profiler saw."""
    values = {}
    for r in graphs:
        if r["method"] == "full":
            values[f"{label(r['tuning'])}, compiled"] = r["launches_per_step"]["total"] / r["layers"]
            if "per_layer" in r:  # a decoder layer's own launches, without the step's embedding, head and sampler
                values[f"{label(r['tuning'])}, compiled, in each layer"] = r["per_layer"]
    for r in profile:
        if r["method"] == "full" and "kernels_per_layer" in r:
            values[f"{label(r['tuning'])}, profiled"] = r["kernels_per_layer"]
            if "per_layer" in r:
                values.setdefault(f"{label(r['tuning'])}, compiled, in each layer", r["per_layer"])
    return Figure(f"kernels per layer, `full` 1 x {size(context)}", "<= 12", values, lambda x: x <= 12, "",
                  lambda x: 12 / x)


def prefill_figure(bars: list[dict[str, Any]], old: list[dict[str, Any]], context: int) -> Figure:
    """Each variant's 32K prefill as a ratio to the code before issue 57 (else to today's defaults)."""
    rows = {v: r for v, r in pick(bars, "full", 1, context).items() if "prefill_s" in r}
    then = next((r["prefill_s"] for r in old if r["method"] == "full" and r["context"] == context
                 and r.get("batch") == 1 and "prefill_s" in r), None)
    ref, ref_name = (then, OLD) if then else (rows.get("defaults", {}).get("prefill_s"), "defaults")
    values = {v: r["prefill_s"] / ref for v, r in rows.items()} if ref else {}
    bar = f"0.9-1.1x of {ref_name} ({ref:.3g} s)" if ref else "within 10% of before issue 57"
    return Figure(f"prefill 1 x {size(context)} `full`", bar, values, lambda x: 0.9 <= x <= 1.1, "x",
                  lambda x: min(x, 1 / x))


def quant_figures(quant: list[dict[str, Any]], context: int, blocks: list[dict[str, Any]] = ()) -> list[Figure]:
    """int8 against bf16 at 1 x `context` under each tuning of `quant57` and `quant_blocks` (pairs of one file and
    tuning only), and KIVI-2's largest batch against bf16's."""
    def by_storage(rows: Any, auto: bool, tune: str | None = None) -> dict[str, dict[str, Any]]:
        return {r["kv_dtype"]: r for r in rows if r["method"] == "full" and r["context"] == context
                and bool(r.get("auto_batch")) == auto and (auto or (r["batch"] == 1 and "step_ms" in r))
                and (tune is None or r.get("tuning", "") == tune)}

    speed = {}
    for source, rows in (("", quant), (" (quant_blocks)", blocks)):
        for tune in dict.fromkeys(r.get("tuning", "") for r in rows):
            one = by_storage(rows, False, tune)
            if "model" in one and "int8" in one:
                speed[f"int8 over bf16, {label(tune)}{source}"] = one["model"]["step_ms"] / one["int8"]["step_ms"]
    most = by_storage(quant, True)
    batch = ({"kivi2 over bf16": most["kivi2"]["batch"] / most["model"]["batch"]}
             if "model" in most and "kivi2" in most else {})
    return [Figure(f"int8 cache, `full` 1 x {size(context)} step speed-up", "> 1x", speed, lambda x: x > 1, "x",
                   lambda x: x),
            Figure(f"KIVI-2's largest batch at {size(context)}", ">= 3x bf16's", batch, lambda x: x >= 3, "x",
                   lambda x: x / 3)]


def where_time_goes(profile: list[dict[str, Any]]) -> list[str]:
    """From the graphs-on profile: each row's step time split into the kernels' own time, the device's idle gaps
    between them and what lies outside the device's span, and its largest kernels."""
    lines = []
    for r in profile:
        if "kernel_ms_per_step" not in r:
            continue
        wall, span, busy = r["wall_ms_per_step"], r["device_span_ms_per_step"], r["kernel_ms_per_step"]
        top = ", ".join(f"{name} {ms:.3f}" for name, ms in list(r.get("top_kernels_ms_per_step", {}).items())[:6])
        lines.append(f"* {r['method']}, {label(r.get('tuning', ''))}: {wall:.2f} ms a step under the profiler; kernels "
                     f"{busy:.2f} ms ({r['kernels_per_step']:.0f} of them), gaps between them {span - busy:.2f} ms, "
                     f"outside the device's span {wall - span:.2f} ms. Largest (ms a step): {top}")
    return lines


#: Repeats of one row further apart than this (slowest over fastest) make its median suspect.
UNSTEADY = 1.25
#: The files of `throughput.py` rows (timed repeats, a second call) the device commands write.
TIMED = ("bars.json", "quant_cache.json", "quant_blocks.json", "quant_ab.json")


def row_name(name: str, r: dict[str, Any]) -> str:
    """A timed row as a list item's head: its file, method, shape, storage and tuning."""
    return (f"* `{name}` {r['method']} {r['batch']} x {size(r['context'])} {r.get('kv_dtype', 'model')}, "
            f"{label(r.get('tuning', ''))}")


def unsteady(out: str) -> list[str]:
    """The timed rows whose repeats disagree (run 14: a first repeat at 30x the second), named with their repeats."""
    lines = []
    for name in TIMED:
        for r in load(out, name):
            ms = r.get("repeat_ms") or []
            if len(ms) > 1 and min(ms) > 0 and max(ms) / min(ms) > UNSTEADY:
                lines.append(f"{row_name(name, r)}: repeats {', '.join(f'{m:.4g}' for m in ms)} ms a step (the "
                             f"row's figure is their median)")
    return lines


def second_calls(out: str) -> list[str]:
    """Each row's untimed second call (throughput.py's `decode_second_s`) where it took over twice a timed call, and
    every `second_call_<variant>.json` row: run 14's second call of a process's first fused-kernel program took
    seconds (about the compile) more than the calls after it."""
    names = sorted(f for f in os.listdir(out) if f.startswith("second_call_") and f.endswith(".json"))
    lines = []
    for name in (*TIMED, *names):
        for r in load(out, name):
            if "decode_second_s" not in r or "step_ms" not in r:
                continue
            steady = r["step_ms"] * (r["new_tokens"] - 1) / 1e3
            if name in names or r["decode_second_s"] > 2 * steady:
                lines.append(f"{row_name(name, r)}: second call {r['decode_second_s']:.3g} s "
                             f"({r['second_call_compiles']} XLA compiles, {r['second_call_compile_s']:.3g} s), "
                             f"a timed call {steady:.3g} s")
    return lines


#: The card the tok/s and TB/s bars were set for (runs 10-14 measured on it).
BAR_CARD = "NVIDIA H200"


def machines(out: str) -> list[tuple[str, str]]:
    """The (device kind, jax version) pairs the result files name (each file's `machine`), in order of first
    appearance."""
    seen: list[tuple[str, str]] = []
    for name in sorted(os.listdir(out)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(out, name)) as f:
                machine = json.load(f).get("machine") or {}
        except (OSError, ValueError, AttributeError):  # a stage cut off mid-write, or a file of another shape
            continue
        if machine.get("device_kind"):
            device = (machine["device_kind"], machine.get("jax", "?"))
            if device not in seen:
                seen.append(device)
    return seen


def report(out: str, shapes: Shapes) -> str:
    lines = ["| figure | bar | measured | verdict |", "|---|---|---|---|"]
    lines += [f.row() for f in figures(out, shapes)]
    devices = machines(out)
    if devices:
        lines += ["", f"Measured on: {', '.join(f'{kind} (jax {jax})' for kind, jax in devices)}."]
        if any(kind != BAR_CARD for kind, _ in devices):
            lines.append(f"The tok/s and TB/s bars were set for an {BAR_CARD}; on another card read them as "
                         "fractions of its own measured read bandwidth (each row's \"% of read BW\").")
    suspect = unsteady(out)
    if suspect:
        lines += ["", f"Repeats more than {UNSTEADY}x apart (read the faster one with care):", *suspect]
    seconds = second_calls(out)
    if seconds:
        lines += ["", "Second calls, untimed (slow ones, and every `second_call_*` row):", *seconds]
    profile = where_time_goes(load(out, "graphs_profile.json"))
    if profile:
        lines += ["", "Where a step's time goes (`graphs_profile.json`, graphs on):", *profile]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="The device command's result folder.")
    p.add_argument("--smoke", action="store_true", help="The SMOKE=1 stages' tiny shapes.")
    args = p.parse_args(argv)
    if not os.path.isdir(args.out):
        p.error(f"no such folder: {args.out}")
    text = report(args.out, SMOKE_SHAPES if args.smoke else Shapes())
    with open(os.path.join(args.out, "bars.md"), "w") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main(sys.argv[1:])
