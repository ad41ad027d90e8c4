"""The eval CLI's cell identity end to end: every setting that changes a result is its own cell (the run directory),
a resume into another setting's directory is refused naming the field, repeated values run once, a budget in
--method_args is the cell's budget, and two processes sharing an output folder (or one killed with -9 and a
second) compute each sample once. On the embedded kvjax-tiny model; the CLI runs in-process except where the
test is about processes."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from cli_inprocess import run_eval, run_report

from kvjax.eval.results import RunDir, run_name

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = ["--task=passkey", "--context_length=200", "--max_samples=2", "--progress=false"]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def _eval(*args):
    """The CLI in this process (tests/cli_inprocess.py); the two-process and kill tests below spawn real ones."""
    return run_eval(*args)


def _cells(out):
    return sorted(p for p in pathlib.Path(out).iterdir() if p.is_dir() and p.name != "plots")


def _records(cell):
    path = cell / "predictions.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


NAME = run_name(model="tiny", method="snapkv", task="passkey", context_length=4096, budget=512)


def test_report_compare_ignores_the_shared_prefill_marker(tmp_path):
    """`--shared_prefill` is an execution setting: a record that ran in a shared group is the same result."""
    for side, extra in (("a", {"shared_prefill": True}), ("b", {})):
        run = RunDir(str(tmp_path / side), NAME)
        run.write_config({"model": "tiny", "method": "snapkv", "budget": 512, "task": "passkey",
                          "context_length": 4096})
        run.append({"id": "0", "task": "passkey", "method": "snapkv", "prediction": "12345", "metric": "m",
                    "scores": {"m": 1.0}, "metadata": {}, **extra, "timings": {"prefill_s": 0.1 if extra else 0.2}})
    proc = run_report("--compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 of 1 settings differ" in proc.stdout


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


def test_a_rerun_that_computes_nothing_keeps_the_config_of_the_run_that_did(tmp_path):
    """config.json records the flags, versions and device of the run behind a cell's records: a rerun that finds the
    cell finished (here with --max_samples=1 and another batch size) computes nothing and must not restamp it."""
    proc = _eval(f"--output_dir={tmp_path}", "--method=full", *BASE)
    assert proc.returncode == 0, proc.stderr
    (cell,) = _cells(tmp_path)
    before = (cell / "config.json").read_bytes()
    proc = _eval(f"--output_dir={tmp_path}", "--method=full", *BASE[:2], "--max_samples=1", "--batch_size=2",
                 "--progress=false")
    assert proc.returncode == 0, proc.stderr
    assert _cells(tmp_path) == [cell] and len(_records(cell)) == 2
    config = json.loads((cell / "config.json").read_text())
    assert (config["flags"]["max_samples"], config["flags"]["batch_size"]) == (2, 1)
    assert (cell / "config.json").read_bytes() == before
    assert json.loads((cell / "metrics.json").read_text())["num_samples"] == 2


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


@pytest.mark.slow
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
