"""One cell key for the run directory, resume, report and leaderboard; duplicate cells run once; processes
sharing an output folder never compute a sample twice (per-cell claims, recovered after kill -9)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from kvjax.eval import claims as claims_mod
from kvjax.eval import report
from kvjax.eval.cell import EXTRA_FIELDS, CellKey
from kvjax.eval.results import RunDir

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
    runs = report.load_runs([str(tmp_path)])
    assert len(runs) == 2 and report.varying_fields(runs) == ["dtype"]
    pivot = report.render_pivot(runs)
    assert "| snapkv [dtype=bfloat16] |" in pivot and "| snapkv [dtype=float32] |" in pivot


def test_resume_into_another_settings_directory_is_refused(tmp_path):
    run = _write_run(tmp_path, KEY, range(2))
    with pytest.raises(Exception, match=r"dtype='float32' \(this command: 'bfloat16'\)") as e:
        run.check_identity(dataclasses.replace(KEY, dtype="bfloat16"))
    assert "seed" not in str(e.value)
    run.check_identity(KEY)  # the same cell resumes


def test_report_compare_ignores_the_shared_prefill_marker(tmp_path):
    """`--shared_prefill` is an execution setting: a record that ran in a shared group is the same result."""
    for side, extra in (("a", {"shared_prefill": True}), ("b", {})):
        run = RunDir(str(tmp_path / side), KEY.name())
        run.write_config({"cell": KEY.as_dict(), "model": "tiny", "method": "snapkv", "budget": 512,
                          "task": KEY.task, "context_length": 4096})
        run.append({"id": "0", "task": KEY.task, "method": "snapkv", "prediction": "12345", "metric": "m",
                    "scores": {"m": 1.0}, "metadata": {}, **extra, "timings": {"prefill_s": 0.1 if extra else 0.2}})
    proc = subprocess.run([sys.executable, "-m", "kvjax.eval.report", "--compare", str(tmp_path / "a"),
                           str(tmp_path / "b")], capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 of 1 settings differ" in proc.stdout


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


# ---- the CLI --------------------------------------------------------------------------------------------


def test_dtype_runs_are_separate_cells_that_never_mix(tmp_path):
    """The reported defect: a bfloat16 run "resumed" float32 predictions and relabelled them."""
    for dtype in ("float32", "bfloat16"):
        proc = _eval(f"--output_dir={tmp_path}", "--method=full", f"--dtype={dtype}", *BASE)
        assert proc.returncode == 0, proc.stderr
    cells = _cells(tmp_path)
    assert len(cells) == 2
    dtypes = sorted(json.loads((c / "config.json").read_text())["cell"]["dtype"] for c in cells)
    assert dtypes == ["bfloat16", "float32"]
    assert all(len(_records(c)) == 2 for c in cells)


def test_resume_with_a_changed_stored_setting_is_refused_naming_it(tmp_path):
    proc = _eval(f"--output_dir={tmp_path}", "--method=full", *BASE)
    assert proc.returncode == 0, proc.stderr
    (cell,) = _cells(tmp_path)
    config = json.loads((cell / "config.json").read_text())
    config["cell"]["seed"] = 7  # a directory holding another setting's results under this cell's name
    (cell / "config.json").write_text(json.dumps(config))
    before = (cell / "predictions.jsonl").read_bytes()
    proc = _eval(f"--output_dir={tmp_path}", "--method=full", *BASE[:-2], "--max_samples=3", "--progress=false")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "error" in x]
    assert "seed=7 (this command: 0)" in line
    assert (cell / "predictions.jsonl").read_bytes() == before


def test_repeated_values_are_one_cell():
    proc = _eval("--method=snapkv,snapkv", "--budget=64,64", "--context_length=1024,1024", "--dry_run", *BASE[:1])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "1 runs planned"


def test_method_args_budget_is_the_cells_budget(tmp_path):
    proc = _eval(f"--output_dir={tmp_path}", "--method=snapkv", "--method_args=budget=48", *BASE)
    assert proc.returncode == 0, proc.stderr
    assert "| snapkv (full)" not in proc.stdout
    assert proc.stdout.splitlines()[0] == "| method | passkey @48 |"
    (cell,) = _cells(tmp_path)
    assert {r["budget"] for r in _records(cell)} == {48}
    assert all(r["kept_tokens"] <= 48 + r["question_tokens"] for r in _records(cell))
    # The same cell as --budget=48: nothing left to run.
    again = _eval(f"--output_dir={tmp_path}", "--method=snapkv", "--budget=48", *BASE)
    assert again.returncode == 0 and _cells(tmp_path) == [cell]


def test_method_args_budget_conflicting_with_budget_is_refused():
    proc = _eval("--method=snapkv", "--budget=64", "--method_args=budget=48", "--dry_run", *BASE)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "error" in x]
    assert "budget=48" in line and "--budget=64" in line


def test_two_processes_on_one_output_dir_compute_each_sample_once(tmp_path):
    """Both processes finish with the whole pivot; together they wrote each sample once."""
    cmd = [sys.executable, "-m", "kvjax.eval", f"--output_dir={tmp_path}", "--method=full,streaming_llm",
           "--budget=32", "--shared_prefill=no", "--throttle_s=0.5", *BASE[:2], "--max_samples=4",
           "--progress=false"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert "| full |" in out and "| streaming_llm |" in out
    cells = _cells(tmp_path)
    assert len(cells) == 2
    for cell in cells:
        ids = [r["id"] for r in _records(cell)]
        assert len(ids) == 4 and len(set(ids)) == 4, (cell.name, ids)
    assert any("is being run by pid" in err for _, err in outs)  # the second process deferred a held cell


def test_a_cell_claimed_by_a_killed_process_is_recovered(tmp_path):
    cmd = [sys.executable, "-m", "kvjax.eval", f"--output_dir={tmp_path}", "--method=full", *BASE[:2],
           "--max_samples=4", "--progress=false"]
    first = subprocess.Popen([*cmd, "--throttle_s=2.0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=_env())
    deadline = time.time() + 300
    while time.time() < deadline and not any(_records(c) for c in _cells(tmp_path)):
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    (cell,) = _cells(tmp_path)
    assert 1 <= len(_records(cell)) < 4
    assert (cell / ".claim").exists()  # the killed holder's claim file stays, its lock went with it
    second = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert second.returncode == 0, second.stderr
    ids = [r["id"] for r in _records(cell)]
    assert len(ids) == 4 and len(set(ids)) == 4


def test_extra_fields_are_the_ones_documented():
    assert set(EXTRA_FIELDS) <= {f.name for f in dataclasses.fields(CellKey)}
