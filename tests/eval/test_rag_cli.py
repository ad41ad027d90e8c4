"""The headline command and the RAG strategies in the eval CLI, on the embedded kvjax-tiny model:
`python -m kvjax.eval --method=samkv` runs with no other flag (multidoc/synthetic, generated offline), the five
strategies run side by side with their kept and recomputed shares in the pivot and the leaderboard, and
--budget / --compression_ratio mean something for samkv (its sparsity knob) and are refused in one line elsewhere."""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest
from cli_inprocess import run_eval, run_leaderboard

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def _eval(*args, cwd=None):
    """The CLI in this process (tests/cli_inprocess.py): the same entry point, exit code and output."""
    return run_eval(*args, cwd=cwd)


@pytest.mark.parametrize("flags,needle", [
    (["--method=samkv", "--budget=64"], "--budget=64 has no meaning for samkv"),
    (["--method=cacheblend", "--compression_ratio=0.5"], "cacheblend.recompute_ratio"),
    (["--method=samkv,epic", "--compression_ratio=0.5"], "epic.k"),
    (["--method=samkv", "--compression_ratio=0.5", "--method_args=p_override=0.2"], "p_override=0.2"),
])
def test_rag_amounts_refused_in_one_line(flags, needle):
    proc = _eval(*flags, "--dry_run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "error" in x]
    assert needle in line


@pytest.mark.parametrize("value", ["100", "-1"])
def test_bad_samkv_stable_layers_refused_in_one_line(value):
    """A number where a list of layers goes (`stable_layers=100`) was a TypeError traceback from the strategy."""
    proc = _eval("--method=samkv", f"--method_args=samkv.stable_layers={value}", "--dry_run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "error" in x]
    assert "stable_layers must be a non-empty list of layer indices" in line and value in line


def _shares(stdout: str, method: str) -> tuple[float, tuple[int, int]]:
    (row,) = [x for x in stdout.splitlines() if x.startswith(f"| {method} |")]
    m = re.search(r"\| ([\d.]+) \(kept (\d+)%, recomputed (\d+)%\) \|", row)
    assert m, row
    return float(m.group(1)), (int(m.group(2)), int(m.group(3)))


@pytest.mark.slow
def test_headline_command_and_strategies_side_by_side(tmp_path):
    """`--method=samkv` alone (kvjax-tiny, multidoc/synthetic, 20 samples at 1024 tokens), then the five strategies
    side by side in the same folder (samkv's cell is finished: it is not run again)."""
    proc = _eval("--method=samkv", "--progress=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (cell,) = [p for p in (tmp_path / "results").iterdir() if p.is_dir() and p.name != "plots"]
    assert cell.name.startswith("multidoc-synthetic__1024__kvjax-tiny__samkv__")
    records = [json.loads(x) for x in (cell / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 20 and all(0 < r["recompute_ratio"] <= r["sequence_ratio"] <= 1 for r in records)
    assert "samkv (full)" not in proc.stdout and "@full" not in proc.stdout
    _, (kept, recomputed) = _shares(proc.stdout, "samkv")
    assert kept == round(100 * sum(r["sequence_ratio"] for r in records) / 20)
    assert recomputed == round(100 * sum(r["recompute_ratio"] for r in records) / 20)
    assert 0 < recomputed <= kept < 100  # SamKV drops middle blocks and recomputes part of what it keeps

    before = (cell / "predictions.jsonl").read_bytes()
    side = _eval("--method=samkv,cacheblend,epic,reuse,recompute", "--max_samples=2", "--progress=false",
                 cwd=tmp_path)
    assert side.returncode == 0, side.stderr
    assert (cell / "predictions.jsonl").read_bytes() == before
    assert _shares(side.stdout, "recompute")[1] == (100, 100)
    assert _shares(side.stdout, "reuse")[1] == (100, 0)
    for name in ("cacheblend", "epic"):
        kept, recomputed = _shares(side.stdout, name)[1]
        assert kept == 100 and 0 < recomputed < 50
    leaderboard = run_leaderboard(str(tmp_path / "results"))
    assert leaderboard.returncode == 0, leaderboard.stderr
    assert re.search(r"\| samkv \| its defaults \| [\d.]+ · kept \d+% · recomputed \d+% · n=", leaderboard.stdout)


@pytest.mark.slow
def test_compression_ratio_lowers_samkvs_kept_share(tmp_path):
    """Removing 75 % of each document's middle blocks keeps less than removing none (which keeps everything)."""
    proc = _eval("--method=samkv", "--compression_ratio=0,0.75", "--task=multidoc/synthetic_3docs",
                 "--context_length=2048", "--max_samples=1", "--progress=false", f"--output_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    kept = {}
    for cell in (p for p in tmp_path.iterdir() if p.is_dir() and p.name != "plots"):
        config = json.loads((cell / "config.json").read_text())
        (record,) = [json.loads(x) for x in (cell / "predictions.jsonl").read_text().splitlines()]
        assert config["method_hyperparameters"]["cross_doc_filter"] is False
        kept[config["compression_ratio"]] = record["sequence_ratio"]
    assert kept[0.0] == 1.0
    assert kept[0.75] < 0.75
    header = proc.stdout.splitlines()[0]
    assert "@ratio 0 " in header + " " and "@ratio 0.75" in header
