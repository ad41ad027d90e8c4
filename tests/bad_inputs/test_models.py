"""Bad model directories, tokenizer files, data files and trainer flags: one clear kvjax error (or exit 2
with one line on stderr and no traceback) naming the file / key / flag, and the inputs left as they were.

Oracle: the error type and message, a hash of the directory before and after, and for the
transformers advisory a plain `import transformers` under the same conditions (which prints it).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from kvjax.errors import CheckpointError, ConfigError
from kvjax.eval import tasks
from kvjax.eval.tasks.base import DataError, read_jsonl
from kvjax.models.model import load_model
from kvjax.models.tokenizer import load_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "kvjax" / "assets" / "kvjax-tiny"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


def _snapshot(root: pathlib.Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}


def _config() -> dict:
    return json.loads((TINY / "config.json").read_text())


def _write_config(d: pathlib.Path, cfg: dict) -> None:
    (d / "config.json").write_text(json.dumps(cfg))


def _truncate_weights(d: pathlib.Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _header_only(d: pathlib.Path) -> None:
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: 8 + struct.unpack("<Q", raw[:8])[0]])


def _pickle_only(d: pathlib.Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle: never opened


@pytest.mark.parametrize(
    "damage,error,named",
    [
        (lambda d: (d / "config.json").write_text('{"model_type": "llama",'), CheckpointError,
         ["config.json", "not valid JSON"]),  # was a bare JSONDecodeError without the file
        (lambda d: _write_config(d, {k: v for k, v in _config().items() if k != "hidden_size"}), CheckpointError,
         ["config.json", "hidden_size"]),  # was a silent default of 4096, then a weight-shape error
        (lambda d: _write_config(d, {k: v for k, v in _config().items() if k != "num_hidden_layers"}),
         CheckpointError, ["config.json", "num_hidden_layers"]),
        (lambda d: _write_config(d, {**_config(), "model_type": "gpt2"}), ConfigError, ["config.json", "'gpt2'"]),
        (lambda d: _write_config(d, {**_config(), "hidden_size": "128"}), ConfigError, ["hidden_size", "'128'"]),
        (_truncate_weights, CheckpointError, ["model.safetensors", "truncated"]),
        (_header_only, CheckpointError, ["model.safetensors", "truncated"]),
        (lambda d: (d / "model.safetensors").write_bytes(b""), CheckpointError, ["model.safetensors"]),
        (_pickle_only, CheckpointError, ["pytorch_model.bin", "never unpickles"]),
    ],
    ids=["broken_json", "no_hidden_size", "no_num_layers", "unsupported_type", "string_size", "truncated",
         "header_only", "empty_weights", "pickle_only"],
)
def test_bad_model_directory(tmp_path, damage, error, named):
    d = tmp_path / "model"
    shutil.copytree(TINY, d)
    damage(d)
    before = _snapshot(d)
    with pytest.raises(error) as info:
        load_model(d)
    for text in named:
        assert text in str(info.value), (text, str(info.value))
    assert _snapshot(d) == before


def test_preset_name_pointed_at_another_architecture(tmp_path):
    d = tmp_path / "llama_weights"
    shutil.copytree(TINY, d)  # kvjax-tiny is a llama
    with pytest.raises(ConfigError, match=r"preset 'qwen2.5-0.5b'.*another architecture.*model_type='llama'"):
        load_model("qwen2.5-0.5b", model_dir=d)
    with pytest.raises(ConfigError, match=r"preset 'qwen2.5-0.5b'.*another architecture"):
        load_tokenizer("qwen2.5-0.5b", model_dir=d)


def test_preset_name_pointed_at_another_size(tmp_path):
    """kvjax-tiny is a Llama like llama-3.1-8b, but 6 layers of 128: under that name its results would be labelled
    llama-3.1-8b. Refused, naming the preset and the sizes; loaded by its own directory it works."""
    d = tmp_path / "llama_weights"
    shutil.copytree(TINY, d)
    for call in (lambda: load_model("llama-3.1-8b", model_dir=d), lambda: load_tokenizer("llama-3.1-8b", model_dir=d)):
        with pytest.raises(ConfigError, match=r"preset 'llama-3.1-8b'.*another size.*hidden_size=128 \(the preset "
                                              r"has 4096\).*num_hidden_layers=6"):
            call()
    assert load_model(d).config.num_layers == 6


@pytest.mark.parametrize(
    "damage,named",
    [
        (lambda d: (d / "tokenizer.json").write_text("{garbage"), ["tokenizer.json", "JSONDecodeError"]),
        (lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": [], "model": {"type": "X"}}'),
         ["tokenizer.json", "corrupt or unsupported"]),  # was a bare Exception from tokenizers
        (lambda d: (d / "tokenizer.json").write_bytes(b"\xff\xfe\x00"), ["tokenizer.json", "UnicodeDecodeError"]),
        (lambda d: [(d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")], ["no tokenizer files"]),
    ],
    ids=["broken_json", "unknown_model_type", "not_utf8", "missing"],
)
def test_bad_tokenizer_files(tmp_path, damage, named):
    d = tmp_path / "model"
    shutil.copytree(TINY, d)
    damage(d)
    before = _snapshot(d)
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(d)
    for text in [str(d), *named]:
        assert text in str(info.value), (text, str(info.value))
    assert _snapshot(d) == before


# ---- data files ----
def test_read_jsonl_names_a_line_that_is_not_utf8(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_bytes(b'{"a": 1}\n{"a": "caf\xe9"}\n')  # Latin-1, not UTF-8
    with pytest.raises(DataError, match=r"data\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 11\)"):
        read_jsonl(str(f))
    assert read_jsonl(str(f), skip_malformed=True) == [{"a": 1}]


def test_data_files_saved_with_a_byte_order_mark_read_as_without(tmp_path):
    """A UTF-8 byte order mark (what Windows editors put first) is not part of the first row or sentence: the files
    read as the same bytes without it do (before, a JSON-lines file's first row was refused as invalid JSON and a
    haystack's first sentence began with U+FEFF)."""
    from kvjax.eval.tasks.base import read_json
    from kvjax.eval.tasks.haystack import file_sentences

    files = {"rows.jsonl": (read_jsonl, '{"a": "caf\u00e9"}\n{"a": 2}\n'), "one.json": (read_json, '{"a": [1, 2]}'),
             "hay.txt": (file_sentences, "The sky is blue. The grass is green.")}
    for name, (read, text) in files.items():
        plain, marked = tmp_path / name, tmp_path / f"bom-{name}"
        plain.write_text(text, encoding="utf-8")
        marked.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
        assert read(str(marked)) == read(str(plain)), name
        assert "\ufeff" not in repr(read(str(marked))), name


ROW_READERS = ["longbench/hotpotqa", "multidoc/hotpotqa", "infinitebench/passkey"]


def _one_row_task(tmp_path: pathlib.Path, name: str, **fields: Any) -> tuple[Callable[[], Any], str]:
    """A data folder holding one row (`fields` over a good row) for task `name`: (its samples call, the regex of the
    row's place in an error)."""
    row = {"input": "Which city?", "context": "Passage 1:\nParis is a city.", "answers": ["Paris"], "_id": "r1",
           "length": 4, "all_classes": None, "id": "r1", "answer": ["1"], **fields}
    infinite = name.startswith("infinitebench")
    (tmp_path / ("passkey.jsonl" if infinite else "hotpotqa.jsonl")).write_text(json.dumps(row) + "\n")
    where = r"passkey\.jsonl \(id r1\)" if infinite else r"hotpotqa\.jsonl: row r1"
    return (lambda: tasks.get(name).samples(count_tokens=lambda t: len(t.split()), context_length=4096,
                                            num_samples=0, seed=0, data_dir=str(tmp_path))), where


@pytest.mark.parametrize("field", ["context", "input"])
@pytest.mark.parametrize("name", ROW_READERS)
def test_a_null_text_field_is_refused_not_prompted_as_none(tmp_path, field, name):
    """Every reader of the JSONL formats refuses a null text field (multidoc and InfiniteBench prompted "None")."""
    samples, where = _one_row_task(tmp_path, name, **{field: None})
    with pytest.raises(DataError, match=rf"{where} has a null '{field}'"):
        samples()


@pytest.mark.parametrize("name", ROW_READERS)
def test_an_answer_that_is_an_object_or_a_nested_list_is_refused(tmp_path, name):
    """Answers are strings or numbers: a nested list or an object became its Python text ("['Paris']"), which no
    prediction matches, so the sample scored 0 silently."""
    samples, where = _one_row_task(tmp_path, name, answers=[["Paris"]], answer=["1", {"value": "1"}])
    with pytest.raises(DataError, match=rf"{where}: answers must be strings or numbers"):
        samples()


# ---- the trainer CLI ----
def _train(tmp_path: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvjax.train", f"--workdir={tmp_path / 'run'}", *flags],
                          capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=600)


@pytest.mark.parametrize(
    "flag,named",
    [
        ("--lengths=abc", ["--lengths", "'abc'", "not an integer"]),  # was a ValueError traceback
        ("--lengths=128,2.5", ["--lengths", "'2.5'"]),
        ("--init_from=/no/such/model", ["--init_from=/no/such/model", "no such directory"]),  # read like a hub error
        ("--num_kv_heads=0", ["num_kv_heads must be positive, got 0"]),  # was a ZeroDivisionError traceback
        ("--seed=-1", ["seed must be >= 0, got -1"]),  # was NumPy's "expected non-negative integer" traceback
        ("--workdir=runs[2]", ["workdir", "runs[2]", "'[...]'"]),  # trained, saved unreadable checkpoints
    ],
)
def test_trainer_bad_flags_exit_2_with_one_line(tmp_path, flag, named):
    proc = _train(tmp_path, flag)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvjax.train: error:"), proc.stderr
    for text in named:
        assert text in lines[0], (text, lines[0])
    assert not (tmp_path / "run").exists()  # nothing written before the check


def test_trainer_export_only_refuses_a_workdir_without_a_checkpoint(tmp_path):
    """`--export_only` exports the latest checkpoint; a workdir with none exported the untrained random weights."""
    small = ["--tokenizer=char", "--tasks=passkey", "--lengths=320", "--curriculum_steps=0", "--num_layers=1",
             "--hidden_size=32", "--intermediate_size=64", "--num_heads=2", "--num_kv_heads=1",
             "--max_position_embeddings=1024", "--position_span=1024", "--noprogress"]
    proc = _train(tmp_path, "--export_only", f"--export_dir={tmp_path / 'out'}", *small)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"kvjax.train: error: --export_only: {tmp_path / 'run'} holds no checkpoint to export (train "
                     "there first, without --export_only)"], proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


# ---- transformers' "PyTorch was not found" advisory ----
NO_TORCH = """
import importlib.util, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] == "torch" else real(name, *a, **k)
if sys.argv[1] == "plain":
    import transformers
else:
    from kvjax.models.tokenizer import load_tokenizer
    load_tokenizer(sys.argv[2])
"""


def test_tokenizer_without_torch_prints_no_pytorch_advisory():
    run = lambda *args: subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True,  # noqa: E731
                                       text=True, env=ENV, timeout=600)
    plain = run("plain")
    assert "PyTorch was not found" in plain.stderr  # the oracle: transformers does print it without torch
    ours = run("kvjax", str(TINY))
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert "PyTorch was not found" not in ours.stderr and "Traceback" not in ours.stderr, ours.stderr
