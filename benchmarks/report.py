"""Markdown tables (BENCHMARKS.md) and PNG plots from the JSON results of the benchmark scripts.

    python benchmarks/report.py benchmarks/results            # prints every table it finds
    python benchmarks/report.py benchmarks/results --plots=benchmarks/plots   # also writes the figures

Plots need matplotlib (`pip install matplotlib`), imported only when `--plots` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import os
import sys
from collections.abc import Callable
from typing import Any


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.2f}"


def machine_line(result: dict[str, Any]) -> str:
    m = result["machine"]
    model = result["model"]
    return (f"Machine: {m['cpu']} ({m['cpu_cores']} cores, {m['memory_gib']} GiB), backend {m['backend']} "
            f"({m['device_kind']}), jax {m['jax']}. Model: `{model['name']}` ({model['num_layers']} layers, hidden "
            f"{model['hidden_size']}, {model['num_heads']}/{model['num_kv_heads']} heads of {model['head_dim']}, "
            f"{model['dtype']}).")


def compression_overhead(r: dict[str, Any]) -> str:
    contexts = sorted({row["context"] for row in r["rows"]})
    methods = list(dict.fromkeys(row["method"] for row in r["rows"]))
    by = {(row["method"], row["context"]): row for row in r["rows"]}
    head = "| method | " + " | ".join(f"{c} prefill / full | {c} hook / forward" for c in contexts) + " |"
    lines = [head, "|---|" + "---|---|" * len(contexts)]
    for m in methods:
        cells = []
        for c in contexts:
            row = by.get((m, c))
            if row is None:
                cells += ["-", "-"]
                continue
            hook = "-" if row["hook_fraction"] is None else f"{100 * row['hook_fraction']:.1f}%"
            cells += [f"{row['prefill_ratio']:.2f}x", hook]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    fwd = ", ".join(f"{c}: forward {by[('full', c)]['forward_s'] * 1e3:.0f} ms, full prefill "
                    f"{by[('full', c)]['full_prefill_over_forward']:.2f}x forward" for c in contexts)
    return "\n".join(lines) + f"\n\n({fwd})"


def decode(r: dict[str, Any]) -> str:
    lines = ["| context | method | budget | ms / step | tokens/s | speedup vs full | ideal (bytes) | prefill |",
             "|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['context']} | {row['method']} | {row['budget'] or '-'} | {row['step_ms']:.3f} | "
                     f"{row['tokens_per_s']:.0f} | {row['speedup']:.2f}x | {row['ideal_speedup']:.2f}x | "
                     f"{row.get('prefill', '-')} |")
    lines += ["", "Ideal memory-bound speedup for Llama-3-8B shapes, bfloat16 (arithmetic, not measured):", "",
              "| context | budget | weights GiB | full KV GiB | kept KV GiB | ideal speedup |",
              "|---|---|---|---|---|---|"]
    for row in r.get("analytic", []):
        lines.append(f"| {row['context']} | {row['budget']} | {row['weight_gib']:.1f} | {row['full_kv_gib']:.2f} | "
                     f"{row['kept_kv_gib']:.3f} | {row['ideal_speedup']:.2f}x |")
    return "\n".join(lines)


def memory(r: dict[str, Any]) -> str:
    lines = ["| model | prompt | x budget | method | mode | cache slots | cache MiB | peak - weights MiB | "
             "vs full one-shot |", "|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        if "unsupported" in row:
            lines.append(f"| {row['model']} | {row['prompt']} | - | {row['method']} | {row['mode']} | "
                         f"n/a | n/a | n/a | unsupported |")
            continue
        mult = "-" if row["budget"] is None else f"{row['prompt'] / row['budget']:g}"
        lines.append(f"| {row['model']} ({row['dtype']}) | {row['prompt']} | {mult} | {row['method']} | {row['mode']} "
                     f"| {row['capacity']} | {_mib(row['cache'])} | {_mib(row['non_weight_peak'])} | "
                     f"{row['non_weight_peak_vs_full_one_shot']:.3f} |")
    lines += ["", "Measured (chunked prefill run for real):", "",
              "| method | prompt | budget | chunk | cache slots | cache bytes | kept tokens (mean) |",
              "|---|---|---|---|---|---|---|"]
    for row in r.get("measured", []):
        lines.append(f"| {row['method']} | {row['prompt']} | {row['budget']} | {row['chunk']} | {row['capacity']} | "
                     f"{row['cache_bytes']:,} | {row['kept_tokens']:.1f} |")
    return "\n".join(lines)


def compile_time(r: dict[str, Any]) -> str:
    lines = ["| variant | method | prompts | programs (prefill + decode) | XLA compilations | compile s | "
             "pass wall s | programs vs full bucketed | compile vs full bucketed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['variant']} | {row['method']} | {row['num_prompts']} | {row['programs']} "
                     f"({row['prefill_programs']} + {row['decode_programs']}) | {row['xla_compilations']} | "
                     f"{row['compile_s']:.1f} | {row['wall_s']:.1f} | {row['programs_vs_full_bucketed']:.1f}x | "
                     f"{row['compile_s_vs_full_bucketed']:.2f}x |")
    buckets = next((row["buckets"] for row in r["rows"] if row["buckets"]), [])
    return "\n".join(lines) + f"\n\nPrompt lengths {r.get('lengths')}; buckets {buckets}."


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:,.1f}"


def accelerator(r: dict[str, Any]) -> str:
    """`benchmarks/accelerator.py`: copy bandwidth, kernels vs XLA (compiled), end-to-end 8B-shaped rows."""
    bw = r.get("bandwidth")
    h = r.get("kernel_heads", {})
    lines = [f"Copy bandwidth (elementwise pass over {bw['copy_mib']} MiB, read + write): "
             f"{_gb(bw['bytes_per_s'])} GB/s." if bw else "Copy bandwidth: not measured in this run."]
    if r.get("kernels"):
        lines += ["", f"Kernels (`implementation=\"pallas\"`) vs XLA, compiled, {h.get('q')} query / {h.get('kv')} KV "
                  f"heads of {h.get('dim')}, batch 1, median of many runs after warm-up; GB/s = K/V bytes read per "
                  "step / time:", "",
                  "| op | context | attended | max rel. err | equal | XLA ms | kernel ms | speedup | kernel GB/s | "
                  "% of copy |", "|---|---|---|---|---|---|---|---|---|---|"]
        # Per layer inside one program: `loop_*` over per-layer buffers (the model's layout), `scan_*` in a scan
        # over stacked caches (results from before the per-layer layout).
        where = next((w for w in ("loop", "scan") if any(f"{w}_kernel_ms" in row for row in r["kernels"])), None)
        label = {"loop": "per-layer buffers", "scan": "in-scan"}.get(where)
        if where:
            lines[-2] += f" {label}: XLA / kernel ms per layer | {label} % of copy |"
            lines[-1] += "---|---|"
    for row in r.get("kernels", []):
        if "skipped" in row:
            lines.append(f"| {row['op']} | {row['context']} | {row['attended_tokens']} | - | {row['skipped']} | - | - "
                         f"| - | - | - |")
            continue
        if "error" in row:
            lines.append(f"| {row['op']} | {row['context']} | {row['attended_tokens']} | - | **failed**: "
                         f"{row['error'][:80]} | - | - | - | - | - |")
            continue
        frac = "-" if row.get("kernel_copy_fraction") is None else f"{100 * row['kernel_copy_fraction']:.0f}%"
        lines.append(f"| {row['op']} | {row['context']} | {row['attended_tokens']} | {row['max_rel_err']:.1e} | "
                     f"{'yes' if row['equal'] else '**no**'} | {row['xla_ms']:.3f} | {row['kernel_ms']:.3f} | "
                     f"{row['speedup']:.2f}x | {_gb(row['kernel_bytes_per_s'])} | {frac} |")
        if where and f"{where}_kernel_ms" in row:
            in_frac = row.get(f"{where}_kernel_copy_fraction")
            lines[-1] += (f" {row[f'{where}_xla_ms']:.3f} / {row[f'{where}_kernel_ms']:.3f} | "
                          + ("-" if in_frac is None else f"{100 * in_frac:.0f}%") + " |")
    tune = [row for row in r.get("tune", []) if "kernel_ms" in row]
    if tune:
        best = min(tune, key=lambda row: row["kernel_ms"])
        lines += ["", f"Dense decode kernel knobs at {best['context']} tokens ({len(tune)} settings compiled, "
                  f"{len(r['tune']) - len(tune)} failed), fastest first:", "",
                  "| block_k | num_warps | num_stages | num_splits | kernel ms | GB/s | max rel. err |",
                  "|---|---|---|---|---|---|---|"]
        for row in sorted(tune, key=lambda row: row["kernel_ms"])[:6]:
            lines.append(f"| {row['block_k']} | {row['num_warps']} | {row['num_stages']} | "
                         f"{row['num_splits'] or 'auto'} | {row['kernel_ms']:.3f} | {_gb(row['kernel_bytes_per_s'])} | "
                         f"{row['max_rel_err']:.1e} |")
        slowest = max(tune, key=lambda row: row["kernel_ms"])
        lines.append(f"\nSlowest: {slowest['kernel_ms']:.3f} ms (block_k {slowest['block_k']}, "
                     f"{slowest['num_warps']} warps, {slowest['num_stages']} stages, splits "
                     f"{slowest['num_splits'] or 'auto'}).")
    if r.get("prefill"):
        lines += ["", "Prefill attention of a prompt over its own keys (causal), blockwise XLA vs "
                  "`jax.nn.dot_product_attention` (cuDNN on GPU) per query block with a mask, and (where measured) "
                  "as one causal call with sequence lengths (`causal_prefix_attention`):", "",
                  "| tokens | XLA ms | XLA TFLOP/s | dot_product_attention ms | TFLOP/s | speedup | max rel. err "
                  "| one causal call ms | TFLOP/s | max rel. err |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in r["prefill"]:
            if "causal_ms" in row:
                causal = f" {row['causal_ms']:.1f} | {row['causal_tflops']:.0f} | {row['causal_max_rel_err']:.1e} |"
            elif "causal_error" in row:
                causal = f" **failed**: {row['causal_error'][:80]} | - | - |"
            else:
                causal = " - | - | - |"
            if "fused_ms" not in row:
                lines.append(f"| {row['context']} | {row.get('xla_ms', float('nan')):.1f} | - | **failed**: "
                             f"{row.get('error', '')[:80]} | - | - | - |" + causal)
                continue
            lines.append(f"| {row['context']} | {row['xla_ms']:.1f} | {row['xla_tflops']:.0f} | "
                         f"{row['fused_ms']:.1f} | {row['fused_tflops']:.0f} | {row['speedup']:.2f}x | "
                         f"{row['max_rel_err']:.1e} |" + causal)
    if not r.get("e2e"):
        return "\n".join(lines)
    shared = "--isolate=no" in r.get("argv", [])
    lines += ["", f"End to end (`prefill` + `decode`, random weights, decode attention `{r.get('attention')}`"
              + ("; every row in one process, so a row's peak is the process's so far and only the first row's is "
                 "its own" if shared else "") + "):", "",
              "| context | method | budget | prefill s (first / timed) | decode tokens/s | speedup vs full | "
              "ideal (bytes) | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for row in r.get("e2e", []):
        if "step_ms" not in row:
            lines.append(f"| {row['context']} | {row['method']} | - | {row.get('skipped') or 'failed'} | - | - | - "
                         f"| - |")
            continue
        timed = "-" if row.get("prefill_s") is None else f"{row['prefill_s']:.2f}"
        peak = "-" if row.get("peak_bytes") is None else f"{row['peak_bytes'] / 2**30:.1f}"
        if shared and row is not r["e2e"][0]:
            peak = f"({peak})"
        speed = "-" if "speedup" not in row else f"{row['speedup']:.2f}x"
        ideal = "-" if "ideal_speedup" not in row else f"{row['ideal_speedup']:.2f}x"
        lines.append(f"| {row['context']} | {row['method']} | {row['budget'] or '-'} | {row['prefill_first_s']:.2f} / "
                     f"{timed} | {row['tokens_per_s']:.1f} | {speed} | {ideal} | {peak} |")
    return "\n".join(lines)


def vs_kvpress(r: dict[str, Any]) -> str:
    version = r.get("kvpress") or "?"
    version = version if version.startswith("kvpress") else f"kvpress {version}"
    threads = f"{r['threads']} thread each" if r["threads"] == 1 else "default threading"
    lines = [f"{version}; {r['model']['name']} ({r['model']['dtype']}); {r['new_tokens']} greedy tokens; {threads}; "
             f"{r['clock']}; steady state = median of {r['repeats']} calls alternating the libraries.", ""]
    split = any("kvjax_prefill_s" in row for row in r["rows"])
    head = "| context | method | kvjax steady s | kvpress steady s | kvjax / kvpress |"
    if split:
        head += " prefill s, kvjax / kvpress | decode s, kvjax / kvpress |"
    head += (" kvjax first s (cold / warm cache) | kvpress first s | warm first / kvpress first | same tokens |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for row in r["rows"]:
        line = (f"| {row['context']} | {row['method']} | {row['kvjax_steady_s']:.3f} | {row['kvpress_steady_s']:.3f} | "
                f"{row['steady_ratio']:.2f}x |")
        if split:
            line += (f" {row['kvjax_prefill_s']:.3f} / {row['kvpress_prefill_s']:.3f} |"
                     f" {row['kvjax_decode_s']:.3f} / {row['kvpress_decode_s']:.3f} |")
        line += (f" {row['kvjax_first_cold_s']:.2f} / {fmt(row.get('kvjax_first_warm_s'), '.2f')} |"
                 f" {row['kvpress_first_s']:.2f} | {fmt(row.get('first_warm_ratio'), '.2f')}x |"
                 f" {'yes' if row['same_tokens'] else 'no'} |")
        lines.append(line)
    return "\n".join(lines)


def layer_slicing(r: dict[str, Any]) -> str:
    copy = (r.get("copy_bandwidth") or {}).get("bytes_per_s")
    lines = [f"{r['args']['layers']} layers, bfloat16, batch 1; copy bandwidth "
             f"{'-' if not copy else f'{copy / 1e9:,.0f} GB/s'}; median of {r['args']['repeats']} runs.", "",
             "| part | variant | layout | ms per step | GB/s | copies in HLO |", "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        if "ms" not in row:
            lines.append(f"| {row['part']} | {row['variant']} | {row['layout']} | failed | - | - |")
            continue
        lines.append(f"| {row['part']} | {row['variant']} | {row['layout']} | {row['ms']:.3f} | "
                     f"{row['bytes_per_s'] / 1e9:,.0f} | {row.get('hlo_copies', '-')} |")
    return "\n".join(lines)


RENDER = {"layer_slicing": layer_slicing, "compression_overhead": compression_overhead, "decode": decode,
          "memory": memory, "compile_time": compile_time, "accelerator": accelerator, "vs_kvpress": vs_kvpress}


def _pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend, or exit with how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("report.py: --plots needs matplotlib, which is not installed: pip install matplotlib") \
            from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(result: dict[str, Any], what: str) -> str:
    """`what` plus the model and machine the result was measured with."""
    m, model = result["machine"], result["model"]
    where = f"{m['cpu']} ({m['cpu_cores']} cores)" if m["backend"] == "cpu" else f"{m['device_kind']} ({m['backend']})"
    return f"{what}: {model['name']} ({model['dtype']}) on {where}, jax {m['jax']}"


def _tokens(n: float) -> str:
    return f"{n / 1024:g}K" if n >= 1024 else f"{n:g}"


def _log2_x(ax: Any, values: list[int], label: str) -> None:
    """Log2 x axis with a tick at each measured length (1K, 4K, 128K, ...)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [_tokens(v) for v in values])
    ax.minorticks_off()
    ax.set_xlabel(label)
    ax.grid(alpha=0.3, which="both")


def _log_y(ax: Any, label: str) -> None:
    """Log y axis labelled at 1, 2, 5 x 10^k in plain numbers, so short ranges still get labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylabel(label)


def _colors(names: list[str]) -> dict[str, Any]:
    """A distinct colour per name, in order (tab10, then tab20 for more)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def _series(rows: list[dict], key: Callable[[dict], Any], x: str, y: Callable[[dict], float | None],
            xs: list[int]) -> dict[Any, list[float]]:
    """{key: y at each of `xs`}, NaN where a row is missing (a method skipped at that length) or y is None."""
    out: dict[Any, dict[int, float]] = {}
    for row in rows:
        value = y(row)
        out.setdefault(key(row), {})[row[x]] = math.nan if value is None else value
    return {k: [pts.get(v, math.nan) for v in xs] for k, pts in out.items()}


def plot_decode(r: dict[str, Any]) -> Any:
    """Tokens/s vs context per (method, budget) and `full`; measured speedup vs full beside the ideal."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    rows = r["rows"]
    contexts = sorted({row["context"] for row in rows})
    budgets = sorted({row["budget"] for row in rows if row["method"] != "full"}, key=lambda b: (b is None, b))
    methods = list(dict.fromkeys(row["method"] for row in rows if row["method"] != "full"))
    color = _colors(methods) | {"full": "black"}
    style = {b: ("os^Dv"[i % 5], ["-", "--", "-."][i % 3]) for i, b in enumerate(budgets)} | {None: ("o", "-")}
    key = operator.itemgetter("method", "budget")
    tps = _series(rows, key, "context", lambda row: row["tokens_per_s"], contexts)
    speedup = _series(rows, key, "context", lambda row: row["speedup"], contexts)
    ideal = _series(rows, key, "context", lambda row: row["ideal_speedup"], contexts)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for (method, budget), ys in tps.items():
        marker, ls = style[budget]
        ax1.plot(contexts, ys, marker=marker, ls=ls, color=color[method], lw=2.5 if method == "full" else 1.5)
        if method != "full":
            ax2.plot(contexts, speedup[(method, budget)], marker=marker, ls=ls, color=color[method])
            ax2.plot(contexts, ideal[(method, budget)], marker=marker, mfc="none", ls=":", color="grey", zorder=1)
    synthetic = [row for row in rows if row.get("prefill") == "synthetic"]
    for row in synthetic:  # hollow marker: decoded from a synthetic (random) cache, not a real prefill
        ax1.plot(row["context"], row["tokens_per_s"], "o", ms=9, mfc="white", color=color[row["method"]])
    _log_y(ax1, "decode tokens/s (log)")
    ax1.set_title("decode throughput")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_ylabel("speedup vs full (x)")
    ax2.set_title("measured speedup (solid) vs ideal memory-bound (dotted)")
    for ax in (ax1, ax2):
        _log2_x(ax, contexts, "context (tokens, log2)")
    handles = [Line2D([], [], color="black", lw=2.5, label="full")]
    handles += [Line2D([], [], color=color[m], lw=2, label=m) for m in methods]
    handles += [Line2D([], [], color="grey", marker=style[b][0], ls=style[b][1], label=f"budget {b}") for b in budgets]
    handles.append(Line2D([], [], color="grey", marker="o", mfc="none", ls=":", label="ideal (bytes read)"))
    if synthetic:
        handles.append(Line2D([], [], color="black", marker="o", mfc="white", ls="", label="synthetic-cache full"))
    fig.legend(handles=handles, loc="center right", fontsize="small")
    fig.suptitle(_title(r, "Decode"))
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    return fig


def plot_memory(r: dict[str, Any]) -> Any:
    """Peak memory beyond the weights vs prompt length, one-shot vs chunked prefill, a panel per model."""
    plt = _pyplot()
    rows = [row for row in r["rows"] if "unsupported" not in row and row.get("non_weight_peak") is not None]
    models = list(dict.fromkeys(row["model"] for row in rows))
    color = _colors(list(dict.fromkeys(row["method"] for row in rows)))
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(6.5 * max(len(models), 1.5), 5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        group = [row for row in rows if row["model"] == model]
        prompts = sorted({row["prompt"] for row in group})
        unit, scale = ("GiB", 2**30) if max(row["non_weight_peak"] for row in group) > 4 * 2**30 else ("MiB", 2**20)
        peak = _series(group, operator.itemgetter("method", "mode"), "prompt", operator.itemgetter("non_weight_peak"),
                       prompts)
        for (method, mode), ys in peak.items():
            chunked = mode == "chunked"
            ax.plot(prompts, [y / scale for y in ys], color=color[method], marker="s" if chunked else "o",
                    ls="-" if chunked else "--", label=f"{method}, {mode.replace('_', '-')}")
        _log_y(ax, f"peak memory beyond weights ({unit}, log)")
        skipped = dict.fromkeys(f"{row['method']} {row['mode']}" for row in r["rows"]
                                if row["model"] == model and row not in rows)
        note = f"; unsupported: {', '.join(skipped)}" if skipped else ""
        ax.set_title(f"{model} ({group[0]['dtype']}){note}", fontsize="medium")
        _log2_x(ax, prompts, "prompt length (tokens, log2)")
        ax.legend(fontsize="small", ncol=2)
    fig.suptitle(_title(r, "Prefill peak memory (XLA compiled)") + "\none-shot (dashed) vs chunked (solid) prefill")
    fig.tight_layout()
    return fig


def plot_compression_overhead(r: dict[str, Any]) -> Any:
    """Each method's compression hook time as a fraction of the model forward, vs context."""
    plt = _pyplot()
    rows = [row for row in r["rows"] if row.get("hook_fraction") is not None]
    contexts = sorted({row["context"] for row in r["rows"]})
    methods = list(dict.fromkeys(row["method"] for row in rows))
    color = _colors(methods)
    frac = _series(rows, operator.itemgetter("method"), "context", lambda row: 100 * row["hook_fraction"], contexts)
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, (method, ys) in enumerate(frac.items()):
        ax.plot(contexts, ys, marker="os^Dv<>ph*"[i % 10], color=color[method], label=method)
    ax.axhline(100, color="grey", ls="--", lw=0.8, label="hook = forward")
    _log_y(ax, "hook time / model forward (%, log)")
    _log2_x(ax, contexts, "context (tokens, log2)")
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(_title(r, "Compression overhead"), fontsize="medium")
    fig.tight_layout()
    return fig


PLOTS = {"decode": plot_decode, "memory": plot_memory, "compression_overhead": plot_compression_overhead}


def _results(folder: str) -> list[tuple[str, dict[str, Any]]]:
    """(file stem, result) of every `*.json` in `folder` whose `benchmark` has a renderer, standard names first
    (`decode.json`, then extra runs such as `decode_long.json`)."""
    out = []
    for file in sorted(os.listdir(folder), key=lambda f: (os.path.splitext(f)[0] not in RENDER, f)):
        stem, ext = os.path.splitext(file)
        if ext != ".json":
            continue
        with open(os.path.join(folder, file)) as f:
            result = json.load(f)
        if isinstance(result, dict) and result.get("benchmark") in RENDER:
            out.append((stem, result))
    return out


def write_plots(folder: str, out_dir: str) -> list[str]:
    """Writes `<stem>.png` into `out_dir` for each result `<stem>.json` in `folder` that has a figure; a
    missing standard result (`decode.json`, ...) skips its figure and says so."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    results = _results(folder)
    for name in PLOTS:
        if name not in dict(results):
            print(f"report.py: no {os.path.join(folder, name + '.json')}; skipping {name}.png", file=sys.stderr)
    written = []
    for stem, result in results:
        plot = PLOTS.get(result["benchmark"])
        if plot is None:
            continue
        fig = plot(result)
        out = os.path.join(out_dir, f"{stem}.png")
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
        print(f"report.py: wrote {out}", file=sys.stderr)
    return written


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="report.py", description=__doc__.splitlines()[0])
    p.add_argument("folder", nargs="?", default=os.path.join(os.path.dirname(__file__), "results"),
                   help="folder of <benchmark>.json results (default: benchmarks/results)")
    p.add_argument("--plots", metavar="DIR", default=None,
                   help="also write decode.png, memory.png and compression_overhead.png into DIR (needs matplotlib)")
    args = p.parse_args(argv[1:])
    folder = args.folder
    if not os.path.isdir(folder):
        raise SystemExit(f"report.py: no results folder {folder}")
    if args.plots:
        _pyplot()  # fail before printing anything when matplotlib is missing
    for stem, result in _results(folder):
        print(f"### {stem}\n\n{machine_line(result)}\n\n{RENDER[result['benchmark']](result)}\n")
    if args.plots:
        write_plots(folder, args.plots)


if __name__ == "__main__":
    main(sys.argv)
