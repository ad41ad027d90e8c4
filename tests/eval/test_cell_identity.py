"""The cell key (kvjax/eval/cell.py) and the per-cell claims (kvjax/eval/claims.py): every setting that changes a
result changes the run directory; the key survives config.json; report keeps settings apart and names what differs;
a resume into another setting's directory is refused; a claim is exclusive and, without file locks, recovered from a
dead holder only. The CLI side: tests/eval/test_eval_identity_cli.py."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from cli_inprocess import run_report

from kvjax.errors import KvjaxError
from kvjax.eval import claims as claims_mod
from kvjax.eval import report
from kvjax.eval.cell import EXTRA_FIELDS, CellKey
from kvjax.eval.results import RunDir
from kvjax.eval.runs import load_runs, varying_fields

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = ["--task=passkey", "--context_length=200", "--max_samples=2", "--progress=false"]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def _eval(*args, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "kvjax.eval", *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout, **kw)


def _cells(out):
    return sorted(p for p in pathlib.Path(out).iterdir() if p.is_dir() and p.name != "plots")


def _records(cell):
    path = cell / "predictions.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


KEY = CellKey(model="/models/Qwen2.5-7B/", method="snapkv", task="ruler/niah_single_1", context_length=4096, budget=512,
              dtype="float32")


@pytest.mark.parametrize("change", [
    {"dtype": "bfloat16"}, {"chat_template": "yes"}, {"chunk_size": 256}, {"max_new_tokens": 8},
    {"data_dir": "/data/longbench"}, {"question_first": True}, {"seed": 1}, {"method_args": {"window_size": 8}},
    {"query_aware": True}, {"budget": 256}, {"compression_ratio": 0.5}, {"context_length": 2048},
    {"answer_prefix": "needle"},
])
def test_every_setting_that_changes_a_result_changes_the_directory(change):
    other = dataclasses.replace(KEY, **change)
    assert other.name() != KEY.name()
    (field,) = change
    assert [d.split("=")[0] for d in KEY.diff(other)] == [field]
    # The key survives config.json: what resume and report read back is the same key.
    assert CellKey.from_config({"cell": other.as_dict()}) == other


def test_key_is_order_free_and_path_free():
    a = dataclasses.replace(KEY, method_args={"window_size": 8, "kernel_size": 5})
    b = dataclasses.replace(KEY, model="Qwen2.5-7B", method_args={"kernel_size": 5, "window_size": 8})
    assert a == b and a.name() == b.name()
    assert "/" not in dataclasses.replace(KEY, model="org/name with space").name()


def test_old_configs_are_read_from_their_flags():
    """Run directories written before the key existed are still merged by report on their settings."""
    config = {"model": "tiny", "method": "snapkv", "budget": 64, "compression_ratio": None, "task": "passkey",
              "context_length": 200, "query_aware": False, "method_args": {}, "dtype": "bfloat16",
              "flags": {"seed": 3, "chat_template": "no", "question_first": True, "chunk_size": None,
                        "data_dir": "/x"}}
    key = CellKey.from_config(config)
    assert (key.seed, key.chat_template, key.question_first, key.dtype) == (3, "no", True, "bfloat16")
    assert key.data_dir is None  # passkey reads no file: the data dir cannot change its results


def _write_run(root, key, ids):
    run = RunDir(str(root), key.name())
    run.write_config({"cell": key.as_dict(), "model": key.model, "method": key.method, "budget": key.budget,
                      "compression_ratio": None, "task": key.task, "context_length": key.context_length,
                      "query_aware": False, "method_args": {}})
    for i in ids:
        run.append({"id": str(i), "task": key.task, "method": key.method, "metric": "m", "scores": {"m": 1.0},
                    "metadata": {}, "prediction": "x"})
    return run


def test_report_keeps_settings_apart_and_names_what_differs(tmp_path):
    for dtype in ("float32", "bfloat16"):
        _write_run(tmp_path, dataclasses.replace(KEY, dtype=dtype, model="tiny"), range(2))
    runs = load_runs([str(tmp_path)])
    assert len(runs) == 2 and varying_fields(runs) == ["dtype"]
    pivot = report.render_pivot(runs)
    assert "| snapkv [dtype=bfloat16] |" in pivot and "| snapkv [dtype=float32] |" in pivot


@pytest.mark.parametrize("edit", [{"budget": "abc"}, {"context_length": None}, {"method_args": [1]},
                                  {"kv_dtype": "int9"}])
def test_a_stored_cell_key_of_the_wrong_kind_is_one_line_naming_the_file(tmp_path, edit):
    """A hand-edited config.json whose cell key does not parse was a ValueError / TypeError traceback from the
    report and the eval's resume; it is a KvjaxError (one line, exit 2) naming the file and the value."""
    run = _write_run(tmp_path, KEY, range(2))
    config = json.loads(open(run.config_path).read())
    config["cell"].update(edit)
    with open(run.config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(KvjaxError, match=re.escape(run.config_path + ": cannot read the cell key")):
        run.check_identity(KEY)
    with pytest.raises(KvjaxError, match=re.escape(run.config_path + ": cannot read the cell key")):
        load_runs([str(tmp_path)])
    proc = run_report(str(tmp_path), "--no_plots")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and run.config_path in proc.stderr


def test_resume_into_another_settings_directory_is_refused(tmp_path):
    run = _write_run(tmp_path, KEY, range(2))
    with pytest.raises(Exception, match=r"dtype='float32' \(this command: 'bfloat16'\)") as e:
        run.check_identity(dataclasses.replace(KEY, dtype="bfloat16"))
    assert "seed" not in str(e.value)
    run.check_identity(KEY)  # the same cell resumes


def test_an_answer_prefix_of_the_niah_tasks_alone_names_no_line(tmp_path):
    """`--answer_prefix=needle` keys the niah cells and leaves vt's (which keeps its own prefix) unkeyed: over such a
    sweep the method is one line of the leaderboard and one row of the pivot, averaged over both tasks. A task run
    with both prefixes splits them."""
    from kvjax.eval import leaderboard

    ratio = dataclasses.replace(KEY, model="tiny", budget=None, compression_ratio=0.5)
    _write_run(tmp_path, dataclasses.replace(ratio, answer_prefix="needle"), range(2))
    _write_run(tmp_path, dataclasses.replace(ratio, task="ruler/vt"), range(2))
    runs = load_runs([str(tmp_path)])
    assert len(runs) == 2 and varying_fields(runs) == []
    pivot = report.render_pivot(runs)
    assert "| snapkv |" in pivot and "answer_prefix" not in pivot
    table = leaderboard.cells(runs)
    assert list(table["tiny @ 4096"]) == ["snapkv"] and table["tiny @ 4096"]["snapkv"][0.5].tasks == 2

    _write_run(tmp_path, ratio, range(2))  # niah_single_1 again with its own prefix: two settings of one task
    runs = load_runs([str(tmp_path)])
    assert varying_fields(runs) == ["answer_prefix"]
    assert set(leaderboard.cells(runs)["tiny @ 4096"]) == {"snapkv [answer_prefix=needle]",
                                                           "snapkv [answer_prefix=None]"}


# ---- claims ---------------------------------------------------------------------------------------------


def test_claim_is_exclusive_and_names_its_holder(tmp_path):
    a, b = claims_mod.Claim(str(tmp_path)), claims_mod.Claim(str(tmp_path))
    assert a.try_acquire()
    assert not b.try_acquire()
    assert b.holder() == f"pid {os.getpid()} on {os.uname().nodename}"
    a.release()
    assert b.try_acquire()
    b.release()


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_claim_without_file_locks_takes_over_a_dead_holder_only(tmp_path, monkeypatch):
    """Where flock is unsupported, the claim is a pid file: a dead process's claim of this host is recovered,
    a live one's or another host's is honoured."""
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    claim = claims_mod.Claim(str(tmp_path))
    host = os.uname().nodename
    for holder, expected in (({"host": host, "pid": _dead_pid()}, True),
                             ({"host": host, "pid": os.getppid()}, False),
                             ({"host": "elsewhere", "pid": _dead_pid()}, False)):
        pathlib.Path(claim.pid_path).write_text(json.dumps(holder))
        assert claim.try_acquire() is expected, holder
        if expected:
            assert json.loads(pathlib.Path(claim.pid_path).read_text())["pid"] == os.getpid()
            claim.release()
            assert not os.path.exists(claim.pid_path)


def test_extra_fields_are_the_ones_documented():
    assert set(EXTRA_FIELDS) <= {f.name for f in dataclasses.fields(CellKey)}
