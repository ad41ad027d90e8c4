"""Issue 60: every combination a method refuses is refused by `--dry_run` and before the first cell runs, in one
line naming the flag and the method, with no run directory left behind; and the small flag refusals (a repeated
`--method_args` key, an empty `--budget` item, a negative or NaN `--throttle_s`, an unknown `--model` under
`--dry_run`). On fadb1c4 each of these passed `--dry_run` (or ran cells first, leaving stub directories, or
traced back); the oracle is the contract of tests/bad_inputs: exit code 2, one error line naming the value.

The models are kvjax-tiny (embedded) and tiny random checkpoints written with `save_hf` (no torch): a Gemma-3-style
one with sliding-window layers, and a Llama one of another size than kvjax-tiny's learned files."""

from __future__ import annotations

import pathlib

import pytest
from cli_inprocess import run_eval
from tiny import tiny_config, tiny_gemma3

from kvjax.models.char_tokenizer import save_char_tokenizer
from kvjax.models.export import save_hf
from kvjax.models.model import DecoderLM

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = ["--task=passkey", "--context_length=200", "--max_samples=1", "--progress=false"]
CALIBRATION = ROOT / "kvjax" / "assets" / "calibration" / "kvjax-tiny"


def _refused(proc, *needles: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], proc.stderr
    return errors[0]


def _run_dirs(out: pathlib.Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A sliding-window (Gemma 3 style) checkpoint and a Llama one of another shape than kvjax-tiny."""
    root = tmp_path_factory.mktemp("models")
    gemma = tiny_gemma3()
    save_hf(gemma.config, gemma.weights(), root / "gemma3")
    config = tiny_config(vocab_size=save_char_tokenizer(root / "llama"), num_layers=3)
    save_hf(config, DecoderLM.random(config, seed=0).weights(), root / "llama")
    return root


def test_kvzip_with_a_quantized_cache_is_refused_by_dry_run_and_before_any_cell(tmp_path):
    args = ["--method=full,snapkv,kvzip", "--budget=64", "--kv_dtype=model,int8", *BASE]
    _refused(run_eval(*args, f"--output_dir={tmp_path / 'dry'}", "--dry_run"), "--kv_dtype=int8", "kvzip")
    out = tmp_path / "out"
    line = _refused(run_eval(*args, f"--output_dir={out}"), "--kv_dtype=int8", "--method=kvzip")
    assert line.startswith("kvjax.eval: error: --kv_dtype=int8 with --method=kvzip:")  # the flag, then the method
    assert _run_dirs(out) == []  # no cell ran, no stub directory (fadb1c4 ran the full / snapkv cells first)


def test_a_strategy_on_sliding_window_layers_passes_the_dry_run(models, tmp_path):
    """The multi-context strategies serve models with sliding-window layers (tests/rag/test_rag_sliding_window.py);
    before, the dry run refused them."""
    proc = run_eval("--method=samkv", f"--model={models / 'gemma3'}", f"--output_dir={tmp_path}", "--dry_run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "samkv" in proc.stdout, proc.stdout


def test_kvzap_files_of_every_layer_on_sliding_window_layers_are_refused_by_dry_run(models, tmp_path):
    """On a sliding-window model KVzap reads one surrogate per global layer: kvjax-tiny's six do not fit."""
    weights = CALIBRATION / "kvzap-linear"
    proc = run_eval("--method=dms", f"--model={models / 'gemma3'}", f"--output_dir={tmp_path}", *BASE, "--dry_run",
                    f"--method_args=base=kvzap,threshold=-4,base_args={{'weights':'{weights}','model_type':'linear'}}")
    _refused(proc, "--method=dms", "1 global layers of 2", "n_modules 6 (model: 1)")


def test_learned_files_of_another_model_are_refused_by_dry_run(models, tmp_path):
    proc = run_eval("--method=qfilter", "--compression_ratio=0.5", f"--model={models / 'llama'}",
                    f"--method_args=filters={CALIBRATION / 'kvjax-tiny_qfilt'}", f"--output_dir={tmp_path}", *BASE,
                    "--dry_run")
    _refused(proc, "--method=qfilter", "3 layers")


def test_a_strategy_on_a_task_without_documents_is_refused_by_dry_run(tmp_path):
    _refused(run_eval("--method=samkv", "--task=passkey", f"--output_dir={tmp_path}", "--dry_run"),
             "--method=samkv", "multidoc")


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_throttle_must_be_a_finite_number_of_seconds(tmp_path, value):
    for extra in (["--dry_run"], []):
        out = tmp_path / f"out{len(extra)}"
        _refused(run_eval("--method=full", *BASE, f"--throttle_s={value}", f"--output_dir={out}", *extra),
                 "--throttle_s", value)
        assert _run_dirs(out) == []


@pytest.mark.parametrize("method_args", ["window_size=8,window_size=16", "snapkv.window_size=8,snapkv.window_size=8"])
def test_a_repeated_method_args_key_is_refused(tmp_path, method_args):
    proc = run_eval("--method=snapkv", "--budget=64", f"--method_args={method_args}", f"--output_dir={tmp_path}",
                    "--dry_run")
    _refused(proc, "--method_args", "window_size", "twice")


@pytest.mark.parametrize("budget", ["64,,128", "64,", ",64"])
def test_an_empty_budget_item_is_refused(tmp_path, budget):
    _refused(run_eval("--method=snapkv", f"--budget={budget}", f"--output_dir={tmp_path}", "--dry_run"),
             "--budget", "empty entry")


@pytest.mark.parametrize("model", ["/nonexistent/model", "kvjax-tinyy"])
def test_dry_run_checks_the_model(tmp_path, model):
    _refused(run_eval(f"--model={model}", f"--output_dir={tmp_path}", "--dry_run"), model)


def test_a_missing_gguf_model_is_named_a_gguf_file(tmp_path):
    """`--model=x.gguf` that does not exist is a missing GGUF file, not a missing model directory."""
    _refused(run_eval("--model=/nonexistent/model.gguf", f"--output_dir={tmp_path}", "--dry_run"),
             "GGUF file '/nonexistent/model.gguf' does not exist")
