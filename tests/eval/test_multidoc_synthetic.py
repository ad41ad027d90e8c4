"""The synthetic multi-document task and the headline command: `python -m kvjax.eval --method=samkv` runs with
no other flag (kvjax-tiny, multidoc/synthetic), the RAG strategies side by side, their kept and recomputed
shares in the pivot, and what --budget / --compression_ratio mean for them."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from kvjax.errors import ConfigError
from kvjax.eval import tasks
from kvjax.eval.rag_amounts import strategy_args
from kvjax.eval.tasks.multidoc_synthetic import default_num_documents

ROOT = pathlib.Path(__file__).resolve().parents[2]
NEEDLE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")


def _count(text: str) -> int:
    return len(text.split())  # a whitespace tokenizer: lengths are checked against the same counter


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


@pytest.mark.parametrize("name,docs,facts", [
    ("multidoc/synthetic", None, 2), ("multidoc/synthetic_1fact", None, 1), ("multidoc/synthetic_7docs", 7, 2),
    ("multidoc/synthetic_3docs_1fact", 3, 1),
])
def test_documents_facts_and_distractors(name, docs, facts):
    length = 3000
    samples = tasks.get(name).samples(count_tokens=_count, context_length=length, num_samples=3, seed=0)
    assert len({s.id for s in samples}) == 3
    for s in samples:
        assert s.documents and "".join(s.documents) == s.context
        assert len(s.documents) == (docs or default_num_documents(length)) == s.metadata["num_documents"]
        found = [NEEDLE.findall(d) for d in s.documents]
        assert all(len(f) == 1 for f in found)  # one fact per document: the others are distractors
        keys = [f[0][0] for f in found]
        values = [f[0][1] for f in found]
        assert len(set(keys)) == len(keys) and len(set(values)) == len(values)
        assert len(s.answers) == facts
        holders = [values.index(a) + 1 for a in s.answers]  # documents holding the asked facts, in question order
        assert holders == s.metadata["answer_documents"] and len(set(holders)) == facts
        for d in holders:  # the question names exactly the keys of the answer documents
            assert keys[d - 1] in s.question
        assert sum(k in s.question for k in keys) == facts
        total = _count(s.prefix + s.context + s.question + s.answer_prefix)
        assert total == s.metadata["num_tokens"] <= length - s.max_new_tokens
        # Documents grow together: each holds the same number of filler sentences (one "." each) and its fact.
        assert [d.count(".") for d in s.documents] == [s.metadata["filler_units"] + 1] * len(s.documents)
    again = tasks.get(name).samples(count_tokens=_count, context_length=length, num_samples=3, seed=0)
    assert [s.context for s in again] == [s.context for s in samples]
    other = tasks.get(name).samples(count_tokens=_count, context_length=length, num_samples=3, seed=1)
    assert [s.answers for s in other] != [s.answers for s in samples]


def test_scores():
    task = tasks.get("multidoc/synthetic")
    (s,) = task.samples(count_tokens=_count, context_length=2000, num_samples=1, seed=0)
    a, b = s.answers
    assert task.score(f" {a} {b}", s) == {"string_match_all": 1.0, "qa_f1_score": 1.0}
    # LongBench's F1 counts the extra word: precision 2/3, recall 1.
    assert task.score(f" {a}, and {b}.", s) == {"string_match_all": 1.0, "qa_f1_score": pytest.approx(0.8)}
    assert task.score(f" {a}.", s)["string_match_all"] == 0.5
    assert task.score(" 42.", s) == {"string_match_all": 0.0, "qa_f1_score": 0.0}


def test_bad_names_and_lengths():
    with pytest.raises(ConfigError, match="facts must be 1 or 2"):
        tasks.get("multidoc/synthetic_3fact")
    with pytest.raises(ConfigError, match="number of documents"):
        tasks.get("multidoc/synthetic_1docs")
    with pytest.raises(Exception, match="needs 821 tokens without any filler, more than the 268 available"):
        tasks.get("multidoc/synthetic_64docs").samples(count_tokens=_count, context_length=300, num_samples=1, seed=0)


def test_compression_ratio_maps_onto_samkvs_knob_and_is_refused_elsewhere():
    assert strategy_args("samkv", {"update": "overwrite"}, None, 0.75) == {
        "update": "overwrite", "p_override": 0.25, "cross_doc_filter": False}
    assert strategy_args("samkv", {}, None, None) == {}
    with pytest.raises(ConfigError, match="--budget=64 has no meaning for samkv.*--compression_ratio"):
        strategy_args("samkv", {}, 64, None)
    with pytest.raises(ConfigError, match="p_override"):
        strategy_args("samkv", {"p_override": 0.3}, None, 0.5)
    for name, hint in (("cacheblend", "recompute_ratio"), ("epic", "epic.k"), ("reuse", "no knob"),
                       ("recompute", "no knob"), ("multi_infllm", "topk")):
        with pytest.raises(ConfigError, match=hint):
            strategy_args(name, {}, None, 0.5)


def _eval(*args, cwd=None, timeout=900):
    return subprocess.run([sys.executable, "-m", "kvjax.eval", *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout, cwd=cwd)


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


def _shares(stdout: str, method: str) -> tuple[float, tuple[int, int]]:
    (row,) = [x for x in stdout.splitlines() if x.startswith(f"| {method} |")]
    m = re.search(r"\| ([\d.]+) \(kept (\d+)%, recomputed (\d+)%\) \|", row)
    assert m, row
    return float(m.group(1)), (int(m.group(2)), int(m.group(3)))


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
    leaderboard = subprocess.run([sys.executable, "-m", "kvjax.eval.leaderboard", str(tmp_path / "results")],
                                 capture_output=True, text=True, env=_env(), timeout=300)
    assert leaderboard.returncode == 0, leaderboard.stderr
    assert re.search(r"\| samkv \| its defaults \| [\d.]+ · kept \d+% · recomputed \d+% · n=", leaderboard.stdout)


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
