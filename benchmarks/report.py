"""Markdown tables (BENCHMARKS.md) from the JSON results of the benchmark scripts.

    python benchmarks/report.py benchmarks/results            # prints every table it finds
"""

from __future__ import annotations

import json
import os
import sys
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


RENDER = {"compression_overhead": compression_overhead, "decode": decode, "memory": memory,
          "compile_time": compile_time}


def main(argv: list[str]) -> None:
    folder = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "results")
    for name, render in RENDER.items():
        path = os.path.join(folder, f"{name}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            result = json.load(f)
        print(f"### {name}\n\n{machine_line(result)}\n\n{render(result)}\n")


if __name__ == "__main__":
    main(sys.argv)
