"""Eval runs read back from their directories and archives: `Run` (one evaluated cell, merged over process shards
and directories), `load_runs`, and the labels that tables and plots give a run.

Runs are merged on their whole cell key (``kvjax.eval.cell.CellKey``: dtype, seed, chat template, ... included);
where the runs shown differ in such a setting, their labels name it (``snapkv [dtype=bfloat16]``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from kvjax.eval import archive
from kvjax.eval.cell import EXTRA_FIELDS, CellKey
from kvjax.eval.results import METRICS, read_json_object, read_predictions, summarize
from kvjax.tasks.base import DataError

__all__ = [
    "FULL_METHODS",
    "TASK_LAYOUT_FIELDS",
    "Run",
    "column_label",
    "find_run_dirs",
    "kept_fraction",
    "load_runs",
    "method_label",
    "row_label",
    "task_columns",
    "varying_fields",
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
        cell = CellKey.from_config(config, first, where=os.path.join(d, "config.json"))
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


def task_columns(runs: Sequence[Run]) -> dict[tuple[str, int | None], str]:
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
