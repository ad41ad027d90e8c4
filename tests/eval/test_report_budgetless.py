"""Issue 60 item 1: only the `full` method is the full cache. A sweep mixing `full`, budgets, ratios (0 included) and
methods run without either (InfLLM by `topk`, `per_layer`, DMS thresholds, DuoAttention, `decoding` at its defaults)
is rendered by the pivot, the long table, both plots and the leaderboard; every number they show is checked against
the records on disk, read here with `json` alone (the oracle), so that no report can disagree with the predictions.
"""

from __future__ import annotations

import csv
import io
import json
import math
import pathlib
import re

import numpy as np
import pytest

from kvjax.eval import leaderboard, report
from kvjax.eval.cell import CellKey
from kvjax.eval.plots import default_plots
from kvjax.eval.results import RunDir
from kvjax.eval.runs import load_runs

TASKS = ("ruler/niah_single_1", "ruler/vt")
LENGTH = 1024
N = 3  # samples per cell
NUM_TOKENS = (1000, 990, 1010)  # the prompts' token counts (metadata, as the tasks record them)

# (method, budget, compression_ratio, method_args)
CELLS = [
    ("full", None, None, {}),
    ("snapkv", 64, None, {}),
    ("snapkv", 128, None, {}),
    ("snapkv", None, 0.5, {}),
    ("knorm", None, 0.0, {}),  # ratio 0: a compressing method that kept everything, still not "the full cache"
    ("infllm", None, None, {"topk": 1, "n_local": 8}),
    ("per_layer", None, None, {"compression_ratios": [0.5, 0.75]}),
    ("dms", None, None, {"threshold": -4, "base_args": {"weights": "/w"}}),
    ("dms", None, None, {"threshold": -6, "base_args": {"weights": "/w"}}),
    ("duo_attention", None, None, {"patterns": "/p", "threshold": 0.5}),
    ("decoding", None, None, {}),
]
BUDGETLESS = [c for c in CELLS if c[0] != "full" and c[1] is None and c[2] is None]


def _args_text(args: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(args.items()))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The run directories as the eval writes them (config.json with the cell key, predictions.jsonl), with seeded
    scores and kept counts that differ per cell; returns the folder."""
    root = tmp_path_factory.mktemp("sweep")
    rng = np.random.default_rng(60)
    for task in TASKS:
        for method, budget, ratio, args in CELLS:
            key = CellKey(model="kvjax-tiny", method=method, task=task, context_length=LENGTH, budget=budget,
                          compression_ratio=ratio, method_args=args, dtype="float32")
            run = RunDir(str(root), key.name())
            run.write_config({"cell": key.as_dict(), "method": method, "budget": budget, "compression_ratio": ratio,
                              "query_aware": False, "method_args": args, "multi_context": False, "task": task,
                              "context_length": LENGTH, "model": "kvjax-tiny", "dtype": "float32"})
            for i in range(N):
                context, question = NUM_TOKENS[i] - 20, 20
                kept = float(context + question) if method == "full" else float(rng.integers(30, 600))
                score = float(rng.integers(0, 2))
                run.append({"id": f"{task}:{LENGTH}:0:{i}", "task": task, "method": method, "budget": budget,
                            "compression_ratio": ratio, "prediction": "x", "answers": ["x"],
                            "metric": "string_match_all", "scores": {"string_match_all": score},
                            "metadata": {"task": task, "num_tokens": NUM_TOKENS[i], "context_length": LENGTH},
                            "context_tokens": context, "question_tokens": question, "kept_tokens": kept,
                            "kept_fraction": kept / (context + question), "timings": {}})
    return root


def _oracle(root: pathlib.Path) -> dict:
    """(method, budget, ratio, args text, task) -> mean score x100, mean kept tokens, mean kept fraction: from the
    files alone."""
    out = {}
    for config_path in root.glob("*/config.json"):
        config = json.loads(config_path.read_text())
        records = [json.loads(line) for line in (config_path.parent / "predictions.jsonl").read_text().splitlines()]
        key = (config["method"], config["budget"], config["compression_ratio"], _args_text(config["method_args"]),
               config["task"])
        out[key] = {
            "score": 100 * np.mean([r["scores"]["string_match_all"] for r in records]),
            "kept": np.mean([r["kept_tokens"] for r in records]),
            "fraction": np.mean([r["kept_fraction"] for r in records]),
            "nominal": np.mean([max(0.0, 1 - (config["budget"] or 0) / r["metadata"]["num_tokens"])
                                for r in records]),
        }
    assert len(out) == len(CELLS) * len(TASKS)
    return out


def _get(oracle, method, budget=None, ratio=None, args=None, task=None):
    return oracle[(method, budget, ratio, _args_text(args or {}), task)]


def _mean_over_tasks(oracle, method, budget=None, ratio=None, args=None, field="score"):
    return np.mean([_get(oracle, method, budget, ratio, args, t)[field] for t in TASKS])


def _pivot(text: str) -> dict[str, dict[str, str]]:
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in rows[0]]
    return {r[0].strip(): dict(zip(header[1:], (c.strip() for c in r[1:]), strict=True)) for r in rows[1:]}


def _cell(text: str) -> tuple[float, float]:
    m = re.fullmatch(r"(-?[0-9.]+) \(([0-9.]+)\)\*?", text)
    assert m, text
    return float(m[1]), float(m[2])


def test_pivot_rows_and_columns_follow_the_records(sweep):
    oracle = _oracle(sweep)
    table = report.render_pivot(load_runs([str(sweep)]))
    assert "(full)" not in table
    rows = _pivot(table)
    budgetless_rows = {f"{m} [{_args_text(a)}]" if a else m: (m, a) for m, _, _, a in BUDGETLESS}
    assert list(rows)[0] == "full" and set(rows) == {"full", "snapkv", "knorm", *budgetless_rows}
    columns = ["64", "128", "ratio 0", "ratio 0.5", "no budget"]
    assert list(rows["full"]) == [f"{t} @{c}" for t in TASKS for c in columns] + [f"avg @{c}" for c in columns]
    for task in TASKS:
        full = _get(oracle, "full", task=task)
        for c in columns:  # the full cache, and only it, fills every column of its task
            assert _cell(rows["full"][f"{task} @{c}"]) == (round(full["score"], 1), round(full["kept"]))
        for c, (budget, ratio) in {"64": (64, None), "128": (128, None), "ratio 0.5": (None, 0.5)}.items():
            want = _get(oracle, "snapkv", budget, ratio, task=task)
            assert _cell(rows["snapkv"][f"{task} @{c}"]) == (round(want["score"], 1), round(want["kept"]))
        want = _get(oracle, "knorm", None, 0.0, task=task)
        assert _cell(rows["knorm"][f"{task} @ratio 0"]) == (round(want["score"], 1), round(want["kept"]))
        for label, (method, args) in budgetless_rows.items():
            want = _get(oracle, method, args=args, task=task)
            assert _cell(rows[label][f"{task} @no budget"]) == (round(want["score"], 1), round(want["kept"]))
            assert all(rows[label][f"{task} @{c}"] == "" for c in columns[:-1]), label  # its own column only
    for label, (method, args) in budgetless_rows.items():
        assert float(rows[label]["avg @no budget"]) == round(_mean_over_tasks(oracle, method, args=args), 1)
    assert float(rows["full"]["avg @64"]) == round(_mean_over_tasks(oracle, "full"), 1)


def test_long_table_names_the_arguments_of_budgetless_runs(sweep):
    oracle = _oracle(sweep)
    text = report.render_table(load_runs([str(sweep)]), "csv")
    header, *rows = csv.reader(io.StringIO(text))
    assert header == ["method", "budget", *TASKS, "avg"]
    by_setting = {(r[0], r[1]): r[2:] for r in rows}
    assert len(by_setting) == len(rows) == len(CELLS) and rows[0][:2] == ["full", "full"]
    for method, _, _, args in BUDGETLESS:
        setting = f"no budget [{_args_text(args)}]" if args else "no budget"
        scores = [_get(oracle, method, args=args, task=t)["score"] for t in TASKS]
        assert by_setting[(method, setting)] == [f"{s:.2f}" for s in [*scores, np.mean(scores)]]


def _figures(monkeypatch) -> dict[str, object]:
    """The figures the report saves, by file name (Figure.savefig wrapped: the figure is kept, the file written)."""
    import matplotlib.figure

    saved, original = {}, matplotlib.figure.Figure.savefig

    def keep(fig, path, *args, **kwargs):
        saved[pathlib.Path(path).name] = fig
        return original(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return saved


def _drawn(ax) -> dict[str, tuple[list[float], list[float]]]:
    return {line.get_label(): (list(map(float, line.get_xdata())), list(map(float, line.get_ydata())))
            for line in ax.get_lines()}


def _same(drawn: tuple[list[float], list[float]], xs: list[float], ys: list[float]) -> None:
    assert drawn[0] == pytest.approx(xs) and drawn[1] == pytest.approx(ys), (drawn, xs, ys)


def test_plots_draw_the_full_cache_and_budgetless_points_from_the_records(sweep, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    oracle = _oracle(sweep)
    figures = _figures(monkeypatch)
    assert report.main([str(sweep), f"--plot_dir={tmp_path}"]) == 0
    budget = figures["score_vs_budget.png"]
    panels = {ax.get_title(): _drawn(ax) for ax in budget.axes}
    assert set(panels) == {*TASKS, "average"}
    labels = {f"{m} [{_args_text(a)}]" if a else m: (m, a) for m, _, _, a in BUDGETLESS}
    for name, drawn in panels.items():
        tasks = TASKS if name == "average" else (name,)

        def mean(method, budget=None, ratio=None, args=None, field="score", tasks=tasks):
            return np.mean([_get(oracle, method, budget, ratio, args, t)[field] for t in tasks])

        assert set(drawn) == {"full cache", "snapkv", *labels}, name
        full_x, full_y = drawn["full cache"]
        assert full_y == pytest.approx([mean("full")] * 2)  # the full method's score, nothing averaged into it
        _same(drawn["snapkv"], [64, 128], [mean("snapkv", 64), mean("snapkv", 128)])
        for label, (method, args) in labels.items():
            _same(drawn[label], [mean(method, args=args, field="kept")], [mean(method, args=args)])
    for task in TASKS:
        ratio_fig = figures[f"score_vs_ratio__{task.replace('/', '-')}.png"]
        drawn = _drawn(ratio_fig.axes[0])
        assert set(drawn) == {"full", "snapkv", "knorm", *labels}
        assert drawn["full"][1] == pytest.approx([_get(oracle, "full", task=task)["score"]] * 2)
        snap = sorted([(_get(oracle, "snapkv", b, task=task)["nominal"], _get(oracle, "snapkv", b, task=task)["score"])
                       for b in (64, 128)] + [(0.5, _get(oracle, "snapkv", None, 0.5, task=task)["score"])])
        _same(drawn["snapkv"], [x for x, _ in snap], [y for _, y in snap])
        _same(drawn["knorm"], [0.0], [_get(oracle, "knorm", None, 0.0, task=task)["score"]])
        for label, (method, args) in labels.items():  # at the realised ratio: one minus the kept share
            want = _get(oracle, method, args=args, task=task)
            _same(drawn[label], [1 - want["fraction"]], [want["score"]])


def test_leaderboard_keeps_budgetless_runs_out_of_the_full_cache_column(sweep):
    oracle = _oracle(sweep)
    runs = load_runs([str(sweep)])
    table = leaderboard.cells(runs)
    (panel, lines), = table.items()
    assert panel == f"kvjax-tiny @ {LENGTH}"
    md = leaderboard.render_leaderboard(table)
    main_table = md.split("\n\n")[1].splitlines()
    nominal = [f"ratio {1 - b / LENGTH:g}" for b in (128, 64)]  # what a budget stands for at the panel's length
    assert main_table[0] == f"| method | full cache | ratio 0 | ratio 0.5 | {' | '.join(nominal)} |"
    rows = {r.split(" | ")[0].lstrip("| "): r for r in main_table[2:]}
    assert set(rows) == {"full", "snapkv", "knorm"}  # budget-less runs have a table of their own
    full = lines["full"][0.0]
    assert full.score == pytest.approx(_mean_over_tasks(oracle, "full"))
    assert rows["knorm"].split(" | ")[1] == "" and lines["knorm"][0.0].score == pytest.approx(
        _mean_over_tasks(oracle, "knorm", None, 0.0))
    swept = {}
    for line, cells_ in lines.items():
        for cell in cells_.values():
            if cell.swept:
                swept[(line, cell.swept)] = cell
    assert set(swept) == {
        ("infllm", "n_local=8,topk=1"), ("per_layer", "compression_ratios=[0.5, 0.75]"),
        ("dms", "threshold=-4"), ("dms", "threshold=-6"),  # the weights' path is left out of labels
        ("duo_attention (head ratio)", "threshold=0.5"), ("decoding", "its defaults"),
    }
    for (line, setting), cell in swept.items():
        method = line.split(" ")[0]
        args = next(a for m, _, _, a in BUDGETLESS
                    if m == method and (method != "dms" or f"={a['threshold']}" in setting))
        assert cell.score == pytest.approx(_mean_over_tasks(oracle, method, args=args))
        assert cell.kept_tokens == pytest.approx(_mean_over_tasks(oracle, method, args=args, field="kept"))
        assert cell.x == pytest.approx(1 - _mean_over_tasks(oracle, method, args=args, field="fraction"))
        assert f"| {line} | {setting} | " in md
    assert not any(math.isnan(c.score) for cells_ in lines.values() for c in cells_.values())


def test_the_default_plot_is_the_one_the_docs_name(sweep, tmp_path):
    """Issue 60: docs/eval.md said every run writes plots/score_vs_budget.png; budget-less sweeps wrote the ratio
    plots instead. Now budget-less runs are points of the budget plot, and the docs name both cases."""
    pytest.importorskip("matplotlib")
    runs = [r for r in load_runs([str(sweep)]) if r.task == "ruler/vt"]  # one task: one PNG a case
    cases = {
        "budget-less": ({"full", "infllm", "dms"}, ["score_vs_budget.png"]),
        "budgets": ({"full", "snapkv"}, ["score_vs_budget.png"]),
        "ratios": ({"full", "knorm"}, ["score_vs_ratio__ruler-vt.png"]),
    }
    for name, (methods_, files) in cases.items():
        written, note = default_plots([r for r in runs if r.method in methods_], str(tmp_path / name))
        assert note is None and [pathlib.Path(w).name for w in written] == files, name
    docs = " ".join((pathlib.Path(__file__).parents[2] / "docs" / "eval.md").read_text().split())
    assert ("writes the default plot to `<output_dir>/plots/`: `score_vs_budget.png` when a cell has a budget or runs "
            "without budget and ratio, else (compression ratios only, or the full cache alone) "
            "`score_vs_ratio__<task>.png` per task (`/` written `-`) and `score_vs_ratio__average.png` when there are "
            "several tasks") in docs
