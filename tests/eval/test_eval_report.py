"""``python -m kvjax.eval.report``: tables and plots from fake run directories."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from kvjax.eval import report
from kvjax.eval.plots import plot_heatmaps
from kvjax.eval.results import RunDir, run_name
from kvjax.eval.runs import load_runs


def _make_run(root, *, method, budget, task, scores, depth_length=None, process_count=1, length=1024):
    name = run_name(model="tiny", method=method, task=task, context_length=length, budget=budget)
    config = {
        "model": "tiny",
        "method": method,
        "budget": budget,
        "compression_ratio": None,
        "task": task,
        "context_length": length,
        "query_aware": False,
        "method_args": {},
    }
    for p in range(process_count):
        run = RunDir(str(root), name, process_index=p, process_count=process_count)
        if p == 0:
            run.write_config(config)
        for i, s in enumerate(scores):
            if i % process_count != p:
                continue
            md = {"task": task, "num_tokens": 1000}
            if depth_length:
                md.update(depth=depth_length[i][0], length=depth_length[i][1])
            run.append(
                {
                    "id": f"{task}:{i}",
                    "task": task,
                    "method": method,
                    "budget": budget,
                    "metric": "string_match_all",
                    "scores": {"string_match_all": s},
                    "metadata": md,
                }
            )
    return name


@pytest.fixture
def two_result_dirs(tmp_path):
    a, b = tmp_path / "host0", tmp_path / "host1"
    for root in (a, b):
        root.mkdir()
    _make_run(a, method="full", budget=None, task="ruler/niah_single_1", scores=[1, 1])
    _make_run(a, method="snapkv", budget=128, task="ruler/niah_single_1", scores=[1, 0])
    _make_run(b, method="snapkv", budget=256, task="ruler/niah_single_1", scores=[1, 1, 1, 0], process_count=2)
    _make_run(a, method="full", budget=None, task="ruler/vt", scores=[1, 0])
    _make_run(b, method="snapkv", budget=128, task="ruler/vt", scores=[0, 0])
    _make_run(b, method="snapkv", budget=256, task="ruler/vt", scores=[1, 0])
    grid = [(d, n) for n in (256, 512) for d in (0, 50, 100)]
    _make_run(b, method="snapkv", budget=128, task="needle", scores=[1, 1, 0, 1, 0, 0], depth_length=grid)
    return str(a), str(b)


def test_markdown_table(two_result_dirs, capsys):
    assert report.main([*two_result_dirs, "--layout=long", "--no_plots"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0] == "| method | budget | ruler/niah_single_1 | ruler/vt | needle | avg |"
    assert lines[2] == "| full | full | 100.00 | 50.00 |  | 75.00 |"
    assert "| snapkv | 128 | 50.00 | 0.00 | 50.00 | 33.33 |" in lines
    # Both process shards of the 256 run are merged: 3 of 4 samples right.
    assert "| snapkv | 256 | 75.00 | 50.00 |  | 62.50 |" in lines


def test_pivot_is_the_default_with_full_first_and_kept_tokens(tmp_path, capsys):
    """Rows: methods (full first); columns: (task, budget); cells 'score (mean kept tokens)', * where the budget
    was at least the prompt; the default plot is score_vs_budget.png in <dir>/plots."""
    kept = {("snapkv", 64): [60, 62], ("snapkv", 256): [250, 250], ("full", None): [1000, 1000]}
    for (method, budget), values in kept.items():
        for task, scores in (("passkey", [1, 0]), ("ruler/vt", [1, 1])):
            name = _make_run(tmp_path, method=method, budget=budget, task=task, scores=scores)
            path = tmp_path / name / "predictions.jsonl"
            recs = [json.loads(x) for x in path.read_text().splitlines()]
            for rec, k in zip(recs, values, strict=True):
                rec["kept_tokens"] = k
                rec["budget_above_prompt"] = budget == 256 and task == "ruler/vt"
            path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert report.main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == (
        "| method | passkey @64 | passkey @256 | ruler/vt @64 | ruler/vt @256 | avg @64 | avg @256 |"
    )
    assert lines[2] == "| full | 50.0 (1000) | 50.0 (1000) | 100.0 (1000) | 100.0 (1000) | 75.0 | 75.0 |"
    assert lines[3] == "| snapkv | 50.0 (61) | 50.0 (250) | 100.0 (61) | 100.0 (250)* | 75.0 | 75.0 |"
    assert "* the budget was at least the prompt" in captured.out
    plot = tmp_path / "plots" / "score_vs_budget.png"
    if importlib.util.find_spec("matplotlib"):
        assert f"plot: {plot}" in captured.err and plot.read_bytes()[:4] == b"\x89PNG"
    else:
        assert "no plot: plots need matplotlib" in captured.err


def test_pivot_survives_missing_matplotlib(two_result_dirs, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert report.main([*two_result_dirs]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("| method |") and "| full |" in captured.out
    assert captured.err.strip() == "no plot: plots need matplotlib, which is not installed (pip install matplotlib)"


def test_csv_table(two_result_dirs, tmp_path):
    out = tmp_path / "table.csv"
    assert report.main([*two_result_dirs, "--format=csv", f"--output={out}"]) == 0
    rows = out.read_text().splitlines()
    assert rows[0] == "method,budget,ruler/niah_single_1,ruler/vt,needle,avg"
    assert "snapkv,256,75.00,50.00,,62.50" in rows


def test_plots(two_result_dirs, tmp_path):
    pytest.importorskip("matplotlib")
    plot_dir = tmp_path / "plots"
    assert report.main([*two_result_dirs, f"--plot_dir={plot_dir}"]) == 0
    files = sorted(os.listdir(plot_dir))
    assert "score_vs_ratio__ruler-niah_single_1.png" in files
    assert "score_vs_ratio__average.png" in files
    heatmaps = [f for f in files if f.startswith("heatmap__needle")]
    assert len(heatmaps) == 1
    for f in files:
        assert (plot_dir / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ratio_from_budget(two_result_dirs):
    runs = load_runs(list(two_result_dirs))
    r = next(x for x in runs if x.budget == 256 and x.task == "ruler/vt")
    assert r.ratio == pytest.approx(1 - 256 / 1000)
    full = next(x for x in runs if x.method == "full")
    assert full.is_full and full.ratio == 0.0


def test_errors_exit_2(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert "no eval runs" in capsys.readouterr().err
    assert report.main([str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("edit", [{"scores": None}, {"scores": {"string_match_all": "1"}},
                                  {"scores": {"string_match_all": None}}, {"metadata": None}])
def test_a_hand_edited_record_the_scores_cannot_be_read_from_is_one_line(tmp_path, capsys, edit):
    """A record whose scores are not numbers (or whose metadata is no object) was a TypeError traceback from the
    score's mean (the eval's resume too, after its samples ran); it is a corrupt line: file, line, how to drop it.
    A run archive holding it says the same."""
    from kvjax.eval import archive

    name = _make_run(tmp_path / "runs", method="snapkv", budget=128, task="ruler/vt", scores=[1, 0])
    path = tmp_path / "runs" / name / "predictions.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), **edit})
    path.write_text("\n".join(lines) + "\n")
    assert report.main([str(tmp_path / "runs"), "--no_plots"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvjax.eval.report: error: {path}:2: prediction record whose ") and "sed -i '2d'" in line
    assert archive.pack(str(tmp_path / "runs"), str(tmp_path / "a.runs.tar.xz")) == 1
    assert report.main([str(tmp_path / "a.runs.tar.xz"), "--no_plots"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"{name}/predictions.jsonl:2: prediction record whose " in line


def test_plots_draw_each_setting_as_its_own_line_never_a_mean_of_several(tmp_path):
    """The default plot pooled every run of a method at one budget into one point, whatever else differed: a
    --kv_dtype=model,int8 sweep (or window_size=8|16, query-aware and not, two models, two full-cache formats) drew one
    'snapkv' line at the mean of the settings' scores. Each setting is a line of its own holding its own score."""
    from kvjax.eval.cell import CellKey
    from kvjax.eval.plots import budget_panels, ratio_panels

    settings = [  # (model, method, budget, kv_dtype, method_args, query_aware, per-sample scores)
        ("tiny", "full", None, None, {}, False, [1, 1]), ("tiny", "full", None, "int8", {}, False, [0, 1]),
        ("tiny", "snapkv", 48, None, {}, False, [1, 1]), ("tiny", "snapkv", 48, "int8", {}, False, [0, 0]),
        ("tiny", "snapkv", 48, None, {"window_size": 8}, False, [1, 0]),
        ("tiny", "snapkv", 48, None, {}, True, [0, 0]), ("other", "snapkv", 48, None, {}, False, [0, 0]),
        ("tiny", "snapkv", 96, None, {}, False, [1, 0]),
    ]
    for model, method, budget, kv, args, qa, scores in settings:
        key = CellKey(model=model, method=method, task="passkey", context_length=1024, budget=budget, kv_dtype=kv,
                      method_args=args, query_aware=qa)
        run = RunDir(str(tmp_path), key.name())
        run.write_config({"cell": key.as_dict()})
        for i, score in enumerate(scores):
            run.append({"id": f"passkey:{i}", "task": "passkey", "method": method, "metric": "exact",
                        "scores": {"exact": score}, "metadata": {"num_tokens": 1000}, "kept_tokens": 40.0})
    runs = load_runs([str(tmp_path)])
    panel = budget_panels(runs)["passkey"]
    assert sorted(y for _, y in panel.full) == [50.0, 100.0]  # the two full-cache formats, neither averaged
    assert len({label for label, _ in panel.full}) == 2
    at_48 = sorted(y for pts in panel.lines.values() for x, y in pts if x == 48)
    assert at_48 == [0.0, 0.0, 0.0, 50.0, 100.0]  # the five snapkv settings at 48, each its own score
    assert all(len({x for x, _ in pts}) == len(pts) for pts in panel.lines.values())
    (line,) = [pts for pts in panel.lines.values() if len(pts) == 2]  # 96 continues the default setting's line
    assert line == [(48.0, 100.0), (96.0, 50.0)]
    ratio = ratio_panels(runs)["passkey"]
    assert sorted(y for pts in ratio.lines.values() for _, y in pts) == [0.0, 0.0, 0.0, 50.0, 50.0, 100.0]
    assert all(len({x for x, _ in pts}) == len(pts) for pts in ratio.lines.values())


def test_pivot_full_cache_row_shows_the_query_aware_run_in_query_aware_columns(tmp_path):
    """Two runs into one folder, one with --query_aware: the full cache's row filled every column with whichever
    full run was read last, so one of them showed the other's score. Each column holds the full run of its kind."""
    from kvjax.eval.cell import CellKey

    for method, budget, qa, scores in (("full", None, False, [1, 1]), ("full", None, True, [0, 1]),
                                       ("snapkv", 48, False, [1, 0]), ("snapkv", 48, True, [0, 0])):
        key = CellKey(model="tiny", method=method, task="passkey", context_length=1024, budget=budget, query_aware=qa)
        run = RunDir(str(tmp_path), key.name())
        run.write_config({"cell": key.as_dict()})
        for i, score in enumerate(scores):
            run.append({"id": f"passkey:{i}", "task": "passkey", "method": method, "metric": "exact",
                        "scores": {"exact": score}, "metadata": {}})
    lines = report.render_pivot(load_runs([str(tmp_path)])).splitlines()
    assert lines[0] == "| method | passkey @48 | passkey @48 (query-aware) |"
    assert lines[2] == "| full | 100.0 | 50.0 |" and lines[3] == "| snapkv | 50.0 | 0.0 |"
    only = [r for r in load_runs([str(tmp_path)]) if r.is_full]  # only full-cache runs: a column each
    assert report.render_pivot(only).splitlines()[:3] == [
        "| method | passkey @full | passkey @full (query-aware) |", "|---|---:|---:|", "| full | 100.0 | 50.0 |"]


def test_module_help():
    out = subprocess.run(
        [sys.executable, "-m", "kvjax.eval.report", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--plot_dir" in out and "--format" in out


def test_one_column_per_length_and_pooled_heatmap(tmp_path, capsys):
    for length in (512, 1024):
        grid = [(d, length) for d in (0, 50, 100)]
        _make_run(
            tmp_path, method="snapkv", budget=64, task="passkey", scores=[1, 0, 1], depth_length=grid, length=length
        )
    assert report.main([str(tmp_path), "--format=csv"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows == ["method,budget,passkey@512,passkey@1024,avg", "snapkv,64,66.67,66.67,66.67"]
    pytest.importorskip("matplotlib")
    runs = load_runs([str(tmp_path)])
    written = plot_heatmaps(runs, str(tmp_path / "plots"))
    assert len(written) == 1  # both lengths in one depth x length grid


def test_heatmaps_keep_runs_of_other_cache_formats_apart(tmp_path):
    """A --kv_dtype=model,int8 sweep of a depth x length task: the heatmap pooled both formats' samples into one grid
    (each cell the mean of the two) and both would have had one file name. Each format is a grid of its own, each
    cell its own format's score."""
    pytest.importorskip("matplotlib")
    from kvjax.eval.cell import CellKey
    from kvjax.eval.plots import plot_heatmaps

    grid = [(0, 512), (100, 512)]
    for kv, scores in ((None, [1, 1]), ("int8", [0, 0])):
        key = CellKey(model="tiny", method="snapkv", task="passkey", context_length=512, budget=64, kv_dtype=kv)
        run = RunDir(str(tmp_path), key.name())
        run.write_config({"cell": key.as_dict()})
        for i, ((depth, length), score) in enumerate(zip(grid, scores, strict=True)):
            run.append({"id": f"passkey:{i}", "task": "passkey", "method": "snapkv", "metric": "exact",
                        "scores": {"exact": score}, "metadata": {"depth": depth, "length": length}})
    runs = load_runs([str(tmp_path)])
    import matplotlib.image

    written = plot_heatmaps(runs, str(tmp_path / "plots"))
    assert len(written) == 2 and len(set(written)) == 2, written
    assert {"int8" in os.path.basename(p) for p in written} == {True, False}
    mean_colours = {os.path.basename(p): matplotlib.image.imread(p)[..., :3].mean() for p in written}
    assert len(set(mean_colours.values())) == 2  # an all-100 grid and an all-0 grid, not two 50s
