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
budget or is budget-less (one panel per task and the average, one line per method, one point per budget-less
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
import dataclasses
import io
import json
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from kvjax.cli.refuse import ArgumentParser, refused
from kvjax.errors import KvjaxError
from kvjax.eval import archive
from kvjax.eval.cell import EXTRA_FIELDS, CellKey
from kvjax.eval.results import METRICS, deterministic_part, read_json_object, read_predictions, summarize
from kvjax.tasks.base import DataError

NAME = "kvjax.eval.report"

__all__ = [
    "Panel",
    "Run",
    "budget_panels",
    "default_plots",
    "draw_budget",
    "find_run_dirs",
    "kept_fraction",
    "load_runs",
    "main",
    "plot_budget",
    "plot_heatmaps",
    "plot_scores",
    "ratio_panels",
    "render_pivot",
    "render_table",
    "row_label",
]

_PRED_FILE = re.compile(r"predictions(\.\d+-of-\d+)?\.jsonl")
FULL_METHODS = frozenset({"full", "none", "no_press", "dense"})


@dataclass
class Run:
    """One evaluated cell, merged over shards and directories: a view of its ``CellKey`` (``cell``, what runs merge
    on) with the records and metrics its run directories hold."""

    cell: CellKey
    dirs: list[str] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    stored_metrics: dict[str, Any] | None = None
    multi_context: bool = False  # a RAG strategy's cell (kvjax.rag)

    @property
    def key(self) -> tuple[str, bool]:
        """What runs merge on: the whole cell key (as its JSON form: argument values may be dicts or lists)."""
        return json.dumps(self.cell.as_dict(), sort_keys=True, default=str), self.multi_context

    @property
    def model(self) -> str:
        return self.cell.model

    @property
    def method(self) -> str:
        return self.cell.method

    @property
    def budget(self) -> int | None:
        return self.cell.budget

    @property
    def compression_ratio(self) -> float | None:
        return self.cell.compression_ratio

    @property
    def task(self) -> str:
        return self.cell.task

    @property
    def context_length(self) -> int | None:
        return self.cell.context_length or None

    @property
    def query_aware(self) -> bool:
        return self.cell.query_aware

    @property
    def method_args(self) -> str:
        """The method arguments as ``name=value,...`` (sorted by name)."""
        return ",".join(f"{k}={v}" for k, v in self.cell.method_args)

    @property
    def extras(self) -> dict[str, Any]:
        """The cell key's fields beyond method, amount, task and length (seed, dtype, kv_dtype, ...)."""
        return self.cell.extras()

    @property
    def is_full(self) -> bool:
        """The full cache: a run of the ``full`` method (``FULL_METHODS``) and nothing else. A compressing method run
        without a budget or ratio (``budgetless``) and a multi-context strategy have their own rows and points."""
        return not self.multi_context and self.method in FULL_METHODS

    @property
    def budgetless(self) -> bool:
        """A compressing method run with neither a budget nor a ratio: its own arguments (InfLLM's ``topk``, a DMS /
        KVzap ``threshold``, ``per_layer``'s ratios, DuoAttention's pattern, ``decoding``'s target size) or its
        defaults set what it keeps."""
        return not self.multi_context and not self.is_full and self.budget is None and self.compression_ratio is None

    @property
    def amount(self) -> str:
        """The setting without the method arguments: the token budget, ``ratio <r>``, ``full``, ``no budget`` (a
        budget-less run), or nothing for a multi-context strategy's own defaults; `` (query-aware)`` appended."""
        if self.budget is not None:
            label = str(self.budget)
        elif self.compression_ratio is not None:
            label = f"ratio {self.compression_ratio:g}"
        elif self.multi_context:
            label = ""
        else:
            label = "no budget" if self.budgetless else "full"
        if self.query_aware:
            label += " (query-aware)"
        return label.strip()

    @property
    def setting(self) -> str:
        """Budget label: ``amount`` and the method arguments in brackets (``no budget [topk=1]``)."""
        return (self.amount + (f" [{self.method_args}]" if self.method_args else "")).strip()

    def _mean_field(self, name: str) -> float | None:
        values = [float(r[name]) for r in self.records if isinstance(r.get(name), int | float)]
        if values:
            return fmean(values)
        stored = (self.stored_metrics or {}).get(f"mean_{name}")
        return float(stored) if isinstance(stored, int | float) else None

    @property
    def kept_share(self) -> float | None:
        """Multi-context cells: the mean share of the context tokens kept in the decode cache."""
        return self._mean_field("sequence_ratio")

    @property
    def recomputed_share(self) -> float | None:
        """Multi-context cells: the mean share of the context tokens recomputed."""
        return self._mean_field("recompute_ratio")

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
    def kept(self) -> float | None:
        """Mean tokens of the prompt the final cache held (per KV head and layer), over the samples."""
        values = [float(r["kept_tokens"]) for r in self.records if isinstance(r.get("kept_tokens"), int | float)]
        if values:
            return fmean(values)
        stored = (self.stored_metrics or {}).get("mean_kept_tokens")
        return float(stored) if isinstance(stored, int | float) else None

    @property
    def kv_bits(self) -> float | None:
        """Stored bits per cached K / V value (`kv_bits_per_value` of the records; for runs older than it, the
        model dtype's width when the cell names its dtype)."""
        bits = self._mean_field("kv_bits_per_value")
        if bits is None and self.extras.get("kv_dtype") is None:
            widths = {"float32": 32.0, "bfloat16": 16.0, "float16": 16.0}
            bits = widths.get(str(self.extras.get("dtype")))
        return bits

    @property
    def above_prompt(self) -> int:
        """Samples whose budget was at least their prompt: they ran with the whole prompt kept."""
        return sum(1 for r in self.records if r.get("budget_above_prompt"))

    @property
    def kept_fraction(self) -> float | None:
        """Mean share of the prompt the final cache held, over the samples (``kept_fraction``)."""
        values = [f for f in map(kept_fraction, self.records) if f is not None]
        if values:
            return fmean(values)
        stored = (self.stored_metrics or {}).get("mean_kept_fraction")
        return float(stored) if isinstance(stored, int | float) else None

    @property
    def ratio(self) -> float:
        """Compression ratio used as the x axis of the plots: a multi-context cell's and a budget-less run's are
        realised (one minus the share kept; NaN when the records hold no kept counts)."""
        if self.multi_context and self.kept_share is not None:
            return max(0.0, 1.0 - self.kept_share)
        if self.compression_ratio is not None:
            return float(self.compression_ratio)
        if self.budgetless:
            kept = self.kept_fraction
            return math.nan if kept is None else max(0.0, 1.0 - kept)
        if self.budget is None or self.is_full:
            return 0.0
        lengths = [r.get("metadata", {}).get("num_tokens") or self.context_length for r in self.records]
        lengths = [float(x) for x in lengths if x]
        if not lengths and self.context_length:
            lengths = [float(self.context_length)]
        if not lengths:
            return 0.0
        return fmean(max(0.0, 1.0 - self.budget / n) for n in lengths)


def kept_fraction(rec: Mapping[str, Any]) -> float | None:
    """A record's share of the prompt the model saw and kept (retrieval methods see the question twice); a multi-context
    record's kept share of the context; records written before ``kept_fraction`` existed: kept tokens over context +
    question tokens."""
    if rec.get("sequence_ratio") is not None:
        return float(rec["sequence_ratio"])
    if rec.get("kept_fraction") is not None:
        return float(rec["kept_fraction"])
    if rec.get("kept_tokens") is None or not rec.get("context_tokens"):
        return None
    return float(rec["kept_tokens"]) / (float(rec["context_tokens"]) + float(rec.get("question_tokens") or 0))


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


def _run_sources(paths: Sequence[str]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any] | None, list[dict]]]:
    """(directory, config, stored metrics, records) of every run under ``paths``: run directories on disk,
    then the run directories packed in ``*.runs.tar.xz`` archives (``kvjax.eval.archive``)."""
    for d in find_run_dirs([p for p in paths if not archive.is_archive(p)]):
        config = read_json_object(os.path.join(d, "config.json")) or {}
        files = sorted(os.path.join(d, f) for f in os.listdir(d) if _PRED_FILE.fullmatch(f))
        yield d, config, read_json_object(os.path.join(d, METRICS)), read_predictions(files)
    for path in archive.find_archives(paths):
        for packed in archive.read_archive(path):
            yield packed.path, packed.config or {}, packed.metrics, packed.records


def load_runs(paths: Sequence[str]) -> list[Run]:
    """Runs found under ``paths`` (directories or run archives); directories with the same setting (e.g. one
    per host) are merged."""
    runs: dict[tuple[Any, ...], Run] = {}
    for d, config, stored, records in _run_sources(paths):
        first = records[0] if records else {}
        cell = CellKey.from_config(config, first)
        if not cell.method:  # a directory with neither config.json nor records naming the method
            cell = dataclasses.replace(cell, method=os.path.basename(d))
        run = Run(cell, multi_context=bool(config.get("multi_context")) or "recompute_ratio" in first)
        merged = runs.setdefault(run.key, run)
        merged.dirs.append(d)
        seen = {str(r["id"]) for r in merged.records}
        merged.records.extend(r for r in records if str(r["id"]) not in seen)
        if stored and not merged.stored_metrics:
            merged.stored_metrics = stored
    return list(runs.values())


#: Cell-key fields that describe a task's prompt layout: `--answer_prefix` applies to the niah tasks only, so a sweep
#: over niah and vt holds both values. Such a field names a line or row only where it differs within one task.
TASK_LAYOUT_FIELDS = ("answer_prefix",)


def varying_fields(runs: Sequence[Run]) -> list[str]:
    """The cell-key fields beyond method, amount, task and length whose values differ between ``runs`` (a
    `TASK_LAYOUT_FIELDS` field: between runs of one task and length)."""
    by_task: dict[tuple[str, int | None], list[Run]] = {}
    for r in runs:
        by_task.setdefault((r.task, r.context_length), []).append(r)

    def varies(k: str) -> bool:
        groups = by_task.values() if k in TASK_LAYOUT_FIELDS else [runs]
        return any(len({repr(r.extras.get(k)) for r in group}) > 1 for group in groups)

    return [k for k in EXTRA_FIELDS if varies(k)]


def method_label(run: Run, fields: Sequence[str]) -> str:
    """``method`` plus the values of the varying ``fields`` (``snapkv [dtype=bfloat16, seed=1]``)."""
    tags = [f"{k}={run.extras.get(k) if k != 'kv_dtype' else run.extras.get(k) or 'model'}" for k in fields]
    return run.method + (f" [{', '.join(tags)}]" if tags else "")


def row_label(run: Run, fields: Sequence[str]) -> str:
    """``method_label``, and for a budget-less run the arguments that set what it kept
    (``infllm [n_local=32,topk=1]``): such runs share one ``no budget`` column, so their row names them."""
    label = method_label(run, fields)
    return label + (f" [{run.method_args}]" if run.budgetless and run.method_args else "")


def column_label(run: Run) -> str:
    """The pivot's column of a run within its task: its ``setting``, or ``no budget`` for every budget-less run."""
    return run.amount if run.budgetless else run.setting


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


def _fmt1(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def render_pivot(runs: Sequence[Run]) -> str:
    """A Markdown table read at a glance: one row per (model,) method, the full cache first; one column per
    (task, budget or ratio); cells ``score (kept tokens)``, ``*`` where the budget was at least the prompt
    (the method ran as the full cache). The full cache (the ``full`` method only) fills every column of its task
    (the ceiling); ``avg`` columns average each budget over tasks. Methods run without a budget or ratio (set by
    their own arguments: ``topk``, a threshold, per-layer ratios) share a ``no budget`` column, one row per
    setting, named by its arguments."""
    cols = _columns(runs)
    budgets = sorted({(r.budget is None, r.budget or 0, r.budgetless, r.compression_ratio or 0.0, column_label(r))
                      for r in runs if not r.is_full})
    labels = [b[-1] for b in budgets] or ["full"]
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
        for label in labels if r.is_full else [column_label(r)]:
            rows.setdefault(key, {})[(task, label)] = r
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


def _pyplot() -> Any:
    import logging

    quiet = logging.getLogger("matplotlib")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # an unwritable config dir (a read-only home): it uses a temporary one, say nothing
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KvjaxError(
            "plots need matplotlib, which is not installed (pip install matplotlib)"
        ) from None
    finally:
        quiet.setLevel(level)
    return plt


def _file_tag(*parts: str) -> str:
    return "__".join(re.sub(r"[^A-Za-z0-9._=-]+", "-", p).strip("-") or "_" for p in parts)


@dataclass
class Panel:
    """What one plot panel draws: the full cache as dashed lines (label, score), one line per method over its budgets
    or ratios (label -> sorted (x, score)), and one point per budget-less setting (label -> (x, score)), the points
    labelled by the arguments that set them."""

    full: list[tuple[str, float]] = field(default_factory=list)
    lines: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    points: dict[str, tuple[float, float]] = field(default_factory=dict)


def _mean(xs: Sequence[float]) -> float:
    """Every mean a table shows comes from an exactly rounded sum (`statistics.fmean`), so a table rendered from an
    archive is the same on every Python: a plain `sum` of floats is compensated on 3.12 and not on 3.11, which moved
    a kept-token count at .5 by one and swapped two rows of equal mean score."""
    return fmean(xs)


def _per_setting(runs: Sequence[Run], cols: Mapping[tuple[str, int | None], str]) -> list[list[Run]]:
    """The runs of each (model, method, setting, varying cell fields) evaluated on every column: what an average
    covers."""
    fields = varying_fields(runs)
    groups: dict[tuple[Any, ...], list[Run]] = {}
    for r in runs:
        if r.score is not None:
            extras = tuple((k, repr(r.extras.get(k))) for k in fields)
            groups.setdefault((r.model, r.method, r.setting, extras, r.multi_context), []).append(r)
    return [g for g in groups.values() if len({(r.task, r.context_length) for r in g}) == len(cols)]


def ratio_panels(runs: Sequence[Run]) -> dict[str, Panel]:
    """The score-vs-ratio plots' panels: one per task column (and ``average`` over them, for the settings run on
    every one). Budget and ratio runs sit at their (nominal) ratio on their method's line; a budget-less run is a
    point at its realised ratio (one minus the kept share) named by its arguments."""
    cols = _columns(runs)
    fields = varying_fields(runs)
    by_column: dict[str, list[list[Run]]] = {}
    for r in runs:
        if r.score is not None:
            by_column.setdefault(cols[(r.task, r.context_length)], []).append([r])
    items = dict(sorted(by_column.items()))
    if len(by_column) > 1:
        items["average"] = _per_setting(runs, cols)
    panels = {}
    for name, groups in items.items():
        many = len({g[0].model for g in groups}) > 1
        panel = Panel()
        for g in groups:
            r, score, x = g[0], _mean([r.score for r in g]), _mean([r.ratio for r in g])
            prefix = f"{r.model}/" if many else ""
            if r.is_full:
                panel.full.append((prefix + method_label(r, fields), score))
            elif r.budgetless:
                if not math.isnan(x):
                    panel.points[prefix + row_label(r, fields)] = (x, score)
            else:
                panel.lines.setdefault(prefix + r.method, []).append((x, score))
        for pts in panel.lines.values():
            pts.sort()
        if panel.full or panel.lines or panel.points:
            panels[name] = panel
    return panels


def plot_scores(runs: Sequence[Run], plot_dir: str) -> list[str]:
    """Score vs compression ratio per method, one PNG per task (and the average over tasks): ``ratio_panels``."""
    plt = _pyplot()
    os.makedirs(plot_dir, exist_ok=True)
    written = []
    for task, panel in ratio_panels(runs).items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label, score in panel.full:
            ax.axhline(score, linestyle="--", color="grey", label=label)
        for label, pts in sorted(panel.lines.items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for label, (x, y) in sorted(panel.points.items()):
            ax.plot([x], [y], marker="s", linestyle="none", label=label)
        ax.set_xlabel("compression ratio (budget-less runs: realised)")
        ax.set_ylabel("score")
        ax.set_title(task)
        ax.set_xlim(-0.02, 1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside: long labels hide no point
        path = os.path.join(plot_dir, f"score_vs_ratio__{_file_tag(task)}.png")
        try:
            fig.savefig(path, dpi=100, bbox_inches="tight")
        finally:
            plt.close(fig)
        written.append(path)
    return written


def budget_panels(runs: Sequence[Run]) -> dict[str, Panel]:
    """The score-vs-budget plot's panels: one per task column (and ``average`` when several). The full cache's mean
    score (``full cache``); one line per method over its budgets (in ``average``, only methods run on every task at
    every budget); one point per budget-less setting at its mean kept tokens (in ``average``, settings run on every
    task). Empty when no run has a budget and none is budget-less."""
    if not any((r.budget is not None and not r.is_full) or r.budgetless for r in runs):
        return {}
    cols = _columns(runs)
    tasks = list(dict.fromkeys(cols.values()))
    fields = varying_fields(runs)
    many = len({r.model for r in runs}) > 1
    panels = {}
    for name in tasks + (["average"] if len(tasks) > 1 else []):
        group = [r for r in runs
                 if r.score is not None and (name == "average" or cols[(r.task, r.context_length)] == name)]
        panel = Panel()
        full = [r.score for r in group if r.is_full]
        if full:
            panel.full.append(("full cache", _mean(full)))
        budgets: dict[str, dict[int, list[float]]] = {}
        for r in group:
            if r.budget is not None and not r.is_full:
                budgets.setdefault(r.method, {}).setdefault(r.budget, []).append(r.score)
        for method, points in budgets.items():
            if name == "average" and any(len(v) != len(tasks) for v in points.values()):
                continue  # average only over methods run on every task
            panel.lines[method] = [(float(b), _mean(points[b])) for b in sorted(points)]
        settings = _per_setting(group, cols) if name == "average" else [[r] for r in group]
        for g in settings:
            if g[0].budgetless and all(r.kept for r in g):
                label = (f"{g[0].model}/" if many else "") + row_label(g[0], fields)
                panel.points[label] = (_mean([r.kept for r in g]), _mean([r.score for r in g]))
        panels[name] = panel
    return panels


def draw_budget(runs: Sequence[Run]) -> Any:
    """The score-vs-budget figure of ``budget_panels`` (matplotlib; None when there is nothing to plot): log-2 budget
    axis, the full cache dashed, budget-less settings as square points at the tokens they kept."""
    panels = budget_panels(runs)
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6), squeeze=False, sharey=True)
    budgets = sorted({x for p in panels.values() for pts in p.lines.values() for x, _ in pts})
    ticks = budgets or sorted({round(x) for p in panels.values() for x, _ in p.points.values()})
    legend: dict[str, Any] = {}
    for ax, (name, panel) in zip(axes[0], panels.items(), strict=True):
        for label, score in panel.full:
            ax.axhline(score, linestyle="--", color="black", label=label)
        for label, pts in sorted(panel.lines.items()):
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        for label, (x, y) in sorted(panel.points.items()):
            ax.plot([x], [y], marker="s", linestyle="none", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(int(b)) for b in ticks])
        ax.set_xlabel("budget (budget-less runs: tokens kept)")
        ax.set_title(name, fontsize="small")
        ax.grid(alpha=0.3)
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)  # every panel's lines, once (a method may miss a task)
    axes[0][0].set_ylabel("score")
    fig.tight_layout()
    fig.legend(list(legend.values()), list(legend), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    return fig


def plot_budget(runs: Sequence[Run], plot_dir: str) -> list[str]:
    """``score_vs_budget.png`` (``draw_budget``): one panel per task (and the average), score against the token
    budget, one line per method, one point per budget-less setting, the full cache as a dashed line. Nothing when
    no run has a budget and none is budget-less."""
    fig = draw_budget(runs)
    if fig is None:
        return []
    os.makedirs(plot_dir, exist_ok=True)
    path = os.path.join(plot_dir, "score_vs_budget.png")
    try:
        fig.savefig(path, dpi=100, bbox_inches="tight")  # cropped to everything drawn: the legend beside the panels
    finally:
        _pyplot().close(fig)
    return [path]


def default_plots(runs: Sequence[Run], plot_dir: str) -> tuple[list[str], str | None]:
    """The report's default plot and a one-line note instead of an error when it cannot be written (no matplotlib, a
    read-only folder): the table is never lost for it. ``score_vs_budget.png`` when a run has a budget or none
    (budget-less methods); else (compression ratios, the full cache alone) ``score_vs_ratio__<task>.png`` per task
    and ``score_vs_ratio__average.png`` when there are several tasks."""
    try:
        written = plot_budget(runs, plot_dir)
        return (written or plot_scores(runs, plot_dir)), None
    except KvjaxError as e:
        return [], f"no plot: {e}"
    except OSError as e:
        return [], f"no plot: cannot write to {plot_dir} ({e.strerror or e})"


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
            [100.0 * fmean(cells[(d, n)]) if (d, n) in cells else math.nan for n in lengths]
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
