"""The resumable results store: append, torn-line recovery, resume, atomic writes, shards."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvjax.errors import KvjaxError
from kvjax.eval import results
from kvjax.eval.results import RunDir, make_record, run_name, shard, summarize
from kvjax.eval.tasks.base import DataError, Sample


def _sample(i: int, task: str = "passkey") -> Sample:
    return Sample(
        id=f"s{i}",
        context="ctx",
        question="q",
        answers=("42",),
        max_new_tokens=8,
        metric="exact",
        metadata={"task": task, "depth": 10.0 * i, "length": 128},
    )


def test_append_and_read_back(tmp_path):
    run = RunDir(str(tmp_path), "r1")
    for i in range(3):
        rec = make_record(
            _sample(i), "42", {"exact": 1.0, "partial": 1.0}, method="snapkv", budget=64, timings={"prefill": 0.1}
        )
        run.append(rec)
    lines = open(run.predictions_path).read().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert first["id"] == "s0" and first["method"] == "snapkv" and first["budget"] == 64
    assert first["scores"] == {"exact": 1.0, "partial": 1.0} and first["metric"] == "exact"
    assert first["timings"] == {"prefill": 0.1} and first["task"] == "passkey"
    assert run.done_ids() == {"s0", "s1", "s2"}
    with pytest.raises(KvjaxError):
        run.append({"no": "id"})


def test_torn_last_line_is_dropped_on_open(tmp_path):
    run = RunDir(str(tmp_path), "r")
    run.append({"id": "a", "scores": {}})
    run.append({"id": "b", "scores": {}})
    with open(run.predictions_path, "ab") as f:
        f.write(b'{"id": "c", "scores": {"ex')  # killed mid-write
    # Readers ignore the partial line even before any repair...
    assert RunDir.done_ids(run) == {"a", "b"}
    # ...and reopening truncates it so the next append starts on a fresh line.
    run2 = RunDir(str(tmp_path), "r")
    assert open(run2.predictions_path, "rb").read().endswith(b"\n")
    run2.append({"id": "c", "scores": {}})
    assert [json.loads(x)["id"] for x in open(run2.predictions_path)] == ["a", "b", "c"]


def test_torn_file_with_no_complete_line(tmp_path):
    os.makedirs(tmp_path / "r")
    (tmp_path / "r" / "predictions.jsonl").write_bytes(b'{"id": "x"')
    run = RunDir(str(tmp_path), "r")
    assert os.path.getsize(run.predictions_path) == 0 and run.done_ids() == set()


def test_corrupt_complete_line_names_file_and_line(tmp_path):
    run = RunDir(str(tmp_path), "r")
    run.append({"id": "a"})
    with open(run.predictions_path, "a") as f:
        f.write("not json\n")
    with pytest.raises(DataError, match=r"predictions\.jsonl:2"):
        run.done_ids()


def _resume_loop(run_dir: RunDir, ids, fail_after=None):
    done = run_dir.done_ids()
    n = 0
    for i in ids:
        if i in done:
            continue
        if fail_after is not None and n == fail_after:
            raise RuntimeError("crash")
        run_dir.append({"id": i, "scores": {"exact": 1.0}, "metric": "exact"})
        n += 1


def test_resume_skips_done_ids(tmp_path):
    ids = [f"s{i}" for i in range(10)]
    with pytest.raises(RuntimeError):
        _resume_loop(RunDir(str(tmp_path), "r"), ids, fail_after=4)
    run = RunDir(str(tmp_path), "r")
    assert len(run.done_ids()) == 4
    _resume_loop(run, ids)
    written = [json.loads(x)["id"] for x in open(run.predictions_path)]
    assert sorted(written) == sorted(ids) and len(written) == len(set(written))


_CHILD = r"""
import sys
from kvjax.eval.results import RunDir
run = RunDir(sys.argv[1], "killed")
done = run.done_ids()
for i in range(400):
    if f"s{i}" in done:
        continue
    run.append({"id": f"s{i}", "prediction": "x" * 20000, "scores": {"exact": 1.0}})
    if i == 5:
        print("started", flush=True)
"""


def test_kill_mid_run_then_resume_gives_each_sample_once(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"started"
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run = RunDir(str(tmp_path), "killed")
    first = run.done_ids()
    assert 6 <= len(first) <= 400
    subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], check=True, env=env, stdout=subprocess.DEVNULL)
    written = [json.loads(x)["id"] for x in open(run.predictions_path)]
    assert sorted(written) == sorted(f"s{i}" for i in range(400))


def test_atomic_metrics_and_config(tmp_path, monkeypatch):
    run = RunDir(str(tmp_path), "r")
    run.write_metrics({"score": 50.0})
    run.write_config({"method": "snapkv", "budget": 64})
    assert run.read_metrics() == {"score": 50.0}
    assert run.read_config() == {"budget": 64, "method": "snapkv"}

    def broken_dump(obj, f, **kw):
        f.write('{"score": 9')  # a crash half-way through writing
        raise OSError("disk full")

    monkeypatch.setattr(results.json, "dump", broken_dump)
    with pytest.raises(OSError):
        run.write_metrics({"score": 99.0})
    monkeypatch.undo()
    assert run.read_metrics() == {"score": 50.0}  # the old file is intact
    run.write_metrics({"score": float("nan"), "x": (1, 2)})
    assert run.read_metrics() == {"score": None, "x": [1, 2]}
    assert [f for f in os.listdir(run.path) if ".tmp." in f] == []


def test_shard_partitions_items():
    items = list(range(11))
    parts = [shard(items, i, 3) for i in range(3)]
    assert sorted(x for p in parts for x in p) == items
    assert parts[0] == [0, 3, 6, 9]
    with pytest.raises(KvjaxError):
        shard(items, 3, 3)


def test_multi_process_files_merge(tmp_path):
    a = RunDir(str(tmp_path), "r", process_index=0, process_count=2)
    b = RunDir(str(tmp_path), "r", process_index=1, process_count=2)
    assert a.predictions_path != b.predictions_path
    a.append({"id": "s0"})
    b.append({"id": "s1"})
    b.append({"id": "s0"})  # a duplicate across shards counts once
    assert a.done_ids() == b.done_ids() == {"s0", "s1"}
    assert len(a.records()) == 2


def test_run_name_is_stable_and_distinguishes_settings():
    base = dict(
        model="/models/Qwen2.5-7B/",
        method="snapkv",
        task="ruler/niah_single_1",
        context_length=4096,
        seed=0,
        budget=512,
    )
    name = run_name(**base)
    assert name.startswith("ruler-niah_single_1__4096__Qwen2.5-7B__snapkv__b512__s0__")  # + a digest of the key
    assert run_name(**base) == name
    with_args = run_name(**base, method_args={"window": 64, "kernel": 5})
    assert with_args == run_name(**base, method_args={"kernel": 5, "window": 64})
    assert with_args != run_name(**base, method_args={"kernel": 7, "window": 64})
    assert "__r0.5__s0__" in run_name(**{**base, "budget": None}, compression_ratio=0.5)
    assert "query_aware" in run_name(**base, query_aware=True)
    assert "/" not in run_name(**{**base, "model": "org/name with space"})


def test_summarize_uses_task_aggregation():
    recs = [make_record(_sample(i, "needle"), "", {"rouge_l_recall": float(i % 2)}, method="full") for i in range(4)]
    for r in recs:
        r["metric"] = "rouge_l_recall"
    out = summarize(recs, "needle")
    assert out["score"] == 50.0 and out["num_samples"] == 4 and "grid" in out
    assert summarize(recs)["score"] == 50.0


def test_intact_run_is_reopened_and_rewritten_without_any_write(tmp_path, monkeypatch):
    """A finished run re-runs in a read-only folder: opening it and storing the same config / metrics again
    opens nothing for writing (a torn tail is still repaired when there is one)."""
    run = RunDir(str(tmp_path), "r")
    run.append(make_record(_sample(0), "42", {"exact": 1.0}, method="full"))
    run.write_config({"a": 1})
    run.write_metrics({"score": 100.0, "nan": float("nan")})
    import builtins

    real_open, real_os_open = builtins.open, os.open

    def read_only_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wa+x"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    def read_only_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied", str(path))
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only_open)
    monkeypatch.setattr(os, "open", read_only_os_open)
    again = RunDir(str(tmp_path), "r")
    again.write_config({"a": 1})
    again.write_metrics({"score": 100.0, "nan": float("nan")})
    assert again.done_ids() == {"s0"}
    with pytest.raises(PermissionError):
        again.write_metrics({"score": 50.0})  # a change does need a write
    monkeypatch.undo()
    with open(again.predictions_path, "ab") as f:
        f.write(b'{"id": "s1", "pred')
    assert RunDir(str(tmp_path), "r").done_ids() == {"s0"}


def test_kept_tokens_counts_prompt_and_generated_slots():
    """Hand-counted: positions below the prompt length are prompt tokens, the rest generated, -1 empty."""
    from kvjax.eval.runner import kept_tokens

    pos = np.full((2, 2, 2, 6), -1)  # [layers, batch, kv heads, capacity]
    pos[0, 0, 0, :5] = [0, 1, 7, 9, 10]  # prompt length 10: 4 prompt, 1 generated
    pos[0, 0, 1, :3] = [0, 8, 11]  # 2 prompt, 1 generated
    pos[1, 0, 0, :2] = [3, 4]
    pos[1, 0, 1, :6] = [0, 1, 2, 3, 10, 12]
    pos[:, 1, :, :4] = [0, 1, 2, 3]  # prompt length 3: 3 prompt, 1 generated everywhere
    prompt, generated = kept_tokens(pos, [10, 3])
    np.testing.assert_allclose(prompt, [(4 + 2 + 2 + 4) / 4, 3])
    np.testing.assert_allclose(generated, [(1 + 1 + 0 + 2) / 4, 1])
    # Only the tokens each row really generated count: row 0 made 1 (position 10), row 1 none.
    _, real = kept_tokens(pos, [10, 3], [1, 0])
    np.testing.assert_allclose(real, [(1 + 0 + 0 + 1) / 4, 0])
