"""Packed run archives (kvjax.eval.archive): the committed leaderboard tables regenerate from them byte for byte,
and packing is lossless and deterministic."""

from __future__ import annotations

import json
import pathlib
import re
import runpy
import tarfile

import pytest

from kvjax.eval import archive, leaderboard
from kvjax.eval.runs import load_runs

ROOT = pathlib.Path(__file__).resolve().parents[2]
BOARD = ROOT / "docs" / "leaderboard"
PANELS = {"smollm2-135m-2k": 2048, "smollm2-135m-4k": 4096}
TINY = "kvjax-tiny-1k"  # its table is docs/leaderboard/kvjax-tiny.md
PRESSES = "smollm2-135m-2k-kvpress-presses"  # issue 44's presses on SmolLM2 at 2K, archived apart from the older panel


@pytest.fixture(scope="module")
def packed_runs():
    return {name: load_runs([str(BOARD / "runs" / f"{name}{archive.SUFFIX}")]) for name in [*PANELS, TINY]}


def _table(runs) -> str:
    """What ``python -m kvjax.eval.leaderboard ARCHIVE [--task=T] > FILE`` writes."""
    return leaderboard.render_leaderboard(leaderboard.cells(runs)) + "\n"


def test_every_committed_smollm2_table_regenerates_from_its_archive(packed_runs):
    # the quantized panel's table is test_archive_kv_dtype.py's
    committed = sorted(p for p in BOARD.glob("smollm2-135m-*.md")
                       if "kv_dtype" not in p.stem and PRESSES not in p.stem)
    assert len(committed) == 22  # two panels and their ten tasks each
    for path in committed:
        panel = next(p for p in PANELS if path.stem == p or path.stem.startswith(p + "-"))
        runs = packed_runs[panel]
        assert {r.context_length for r in runs} == {PANELS[panel]} and len(runs) == 650
        task = path.stem[len(panel) + 1:]
        if task:
            runs = [r for r in runs if r.task == f"ruler/{task}"]
            assert len(runs) == 65, path.name
        assert _table(runs) == path.read_text(encoding="utf-8"), f"{path.name} differs from its archive"


def test_docs_leaderboard_tables_are_the_archives(packed_runs):
    """The SmolLM2 tables in docs/leaderboard.md are the regenerated ones, rows and all."""
    page = (ROOT / "docs" / "leaderboard.md").read_text(encoding="utf-8")
    for panel, runs in packed_runs.items():
        body = _table(runs).split("\n", 2)[2].strip()  # without the "### panel" heading
        if panel == TINY:
            body = body.split("\n\nThreshold sweeps")[0]  # the page shows the ratio table
        assert body.startswith("| method | full cache |")
        assert body in page, f"docs/leaderboard.md's {panel} table differs from the archive"


def test_kvjax_tiny_table_regenerates_from_its_archive(packed_runs):
    runs = packed_runs[TINY]
    assert {r.context_length for r in runs} == {1024} and {r.model for r in runs} == {"kvjax-tiny"}
    assert all(len(r.records) == 20 for r in runs)  # finished cells only, every one of 20 samples
    full = [r for r in runs if r.method == "full"]
    assert {r.task for r in runs} == {r.task for r in full}  # every archived task has its full-cache cell
    assert _table(runs) == (BOARD / "kvjax-tiny.md").read_text(encoding="utf-8")


def test_smollm2_presses_table_regenerates_beside_the_older_methods():
    """The presses' table renders their archive with the older 2K archive's cells of the same tasks; every archived
    task is complete (each cell of every task, 20 samples each), and the four tasks issue 44 asks for are there."""
    new = load_runs([str(BOARD / "runs" / f"{PRESSES}{archive.SUFFIX}")])
    tasks = {r.task for r in new}
    assert tasks >= {f"ruler/{t}" for t in ("niah_single_1", "niah_multikey_1", "niah_multiquery", "vt")}  # issue 44
    assert {r.context_length for r in new} == {2048} and all(len(r.records) == 20 for r in new)
    assert len(new) == len({r.key for r in new}) == 102 * len(tasks)  # one run per cell: issue 44's 96, KVzip+'s 6
    assert "full" not in {r.method for r in new}  # the full cache is the older archive's
    old = [r for r in load_runs([str(BOARD / "runs" / f"smollm2-135m-2k{archive.SUFFIX}")]) if r.task in tasks]
    assert len(old) == 65 * len(tasks)
    assert _table(old + new) == (BOARD / f"{PRESSES}.md").read_text(encoding="utf-8")


@pytest.mark.slow
def test_cli_reads_an_archive_and_filters_tasks(capsys):
    path = str(BOARD / "runs" / f"smollm2-135m-4k{archive.SUFFIX}")
    assert leaderboard.main([path, "--task=ruler/vt"]) == 0
    assert capsys.readouterr().out == (BOARD / "smollm2-135m-4k-vt.md").read_text(encoding="utf-8")
    assert leaderboard.main([str(BOARD / "runs")]) == 0  # a directory holding archives: both panels
    out = capsys.readouterr().out
    assert "### smollm2-135m @ 2048 (10 tasks" in out and "### smollm2-135m @ 4096 (10 tasks" in out


def _write_run(root: pathlib.Path, method: str, ratio: float | None, length: int, shards: int = 1) -> pathlib.Path:
    d = root / "m" / f"ruler-vt__{length}__m__{method}__{ratio}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(dict(model="m", method=method, budget=None, compression_ratio=ratio,
                                                   task="ruler/vt", context_length=length, query_aware=False)))
    (d / "metrics.json").write_text(json.dumps({"score": 50.0, "num_samples": 4}))
    for s in range(shards):
        name = "predictions.jsonl" if shards == 1 else f"predictions.{s}-of-{shards}.jsonl"
        with open(d / name, "w") as f:
            for i in range(s, 4, shards):
                f.write(json.dumps(dict(id=f"vt:{i}", task="ruler/vt", metric="string_match_all",
                                        scores={"string_match_all": float(i % 2)}, kept_tokens=100 + i,
                                        metadata={"task": "ruler/vt"}, timings={"ttft_s": 0.1 * i})) + "\n")
    return d


@pytest.fixture
def run_tree(tmp_path):
    src = tmp_path / "results"
    for method, ratio in (("full", None), ("snapkv", 0.5), ("lagkv", 0.5)):
        _write_run(src, method, ratio, 1024)
    _write_run(src, "h2o", 0.5, 1024, shards=2)  # a two-process run: both shards are packed and merged
    _write_run(src, "snapkv", 0.5, 2048)  # another panel: left out by --context_length
    return src / "m"


def _view(runs):
    return sorted(((r.method, r.compression_ratio, r.context_length, r.score, json.dumps(r.records, sort_keys=True))
                   for r in runs), key=str)


def test_pack_is_lossless_deterministic_and_read_in_place(run_tree, tmp_path):
    out = tmp_path / f"m-1k{archive.SUFFIX}"
    assert archive.main(["pack", str(run_tree), f"--out={out}", "--context_length=1024"]) == 0
    again = tmp_path / f"again{archive.SUFFIX}"
    archive.pack(str(run_tree), str(again), context_length=1024)
    assert out.read_bytes() == again.read_bytes()  # same runs, same bytes
    on_disk = [r for r in load_runs([str(run_tree)]) if r.context_length == 1024]
    packed = load_runs([str(out)])
    assert len(packed) == 4 and _view(packed) == _view(on_disk)
    assert sum(len(r.records) for r in packed if r.method == "h2o") == 4  # both shards
    with tarfile.open(out, "r:xz") as tar:  # extracts to the run directories, byte for byte
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
        assert {(m.uid, m.gid, m.mtime, m.mode) for m in tar} == {(0, 0, 0, 0o644)}
    disk = {str(p.relative_to(run_tree.parent)): p.read_bytes() for p in run_tree.rglob("*") if p.is_file()}
    assert members == {k: v for k, v in disk.items() if "__1024__" in k}


def test_a_run_both_packed_and_on_disk_is_merged_by_sample_id(run_tree, tmp_path):
    out = tmp_path / f"m{archive.SUFFIX}"
    archive.pack(str(run_tree), str(out))
    merged = load_runs([str(run_tree), str(out)])
    assert _view(merged) == _view(load_runs([str(run_tree)]))


def test_bad_archives_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / f"bad{archive.SUFFIX}"
    bad.write_bytes(b"not xz at all")
    assert leaderboard.main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"kvjax\.eval\.leaderboard: error: cannot read run archive .*bad\.runs\.tar\.xz: .*", err)
    assert "\n" not in err
    assert archive.main(["pack", str(tmp_path), f"--out={tmp_path / 'x.tar.xz'}"]) == 2
    assert archive.main(["pack", str(tmp_path / "none"), f"--out={tmp_path / ('y' + archive.SUFFIX)}"]) == 2
    assert "no run directories" in capsys.readouterr().err


def test_a_failed_pack_leaves_no_file(run_tree, tmp_path, capsys):
    """A run file that cannot be read midway (here a folder under a predictions file's name): one line, and neither
    the archive nor its partly written temporary file is left beside it."""
    (run_tree / "ruler-vt__1024__m__snapkv__0.5" / "predictions.extra.jsonl").mkdir()
    out = tmp_path / "out" / f"m{archive.SUFFIX}"
    out.parent.mkdir()
    assert archive.main(["pack", str(run_tree), f"--out={out}"]) == 2
    assert "Is a directory" in capsys.readouterr().err and list(out.parent.iterdir()) == []


@pytest.mark.parametrize("damage", [b"\xff\xfe{}", b'{"context_length": 10'], ids=["not_utf8", "truncated"])
def test_a_damaged_run_config_is_one_line_naming_it(run_tree, capsys, damage):
    """A run's config.json that is not UTF-8 or not whole: the leaderboard over its directory, and packing it by
    context length, stop with one line naming the file, never a traceback; no archive is written."""
    config = next(run_tree.glob("*/config.json"))
    config.write_bytes(damage)
    assert leaderboard.main([str(run_tree)]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"kvjax\.eval\.leaderboard: error: cannot read {re.escape(str(config))}: .*", err), err
    out = run_tree.parent / f"m{archive.SUFFIX}"
    assert archive.main(["pack", str(run_tree), f"--out={out}", "--context_length=1024"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"kvjax\.eval\.archive: error: cannot read {re.escape(str(config))}: .*", err), err
    assert not out.exists()


def _short(cell: str) -> str:
    """A leaderboard cell as the README shows it: `score · kept tokens`."""
    found = re.match(r"\s*([0-9.]+) · ([0-9]+)", cell)
    return f"{found[1]} · {found[2]}" if found else ""


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


@pytest.mark.parametrize("board", ["kvjax-tiny", PRESSES])
def test_readme_leaderboard_tables_quote_the_rendered_ones(board):
    """The README's short tables (a row per press by ratio, then KVzap by threshold) repeat the cells of the table
    rendered from the archives, score and kept tokens alike."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    after = readme[readme.index(f"(docs/leaderboard/{board}.md)") :].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("| method |"))
    block = after[start : start + 2 + next(i for i, line in enumerate(after[start:]) if line.startswith("| KVzap-MLP"))]
    rendered = (BOARD / f"{board}.md").read_text(encoding="utf-8").splitlines()
    by_name = {_cells(r)[0]: _cells(r) for r in rendered if r.startswith("| ") and "threshold=" not in r}
    ratio_rows = [_cells(r) for r in block if r.startswith("| ") and " · " in r and "KVzap" not in r]
    assert len(ratio_rows) >= 10
    for name, *cells in ratio_rows:
        if name == "full cache":
            assert cells[0] == _short(by_name["full"][1])
        else:
            assert cells == [_short(c) for c in by_name[name][2:]], name
    thresholds = next(_cells(r)[1:] for r in block if r.startswith("| KVzap under DMS"))
    for label, kind in (("KVzap-Linear", "linear"), ("KVzap-MLP", "mlp")):
        quoted = next(_cells(r)[1:] for r in block if r.startswith(f"| {label}:"))
        swept = {re.search(r"threshold=(\S+) ", r)[1]: _short(_cells(r)[2]) for r in rendered
                 if "threshold=" in r and f"'model_type': '{kind}'" in r}
        assert quoted == [swept[t] for t in thresholds], label


# Issue 58's Gemma 3 270M panels (configs/leaderboard_gemma3.py), archived task by task as each finishes.
GEMMA_PANELS = {"gemma3-270m-4k": "4k", "gemma3-270m-16k": "16k"}
GEMMA_CONFIG = runpy.run_path(str(ROOT / "configs" / "leaderboard_gemma3.py"))


def _gemma_cells(panel: str) -> tuple[set, list[set]]:
    """A Gemma panel's cells as (method, ratio, budget, threshold): its main run's, and each run of its own's (KVzip
    at the panel's ratios; on the 4K panel ActQKV at its per-step budgets)."""
    config = GEMMA_CONFIG["PANELS"][panel]
    ratios = [float(x) for x in config["compression_ratio"].split(",")]
    main = {("full", None, None, "")} | {(m, x, None, "") for m in config["method"].split(",") if m != "full"
                                         for x in ratios}
    own_runs = [{("kvzip", x, None, "") for x in ratios}]
    if panel == "4k":
        budgets = GEMMA_CONFIG["get_config"]("4k/actqkv").budget.split(",")
        own_runs.append({("actqkv", None, int(b), "") for b in budgets})
    return main, own_runs


def _threshold(run) -> str:
    """A KVzap-under-DMS cell's threshold (``threshold=-4.42``), '' for the others."""
    return leaderboard._sweep_args(run)[1] if run.budgetless else ""


@pytest.mark.parametrize("name", GEMMA_PANELS)
def test_gemma3_tables_regenerate_from_their_archive(name):
    """Every archived task holds the panel's main run whole (the full cache and each method at each ratio) and each
    run of its own whole or not at all, 20 / 10 samples per cell; the panel's table, each task's and
    docs/leaderboard.md's regenerate from the archive."""
    panel = GEMMA_CONFIG["PANELS"][GEMMA_PANELS[name]]
    runs = load_runs([str(BOARD / "runs" / f"{name}{archive.SUFFIX}")])
    tasks = sorted({r.task for r in runs})
    assert set(tasks) <= set(panel["task"].split(","))
    assert {r.context_length for r in runs} == {int(panel["context_length"])} and {r.model for r in runs} == {
        "gemma3-270m"}
    assert all(len(r.records) == panel["max_samples"] for r in runs)
    main, own_runs = _gemma_cells(GEMMA_PANELS[name])
    # KVzap's sweep: the calibration's thresholds (a local file, so read from the archive), as many as kvpress's,
    # the same on every task that has them
    swept = {_threshold(r) for r in runs if r.method == "dms"}
    if swept:
        assert len(swept) == len(runpy.run_path(str(ROOT / "configs" / "leaderboard.py"))["KVPRESS_THRESHOLDS"])
        own_runs.append({("dms", None, None, t) for t in swept})
    for task in tasks:
        cells = [(r.method, r.compression_ratio, r.budget, _threshold(r)) for r in runs if r.task == task]
        assert len(cells) == len(set(cells)), task
        assert main <= set(cells), task
        extra = set(cells) - main
        assert extra == set().union(*(run for run in own_runs if run & extra)), task  # whole runs, nothing else
    committed = sorted(BOARD.glob(f"{name}*.md"))
    assert {p.stem for p in committed} == {name} | {f"{name}-{t.removeprefix('ruler/')}" for t in tasks}
    for path in committed:
        task = path.stem[len(name) + 1:]
        shown = [r for r in runs if r.task == f"ruler/{task}"] if task else runs
        assert _table(shown) == path.read_text(encoding="utf-8"), f"{path.name} differs from its archive"
    body = _table(runs).split("\n", 2)[2].strip()
    assert body in (ROOT / "docs" / "leaderboard.md").read_text(encoding="utf-8")
