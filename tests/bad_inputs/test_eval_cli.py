"""Bad inputs to `python -m kvjax.eval` and `python -m kvjax.eval.report`: each one exits 2 with one clear line
naming the bad value, no traceback, and leaves the finished run already in the output folder untouched.

The finished run is a real one (the embedded kvjax-tiny model, 2 passkey samples); every case but the
output-folder ones points at that folder, and its files (bytes, inode, mtime) must be the same afterwards.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from cli_inprocess import run_eval, run_report

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = ["--method=full", "--task=passkey", "--context_length=200", "--max_samples=2", "--progress=false"]
UNWRITABLE = "/sys/kvjax_no_such_dir"  # cannot be created, not even by root (sysfs)


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def _eval(*args):
    """The CLI in this process (tests/cli_inprocess.py): the same entry point, exit code and output."""
    return run_eval(*args)


def _eval_process(*args, timeout=300):
    """The CLI in a process of its own, for what needs one: absl's --help, the exit status a shell sees."""
    return subprocess.run(
        [sys.executable, "-m", "kvjax.eval", *args], capture_output=True, text=True, env=_env(), timeout=timeout
    )


def _report(*args):
    return run_report(*args)


def _snapshot(root):
    out = {}
    for path in sorted(pathlib.Path(root).rglob("*")):
        if path.is_file():
            st = path.stat()
            out[str(path)] = (path.read_bytes(), st.st_ino, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    proc = _eval(f"--output_dir={out}", *BASE)
    assert proc.returncode == 0, proc.stderr
    (cell,) = [p for p in out.iterdir() if p.is_dir() and p.name != "plots"]
    assert len((cell / "predictions.jsonl").read_text().splitlines()) == 2
    return out


def _assert_refused(proc, needle):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, proc.stderr
    assert needle in errors[0], proc.stderr


def _data_dir(tmp_path, content: bytes):
    data = tmp_path / "data"
    data.mkdir()
    (data / "hotpotqa.jsonl").write_bytes(content)
    return data


CASES = {
    "max_samples_zero": (["--max_samples=0"], "--max_samples=0"),
    "context_beyond_model": (["--context_length=1000000"], "--context_length=1000000"),
    "budget_beyond_model": (["--method=snapkv", "--budget=99999"], "budget=99999"),
    "budget_beyond_model_in_second_cell": (["--method=full,snapkv", "--budget=64,99999"], "budget=99999"),
    "context_not_a_number": (["--context_length=1k"], "'1k'"),
    "context_with_no_room_for_the_prompt": (
        ["--context_length=20"], "passkey: context_length 20 leaves no room for the prompt after 21 generated tokens"),
    "context_with_no_room_before_the_data_is_looked_for": (
        ["--task=longbench/qasper", "--context_length=100"],
        "longbench/qasper: context_length 100 leaves no room for the prompt after 128 generated tokens"),
    "unknown_method": (["--method=full,snapkvv"], "snapkvv"),
    "unknown_task": (["--task=passkeyy"], "passkeyy"),
    "empty_task": (["--task="], "--task is empty"),  # before: ran the default task, as if the flag were not given
    "ratio_out_of_range": (["--method=snapkv", "--compression_ratio=1.5"], "1.5"),
    "batch_size_zero": (["--batch_size=0"], "--batch_size must be > 0, got 0"),
    "seed_beyond_32_bits": (["--seed=4294967296"], "--seed must be an integer in [0, 2**32), got 4294967296"),
    "chunk_size_negative": (["--chunk_size=-4"], "-4"),
    "answer_prefix_unknown": (["--answer_prefix=echo"], "one of ['task', 'needle'], got 'echo'"),
    "answer_prefix_without_niah": (["--answer_prefix=needle"], "--answer_prefix=needle applies to RULER's niah tasks"),
    "method_args_not_key_value": (["--method=snapkv", "--budget=64", "--method_args=window_size"], "window_size"),
    "method_args_unknown_key": (["--method=snapkv", "--budget=64", "--method_args=windw=8"], "windw"),
    "bad_mesh": (["--mesh=data:two"], "data:two"),
    "dtype_not_allowed": (["--dtype=int8"], "int8"),
    "missing_config": (["--config=configs/lagkv_passkey.py"], "configs/lagkv_passkey.py"),
    "positional_argument": (["passkey"], "passkey"),
    "missing_model_dir": (["--model=/nonexistent/model"], "/nonexistent/model"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_flag(finished, name):
    extra, needle = CASES[name]
    before = _snapshot(finished)
    proc = _eval(f"--output_dir={finished}", *BASE, *extra)
    _assert_refused(proc, needle)
    assert _snapshot(finished) == before


def test_config_setting_an_unknown_flag(finished, tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text("def get_config():\n    return {'methd': 'snapkv'}\n")
    before = _snapshot(finished)
    _assert_refused(_eval(f"--output_dir={finished}", *BASE, f"--config={config}"), "'methd'")
    assert _snapshot(finished) == before


def test_empty_data_file_is_not_a_zero_score(finished, tmp_path):
    data = _data_dir(tmp_path, b"")
    before = _snapshot(finished)
    proc = _eval(f"--output_dir={finished}", *BASE, "--task=longbench/hotpotqa", f"--data_dir={data}")
    _assert_refused(proc, "hotpotqa")
    assert _snapshot(finished) == before
    assert not [p for p in finished.iterdir() if "hotpotqa" in p.name]  # no "0 samples, score 0" run left


def test_output_dir_that_is_a_file(tmp_path):
    target = tmp_path / "results.txt"
    target.write_text("keep me\n")
    _assert_refused(_eval(f"--output_dir={target}", *BASE), str(target))
    assert target.read_text() == "keep me\n"


def test_output_dir_that_cannot_be_created():
    """In a real process: exit status 2 and the one line are what a shell sees."""
    _assert_refused(_eval_process(f"--output_dir={UNWRITABLE}", *BASE), UNWRITABLE)


def test_corrupt_prediction_line_names_file_line_and_repair(finished, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    (preds,) = out.glob("*/predictions.jsonl")
    lines = preds.read_bytes().splitlines(keepends=True)
    preds.write_bytes(lines[0] + b'{"id": "passkey:200:0:1", "predic\x00\n')
    before = _snapshot(out)
    proc = _eval(f"--output_dir={out}", *BASE)
    _assert_refused(proc, f"{preds}:2:")
    assert "sed -i '2d'" in proc.stderr
    assert _snapshot(out) == before
    report = _report(str(out))
    _assert_refused(report, f"{preds}:2:")
    assert _snapshot(out) == before
    # The repair the message gives works: the sample is run again.
    preds.write_bytes(lines[0])
    again = _eval(f"--output_dir={out}", *BASE)
    assert again.returncode == 0, again.stderr
    assert [json.loads(x)["id"] for x in preds.read_text().splitlines()] == [
        json.loads(x)["id"] for x in lines
    ]


def test_report_plot_dir_that_cannot_be_written_keeps_the_table(finished):
    before = _snapshot(finished)
    proc = _report(str(finished), f"--plot_dir={UNWRITABLE}")
    _assert_refused(proc, UNWRITABLE)
    assert "| full |" in proc.stdout  # the table is printed before the plot fails
    assert _snapshot(finished) == before


def test_max_samples_minus_one_is_accepted_as_every_sample(finished, tmp_path):
    """The help says <= 0 means every sample of a file-based task: -1 runs the whole (2-sample) file."""
    data = ROOT / "tests" / "fixtures" / "eval" / "longbench"
    total = sum(1 for x in (data / "hotpotqa.jsonl").read_text().splitlines() if x.strip())
    assert total == 2
    out = tmp_path / "out"
    proc = _eval(f"--output_dir={out}", *BASE[:-2], "--max_samples=-1", "--task=longbench/hotpotqa",
                 f"--data_dir={data}", "--context_length=1000", "--progress=false")
    assert proc.returncode == 0, proc.stderr
    (preds,) = out.glob("*/predictions.jsonl")
    assert len(preds.read_text().splitlines()) == total


def test_finished_run_reruns_without_writing(finished):
    """A rerun of a finished run writes nothing (so it also works in a read-only folder) and prints the pivot."""
    cells = {p for p in finished.iterdir() if p.is_dir() and p.name != "plots"}
    before = {k: v for k, v in _snapshot(finished).items() if pathlib.Path(k).parent in cells}
    proc = _eval(f"--output_dir={finished}", *BASE)
    assert proc.returncode == 0, proc.stderr
    assert "| full |" in proc.stdout
    after = {k: v for k, v in _snapshot(finished).items() if pathlib.Path(k).parent in cells}
    assert after == before


def test_help_examples_name_configs_that_exist():
    import re

    proc = _eval_process("--help", timeout=120)
    assert proc.returncode == 0, proc.stderr  # absl's own --help exits with 1
    assert "Traceback" not in proc.stderr, proc.stderr
    configs = re.findall(r"--config=(\S+\.py)", proc.stdout)
    assert configs, proc.stdout[:2000]
    for config in configs:
        assert (ROOT / config).is_file(), config


def test_budget_above_the_prompt_is_said_not_silent(tmp_path):
    """A budget longer than the prompt runs as the full cache: the record, metrics.json and the pivot say so."""
    out = tmp_path / "out"
    proc = _eval(f"--output_dir={out}", "--method=snapkv", "--budget=4096", *BASE[1:3], "--max_samples=1",
                 "--progress=false")
    assert proc.returncode == 0, proc.stderr
    (cell,) = [p for p in out.iterdir() if p.is_dir() and p.name != "plots"]
    (record,) = [json.loads(x) for x in (cell / "predictions.jsonl").read_text().splitlines()]
    assert record["budget_above_prompt"] is True
    assert record["kept_tokens"] == record["context_tokens"] + record["question_tokens"]
    assert json.loads((cell / "metrics.json").read_text())["budget_above_prompt_samples"] == 1
    assert f"({record['kept_tokens']:.0f})*" in proc.stdout and "ran with the whole prompt kept" in proc.stdout


def test_config_whose_get_config_returns_none(finished, tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text("def get_config():\n    pass\n")
    before = _snapshot(finished)
    _assert_refused(_eval(f"--output_dir={finished}", *BASE, f"--config={config}"), "returned NoneType")
    assert _snapshot(finished) == before


def test_output_dir_inside_proc():
    """/proc/self is a directory nothing can be created in: one line before the model loads."""
    _assert_refused(_eval("--output_dir=/proc/self", *BASE), "--output_dir '/proc/self': cannot create")


def _limit_memory():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))  # the uncapped prefill asked for tens of GB


@pytest.mark.slow
def test_chunk_size_beyond_the_prompt_runs_as_one_shot(finished, tmp_path):
    """--chunk_size=10000000 on a 168-token prompt: capped at the prompt bucket, the same predictions as without."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kvjax.eval", f"--output_dir={out}", *BASE, "--chunk_size=10000000"],
                          capture_output=True, text=True, env=_env(), timeout=300, preexec_fn=_limit_memory)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (ours,) = out.glob("*/predictions.jsonl")
    (base,) = finished.glob("*/predictions.jsonl")
    strip = lambda r: {k: v for k, v in r.items() if k != "timings"}  # noqa: E731
    assert [strip(json.loads(x)) for x in ours.read_text().splitlines()] == \
        [strip(json.loads(x)) for x in base.read_text().splitlines()]


FULL_DISK = """
import errno, os, runpy, sys
from kvjax.eval import results
real_write, calls = os.write, []
def write(fd, data):
    if os.fstat(fd).st_size and fd not in calls and data.startswith(b'{"id"'):
        calls.append(fd)
        real_write(fd, data[: len(data) // 2])  # half a record reaches the disk, then it is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_write(fd, data)
results.os.write = write
sys.argv = ["kvjax.eval", *sys.argv[1:]]
runpy.run_module("kvjax.eval", run_name="__main__", alter_sys=True)
"""


def test_full_disk_while_writing_records(tmp_path):
    """ENOSPC on the second record: one line, exit 2; the first record stays whole (the torn half is dropped),
    and the same command resumes."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, f"--output_dir={out}", *BASE], capture_output=True,
                          text=True, env=_env(), timeout=300)
    _assert_refused(proc, "No space left on device")
    assert "1 samples kept" in proc.stderr
    (preds,) = out.glob("*/predictions.jsonl")
    data = preds.read_bytes()
    assert data.endswith(b"\n") and len(data.splitlines()) == 1
    json.loads(data)
    again = _eval(f"--output_dir={out}", *BASE)
    assert again.returncode == 0, again.stderr
    ids = [json.loads(x)["id"] for x in preds.read_text().splitlines()]
    assert len(ids) == 2 and len(set(ids)) == 2


def test_a_predictions_file_that_is_a_directory(finished, tmp_path):
    """Issue 60: a directory named predictions.jsonl was a traceback (IsADirectoryError) in the eval and the report."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    (preds,) = out.glob("*/predictions.jsonl")
    preds.unlink()
    preds.mkdir()
    before = _snapshot(out)
    _assert_refused(_eval(f"--output_dir={out}", *BASE), f"cannot read {preds}")
    _assert_refused(_report(str(out), "--no_plots"), f"cannot read {preds}")
    assert _snapshot(out) == before and preds.is_dir()


def test_a_record_of_a_sample_the_task_never_produced_is_refused(finished, tmp_path):
    """Issue 60: a record whose id the task never produces (a line pasted from another task) was counted in the score.
    The eval refuses it before any cell runs, naming file, line and id; a record of one of the task's own samples
    beyond this run's --max_samples (an earlier, larger run) is the task's and is kept."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    (preds,) = out.glob("*/predictions.jsonl")
    first = json.loads(preds.read_text().splitlines()[0])
    assert first["id"] == "passkey:200:0:0"  # task:length:seed:index
    with preds.open("a") as f:
        f.write(json.dumps({**first, "id": "ruler/vt:200:0:0"}) + "\n")
    before = _snapshot(out)
    proc = _eval(f"--output_dir={out}", *BASE)
    _assert_refused(proc, f"{preds}:3: a record of sample 'ruler/vt:200:0:0', which passkey never produces")
    assert f"sed -i '3d' {preds}" in proc.stderr
    assert _snapshot(out) == before
    lines = preds.read_text().splitlines()
    preds.write_text("\n".join([*lines[:2], json.dumps({**first, "id": "passkey:200:0:2"})]) + "\n")  # its 3rd sample
    proc = _eval(f"--output_dir={out}", *BASE)  # --max_samples=2
    assert proc.returncode == 0, proc.stderr
    assert len(preds.read_text().splitlines()) == 3  # kept, nothing re-run


def test_a_context_beyond_the_model_is_not_a_prompt_plus_zero_new_tokens(finished):
    """Issue 60: the eval's context length counts the answer; the message said "prompt of N tokens + 0 new tokens"."""
    proc = _eval(f"--output_dir={finished}", *BASE[:2], "--context_length=1000000", *BASE[3:])
    _assert_refused(proc, "--context_length=1000000: a sequence of 1000000 tokens (prompt and answer) exceeds the "
                          "model's maximum context of")
    assert "new tokens" not in proc.stderr
    from tiny import tiny_model

    import kvjax
    from kvjax.errors import KvjaxError

    with pytest.raises(KvjaxError, match="prompt of 10 tokens \\+ 5000 new tokens exceeds the model's maximum"):
        kvjax.generate(tiny_model(), [list(range(10))], method="full", max_new_tokens=5000)


@pytest.mark.parametrize("template, needle", [
    ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}x",
     "chat template cannot render a user message (TemplateError: a system message first); pass --chat_template=no"),
    ("{% for m in messages %}[{{ m['role'] }}]{% endfor %}", "chat template leaves out the user message's text"),
])
def test_chat_template_that_cannot_wrap_a_prompt(tmp_path, template, needle):
    """A chat template that refuses (jinja2's raise_exception) or drops a lone user message: one line, exit 2,
    before the weights load and before a run directory is made (it was a jinja2 traceback mid-run)."""
    model = tmp_path / "model"
    shutil.copytree(ROOT / "kvjax" / "assets" / "kvjax-tiny", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    out = tmp_path / "out"
    out.mkdir()
    _assert_refused(_eval(f"--output_dir={out}", f"--model={model}", *BASE), needle)
    assert not list(out.iterdir())
