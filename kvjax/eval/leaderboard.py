"""The leaderboard: average score against compression ratio, one line per method, one panel per model.

    python -m kvjax.eval.leaderboard results/leaderboard [--out_dir=results/leaderboard]

Reads every run directory under the given paths, packed run archives included (``kvjax.eval.report.load_runs``:
metrics.json and the per-sample predictions), and writes ``leaderboard.png`` (one panel per model and context
length, the full cache as a dashed line, like kvpress's leaderboard plot) and ``leaderboard.md``: per panel, one row
per method (query-aware runs apart) and one column per compression ratio, each cell the score averaged
over tasks, the mean tokens kept per KV head and layer (and as a share of the prompt), and the
samples behind it (the fewest of any task in the cell). Multi-context (RAG) strategies have no nominal
ratio: each of their cells sits at its realised one (one minus the share of the context it kept), in a
table of their own below the panel's, with the share it recomputed. Runs that differ in a setting of the
cell key other than method and amount (dtype, seed, ...) are separate lines naming it, the full cache's included;
where the cache's storage (``kv_dtype``) differs, each line also names its stored bits per value
(``snapkv [kv_dtype=int8, 8.5 b]``: codes, scales and zero points per cached key / value).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvjax.errors import KvjaxError
from kvjax.eval.report import Run, _pyplot, load_runs, method_label, varying_fields

__all__ = ["Cell", "cells", "line_styles", "main", "plot_leaderboard", "render_leaderboard"]


@dataclass(frozen=True)
class Cell:
    """One (panel, method line, ratio) point: scores averaged over tasks."""

    score: float
    tasks: int
    samples: int
    kept_tokens: float | None
    kept_fraction: float | None
    recomputed: float | None = None  # multi-context cells: the share of the context recomputed
    setting: str = ""  # multi-context cells: the nominal amount (``ratio 0.5``), empty for the defaults
    x: float | None = None  # where the plot puts it (multi-context cells: 1 - kept share; else its ratio)


def _kept_fraction(rec: dict) -> float | None:
    """The runner's share of the prompt the model saw (retrieval methods see the question twice); records
    written before it existed: kept tokens over context + question tokens."""
    if rec.get("sequence_ratio") is not None:  # a multi-context record: kept share of the context
        return float(rec["sequence_ratio"])
    if rec.get("kept_fraction") is not None:
        return float(rec["kept_fraction"])
    if rec.get("kept_tokens") is None or not rec.get("context_tokens"):
        return None
    return float(rec["kept_tokens"]) / (float(rec["context_tokens"]) + float(rec.get("question_tokens") or 0))


def _line(run: Run, fields: Sequence[str] = ()) -> str:
    label = method_label(run, fields)
    if run.is_full:
        label = "full" + label[len(run.method):]
    if "kv_dtype" in fields and run.kv_bits is not None:  # the storage's bits beside its name
        label = label[:-1] + f", {run.kv_bits:g} b]"
    if run.query_aware:
        label += " (query-aware)"
    if run.method_args:
        label += f" [{run.method_args}]"
    return label


def _panel(run: Run) -> str:
    return f"{run.model} @ {run.context_length}" if run.context_length else run.model


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def cells(runs: Sequence[Run]) -> dict[str, dict[str, dict[float, Cell]]]:
    """panel -> line -> compression ratio -> Cell (the full cache sits at ratio 0; a multi-context cell at its
    nominal ratio, ``RAG_DEFAULTS`` for its strategy's own defaults)."""
    groups: dict[tuple[str, str, float], list[Run]] = {}
    fields = varying_fields(runs)
    for r in runs:
        if r.score is None:
            continue
        if r.multi_context:
            x = RAG_DEFAULTS if r.compression_ratio is None else round(r.compression_ratio, 6)
        else:
            x = 0.0 if r.is_full else round(r.ratio, 6)
        groups.setdefault((_panel(r), _line(r, fields), x), []).append(r)
    out: dict[str, dict[str, dict[float, Cell]]] = {}
    for (panel, line, ratio), group in sorted(groups.items()):
        records = [rec for r in group for rec in r.records]
        kept = [float(rec["kept_tokens"]) for rec in records if rec.get("kept_tokens") is not None]
        frac = [_kept_fraction(rec) for rec in records]
        frac = [f for f in frac if f is not None]
        out.setdefault(panel, {}).setdefault(line, {})[ratio] = Cell(
            score=sum(r.score for r in group) / len(group),
            tasks=len(group),
            samples=min(len(r.records) or int(r.summary.get("num_samples", 0) or 0) for r in group),
            kept_tokens=_mean(kept),
            kept_fraction=_mean(frac),
            recomputed=_mean([r.recomputed_share for r in group if r.recomputed_share is not None])
            if group[0].multi_context else None,
            setting=group[0].setting if group[0].multi_context else "",
            x=_mean([r.ratio for r in group]) if group[0].multi_context else ratio,
        )
    return out


#: The key of a multi-context cell run with its strategy's own defaults (no nominal ratio).
RAG_DEFAULTS = -1.0


def _is_rag(cells_: dict[float, Cell]) -> bool:
    return any(c.recomputed is not None for c in cells_.values())


_BITS = re.compile(r", ([0-9.]+) b\]")


def _order(lines: dict[str, dict[float, Cell]]) -> list[str]:
    """Full cache first, then by mean score over ratios (best first). Lines naming their storage's bits per value
    (several ``kv_dtype``): each method's lines together (methods by their best line's mean), widest storage first."""
    def mean(line: str) -> float:
        scores = [c.score for c in lines[line].values()]
        return sum(scores) / len(scores)

    def key(line: str) -> tuple[int, float, str]:
        return (0 if line.startswith("full") else 1, -mean(line), line)

    if not any(_BITS.search(line) for line in lines):
        return sorted(lines, key=key)
    method = {line: line.split(" (")[0].split(" [")[0] for line in lines}
    best = {m: max(mean(line) for line in lines if method[line] == m) for m in set(method.values())}

    def grouped(line: str) -> tuple:
        bits = _BITS.search(line)
        return (0 if line.startswith("full") else 1, -best[method[line]], method[line],
                -float(bits.group(1)) if bits else 0.0, line)

    return sorted(lines, key=grouped)


def render_leaderboard(table: dict[str, dict[str, dict[float, Cell]]]) -> str:
    """Markdown: one table per panel; cells ``score · kept tokens (share of context) · n``."""
    parts = []
    for panel, all_lines in table.items():
        lines = {k: v for k, v in all_lines.items() if not _is_rag(v)}
        rag = {k: v for k, v in all_lines.items() if _is_rag(v)}
        ratios = sorted({x for cells_ in lines.values() for x in cells_ if x > 0})
        n_tasks = max(c.tasks for cells_ in all_lines.values() for c in cells_.values())
        parts.append(
            f"### {panel} ({n_tasks} task{'s' if n_tasks > 1 else ''}; cell: average score · kept tokens "
            "(share of the prompt) · samples per task × tasks)"
        )
        parts.append("")
        if lines:
            parts.append("| " + " | ".join(["method", "full cache", *(f"ratio {x:g}" for x in ratios)]) + " |")
            parts.append("|---|---|" + "---|" * len(ratios))
            for line in _order(lines):
                row = [line, _fmt(lines[line].get(0.0))] + [_fmt(lines[line].get(x)) for x in ratios]
                parts.append("| " + " | ".join(row) + " |")
            parts.append("")
        if rag:
            parts += [f"Multi-context strategies on {panel} (cell: average score · kept share of the context · "
                      "recomputed share · samples per task × tasks; plotted at ratio = 1 - kept share)", "",
                      "| strategy | setting | result |", "|---|---|---|"]
            for line in _order(rag):
                for _, cell in sorted(rag[line].items()):
                    parts.append(f"| {line} | {cell.setting or 'its defaults'} | {_fmt(cell)} |")
            parts.append("")
    return "\n".join(parts)


def _fmt(cell: Cell | None) -> str:
    if cell is None:
        return ""
    text = f"{cell.score:.1f}"
    if cell.recomputed is not None:
        kept = f" · kept {100 * cell.kept_fraction:.0f}%" if cell.kept_fraction is not None else ""
        text += f"{kept} · recomputed {100 * cell.recomputed:.0f}%"
    elif cell.kept_tokens is not None:
        text += f" · {cell.kept_tokens:.0f}"
        if cell.kept_fraction is not None:
            text += f" ({100 * cell.kept_fraction:.0f}%)"
    text += f" · n={cell.samples}"
    if cell.tasks > 1:
        text += f"×{cell.tasks}"
    return text


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_DASHES = ("--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1)), (0, (1, 3)))


def _base(line: str) -> str:
    """The method a line plots (``snapkv (query-aware) [window=8]`` -> ``snapkv``), with its cache storage where the
    line names one (``snapkv [kv_dtype=int8, 8.5 b]`` -> ``snapkv [kv_dtype=int8, 8.5 b]``: a style per format)."""
    method = line.split(" (")[0].split(" [")[0]
    storage = next((part for part in line.split(" [")[1:] if part.startswith("kv_dtype=")), None)
    return method if storage is None else f"{method} [{storage.split(']')[0]}]"


def line_styles(table: dict[str, dict[str, dict[float, Cell]]]) -> dict[str, tuple[int, str]]:
    """A (tab20 colour index, marker) per method, distinct within the figure and the same in every panel;
    a method's query-aware line shares its style and is dashed. 20 colours times 10 markers."""
    bases = sorted({_base(line) for lines in table.values() for line in lines if not line.startswith("full")})
    return {b: (i % 20, _MARKERS[(i + i // 20) % len(_MARKERS)]) for i, b in enumerate(bases)}


def plot_leaderboard(table: dict[str, dict[str, dict[float, Cell]]], path: str) -> str:
    """One panel per model (and length): average score vs compression ratio, one line per method."""
    plt = _pyplot()
    n = len(table)
    if n == 0:
        raise KvjaxError("no scored runs to plot")
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8.0 * cols, 4.6 * rows), squeeze=False)
    styles, palette = line_styles(table), plt.get_cmap("tab20")
    for ax, (panel, lines) in zip(axes.flat, table.items(), strict=False):
        for line in _order(lines):
            pts = sorted(((x if c.x is None else c.x, c) for x, c in lines[line].items()), key=lambda p: p[0])
            if line.startswith("full"):  # several storages: one dash pattern each
                dash = _DASHES[sum(other.startswith("full") for other in _order(lines)[:_order(lines).index(line)])
                               % len(_DASHES)]
                ax.axhline(pts[0][1].score, linestyle=dash, color="grey", label=line)
                continue
            style = "--" if "query-aware" in line else "-"
            colour, marker = styles[_base(line)]
            ax.plot([x for x, _ in pts], [c.score for _, c in pts], marker=marker, linestyle=style, label=line,
                    color=palette(colour))
        ax.set_title(panel)
        ax.set_xlabel("compression ratio")
        ax.set_ylabel("average score")
        ax.set_xlim(0.2, 0.9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the lines
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvjax.eval.leaderboard", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="directories holding run directories or *.runs.tar.xz archives "
                        "(searched recursively), or archives")
    parser.add_argument("--task", default=None, help="only these tasks (comma-separated, e.g. ruler/vt)")
    parser.add_argument("--out_dir", default=None, help="where leaderboard.png / leaderboard.md go (default: print)")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.paths)
        table = cells([r for r in runs if r.task in args.task.split(",")] if args.task else runs)
        if not table:
            raise KvjaxError(f"no scored runs under {', '.join(args.paths)}")
        markdown = render_leaderboard(table)
        print(markdown)
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, "leaderboard.md"), "w", encoding="utf-8") as f:
                f.write(markdown + "\n")
            print(plot_leaderboard(table, os.path.join(args.out_dir, "leaderboard.png")), file=sys.stderr)
    except KvjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
