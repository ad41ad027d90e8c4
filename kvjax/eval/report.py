"""Tables and plots from eval run directories.

    python -m kvjax.eval.report results/ [more_dirs...] [--format=md|csv] [--layout=pivot|long] [--plot_dir=plots/]
    python -m kvjax.eval.report --compare results_a/ results_b/

Finds run directories recursively (any directory holding ``config.json``, ``metrics.json`` or
``predictions*.jsonl``), merges the predictions of every process shard and of every directory holding
the same setting, recomputes each run's summary from its per-sample scores, and prints a pivot: one row
per (model,) method, the full cache first, one column per (task, budget), cells ``score (kept tokens)``
(``--layout=long`` / csv: one row per method and budget, one column per task).

The full cache is a run of the ``full`` method and nothing else. A compressing method run with neither budget nor
ratio (InfLLM / Q-LLM / ActQKV by ``topk``, ``per_layer``, DMS / KVzap thresholds, DuoAttention, ``decoding``) is
set by its own arguments: the pivot gives it a ``no budget`` column and a row per setting named by them
(``infllm [n_local=32,topk=1]``), the plots a point of its own; a ratio of 0 is a ``ratio 0`` column.

Plots (matplotlib, Agg backend): by default ``score_vs_budget.png`` in ``<first dir>/plots`` when a run has a
budget or is budget-less (one panel per task and the average, one line per method and setting: runs that differ
in a cell field, their arguments or query-awareness are never averaged into one line; one point per budget-less
setting at the tokens it kept, the full cache dashed), else (compression ratios only, or the full cache alone)
``score_vs_ratio__<task>.png`` per task and ``score_vs_ratio__average.png`` when there are several; or a note
when it cannot be written. With ``--plot_dir`` every plot there:

* ``score_vs_budget.png`` as above;
* ``score_vs_ratio__<task>.png``: score against compression ratio, one line per method, one point per budget-less
  setting at its realised ratio (one minus the share of the prompt it kept), the full cache as a dashed line (and
  ``score_vs_ratio__average.png`` over tasks), like kvpress's leaderboard plot;
* ``heatmap__<task>__<method>__<setting>.png``: depth x length grids of needle / passkey runs.

``--compare`` checks that two result directories hold the same predictions, ignoring each record's
wall-clock ``timings`` (everything else of a record is deterministic for identical runs).

The compression ratio of a budget run is ``1 - budget / prompt_tokens`` averaged over its samples
(0 for a budget above the prompt); ratio runs use their ratio; budget-less runs their realised one; full-cache runs
are at 0.

Runs are merged on their whole cell key (``kvjax.eval.cell.CellKey``: dtype, seed, chat template, ...
included); where the runs shown differ in such a setting, the rows name it (``snapkv [dtype=bfloat16]``).
Multi-context (RAG) cells show their kept share of the context and their recomputed share (SamKV's
Table 1 ratios) instead of kept tokens: ``score (kept 86%, recomputed 83%)``.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import sys
from collections.abc import Sequence
from statistics import fmean
from typing import Any

from kvjax.cli.refuse import ArgumentParser, refused
from kvjax.errors import KvjaxError
from kvjax.eval.plots import default_plots, plot_budget, plot_heatmaps, plot_scores
from kvjax.eval.results import deterministic_part
from kvjax.eval.runs import Run, column_label, load_runs, method_label, row_label, task_columns, varying_fields
from kvjax.tasks.base import DataError

NAME = "kvjax.eval.report"

__all__ = ["main", "render_pivot", "render_table"]


def _fmt(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


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
    cols = task_columns(runs)
    labels = list(dict.fromkeys(cols.values()))
    many_models = len({r.model for r in runs}) > 1
    fields = varying_fields(runs)
    rows: dict[tuple[str, str, str], dict[str, float | None]] = {}
    order: dict[tuple[str, str, str], tuple[Any, ...]] = {}
    for r in runs:
        key = (r.model, method_label(r, fields), r.setting)
        rows.setdefault(key, {})[cols[(r.task, r.context_length)]] = r.score
        order[key] = _row_order(r)
    header = (["model"] if many_models else []) + ["method", "budget"] + labels + ["avg"]
    body = []
    for key in sorted(rows, key=lambda k: order[k]):
        scores = rows[key]
        present = [s for s in scores.values() if s is not None]
        avg = fmean(present) if present else None
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


def _bits(r: Run) -> str:
    return "" if r.kv_bits is None else f"{r.kv_bits:.3g} b"


def _pivot_cell(r: Run, bits: bool = False) -> str:
    """``score (kept tokens)``; with `bits` (a pivot holding a quantized cache) ``score (kept tokens, <bits> b)``."""
    score = _fmt1(r.score)
    extra = [_bits(r)] if bits and r.kv_bits is not None else []
    if r.multi_context:
        shares = [f"{name} {100 * x:.0f}%" for name, x in (("kept", r.kept_share), ("recomputed", r.recomputed_share))
                  if x is not None]
        shares += extra
        return score + (f" ({', '.join(shares)})" if shares else "")
    parts = ([f"{r.kept:.0f}"] if r.kept is not None else []) + extra
    if parts:
        score += f" ({', '.join(parts)})"
    return score + ("*" if r.above_prompt else "")


def _query_aware_column(label: str) -> bool:
    """Whether a pivot column holds query-aware runs (its label ends with `(query-aware)`, `Run.amount`)."""
    return label.endswith("(query-aware)")


def _fmt1(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def render_pivot(runs: Sequence[Run]) -> str:
    """A Markdown table read at a glance: one row per (model,) method, the full cache first; one column per
    (task, budget or ratio); cells ``score (kept tokens)``, ``*`` where the budget was at least the prompt
    (the method ran as the full cache). The full cache (the ``full`` method only) fills every column of its task
    (the ceiling; where it ran both ways, each run the columns of its own kind, query-aware or not); ``avg``
    columns average each budget over tasks. Methods run without a budget or ratio (set by
    their own arguments: ``topk``, a threshold, per-layer ratios) share a ``no budget`` column, one row per
    setting, named by its arguments."""
    cols = task_columns(runs)
    budgets = sorted({(r.budget is None, r.budget or 0, r.budgetless, r.compression_ratio or 0.0, column_label(r))
                      for r in runs if not r.is_full})
    labels = [b[-1] for b in budgets] or sorted({r.amount for r in runs if r.is_full}) or ["full"]
    many_models = len({r.model for r in runs}) > 1
    fields = varying_fields(runs)
    bits = any(r.extras.get("kv_dtype") is not None for r in runs)  # a quantized cache: bits beside every score
    rows: dict[tuple[str, str], dict[tuple[str, str], Run]] = {}
    order: dict[tuple[str, str], tuple[Any, ...]] = {}
    for r in runs:
        key = (r.model, row_label(r, fields))
        widest = (r.method, -(r.kv_bits or 0.0)) if bits else ()  # each method's cache formats, widest first
        order.setdefault(key, (r.model, not r.is_full, *widest, key[1]))
        task = cols[(r.task, r.context_length)]
        cells = rows.setdefault(key, {})
        for label in labels if r.is_full else [column_label(r)]:
            held = cells.get((task, label))
            if r.is_full and held is not None and _query_aware_column(label) == held.query_aware != r.query_aware:
                continue  # the full cache run the column's way (query-aware or not) stays in it
            cells[(task, label)] = r
    tasks = list(dict.fromkeys(cols.values()))
    columns = [(t, b) for t in tasks for b in labels]
    header = (["model"] if many_models else []) + ["method"] + [f"{t} @{b}" if b else t for t, b in columns]
    if len(tasks) > 1:
        header += [f"avg @{b}" if b else "avg" for b in labels]
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join(["---"] * (2 if many_models else 1) + ["---:"] * (len(header) - 1 - many_models)) + "|")
    starred = False
    for key in sorted(rows, key=lambda k: order[k]):
        cells = rows[key]
        row = ([key[0]] if many_models else []) + [key[1]]
        row += [_pivot_cell(cells[c], bits) if c in cells else "" for c in columns]
        starred = starred or any(cells[c].above_prompt for c in columns if c in cells)
        if len(tasks) > 1:
            for b in labels:
                scores = [cells[(t, b)].score for t in tasks if (t, b) in cells and cells[(t, b)].score is not None]
                row.append(_fmt1(fmean(scores)) if len(scores) == len(tasks) else "")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    rag_note = "(share of the context tokens kept in the decode cache, share recomputed: SamKV's Table 1 ratios)"
    if all(r.multi_context for r in runs):
        note = f"\nscore x100 {rag_note}"
    else:
        note = "\nscore x100 (mean tokens of the prompt kept per KV head and layer)"
        if any(r.multi_context for r in runs):
            note += f"; multi-context strategies: {rag_note}"
    if bits:
        note += ("; b: stored bits per cached key / value, scales and zero points included (KIVI's full-precision "
                 "residual tokens not counted)")
    if starred:
        note += "; * the budget was at least the prompt: those samples ran with the whole prompt kept"
    return "\n".join(lines) + "\n" + note + "\n"


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
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
        "--layout",
        choices=("pivot", "long"),
        default="pivot",
        help="md table: pivot (a row per method, full cache first, a column per task and budget, cells "
        "'score (kept tokens)'; the default) or long (a row per method and budget, a column per task)",
    )
    p.add_argument(
        "--plot_dir",
        default=None,
        help="write every plot here: score vs budget, score vs compression ratio per task, needle heatmaps "
        "(an unwritable folder is an error). Default: only score_vs_budget.png (or the ratio plot) in "
        "<first dir>/plots, skipped with a note when it cannot be written",
    )
    p.add_argument("--no_plots", action="store_true", help="write no plot")
    p.add_argument("--output", default=None, help="write the table to this file instead of stdout")
    p.add_argument(
        "--compare",
        action="store_true",
        help="compare the predictions of exactly two result directories, ignoring each record's wall-clock "
        "'timings'; exit 0 when identical, 1 otherwise",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 on bad input)."""
    args = _parser().parse_args(argv)
    try:
        if args.compare:
            return _compare(args.dirs)
        runs = load_runs(args.dirs)
        if not runs:
            raise DataError(f"no eval runs found under {', '.join(args.dirs)}")
        long = args.format == "csv" or args.layout == "long"
        table = render_table(runs, args.format) if long else render_pivot(runs)
    except KvjaxError as e:
        return refused(NAME, e)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(table)
        except OSError as e:
            sys.stdout.write(table)
            return refused(NAME, f"cannot write --output {args.output}: {e.strerror or e}")
    else:
        sys.stdout.write(table)
    if args.no_plots:
        return 0
    if args.plot_dir is None:
        plots, note = default_plots(runs, os.path.join(args.dirs[0], "plots"))
        if note:
            print(note, file=sys.stderr)
    else:
        try:
            plots = plot_budget(runs, args.plot_dir) + plot_scores(runs, args.plot_dir)
            plots += plot_heatmaps(runs, args.plot_dir)
        except KvjaxError as e:
            return refused(NAME, e)
        except OSError as e:
            return refused(NAME, f"cannot write plots to --plot_dir {args.plot_dir}: {e.strerror or e}")
    for path in plots:
        print(f"plot: {path}", file=sys.stderr)
    return 0


def _compare(dirs: Sequence[str]) -> int:
    """Prints the settings whose predictions differ between two result directories (timings ignored)."""
    if len(dirs) != 2:
        raise KvjaxError(f"--compare takes two result directories, got {len(dirs)}")
    sides = []
    for d in dirs:
        runs = load_runs([d])
        if not runs:
            raise DataError(f"no eval runs found under {d}")
        sides.append({r.key: r for r in runs})
    differ = 0
    for key in sorted(set(sides[0]) | set(sides[1]), key=str):
        a, b = (side.get(key) for side in sides)
        run = a or b
        label = f"{method_label(run, [k for k, v in run.extras.items() if v is not None])} {run.setting} on " \
            f"{run.task} @ {run.context_length}"
        if a is None or b is None:
            print(f"only in {dirs[0] if b is None else dirs[1]}: {label}")
            differ += 1
            continue
        left, right = (sorted((deterministic_part(x) for x in r.records), key=lambda x: str(x["id"])) for r in (a, b))
        if left != right:
            print(f"differ: {label}")
            differ += 1
    print(f"{differ} of {len(set(sides[0]) | set(sides[1]))} settings differ (timings ignored)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
