"""Plots of eval runs (matplotlib, Agg backend): score against compression ratio or token budget, and needle
heatmaps. ``kvjax.eval.report`` documents which it writes when."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from kvjax.errors import KvjaxError
from kvjax.eval.runs import Run, method_label, row_label, task_columns, varying_fields

__all__ = [
    "Panel",
    "budget_panels",
    "default_plots",
    "draw_budget",
    "line_label",
    "plot_budget",
    "plot_heatmaps",
    "plot_scores",
    "pyplot",
    "ratio_panels",
]


def pyplot() -> Any:
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


def line_label(run: Run, fields: Sequence[str], many_models: bool) -> str:
    """The plot line of a method run at a budget or ratio: its model (where several are shown), method, the varying
    cell fields (``method_label``), its arguments and ``(query-aware)``. Runs that differ in any of them are lines of
    their own, as they are rows or columns of the pivot, never one mean."""
    label = (f"{run.model}/" if many_models else "") + method_label(run, fields)
    label += f" [{run.method_args}]" if run.method_args else ""
    return label + (" (query-aware)" if run.query_aware else "")


def ratio_panels(runs: Sequence[Run]) -> dict[str, Panel]:
    """The score-vs-ratio plots' panels: one per task column (and ``average`` over them, for the settings run on
    every one). Budget and ratio runs sit at their (nominal) ratio on their method's line; a budget-less run is a
    point at its realised ratio (one minus the kept share) named by its arguments."""
    cols = task_columns(runs)
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
                panel.lines.setdefault(line_label(r, fields, many), []).append((x, score))
        for pts in panel.lines.values():
            pts.sort()
        if panel.full or panel.lines or panel.points:
            panels[name] = panel
    return panels


def plot_scores(runs: Sequence[Run], plot_dir: str) -> list[str]:
    """Score vs compression ratio per method, one PNG per task (and the average over tasks): ``ratio_panels``."""
    plt = pyplot()
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
    cols = task_columns(runs)
    tasks = list(dict.fromkeys(cols.values()))
    fields = varying_fields(runs)
    many = len({r.model for r in runs}) > 1
    panels = {}
    for name in tasks + (["average"] if len(tasks) > 1 else []):
        group = [r for r in runs
                 if r.score is not None and (name == "average" or cols[(r.task, r.context_length)] == name)]
        panel = Panel()
        full: dict[str, list[float]] = {}  # one dashed line per full-cache setting (dtype, kv_dtype, model, ...)
        for r in group:
            if r.is_full:
                full.setdefault(line_label(r, fields, many), []).append(r.score)
        for label, scores in full.items():
            panel.full.append(("full cache" if len(full) == 1 else label, _mean(scores)))
        budgets: dict[str, dict[int, list[float]]] = {}
        for r in group:
            if r.budget is not None and not r.is_full:
                budgets.setdefault(line_label(r, fields, many), {}).setdefault(r.budget, []).append(r.score)
        for label, points in budgets.items():
            if name == "average" and any(len(v) != len(tasks) for v in points.values()):
                continue  # average only over settings run on every task
            panel.lines[label] = [(float(b), _mean(points[b])) for b in sorted(points)]
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
    plt = pyplot()
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
        pyplot().close(fig)
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
    """Depth x length heatmaps of the primary score for runs whose samples carry depth and length: one grid per
    task, model, method label (with the cell fields that vary, such as ``kv_dtype``) and setting, its context lengths
    pooled."""
    fields = varying_fields(runs)  # runs that differ in a cell field (kv_dtype, dtype, ...) are grids of their own
    pooled: dict[tuple[str, str, str, str], list[Run]] = {}
    for r in runs:  # one run per context length: pool them into one grid
        pooled.setdefault((r.task, r.model, method_label(r, fields), r.setting), []).append(r)
    written = []
    for (_, _, label, _), group in pooled.items():
        r = group[0]
        cells: dict[tuple[float, int], list[float]] = {}
        for rec in (x for run in group for x in run.records):
            md = rec.get("metadata", {})
            metric = rec.get("metric")
            if "depth" in md and "length" in md and metric in rec.get("scores", {}):
                cells.setdefault((float(md["depth"]), int(md["length"])), []).append(float(rec["scores"][metric]))
        if len(cells) < 2:
            continue
        plt = pyplot()
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
        ax.set_title(f"{r.task}: {label} {r.setting}", fontsize="small")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        path = os.path.join(plot_dir, f"heatmap__{_file_tag(r.task, r.model, label, r.setting)}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
