"""Caches degrade, they don't crash: an unusable compilation-cache directory is one warning and a run without the
persistent cache; an unusable model cache (GGUF conversions) is one error naming KVJAX_CACHE_DIR; a conversion
killed half-way leaves no hidden directory behind for good; the GGUF path prints no PyTorch advisory."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kvjax.errors import CheckpointError  # noqa: E402
from kvjax.models import gguf as kgguf  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def write_tiny_gguf(path: pathlib.Path) -> pathlib.Path:
    """A 1-layer random Llama as an F32 GGUF with a 32-token byte-level BPE vocabulary (numpy only)."""
    rng = np.random.default_rng(0)
    dim, ffn, heads, kv, hd = 16, 32, 2, 1, 8
    tokens = ["<unk>", "<s>", "</s>", *(chr(c) for c in range(ord("a"), ord("z") + 1)), "Ġ", "ab"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<") else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    shapes = {"token_embd.weight": (len(tokens), dim), "output_norm.weight": (dim,), "blk.0.attn_norm.weight": (dim,),
              "blk.0.attn_q.weight": (heads * hd, dim), "blk.0.attn_k.weight": (kv * hd, dim),
              "blk.0.attn_v.weight": (kv * hd, dim), "blk.0.attn_output.weight": (dim, heads * hd),
              "blk.0.ffn_norm.weight": (dim,), "blk.0.ffn_gate.weight": (ffn, dim), "blk.0.ffn_up.weight": (ffn, dim),
              "blk.0.ffn_down.weight": (dim, ffn)}
    for name, shape in shapes.items():
        w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
