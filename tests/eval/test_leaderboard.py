"""Leaderboard table and plot on a synthetic results directory (scores chosen by the test)."""

from __future__ import annotations

import json
import pathlib
import runpy
import zlib

import numpy as np
import pytest

from kvjax.eval import leaderboard

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASKS = ("ruler/niah_single_1", "ruler/vt")


def _run(out: pathlib.Path, model, method, ratio, task, length, scores, kept, ctx, query_aware=False,
         method_args=None, budget=None, prompt_tokens=None):
    tag = zlib.crc32(json.dumps(method_args or {}, sort_keys=True).encode())
    d = out / (f"{task.replace('/', '-')}__{length}__{model}__{method}__{ratio}__{budget}__"
               f"{'qa' if query_aware else 'qg'}__{tag}")
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(dict(
        model=model, method=method, budget=budget, compression_ratio=ratio, task=task, context_length=length,
        query_aware=query_aware, method_args=method_args or {},
    )))
    with open(d / "predictions.jsonl", "w") as f:
        for i, (s, k) in enumerate(zip(scores, kept, strict=True)):
            rec = dict(id=str(i), task=task, method=method, metric="string_match_all", scores={"string_match_all": s},
                       metadata={"task": task, **({"num_tokens": prompt_tokens} if prompt_tokens else {})},
                       kept_tokens=k, context_tokens=ctx - 24, question_tokens=24)
            f.write(json.dumps(rec) + "\n")


@pytest.fixture
def results(tmp_path):
    """Two models; methods a / b at two ratios (b also query-aware), the full cache; 4 samples per cell."""
    rng = np.random.default_rng(0)
    truth = {}
    for model, length in (("m1", 1024), ("m2", 2048)):
        for method, ratios, qa in (("full", [None], False), ("a", [0.25, 0.75], False), ("b", [0.25, 0.75], False),
                                   ("b", [0.25, 0.75], True)):
            for ratio in ratios:
                per_task, kept_all, frac_all = [], [], []
                for task in TASKS:
                    scores = rng.integers(0, 2, 4).astype(float).tolist()
                    kept = (length * (1 - (ratio or 0)) + rng.integers(0, 9, 4)).tolist()
                    _run(tmp_path, model, method, ratio, task, length, scores, kept, length, qa)
                    per_task.append(100 * np.mean(scores))
                    kept_all += kept
                    frac_all += [k / length for k in kept]
                line = "full" if method == "full" else method + (" (query-aware)" if qa else "")
                truth[(f"{model} @ {length}", line, ratio or 0.0)] = (np.mean(per_task), np.mean(kept_all),
                                                                      np.mean(frac_all))
    return tmp_path, truth


def test_cells_average_over_tasks_with_kept_tokens(results):
    path, truth = results
    table = leaderboard.cells(leaderboard.load_runs([str(path)]))
    got = {(p, line, x): c for p, lines in table.items() for line, cs in lines.items() for x, c in cs.items()}
    assert set(got) == set(truth)
    for key, (score, kept, frac) in truth.items():
        cell = got[key]
        assert cell.score == pytest.approx(score) and cell.tasks == 2 and cell.samples == 4
        assert cell.kept_tokens == pytest.approx(kept) and cell.kept_fraction == pytest.approx(frac)


def test_budget_lines_share_the_ratio_columns_their_budgets_were_set_from(tmp_path):
    """A budget run sits in the column of 1 - budget / context length (4096 x (1 - 0.75) = 1024 -> ratio 0.75),
    whatever each task's prompt length, so that its tasks average in one cell beside the ratio lines'."""
    for task, prompt in zip(TASKS, (3905, 4010), strict=True):
        _run(tmp_path, "m", "full", None, task, 4096, [1.0, 1.0], [prompt, prompt], 4096, prompt_tokens=prompt)
        _run(tmp_path, "m", "a", 0.75, task, 4096, [1.0, 0.0], [1000, 1000], 4096, prompt_tokens=prompt)
        _run(tmp_path, "m", "r", None, task, 4096, [1.0, 0.0] if task == TASKS[0] else [0.0, 0.0], [prompt, prompt],
             4096, budget=1024, prompt_tokens=prompt)
    table = leaderboard.cells(leaderboard.load_runs([str(tmp_path)]))["m @ 4096"]
    assert set(table["r"]) == {0.75} == set(table["a"])
    cell = table["r"][0.75]
    assert cell.tasks == 2 and cell.samples == 2 and cell.score == pytest.approx(25.0) and cell.x == 0.75
    assert cell.kept_tokens == pytest.approx((3905 + 4010) / 2)  # what it kept, whatever its column
    md = leaderboard.render_leaderboard(leaderboard.cells(leaderboard.load_runs([str(tmp_path)])))
    assert "| method | full cache | ratio 0.75 |\n" in md


def test_markdown_and_plot(results, tmp_path):
    path, truth = results
    out = tmp_path / "board"
    assert leaderboard.main([str(path), f"--out_dir={out}"]) == 0
    md = (out / "leaderboard.md").read_text()
    assert "### m1 @ 1024" in md and "### m2 @ 2048" in md and "| b (query-aware) |" in md
    score, kept, frac = truth[("m2 @ 2048", "a", 0.75)]
    assert f"{score:.1f} · {kept:.0f} ({100 * frac:.0f}%) · n=4×2" in md
    png = (out / "leaderboard.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_line_styles_distinct_and_stable_across_panels():
    methods = [f"m{i:02d}" for i in range(45)]
    cell = leaderboard.Cell(score=1.0, tasks=1, samples=1, kept_tokens=None, kept_fraction=None)
    table = {
        "p1": {"full": {0.0: cell}, **{m: {0.5: cell} for m in methods[:30]}, "m03 (query-aware)": {0.5: cell}},
        "p2": {f"{m} [window=8]": {0.5: cell} for m in methods[10:]},
    }
    styles = leaderboard.line_styles(table)
    variants = [f"{m} [window=8]" for m in methods[10:]]
    assert sorted(styles) == sorted(methods[:30] + variants)  # query-aware lines share their method's style,
    assert len(set(styles.values())) == len(styles)  # argument variants have their own
    assert len({colour for colour, _ in list(styles.values())[:20]}) == 20  # 20 colours before any repeats


def test_empty_directory_is_a_clear_error(tmp_path, capsys):
    assert leaderboard.main([str(tmp_path)]) == 2
    assert "no scored runs" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["proc", "file", "sysfs"])
def test_an_out_dir_that_cannot_be_written_is_one_line(results, tmp_path, capsys, where):
    """Issue 60: an --out_dir that cannot be created (inside /proc/self), is a file, or is a folder nothing can be
    written in (sysfs, read-only even for root) was a traceback."""
    path, _ = results
    target = {"proc": "/proc/self/kvjax_board", "file": str(tmp_path / "a_file"), "sysfs": "/sys"}[where]
    if where == "file":
        pathlib.Path(target).write_text("keep me\n")
    assert leaderboard.main([str(path), f"--out_dir={target}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvjax.eval.leaderboard: error: ") and target in err, err
    if where == "file":
        assert pathlib.Path(target).read_text() == "keep me\n"


@pytest.mark.parametrize("lines", [3, 45])
def test_legend_fits_beside_its_panel_and_in_the_image(tmp_path, lines):
    """A panel of many methods (SmolLM2's presses: 33 lines) gets a legend no taller than its panel, and the saved
    image holds all of it: 45 entries in one column overran a 4.6-inch figure and were cut off."""
    cell = leaderboard.Cell(score=1.0, tasks=1, samples=1, kept_tokens=None, kept_fraction=None)
    table = {"p": {"full": {0.0: cell}, **{f"m{i:02d}": {0.5: cell, 0.75: cell} for i in range(lines - 1)}}}
    fig = leaderboard.draw_leaderboard(table)
    fig.canvas.draw()
    (ax,) = [a for a in fig.axes if a.get_legend()]
    legend = ax.get_legend()
    assert len(legend.get_texts()) == lines
    box, panel = legend.get_window_extent(), ax.get_window_extent()
    assert box.height <= fig.bbox.height and box.y1 <= panel.y1 + 1  # no taller than the figure, level with the panel
    from matplotlib import pyplot as plt

    plt.close(fig)
    out = tmp_path / "board.png"
    leaderboard.plot_leaderboard(table, str(out))
    width, height = (int.from_bytes(out.read_bytes()[o : o + 4], "big") for o in (16, 20))
    assert width >= box.x1 - panel.x0 and height >= box.height  # the legend is inside the saved image


def test_config_plans_kvpress_protocol():
    cfg = runpy.run_path(str(ROOT / "configs" / "leaderboard.py"))["get_config"]
    plain, aware = cfg("smollm2-135m"), cfg("smollm2-135m/query_aware")
    assert plain.compression_ratio == "0.25,0.5,0.75,0.875,0.9375,0.96875" and plain.max_samples >= 20
    assert plain.context_length == "2048,4096" and cfg("kvjax-tiny").context_length == "1024"
    assert not plain.query_aware and aware.query_aware and aware.method == "snapkv,adakv,finch,chunkkv"
    assert {"full", "snapkv", "lagkv", "sagekv", "ahakv", "h2o", "streaming_llm"} <= set(plain.method.split(","))
    with pytest.raises(ValueError, match="unknown leaderboard model"):
        cfg("gpt-5")
    # kvpress's own leaderboard (evaluation/leaderboard.sh): Qwen3-8B on RULER at 4096, the same ratios and loops.
    qwen, qwen_aware = cfg("qwen3-8b"), cfg("qwen3-8b/query_aware")
    assert qwen.model == "qwen3-8b" and qwen.context_length == "4096"
    assert qwen.compression_ratio == plain.compression_ratio
    assert qwen.method == plain.method and qwen_aware.method == "snapkv,adakv,finch,chunkkv" and qwen_aware.query_aware
    assert qwen.task == plain.task and qwen.max_samples == 500 and qwen.output_dir == "results/leaderboard/qwen3-8b"


def _settings_tree(tmp_path):
    """One model: the full cache; lagkv at its defaults and at two argument sets, at the new ratios 16:1 / 32:1;
    DuoAttention at a head ratio (a learned-file path among its arguments); DMS over KVzap at two thresholds (no
    ratio). Two tasks, 4 samples each; returns the directory and per (line, x or swept setting) the expected
    (score, kept tokens, kept share)."""
    rng = np.random.default_rng(1)
    length, truth = 1024, {}
    lagkv = {"lagkv": {}, "lagkv [lag_size=128,sink_size=4]": {"sink_size": 4, "lag_size": 128},
             "lagkv [lag_size=1024,sink_size=16]": {"sink_size": 16, "lag_size": 1024}}
    settings = [("full", "full", None, {}, None)]
    settings += [(line, "lagkv", r, args, r) for line, args in lagkv.items() for r in (0.9375, 0.96875)]
    settings += [("duo_attention (head ratio)", "duo_attention", 0.5, {"patterns": "/cal/duo_attention"}, 0.5)]
    zap = {"base": "kvzap", "base_args": {"weights": "/cal/KVzap-mlp-m"}}
    settings += [("dms [base=kvzap]", "dms", None, {**zap, "threshold": t}, f"threshold={t}") for t in (-4, -6)]
    for line, method, ratio, args, key in settings:
        per_task, kept_all, frac_all = [], [], []
        for task in TASKS:
            scores = rng.integers(0, 2, 4).astype(float).tolist()
            kept = rng.integers(10, 900, 4).astype(float).tolist()
            _run(tmp_path, "m", method, ratio, task, length, scores, kept, length, method_args=args)
            per_task.append(100 * np.mean(scores))
            kept_all += kept
            frac_all += [k / length for k in kept]
        truth[(line, key if key is not None else 0.0)] = (np.mean(per_task), np.mean(kept_all), np.mean(frac_all))
    return tmp_path, truth


def test_new_ratio_columns_argument_lines_and_threshold_sweeps(tmp_path):
    path, truth = _settings_tree(tmp_path)
    table = leaderboard.cells(leaderboard.load_runs([str(path)]))
    lines = table["m @ 1024"]
    got = {}
    for line, cells in lines.items():
        for x, cell in cells.items():
            got[(line, cell.swept or x)] = cell
    assert set(got) == set(truth)  # each argument set its own line; learned-file paths left out of the labels
    for key, (score, kept, frac) in truth.items():
        cell = got[key]
        assert cell.score == pytest.approx(score) and cell.tasks == 2 and cell.samples == 4
        assert cell.kept_tokens == pytest.approx(kept) and cell.kept_fraction == pytest.approx(frac)
        if cell.swept:  # no nominal ratio: plotted at the measured one
            assert cell.x == pytest.approx(1 - frac)
    md = leaderboard.render_leaderboard(table)
    main, sweeps = md.split("Threshold sweeps on m @ 1024")
    assert "| method | full cache | ratio 0.5 | ratio 0.9375 | ratio 0.96875 |" in main
    score, kept, frac = truth[("lagkv [lag_size=128,sink_size=4]", 0.96875)]
    row = next(r for r in main.splitlines() if r.startswith("| lagkv [lag_size=128,sink_size=4] |"))
    assert row.split(" | ")[-1] == f"{score:.1f} · {kept:.0f} ({100 * frac:.0f}%) · n=4×2 |"
    assert "/cal/" not in md and "| duo_attention (head ratio) |" in main and "dms" not in main
    rows = [r for r in sweeps.splitlines() if r.startswith("| dms [base=kvzap] |")]
    assert [r.split(" | ")[1] for r in rows] == ["threshold=-4", "threshold=-6"]
    score, kept, frac = truth[("dms [base=kvzap]", "threshold=-6")]
    assert rows[1].endswith(f"| {score:.1f} · {kept:.0f} ({100 * frac:.0f}%) · n=4×2 |")
    out = tmp_path / "board.png"
    assert leaderboard.plot_leaderboard(table, str(out)) == str(out) and out.stat().st_size > 10_000
    assert leaderboard.x_limit(lines) == pytest.approx(max(0.96875, *(1 - c.kept_fraction for c in
                                                                          lines["dms [base=kvzap]"].values())) + 0.03)


def test_shown_arguments_split_sweeps_and_drop_learned_paths():
    shown, swept = leaderboard._shown_args("base=kvzap,base_args={'weights': '/a/b', 'x': 1},threshold=-4.5")
    assert (shown, swept) == ("base=kvzap,base_args={'x': 1}", "threshold=-4.5")
    assert leaderboard._shown_args("filters=/a/m_qfilt,window_size=8") == ("window_size=8", "")
    assert leaderboard._shown_args("base_args={'epsilon': 0.01},base=expected_attention") == (
        "base_args={'epsilon': 0.01},base=expected_attention", "")
