"""The leaderboard: average score against compression ratio, one line per method, one panel per model.

    python -m kvjax.eval.leaderboard results/leaderboard [--out_dir=results/leaderboard]

Reads every run directory under the given paths, packed run archives included (``kvjax.eval.runs.load_runs``:
metrics.json and the per-sample predictions), and writes ``leaderboard.png`` (one panel per model and context
length, the full cache as a dashed line, like kvpress's leaderboard plot) and ``leaderboard.md``: per panel, one row
per method (query-aware runs apart) and one column per compression ratio, each cell the score averaged over tasks,
the mean tokens kept per KV head and layer (and as a share of the prompt), and the samples behind it (the fewest of
any task in the cell). A budget run's column is the ratio its budget stands for at the panel's context length
(``1-budget/length``: 1024 of 4096 is ratio 0.75); its cells still show what it kept. Multi-context (RAG) strategies
have no nominal ratio: each of their cells sits at its realised one (one minus the share of the context it kept), in
a table of their own below the panel's, with the share it recomputed. So does every compressing method run with
neither budget nor ratio (only the ``full`` method is the full cache): a threshold sweep (KVzap under DMS at
``threshold=-4``) is one line per method and settings with a cell per threshold; a run set by other arguments
(InfLLM's ``topk``, ``per_layer``'s ratios) or its defaults is a cell named by them; each plotted at its realised
ratio. Runs that differ in a setting of the cell key other than method and amount (dtype, seed, ...) are separate
lines naming it; method arguments are shown in brackets, without the paths of learned files (``weights``,
``filters``, ``patterns``), which say where, not what. DuoAttention's ratio is its head ratio (the share of KV heads
made streaming heads), and its lines say so. Where the cache's storage (``kv_dtype``) differs, each line, the full
cache's included, also names its stored bits per value (``snapkv [kv_dtype=int8, 8.5 b]``: codes, scales and zero
points per cached key / value).
"""

from __future__ import annotations

import ast
import hashlib
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean

from kvjax.cli import paths
from kvjax.cli.refuse import ArgumentParser, refused
from kvjax.errors import KvjaxError
from kvjax.eval.plots import pyplot
from kvjax.eval.runs import Run, kept_fraction, load_runs, method_label, varying_fields

__all__ = ["Cell", "Point", "cells", "line_styles", "main", "plot_leaderboard", "render_leaderboard"]


@dataclass(frozen=True)
class Point:
    """One (panel, method line, ratio) point of the leaderboard: the scores of its runs (`runs.Run`, views of
    their cell keys) averaged over tasks. Not a cell: one point pools a line's cells over the tasks."""

    score: float
    tasks: int
    samples: int
    kept_tokens: float | None
    kept_fraction: float | None
    recomputed: float | None = None  # multi-context cells: the share of the context recomputed
    setting: str = ""  # multi-context cells: the nominal amount (``ratio 0.5``), empty for the defaults
    x: float | None = None  # where the plot puts it (multi-context cells: 1 - kept share; else its ratio)
    swept: str = ""  # threshold-sweep cells: the swept setting (``threshold=-4``)


#: The older name of `Point`.
Cell = Point


#: Method arguments that name a learned file (left out of labels) and the ones a threshold sweep varies.
PATH_ARGS = ("weights", "filters", "patterns")
SWEEP_ARGS = ("threshold",)


def _split_args(text: str) -> list[str]:
    """``a=1,b={'x': 1, 'y': 2}`` -> ``["a=1", "b={'x': 1, 'y': 2}"]`` (commas inside brackets kept)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [item for item in [*items, text[start:]] if item]


def _shown_args(text: str, drop: Sequence[str] = ()) -> tuple[str, str]:
    """(the arguments a label shows, the swept ones): learned-file paths left out, also inside dicts
    (``base_args={'weights': ...}``), and the ``SWEEP_ARGS`` moved to the second string."""
    shown, swept = [], []
    for item in _split_args(text):
        key, _, value = item.partition("=")
        if key in PATH_ARGS or key in drop:
            continue
        if key in SWEEP_ARGS:
            swept.append(item)
            continue
        if value.startswith("{"):
            try:
                inner = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                inner = None
            if isinstance(inner, dict):
                inner = {k: v for k, v in inner.items() if k not in PATH_ARGS}
                if not inner:
                    continue
                item = f"{key}={inner}"
        shown.append(item)
    return ",".join(shown), ",".join(swept)


def is_threshold_sweep(run: Run) -> bool:
    """A compressing method run with neither budget nor ratio (``Run.budgetless``: DMS at a threshold, InfLLM by its
    ``topk``, ``per_layer``'s ratios): no nominal ratio, so a cell of the panel's sweep table, at its realised one."""
    return run.budgetless


def _sweep_args(run: Run) -> tuple[str, str]:
    """(the arguments its line shows, what its cell is labelled by) of a budget-less run: the ``SWEEP_ARGS``
    (``threshold=-4``) when it has one, else every argument it shows, else ``its defaults``."""
    shown, swept = _shown_args(run.method_args)
    if swept:
        return shown, swept
    return "", shown or "its defaults"


def _line(run: Run, fields: Sequence[str] = ()) -> str:
    sweep = is_threshold_sweep(run)
    label = method_label(run, fields)
    if run.is_full:
        label = "full" + label[len(run.method):]
    if "kv_dtype" in fields and run.kv_bits is not None:  # the storage's bits beside its name
        label = label[:-1] + f", {run.kv_bits:g} b]"
    if run.method == "duo_attention":
        label += " (head ratio)"
    if run.query_aware:
        label += " (query-aware)"
    shown = _sweep_args(run)[0] if sweep else _shown_args(run.method_args)[0]
    if shown:
        label += f" [{shown}]"
    return label


def _panel(run: Run) -> str:
    return f"{run.model} @ {run.context_length}" if run.context_length else run.model


def _mean(xs: Sequence[float]) -> float | None:
    return fmean(xs) if xs else None


def _column_ratio(run: Run) -> float:
    """A line's column: a ratio run's ratio; a budget run's nominal one, ``1 - budget / context length`` (the length
    its budget was set from), not ``Run.ratio``'s average over each prompt's own length, which differs by task and
    would split one budget into a column per task."""
    if run.compression_ratio is None and run.budget is not None and run.context_length:
        return max(0.0, 1.0 - run.budget / run.context_length)
    return run.ratio


def cells(runs: Sequence[Run]) -> dict[str, dict[str, dict[float, Point]]]:
    """panel -> line -> compression ratio -> Point (the full cache sits at ratio 0; a multi-context cell at its
    nominal ratio, ``RAG_DEFAULTS`` for its strategy's own defaults)."""
    groups: dict[tuple[str, str, float], list[Run]] = {}
    fields = varying_fields(runs)
    for r in runs:
        if r.score is None:
            continue
        if r.multi_context:
            x = RAG_DEFAULTS if r.compression_ratio is None else round(r.compression_ratio, 6)
        elif is_threshold_sweep(r):
            x = _sweep_key(_sweep_args(r)[1])
        else:
            x = 0.0 if r.is_full else round(_column_ratio(r), 6)
        groups.setdefault((_panel(r), _line(r, fields), x), []).append(r)
    out: dict[str, dict[str, dict[float, Point]]] = {}
    for (panel, line, ratio), group in sorted(groups.items()):
        records = [rec for r in group for rec in r.records]
        kept = [float(rec["kept_tokens"]) for rec in records if rec.get("kept_tokens") is not None]
        frac = [kept_fraction(rec) for rec in records]
        frac = [f for f in frac if f is not None]
        sweep = is_threshold_sweep(group[0])
        if sweep:
            where = 1.0 - _mean(frac) if frac else None
        elif group[0].multi_context:
            where = _mean([r.ratio for r in group])
        else:
            where = ratio
        out.setdefault(panel, {}).setdefault(line, {})[ratio] = Point(
            score=fmean(r.score for r in group),
            tasks=len(group),
            samples=min(len(r.records) or int(r.summary.get("num_samples", 0) or 0) for r in group),
            kept_tokens=_mean(kept),
            kept_fraction=_mean(frac),
            recomputed=_mean([r.recomputed_share for r in group if r.recomputed_share is not None])
            if group[0].multi_context else None,
            setting=group[0].setting if group[0].multi_context else "",
            x=where,
            swept=_sweep_args(group[0])[1] if sweep else "",
        )
    return out


def _sweep_key(swept: str) -> float:
    """The key of a sweep cell within its line: the swept value (``threshold=-4`` -> -4.0); settings that are not one
    number (``n_local=32,topk=1``) hash to a stable key, the whole text (a prefix would collide)."""
    try:
        return float(swept.partition("=")[2])
    except ValueError:
        return float(int.from_bytes(hashlib.sha1(swept.encode()).digest()[:6], "big"))


def _sweep_order(cell: Point) -> tuple:
    """Sweep rows: numeric settings from the largest down (``threshold=-3`` before ``-5``), then the others by name."""
    try:
        return (0, -float(cell.swept.partition("=")[2]), "")
    except ValueError:
        return (1, 0.0, cell.swept)


#: The key of a multi-context cell run with its strategy's own defaults (no nominal ratio).
RAG_DEFAULTS = -1.0


def _is_rag(cells_: dict[float, Point]) -> bool:
    return any(c.recomputed is not None for c in cells_.values())


def _is_sweep(cells_: dict[float, Point]) -> bool:
    return any(c.swept for c in cells_.values())


_BITS = re.compile(r", ([0-9.]+) b\]")


def _order(lines: dict[str, dict[float, Point]]) -> list[str]:
    """Full cache first, then by mean score over ratios (best first), equal means by name. Lines naming their
    storage's bits per value (several ``kv_dtype``): each method's lines together (methods by their best line's mean),
    widest storage first.

    The mean is rounded to 6 decimals before it is compared: two lines whose scores average to the same number would
    otherwise be ordered by the last bit of their float means."""
    def mean(line: str) -> float:
        scores = [c.score for c in lines[line].values()]
        return round(fmean(scores), 6)

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


def render_leaderboard(table: dict[str, dict[str, dict[float, Point]]]) -> str:
    """Markdown: one table per panel; cells ``score · kept tokens (share of context) · n``."""
    parts = []
    for panel, all_lines in table.items():
        lines = {k: v for k, v in all_lines.items() if not _is_rag(v) and not _is_sweep(v)}
        rag = {k: v for k, v in all_lines.items() if _is_rag(v)}
        sweeps = {k: v for k, v in all_lines.items() if _is_sweep(v)}
        # the full cache sits at 0 in its own column; a compressing line's ratio 0 (or a budget above every prompt)
        # is a ratio column of its own, never the full cache's
        ratios = sorted({x for line, cells_ in lines.items() for x in cells_ if x > 0 or not line.startswith("full")})
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
                row = [line, _fmt(lines[line].get(0.0)) if line.startswith("full") else ""]
                row += [_fmt(lines[line].get(x)) for x in ratios]
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
        if sweeps:
            thresholds = all(c.swept.split("=")[0] in SWEEP_ARGS for cells_ in sweeps.values() for c in cells_.values())
            what = "Threshold sweeps" if thresholds else "Runs set by their own arguments (no budget or ratio)"
            parts += [f"{what} on {panel} (no nominal ratio: cell: average score · kept tokens (share of the "
                      "prompt) · samples per task × tasks; plotted at ratio = 1 - kept share)", "",
                      "| method | setting | result |", "|---|---|---|"]
            for line in _order(sweeps):
                for cell in sorted(sweeps[line].values(), key=_sweep_order):
                    parts.append(f"| {line} | {cell.swept} | {_fmt(cell)} |")
            parts.append("")
    return "\n".join(parts)


def _fmt(cell: Point | None) -> str:
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
    """The method and settings a line plots (``snapkv (query-aware) [window=8]`` -> ``snapkv [window=8]``)."""
    return line.replace(" (query-aware)", "")


def line_styles(table: dict[str, dict[str, dict[float, Point]]]) -> dict[str, tuple[int, str]]:
    """A (tab20 colour index, marker) per method and settings (``adakv [base=compactor]`` is not ``adakv``),
    distinct within the figure and the same in every panel; a query-aware line shares its style and is dashed.
    20 colours times 10 markers."""
    bases = sorted({_base(line) for lines in table.values() for line in lines if not line.startswith("full")})
    return {b: (i % 20, _MARKERS[(i + i // 20) % len(_MARKERS)]) for i, b in enumerate(bases)}


def _points(cells_: dict[float, Point]) -> list[tuple[float, Point]]:
    """A line's (x, cell) in x order: its ratio, or where the cell sits (multi-context, threshold sweeps)."""
    pts = [(x if c.x is None and not c.swept else c.x, c) for x, c in cells_.items()]
    return sorted(((x, c) for x, c in pts if x is not None), key=lambda p: p[0])


def x_limit(lines: dict[str, dict[float, Point]]) -> float:
    """The right end of a panel's x axis: 0.9, or a little past its rightmost cell (16:1, 32:1), at most 1."""
    right = max((pts[-1][0] for pts in map(_points, lines.values()) if pts), default=0.0)
    return min(max(0.9, right + 0.03), 1.0)


LEGEND_ROWS = 24  # legend entries per column: what fits beside a 4.6-inch panel at x-small


def legend_columns(entries: int) -> int:
    """Columns for a legend of `entries` lines, so that it is no taller than its panel."""
    return max(1, math.ceil(entries / LEGEND_ROWS))


def draw_leaderboard(table: dict[str, dict[str, dict[float, Point]]]):
    """The leaderboard figure (matplotlib), one panel per model (and length); `plot_leaderboard` saves it."""
    plt = pyplot()
    n = len(table)
    if n == 0:
        raise KvjaxError("no scored runs to plot")
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    # a panel's legend has an entry per line with a point; each column past the first widens the figure 3 inches
    columns = [legend_columns(sum(bool(_points(cells_)) for cells_ in lines.values())) for lines in table.values()]
    fig, axes = plt.subplots(rows, cols, figsize=((8.0 + 3.0 * (max(columns) - 1)) * cols, 4.6 * rows), squeeze=False)
    styles, palette = line_styles(table), plt.get_cmap("tab20")
    for ax, (panel, lines), ncol in zip(axes.flat, table.items(), columns, strict=False):
        for line in _order(lines):
            pts = _points(lines[line])
            if not pts:
                continue
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
        ax.set_xlim(0.2, x_limit(lines))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=ncol)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_leaderboard(table: dict[str, dict[str, dict[float, Point]]], path: str) -> str:
    """One panel per model (and length): average score vs compression ratio, one line per method; the legend beside
    its panel, the image cropped to everything drawn (so that a wide legend is never cut off)."""
    fig = draw_leaderboard(table)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    pyplot().close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m kvjax.eval.leaderboard", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="directories holding run directories or *.runs.tar.xz archives "
                        "(searched recursively), or archives")
    parser.add_argument("--task", default=None, help="only these tasks (comma-separated, e.g. ruler/vt)")
    parser.add_argument("--out_dir", default=None, help="where leaderboard.png / leaderboard.md go (default: print)")
    args = parser.parse_args(argv)
    try:
        if args.out_dir:
            paths.output_folder("out_dir", args.out_dir)  # before reading anything
        runs = load_runs(args.paths)
        table = cells([r for r in runs if r.task in args.task.split(",")] if args.task else runs)
        if not table:
            raise KvjaxError(f"no scored runs under {', '.join(args.paths)}")
        markdown = render_leaderboard(table)
        print(markdown)
        if args.out_dir:
            try:
                with open(os.path.join(args.out_dir, "leaderboard.md"), "w", encoding="utf-8") as f:
                    f.write(markdown + "\n")
                print(plot_leaderboard(table, os.path.join(args.out_dir, "leaderboard.png")), file=sys.stderr)
            except OSError as e:  # a full disk, a folder made read-only meanwhile
                raise KvjaxError(f"cannot write to --out_dir {args.out_dir}: {e.strerror or e}") from None
    except KvjaxError as e:
        return refused("kvjax.eval.leaderboard", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
