"""Caches degrade, they don't crash: an unusable compilation-cache directory is one warning and a run without the
persistent cache; an unusable model cache (GGUF conversions) is one error naming KVJAX_CACHE_DIR; a conversion
short of disk space is one error stating the megabytes it needs, before or while it writes; a damaged converted
entry is one error naming the directory to delete; a conversion killed half-way leaves no hidden directory behind
for good; the GGUF path prints no PyTorch advisory."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

gguf = pytest.importorskip("gguf")

from gguf_tiny import write_tiny_gguf  # noqa: E402

from kvjax.errors import CheckpointError  # noqa: E402
from kvjax.models import gguf as kgguf  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf")


# ---- the compilation cache ----
GENERATE = """
import kvjax
model = kvjax.load_model("kvjax-tiny")
print(kvjax.generate(model, [[1, 2, 3, 4]], method="full", max_new_tokens=2).tokens.tolist())
"""


def _no_cache_env(**extra):
    env = {k: v for k, v in ENV.items() if k != "KVJAX_COMPILATION_CACHE_DIR"}  # tests/conftest.py turns it off
    env.update(extra)
    return env


@pytest.mark.parametrize("setting", ["xdg_proc", "env_file", "env_unwritable"])
def test_unusable_compilation_cache_is_one_warning(tmp_path, setting):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    env, where = {
        "xdg_proc": ({"XDG_CACHE_HOME": "/proc/x"}, "/proc/x/kvjax/jax"),
        "env_file": ({"KVJAX_COMPILATION_CACHE_DIR": str(a_file)}, str(a_file)),
        "env_unwritable": ({"KVJAX_COMPILATION_CACHE_DIR": "/proc/self/kvjax"}, "/proc/self/kvjax"),
    }[setting]
    proc = subprocess.run([sys.executable, "-c", GENERATE], capture_output=True, text=True, env=_no_cache_env(**env),
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout.strip())[0]) == 2
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert where in lines[0] and "KVJAX_COMPILATION_CACHE_DIR" in lines[0] and "without" in lines[0]
    assert a_file.read_text() == "not a directory\n"


@pytest.mark.slow
def test_eval_with_an_uncreatable_home_cache_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvjax.eval", "--method=full", "--task=passkey",
                           "--context_length=200", "--max_samples=1", "--progress=false",
                           f"--output_dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, env=_no_cache_env(XDG_CACHE_HOME="/proc/x"), timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warnings = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(warnings) == 1 and "/proc/x/kvjax/jax" in warnings[0], proc.stderr
    assert "| full |" in proc.stdout


# ---- the model cache (GGUF conversions) ----
@pytest.mark.parametrize("where", ["file", "proc"])
def test_unusable_model_cache_names_the_variable(tiny_gguf, tmp_path, monkeypatch, where):
    value = str(tmp_path / "a_file") if where == "file" else "/proc/x"
    if where == "file":
        pathlib.Path(value).write_text("x")
    monkeypatch.setenv(kgguf.ENV_CACHE_DIR, value)
    with pytest.raises(CheckpointError, match=rf"KVJAX_CACHE_DIR={value} cannot hold converted models"):
        kgguf.gguf_model_dir(tiny_gguf)


def test_eval_with_an_unusable_model_cache_is_one_line(tiny_gguf, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvjax.eval", f"--model={tiny_gguf}", "--method=full",
                           "--task=passkey", "--context_length=60", "--max_samples=1", "--progress=false",
                           f"--output_dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, env=dict(ENV, KVJAX_CACHE_DIR="/proc/x"), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if "error" in x]
    assert "KVJAX_CACHE_DIR=/proc/x" in line


# ---- the model cache out of space ----
def _converted_bytes(gguf_path: pathlib.Path, cache: pathlib.Path) -> int:
    """What a real conversion of ``gguf_path`` leaves in ``cache`` (its marker excluded)."""
    out = kgguf.gguf_model_dir(gguf_path, cache)
    return sum(p.stat().st_size for p in out.iterdir() if p.name != "kvjax_gguf.json")


def test_conversion_short_of_space_says_what_it_needs_before_writing(tmp_path, monkeypatch):
    """The disk's free space is checked against the conversion's size before model.safetensors is written: one
    CheckpointError stating the megabytes the conversion writes (measured here by converting for real), and nothing
    left in the cache. On fadb1c4 the conversion ran into the full disk (a 40-line SafetensorError)."""
    path = write_tiny_gguf(tmp_path / "wide.gguf", ffn=16384)
    need = _converted_bytes(path, tmp_path / "room")
    assert need > 3_000_000  # 3 MB of weights beside a few KB of tokenizer files
    cache = tmp_path / "cache"
    real = kgguf.shutil.disk_usage
    monkeypatch.setattr(kgguf.shutil, "disk_usage", lambda p: real(p)._replace(free=1_000_000))
    with pytest.raises(CheckpointError) as err:
        kgguf.gguf_model_dir(path, cache)
    msg = str(err.value)
    assert "\n" not in msg and f"converting wide.gguf needs {need / 1e6:,.0f} MB" in msg, msg
    assert "1 MB free" in msg and str(cache / "gguf") in msg and "KVJAX_CACHE_DIR" in msg
    assert list((cache / "gguf").iterdir()) == []  # no entry, no temporary directory


# The eval CLI in a process whose writes past 1 MB fail with EFBIG, as on a full disk (SIGXFSZ ignored, so the
# write fails instead of killing it); the limit is set inside the child, not by a fork hook in this threaded process.
_LIMITED_EVAL = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
sys.argv = ["kvjax.eval", *sys.argv[1:]]
runpy.run_module("kvjax.eval", run_name="__main__")
"""


def test_conversion_running_out_of_space_is_one_line_and_exit_2(tmp_path):
    """The disk fills while model.safetensors is written (a file-size limit makes the write fail as a full disk
    does): the eval CLI exits 2 with one line stating the megabytes needed, and no temporary directory is left.
    On fadb1c4: exit 1 and a SafetensorError traceback."""
    path = write_tiny_gguf(tmp_path / "wide.gguf", ffn=16384)
    need = _converted_bytes(path, tmp_path / "room")
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-c", _LIMITED_EVAL, f"--model={path}", "--method=full", "--task=passkey",
                           "--context_length=60", "--max_samples=1", "--progress=false",
                           f"--output_dir={tmp_path / 'out'}"], capture_output=True, text=True,
                          env=dict(ENV, KVJAX_CACHE_DIR=str(cache)), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert f"converting wide.gguf needs {need / 1e6:,.0f} MB" in lines[0] and "File too large" in lines[0], lines[0]
    assert list((cache / "gguf").iterdir()) == []


# ---- a damaged converted entry ----
def _damage(out: pathlib.Path, how: str) -> None:
    if how == "truncated_weights":
        weights = out / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "garbled_config":  # same size, not JSON: only reading it shows the damage
        config = out / "config.json"
        config.write_bytes(b"#" * config.stat().st_size)
    elif how == "deleted_tokenizer":
        (out / "tokenizer.json").unlink()
    elif how == "no_marker":  # a directory under the entry's name that no finished conversion wrote
        (out / "kvjax_gguf.json").unlink()


@pytest.mark.parametrize("how", ["truncated_weights", "garbled_config", "deleted_tokenizer", "no_marker"])
def test_damaged_converted_entry_names_the_directory_to_delete(tiny_gguf, tmp_path, monkeypatch, how):
    """On fadb1c4 a truncated model.safetensors or a garbled config.json gave the loader's error with no way out
    (the entry is never rewritten), a deleted tokenizer file a tokenizer error and a directory without its marker
    a raw OSError from the rename. Now: one CheckpointError naming the entry and saying to delete it; deleting it
    reconverts."""
    monkeypatch.setenv(kgguf.ENV_CACHE_DIR, str(tmp_path / "cache"))
    import kvjax

    out = kgguf.gguf_model_dir(tiny_gguf)
    _damage(out, how)
    for load in (kvjax.load_model, kvjax.load_tokenizer):
        with pytest.raises(CheckpointError) as err:
            load(tiny_gguf)
        msg = str(err.value)
        assert f"the converted model {str(out)!r} is damaged" in msg and f"delete {str(out)!r} to reconvert" in msg
        assert "\n" not in msg
    kgguf.shutil.rmtree(out)
    assert kvjax.load_model(tiny_gguf).config.num_layers == 1


def test_eval_on_a_damaged_entry_is_one_line_and_exit_2(tiny_gguf, tmp_path):
    from cli_inprocess import run_eval

    cache = tmp_path / "cache"
    out = kgguf.gguf_model_dir(tiny_gguf, cache)
    _damage(out, "truncated_weights")
    old = os.environ.get(kgguf.ENV_CACHE_DIR)
    os.environ[kgguf.ENV_CACHE_DIR] = str(cache)
    try:
        proc = run_eval(f"--model={tiny_gguf}", "--method=full", "--task=passkey", "--context_length=60",
                        "--max_samples=1", "--progress=false", f"--output_dir={tmp_path / 'out'}")
    finally:
        if old is None:
            del os.environ[kgguf.ENV_CACHE_DIR]
        else:
            os.environ[kgguf.ENV_CACHE_DIR] = old
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert f"delete {str(out)!r} to reconvert" in line and "model.safetensors has" in line


KILLED = """
import os, signal, sys
from kvjax.models import gguf
def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)  # as a user's kill -9 half-way through the first conversion
gguf.write_safetensors = killed
gguf.gguf_model_dir(sys.argv[1])
"""


def test_conversion_killed_half_way_leaves_no_hidden_directory_for_good(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    env = dict(ENV, KVJAX_CACHE_DIR=str(cache))
    proc = subprocess.run([sys.executable, "-c", KILLED, str(tiny_gguf)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL
    left = [p.name for p in (cache / "gguf").iterdir()]
    assert len(left) == 1 and left[0].startswith(".tiny-") and ".tmp-" in left[0]  # what the kill left
    done = subprocess.run([sys.executable, "-c", "import sys; from kvjax.models import gguf; "
                           "print(gguf.gguf_model_dir(sys.argv[1]))", str(tiny_gguf)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    converted = pathlib.Path(done.stdout.strip())
    assert [p.name for p in (cache / "gguf").iterdir()] == [converted.name]  # the leftover is gone
    assert (converted / "model.safetensors").is_file()


def test_stale_temp_dirs_of_live_or_other_processes_are_kept(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    host = kgguf._host_tag()
    dead = tmp_path / f".m-1.tmp-{host}-{proc.pid}-abcd"
    live = tmp_path / f".m-2.tmp-{host}-{os.getpid()}-abcd"
    other = tmp_path / f".m-3.tmp-elsewhere-{proc.pid}-abcd"
    for d in (dead, live, other):
        d.mkdir()
    assert kgguf.remove_stale_temp_dirs(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


# ---- transformers' advisory ----
NO_TORCH = """
import importlib.util, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] == "torch" else real(name, *a, **k)
import kvjax
kvjax.load_model(sys.argv[1])
print(kvjax.load_tokenizer(sys.argv[1]).encode("ab c"))
"""


def test_gguf_path_prints_no_pytorch_advisory(tiny_gguf, tmp_path):
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, str(tiny_gguf)], capture_output=True, text=True,
                          env=dict(ENV, KVJAX_CACHE_DIR=str(tmp_path / "cache")), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PyTorch was not found" not in proc.stderr, proc.stderr
