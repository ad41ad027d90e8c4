"""The quantized-cache panel's archive (docs/leaderboard/runs/kvjax-tiny-1k-kv_dtype.runs.tar.xz): its committed
table, and the table in docs/leaderboard.md, regenerate from it byte for byte; every archived task is complete."""

from __future__ import annotations

import pathlib

from kvjax.eval import archive, leaderboard
from kvjax.eval.runs import load_runs

ROOT = pathlib.Path(__file__).resolve().parents[2]
BOARD = ROOT / "docs" / "leaderboard"
PANEL = "kvjax-tiny-1k-kv_dtype"
CELLS_PER_TASK = 6 + 3 * 4 * 6  # the full cache and three methods at four ratios, each at six storages


def test_the_kv_dtype_panel_regenerates_from_its_archive():
    runs = load_runs([str(BOARD / "runs" / f"{PANEL}{archive.SUFFIX}")])
    assert {r.context_length for r in runs} == {1024} and {r.model for r in runs} == {"kvjax-tiny"}
    tasks = {r.task for r in runs}
    assert len(runs) == CELLS_PER_TASK * len(tasks)
    assert all(len(r.records) == 20 for r in runs)  # finished cells only
    table = leaderboard.render_leaderboard(leaderboard.cells(runs)) + "\n"
    assert table == (BOARD / f"{PANEL}.md").read_text(encoding="utf-8")
    body = table.split("\n", 2)[2].strip()
    assert body.startswith("| method | full cache |") and "[kv_dtype=kivi2, " in body
    assert body in (ROOT / "docs" / "leaderboard.md").read_text(encoding="utf-8")


SMOLLM2 = "smollm2-135m-2k-kv_dtype"  # the full cache at every storage: issue 46's quality cells
KV_DTYPES = ("model", "int8", "fp8", "int4", "kivi4", "kivi2")


def test_the_smollm2_quality_cells_regenerate_from_their_archive():
    runs = load_runs([str(BOARD / "runs" / f"{SMOLLM2}{archive.SUFFIX}")])
    assert {r.context_length for r in runs} == {2048} and {r.model for r in runs} == {"smollm2-135m"}
    assert {r.task for r in runs} == {"ruler/niah_single_1", "ruler/niah_multikey_1"}
    assert {r.method for r in runs} == {"full"} and len(runs) == 2 * len(KV_DTYPES)
    assert all(len(r.records) == 20 for r in runs)  # finished cells only
    table = leaderboard.render_leaderboard(leaderboard.cells(runs)) + "\n"
    assert table == (BOARD / f"{SMOLLM2}.md").read_text(encoding="utf-8")
    body = table.split("\n", 2)[2].strip()
    assert all(f"[kv_dtype={d}, " in body for d in KV_DTYPES)
    assert body in (ROOT / "docs" / "leaderboard.md").read_text(encoding="utf-8")
