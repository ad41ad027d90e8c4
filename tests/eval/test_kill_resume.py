"""Kill -9 at several points of a `python -m kvjax.eval` sweep, then rerun: every sample exactly once and the
same predictions and metrics as an uninterrupted run. Also Ctrl-C (exit 130, one line) and byte-identical
predictions (timings aside) across identical runs.

The embedded kvjax-tiny model on 256-token passkey prompts, a two-cell sweep (full, then SnapKV at 64 tokens),
4 samples per cell, one per batch. Kill points observed from outside: during the first sample (config.json
written, no prediction yet), during a later sample, between samples (in the `--throttle_s` sleep) and between
the cells (the first cell's metrics.json written). The sub-millisecond windows inside a write are reproduced
by the state a kill there leaves: a torn last line, a stray `metrics.json.tmp.<pid>`.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from cli_inprocess import run_cmd

from kvjax.eval.results import deterministic_part

ROOT = pathlib.Path(__file__).resolve().parents[2]
N = 4


def _cmd(out, *extra):
    return [
        sys.executable, "-m", "kvjax.eval", f"--output_dir={out}", "--method=full,snapkv", "--budget=64",
        "--task=passkey", "--context_length=256", f"--max_samples={N}", "--batch_size=1", "--progress=false", *extra,
    ]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def _records(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _cells(out):
    return {p.name: p for p in sorted(pathlib.Path(out).iterdir()) if p.is_dir() and p.name != "plots"}


def _state(out):
    """{cell: (sorted deterministic records, metrics without wall-clock keys)}"""
    state = {}
    for name, cell in _cells(out).items():
        recs = _records(cell / "predictions.jsonl")
        ids = [r["id"] for r in recs]
        assert len(ids) == len(set(ids)) == N, f"{name}: ids {ids}"  # 0 lost, 0 duplicated
        metrics = json.loads((cell / "metrics.json").read_text())
        metrics = {k: v for k, v in metrics.items() if "ttft" not in k}
        state[name] = (sorted((deterministic_part(r) for r in recs), key=lambda r: r["id"]), metrics)
    return state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    proc = run_cmd(_cmd(out))  # in this process; the killed runs and the identical-run check are real processes
    assert proc.returncode == 0, proc.stderr
    assert len(_cells(out)) == 2
    return out, _state(out)


def _run_until(out, condition, *extra, timeout=300):
    """Starts the sweep, kill -9s it as soon as `condition(out)` holds."""
    proc = subprocess.Popen(_cmd(out, *extra), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and proc.poll() is None:
            if condition(pathlib.Path(out)):
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before the kill point"
        assert condition(pathlib.Path(out)), "the kill point was never reached"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _first_cell(out):
    cells = [c for c in _cells(out).values() if "__full__" in c.name]
    return cells[0] if cells else None


def _lines_in_first(out):
    cell = _first_cell(out)
    return len(_records(cell / "predictions.jsonl")) if cell else 0


def _resume_and_compare(out, reference):
    proc = run_cmd(_cmd(out))  # the resume, in this process (the kill itself needs the real one)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert _state(out) == reference[1]


@pytest.mark.slow
def test_kill_during_first_sample(tmp_path, reference):
    def started(out):
        cell = _first_cell(out)
        return cell is not None and (cell / "config.json").exists()

    _run_until(tmp_path, started)
    assert _lines_in_first(tmp_path) == 0
    _resume_and_compare(tmp_path, reference)


def test_kill_during_a_later_sample(tmp_path, reference):
    _run_until(tmp_path, lambda out: _lines_in_first(out) >= 2)
    assert 2 <= _lines_in_first(tmp_path) < N
    _resume_and_compare(tmp_path, reference)


def test_kill_between_samples_and_mid_write(tmp_path, reference):
    """Killed in the sleep after a sample; a second, torn record line is what a kill inside `append` leaves."""
    _run_until(tmp_path, lambda out: _lines_in_first(out) >= 1, "--throttle_s=3")
    preds = _first_cell(tmp_path) / "predictions.jsonl"
    done = _records(preds)
    assert 1 <= len(done) < N
    line = preds.read_bytes().splitlines(keepends=True)[0]
    with open(preds, "ab") as f:
        f.write(line.replace(done[0]["id"].encode(), b"passkey:torn")[: len(line) // 2])
    _resume_and_compare(tmp_path, reference)


@pytest.mark.slow
def test_kill_between_cells_and_mid_metrics_write(tmp_path, reference):
    """Killed after the first cell's metrics; a stray temporary file is what a kill inside the write leaves."""

    def first_done(out):
        cell = _first_cell(out)
        return cell is not None and (cell / "metrics.json").exists()

    _run_until(tmp_path, first_done, "--throttle_s=3")
    first = _first_cell(tmp_path)
    assert len(_records(first / "predictions.jsonl")) == N
    (first / "metrics.json.tmp.99999").write_text('{"score": 0.')
    metrics = json.loads((first / "metrics.json").read_text())
    assert metrics["num_samples"] == N
    _resume_and_compare(tmp_path, reference)


# A child inherits its parent's ignored signals and signal mask through exec, and Python installs its
# KeyboardInterrupt handler only where SIGINT is not ignored. Inside a loaded pytest-xdist run the child
# twice ran on with SIGINT ignored (it finished its 4 samples and exited 0 with nothing on stderr), while
# 3 runs alone and 6 under `-n 2` passed. So the run starts as a terminal would start it: this shim gives
# SIGINT its default disposition and unblocks it, then execs the CLI.
_TERMINAL_SIGINT = (
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
    "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def test_ctrl_c_says_what_is_kept_and_exits_130(tmp_path, reference):
    cmd = _cmd(tmp_path, "--throttle_s=3")
    proc = subprocess.Popen(
        [cmd[0], "-c", _TERMINAL_SIGINT, *cmd[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env(),
    )
    deadline = time.time() + 300
    while time.time() < deadline and _lines_in_first(tmp_path) < 1 and proc.poll() is None:
        time.sleep(0.02)
    # Which of the two ways this can go wrong, if it does: the run ended before the interrupt was sent
    # (a starved poller), or the interrupt was sent and the run went on to exit 0.
    ended_before = proc.poll() is not None
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert not ended_before, f"the run ended (exit {proc.returncode}) before the interrupt was sent"
    assert proc.returncode == 130, f"interrupted at {_lines_in_first(tmp_path)} samples: exit {proc.returncode}, {err}"
    assert "Traceback" not in err
    kept = _lines_in_first(tmp_path)
    assert f"interrupted: {kept} samples kept" in err and "rerun to resume" in err
    _resume_and_compare(tmp_path, reference)


@pytest.mark.slow
def test_identical_runs_give_identical_predictions_but_timings(tmp_path, reference):
    # A process of its own against the reference made in the test process: identical across processes.
    proc = subprocess.run(_cmd(tmp_path), capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr
    for name, cell in _cells(tmp_path).items():
        ours = (cell / "predictions.jsonl").read_bytes().splitlines()
        theirs = (reference[0] / name / "predictions.jsonl").read_bytes().splitlines()
        assert len(ours) == len(theirs) == N
        for a, b in zip(ours, theirs, strict=True):
            # `timings` is the record's last key: everything before it is the same bytes.
            assert a.split(b', "timings": ')[0] == b.split(b', "timings": ')[0]
            assert b'"timings": ' in a
    same = run_cmd([sys.executable, "-m", "kvjax.eval.report", "--compare", str(tmp_path), str(reference[0])])
    assert same.returncode == 0 and "0 of 2 settings differ" in same.stdout, same.stdout + same.stderr
