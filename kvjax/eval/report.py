"""Tables and plots from eval run directories.

    python -m kvjax.eval.report results/ [more_dirs...] [--format=md|csv] [--plot_dir=plots/]

Finds run directories recursively (any directory holding ``config.json``, ``metrics.json`` or
``predictions*.jsonl``), merges the predictions of every process shard and of every directory holding
the same setting, recomputes each run's summary from its per-sample scores, and prints a table with one
row per (model,) method and budget / compression ratio and one column per task, plus the average.

With ``--plot_dir`` it writes PNGs (matplotlib, Agg backend; an optional dependency):

* ``score_vs_ratio__<task>.png``: score against compression ratio, one line per method, the full cache as
  a dashed line (and ``score_vs_ratio__average.png`` over tasks), like kvpress's leaderboard plot;
* ``heatmap__<task>__<method>__<setting>.png``: depth x length grids of needle / passkey runs.

The compression ratio of a budget run is ``1 - budget / prompt_tokens`` averaged over its samples
(0 for a budget above the prompt); ratio runs use their ratio; full-cache runs are at 0.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvjax.errors import KvjaxError
from kvjax.eval.results import METRICS, read_predictions, summarize
from kvjax.eval.tasks.base import DataError

__all__ = ["Run", "find_run_dirs", "load_runs", "main", "plot_heatmaps", "plot_scores", "render_table"]

_PRED_FILE = re.compile(r"predictions(\.\d+-of-\d+)?\.jsonl")
FULL_METHODS = frozenset({"full", "none", "no_press", "dense"})


@dataclass
class Run:
    """One evaluated setting, merged over shards and directories."""

    model: str
    method: str
    budget: int | None
    compression_ratio: float | None
    task: str
    context_length: int | None
    query_aware: bool
    method_args: str
    dirs: list[str] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    stored_metrics: dict[str, Any] | None = None

    @property
    def is_full(self) -> bool:
        return self.method in FULL_METHODS or (self.budget is None and self.compression_ratio in (None, 0, 0.0))

    @property
    def setting(self) -> str:
        """Budget label: the token budget, ``ratio <r>`` or ``full``."""
        if self.budget is not None:
            label = str(self.budget)
        elif self.compression_ratio is not None:
            label = f"ratio {self.compression_ratio:g}"
        else:
            label = "full"
        if self.query_aware:
            label += " (query-aware)"
        if self.method_args:
            label += f" [{self.method_args}]"
        return label

    @property
    def summary(self) -> dict[str, Any]:
        if self.records:
            return summarize(self.records, self.task)
        return dict(self.stored_metrics or {})

    @property
    def score(self) -> float | None:
        s = self.summary.get("score")
        return float(s) if isinstance(s, int | float) else None

    @property
    def ratio(self) -> float:
        """Compression ratio used as the x axis of the plots."""
        if self.compression_ratio is not None:
            return float(self.compression_ratio)
        if self.budget is None or self.is_full:
            return 0.0
        lengths = [r.get("metadata", {}).get("num_tokens") or self.context_length for r in self.records]
        lengths = [float(x) for x in lengths if x]
        if not lengths and self.context_length:
            lengths = [float(self.context_length)]
        if not lengths:
            return 0.0
        return sum(max(0.0, 1.0 - self.budget / n) for n in lengths) / len(lengths)


def find_run_dirs(paths: Sequence[str]) -> list[str]:
    """Directories under ``paths`` (recursively) that hold run files."""
    found: list[str] = []
    for root in paths:
        if not os.path.isdir(root):
            raise DataError(f"not a directory: {root}")
        for d, _, files in os.walk(root):
            if METRICS in files or "config.json" in files or any(_PRED_FILE.fullmatch(f) for f in files):
                found.append(d)
    return sorted(set(found))


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    return obj if isinstance(obj, dict) else None


def _opt_int(v: Any) -> int | None:
    return None if v is None or v == "" else int(v)


def _opt_float(v: Any) -> float | None:
    return None if v is None or v == "" else float(v)


def load_runs(paths: Sequence[str]) -> list[Run]:
    """Runs found under ``paths``; directories with the same setting (e.g. one per host) are merged."""
    runs: dict[tuple[Any, ...], Run] = {}
    for d in find_run_dirs(paths):
        config = _read_json(os.path.join(d, "config.json")) or {}
        stored = _read_json(os.path.join(d, METRICS))
        files = sorted(os.path.join(d, f) for f in os.listdir(d) if _PRED_FILE.fullmatch(f))
        records = read_predictions(files)
        first = records[0] if records else {}
        md = first.get("metadata", {}) if first else {}
        flags = config.get("flags") if isinstance(config.get("flags"), dict) else {}
        margs = config.get("method_args", flags.get("method_args")) or {}
        run = Run(
            model=str(config.get("model") or ""),
            method=str(config.get("method") or first.get("method") or os.path.basename(d)),
            budget=_opt_int(config.get("budget", first.get("budget"))),
            compression_ratio=_opt_float(config.get("compression_ratio", first.get("compression_ratio"))),
            task=str(config.get("task") or first.get("task") or md.get("task") or ""),
            context_length=_opt_int(config.get("context_length", md.get("context_length"))),
            query_aware=bool(config.get("query_aware", flags.get("query_aware", False))),
            method_args=(
                ",".join(f"{k}={v}" for k, v in sorted(margs.items())) if isinstance(margs, dict) else str(margs)
            ),
        )
        key = (
            run.model,
            run.method,
            run.budget,
            run.compression_ratio,
            run.task,
            run.context_length,
            run.query_aware,
            run.method_args,
        )
        merged = runs.setdefault(key, run)
        merged.dirs.append(d)
        seen = {str(r["id"]) for r in merged.records}
        merged.records.extend(r for r in records if str(r["id"]) not in seen)
        if stored and not merged.stored_metrics:
            merged.stored_metrics = stored
    return list(runs.values())


def _fmt(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def _columns(runs: Sequence[Run]) -> dict[tuple[str, int | None], str]:
    """Column label per (task, context length): the task name, with ``@<length>`` where a task was run at
    several context lengths."""
    cols: dict[tuple[str, int | None], str] = {}
    for r in runs:
        cols.setdefault((r.task, r.context_length), r.task)
    for key in cols:
        if sum(1 for t, _ in cols if t == key[0]) > 1:
            cols[key] = f"{key[0]}@{key[1]}"
    first = {t: i for i, t in reversed(list(enumerate(t for t, _ in cols)))}
    return dict(sorted(cols.items(), key=lambda kv: (first[kv[0][0]], kv[0][1] or 0)))


def _row_order(r: Run) -> tuple[Any, ...]:
    return (
        r.model,
        not r.is_full,
        r.method,
        r.budget is None,
        r.budget or 0,
        r.compression_ratio or 0.0,
        r.setting,
    )


def render_table(runs: Sequence[Run], fmt: str = "md") -> str:
    """Rows: (model,) method and budget; columns: tasks (per context length when several); cells: the
    primary score x100; ``avg`` is the mean over the row's filled cells."""
    if fmt not in ("md", "csv"):
        raise KvjaxError(f"unknown table format {fmt!r}; use md or csv")
    cols = _columns(runs)
    labels = list(dict.fromkeys(cols.values()))
    many_models = len({r.model for r in runs}) > 1
    rows: dict[tuple[str, str, str], dict[str, float | None]] = {}
    order: dict[tuple[str, str, str], tuple[Any, ...]] = {}
    for r in runs:
        key = (r.model, r.method, r.setting)
        rows.setdefault(key, {})[cols[(r.task, r.context_length)]] = r.score
        order[key] = _row_order(r)
    header = (["model"] if many_models else []) + ["method", "budget"] + labels + ["avg"]
    body = []
    for key in sorted(rows, key=lambda k: order[k]):
        scores = rows[key]
        present = [s for s in scores.values() if s is not None]
        avg = sum(present) / len(present) if present else None
        cells = ([key[0]] if many_models else []) + [key[1], key[2]]
        cells += [_fmt(scores.get(t)) for t in labels] + [_fmt(avg)]
        body.append(cells)
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(body)
        return buf.getvalue()
    n_text = len(header) - len(labels) - 1
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join(["---"] * n_text + ["---:"] * (len(labels) + 1)) + "|")
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise KvjaxError(
            "plots need matplotlib, which is not installed: pip install matplotlib (or drop --plot_dir)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _file_tag(*parts: str) -> str:
    return "__".join(re.sub(r"[^A-Za-z0-9._=-]+", "-", p).strip("-") or "_" for p in parts)


def plot_scores(runs: Sequence[Run], plot_dir: str) -> list[str]:
    """Score vs compression ratio per method, one PNG per task (and the average over tasks)."""
    plt = _pyplot()
    os.makedirs(plot_dir, exist_ok=True)
    cols = _columns(runs)
    series: dict[str, list[Run]] = {}
    for r in runs:
        series.setdefault(cols[(r.task, r.context_length)], []).append(r)
    series = dict(sorted(series.items()))
    if len(series) > 1:
        series["average"] = _average_runs(runs, cols)
    written = []
    for task, group in series.items():
        if not group:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in group:
            if r.score is None:
                continue
            label = f"{r.model}/{r.method}" if len({x.model for x in group}) > 1 else r.method
            if r.is_full:
                full_label = label if r.method in FULL_METHODS else f"{label} (full cache)"
                ax.axhline(r.score, linestyle="--", color="grey", label=full_label)
            else:
                lines.setdefault(label, []).append((r.ratio, r.score))
        for label, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xlabel("compression ratio")
        ax.set_ylabel("score")
        ax.set_title(task)
        ax.set_xlim(-0.02, 1.0)
        ax.grid(alpha=0.3)
        if lines or any(r.is_full for r in group):
            ax.legend(fontsize="small")
        path = os.path.join(plot_dir, f"score_vs_ratio__{_file_tag(task)}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _average_runs(runs: Sequence[Run], cols: Mapping[tuple[str, int | None], str]) -> list[Run]:
    """Synthetic runs holding the mean score over all columns per (model, method, setting)."""
    groups: dict[tuple[str, str, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.model, r.method, r.setting), []).append(r)
    out = []
    for group in groups.values():
        scores = [r.score for r in group if r.score is not None]
        if len({(r.task, r.context_length) for r in group}) != len(cols) or not scores:
            continue  # only settings evaluated on every task
        base = group[0]
        avg = Run(
            model=base.model,
            method=base.method,
            budget=None,
            compression_ratio=sum(r.ratio for r in group) / len(group),
            task="average",
            context_length=base.context_length,
            query_aware=base.query_aware,
            method_args=base.method_args,
            stored_metrics={"score": sum(scores) / len(scores)},
        )
        if base.is_full:
            avg.method = base.method if base.method in FULL_METHODS else "full"
            avg.compression_ratio = None
        out.append(avg)
    return out


def plot_heatmaps(runs: Sequence[Run], plot_dir: str) -> list[str]:
    """Depth x length heatmaps of the primary score for runs whose samples carry depth and length."""
    pooled: dict[tuple[str, str, str, str], list[Run]] = {}
    for r in runs:  # one run per context length: pool them into one grid
        pooled.setdefault((r.task, r.model, r.method, r.setting), []).append(r)
    written = []
    for group in pooled.values():
        r = group[0]
        cells: dict[tuple[float, int], list[float]] = {}
        for rec in (x for run in group for x in run.records):
            md = rec.get("metadata", {})
            metric = rec.get("metric")
            if "depth" in md and "length" in md and metric in rec.get("scores", {}):
                cells.setdefault((float(md["depth"]), int(md["length"])), []).append(float(rec["scores"][metric]))
        if len(cells) < 2:
            continue
        plt = _pyplot()
        os.makedirs(plot_dir, exist_ok=True)
        depths = sorted({d for d, _ in cells})
        lengths = sorted({n for _, n in cells})
        grid = [
            [100.0 * sum(cells[(d, n)]) / len(cells[(d, n)]) if (d, n) in cells else math.nan for n in lengths]
            for d in depths
        ]
        fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.45 * len(depths)))
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth (%)")
        ax.set_title(f"{r.task}: {r.method} {r.setting}", fontsize="small")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        path = os.path.join(plot_dir, f"heatmap__{_file_tag(r.task, r.model, r.method, r.setting)}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvjax.eval.report",
        description=(
            "Summarise kvjax eval runs: finds run directories (config.json / metrics.json / "
            "predictions*.jsonl) under the given paths, merges process shards, prints a method x "
            "budget x task table of primary scores (x100) and optionally writes PNG plots."
        ),
    )
    p.add_argument("dirs", nargs="+", help="result directories to search recursively")
    p.add_argument("--format", choices=("md", "csv"), default="md", help="table format (default: md)")
    p.add_argument(
        "--plot_dir",
        default=None,
        help="write score-vs-compression-ratio plots and needle heatmaps (PNG) here; needs "
        "matplotlib (default: no plots)",
    )
    p.add_argument("--output", default=None, help="write the table to this file instead of stdout")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 on bad input)."""
    args = _parser().parse_args(argv)
    try:
        runs = load_runs(args.dirs)
        if not runs:
            raise DataError(f"no eval runs found under {', '.join(args.dirs)}")
        table = render_table(runs, args.format)
        plots: list[str] = []
        if args.plot_dir:
            plots = plot_scores(runs, args.plot_dir) + plot_heatmaps(runs, args.plot_dir)
    except KvjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(table)
    else:
        sys.stdout.write(table)
    for path in plots:
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
