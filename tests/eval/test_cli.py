"""`python -m kvjax.eval` end to end on a tiny random HF model: files, resume after a kill, bad input."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

import hf_tiny  # noqa: E402
from cli_inprocess import run_cmd  # noqa: E402

from kvjax.models.char_tokenizer import save_char_tokenizer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = hf_tiny.make_llama(tmp_path_factory.mktemp("m"), name="tiny", max_position_embeddings=1024)
    save_char_tokenizer(path)
    return path


def _cmd(model_dir, out, *extra):
    return [
        sys.executable,
        "-m",
        "kvjax.eval",
        f"--model={model_dir}",
        f"--output_dir={out}",
        "--task=passkey",
        "--context_length=400",
        "--max_samples=4",
        "--progress=false",
        *extra,
    ]


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return env


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_run_writes_three_files_and_a_table(model_dir, tmp_path):
    proc = run_cmd(
        _cmd(model_dir, tmp_path, "--method=full,streaming_llm", "--budget=32"),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and p.name != "plots")
    assert len(runs) == 2
    plot = tmp_path / "plots" / "score_vs_budget.png"
    assert f"plot: {plot}" in proc.stdout and plot.read_bytes()[:4] == b"\x89PNG"
    for run in runs:
        assert {"predictions.jsonl", "metrics.json", "config.json"} <= {p.name for p in run.iterdir()}
        records = _lines(run / "predictions.jsonl")
        assert len(records) == 4 and len({r["id"] for r in records}) == 4
        config = json.loads((run / "config.json").read_text())
        assert config["versions"]["jax"] and config["device"]["backend"] == "cpu"
        assert json.loads((run / "metrics.json").read_text())["num_samples"] == 4
    lines = proc.stdout.splitlines()
    assert lines[0] == "| method | passkey @32 |"  # the pivot: methods as rows, the full cache first
    assert lines[2].startswith("| full | ") and lines[3].startswith("| streaming_llm | ")
    stream = [r for r in runs if "streaming_llm" in r.name][0]
    full = [r for r in runs if "__full__" in r.name][0]
    for r in _lines(stream / "predictions.jsonl"):
        assert r["kept_tokens"] <= 32 + r["question_tokens"]
        assert r["kept_fraction"] == pytest.approx(r["kept_tokens"] / (r["context_tokens"] + r["question_tokens"]))
        assert not r["budget_above_prompt"]
    for r in _lines(full / "predictions.jsonl"):  # the full cache holds the whole prompt
        assert r["kept_tokens"] == r["context_tokens"] + r["question_tokens"] and r["kept_fraction"] == 1.0
    kept = sum(r["kept_tokens"] for r in _lines(stream / "predictions.jsonl")) / 4
    assert f"({kept:.0f})" in lines[3]
    assert json.loads((stream / "metrics.json").read_text())["mean_kept_tokens"] == pytest.approx(kept)


@pytest.mark.slow
def test_killed_run_resumes_with_every_sample_exactly_once(model_dir, tmp_path):
    cmd = _cmd(model_dir, tmp_path, "--method=full", "--max_samples=6", "--throttle_s=1.0")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    deadline = time.time() + 240
    preds = None
    while time.time() < deadline:
        found = list(tmp_path.glob("*/predictions.jsonl"))
        if found and len(_lines(found[0])) >= 2:
            preds = found[0]
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert preds is not None, "the first run never wrote a prediction"
    first = len(_lines(preds))
    assert 2 <= first < 6
    done = run_cmd(cmd[:-1], capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    ids = [r["id"] for r in _lines(preds)]
    assert len(ids) == 6 and len(set(ids)) == 6


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--task=nope"], "unknown task 'nope'"),
        (["--method=nope"], "unknown method 'nope'"),
        (["--budget=0", "--method=streaming_llm"], "--budget values must be > 0"),
        (["--budget=64,-1", "--method=streaming_llm"], "--budget values must be > 0"),
        (["--compression_ratio=1.5", "--method=streaming_llm"], "[0, 1)"),
        (["--batch_size=abc"], "batch_size"),
        (["--data_dir=/does/not/exist"], "is not a directory"),
        (["--method_args=oops"], "is not key=value"),
        (["--method=streaming_llm", "--method_args=budget=8,bogus=1"], "no hyperparameter"),
    ],
)
def test_bad_input_exits_2_without_traceback(model_dir, tmp_path, extra, needle):
    proc = run_cmd(_cmd(model_dir, tmp_path, *extra), capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_malformed_jsonl_is_reported_with_file_and_line(model_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    good = {
        "input": "q?",
        "context": "some context",
        "answers": ["a"],
        "length": 3,
        "dataset": "hotpotqa",
        "language": "en",
        "all_classes": None,
        "_id": "x1",
    }
    (data / "hotpotqa.jsonl").write_text(json.dumps(good) + "\n{not json\n")
    cmd = _cmd(model_dir, tmp_path / "out", f"--data_dir={data}", "--task=longbench/hotpotqa")
    proc = run_cmd(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2 and "hotpotqa.jsonl:2:" in proc.stderr
    assert "Traceback" not in proc.stderr
    ok = run_cmd([*cmd, "--skip_malformed"], capture_output=True, text=True, env=_env(), timeout=300)
    assert ok.returncode == 0, ok.stderr


def test_multi_context_strategies_run_on_multidoc(model_dir, tmp_path):
    data = ROOT / "tests" / "fixtures" / "eval" / "longbench"
    cmd = _cmd(model_dir, tmp_path, "--method=recompute,samkv,epic", f"--data_dir={data}",
               "--task=multidoc/hotpotqa", "--context_length=900", "--method_args=epic.recompute_ratio=0.141")
    proc = run_cmd(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    samkv = _lines(next(tmp_path.glob("*samkv*/predictions.jsonl")))
    assert len(samkv) == 2 and all(r["num_documents"] == 3 for r in samkv)
    assert all(0 < r["sequence_ratio"] <= 1 and 0 <= r["recompute_ratio"] <= 1 for r in samkv)
    recompute = _lines(next(tmp_path.glob("*recompute*/predictions.jsonl")))
    assert all(r["sequence_ratio"] == 1.0 for r in recompute)
    # Every RAG cell reports its realised recomputation ratios, per sample and in metrics.json.
    for name, low, high in (("recompute", 1.0, 1.0), ("samkv", 0.0, 1.0), ("epic", 0.141, 0.2)):
        run = next(tmp_path.glob(f"*{name}*/predictions.jsonl")).parent
        records = _lines(run / "predictions.jsonl")
        assert all(low <= r["recompute_ratio"] <= high and 0 <= r["layer_recompute_ratio"] <= 1 for r in records)
        metrics = json.loads((run / "metrics.json").read_text())
        mean = sum(r["recompute_ratio"] for r in records) / len(records)
        assert metrics["mean_recompute_ratio"] == pytest.approx(mean)
        assert "mean_layer_recompute_ratio" in metrics
    # A multi-context strategy on a task without documents is refused with a clear message.
    bad = run_cmd(_cmd(model_dir, tmp_path / "bad", "--method=samkv"), capture_output=True, text=True,
                         env=_env(), timeout=300)
    assert bad.returncode == 2 and "multidoc" in bad.stderr and "Traceback" not in bad.stderr


def test_scoped_method_args_and_dry_run(model_dir, tmp_path):
    cmd = _cmd(model_dir, tmp_path, "--method=streaming_llm,snapkv", "--budget=32",
               "--method_args=streaming_llm.sink_size=2,snapkv.window_size=8", "--dry_run")
    proc = run_cmd(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "2 runs planned" in proc.stdout and not list(tmp_path.iterdir())
    bad = run_cmd([*cmd[:-2], "--method_args=lagkv.lag_size=8", "--dry_run"], capture_output=True, text=True,
                         env=_env(), timeout=120)
    assert bad.returncode == 2 and "lagkv" in bad.stderr


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.py")))
def test_paper_configs_validate(config, tmp_path):
    proc = run_cmd(
        [sys.executable, "-m", "kvjax.eval", f"--config={ROOT / 'configs' / config}", "--dry_run",
         f"--output_dir={tmp_path}"],
        capture_output=True, text=True, env=_env(), timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "runs planned" in proc.stdout


def test_chat_template_wraps_context_and_question():
    from kvjax.eval.runner import PromptEncoder
    from kvjax.eval.tasks import get
    from kvjax.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    task = get("passkey")
    sample = task.samples(count_tokens=len, context_length=400, num_samples=1, seed=0, data_dir=None)[0]
    ctx, question = PromptEncoder(tok, "auto").encode(task, sample, query_aware=False)
    assert tok.decode(ctx).startswith("<<" + sample.prefix[:10])
    assert tok.decode(question).endswith(">>A:" + sample.answer_prefix)  # the answer prefix opens the reply
    plain_ctx, plain_q = PromptEncoder(tok, "no").encode(task, sample, query_aware=False)
    assert plain_ctx[0] == tok.bos_token_id and not tok.decode(plain_q).endswith("A:")


@pytest.mark.parametrize("task_name", ["passkey", "ruler/niah_single_1"])
@pytest.mark.parametrize("query_aware", [False, True])
def test_chat_template_token_layout_matches_apply_chat_template(task_name, query_aware):
    """Context + question ids equal transformers' rendering of one user turn, then the answer prefix."""
    from kvjax.eval.runner import PromptEncoder
    from kvjax.eval.tasks import get
    from kvjax.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    task = get(task_name)
    sample = task.samples(count_tokens=len, context_length=1000, num_samples=1, seed=0, data_dir=None)[0]
    assert sample.answer_prefix and sample.question
    ctx, question = PromptEncoder(tok, "auto").encode(task, sample, query_aware=query_aware)
    user = sample.prefix + sample.context + sample.question
    expected = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
    expected = list(expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected)
    assert ctx + question == expected + tok.encode(sample.answer_prefix, add_special_tokens=False)
    assert tok.decode(question).endswith("<|im_start|>assistant\n" + sample.answer_prefix)
    assert tok.decode(question).startswith(sample.question) != query_aware  # query-aware: the question is compressed


def test_hybrid_thinking_template_answers_without_thinking():
    """Qwen3's template opens an empty reasoning block when thinking is off: kvpress renders it that way, and so
    does the prompt encoder (the answer prefix follows the closed block)."""
    from kvjax.eval.runner import PromptEncoder
    from kvjax.eval.tasks import get
    from kvjax.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"
    )
    task = get("passkey")
    sample = task.samples(count_tokens=len, context_length=300, num_samples=1, seed=0, data_dir=None)[0]
    _, question = PromptEncoder(tok, "auto").encode(task, sample, query_aware=False)
    assert tok.decode(question).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + sample.answer_prefix)


@pytest.mark.parametrize("query_aware", [False, True])
def test_question_first_states_the_question_before_the_context(query_aware):
    """--question_first: one user turn of question, blank line, whole prompt; the answer prefix opens the reply."""
    from kvjax.eval.runner import PromptEncoder
    from kvjax.eval.tasks import get
    from kvjax.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    task = get("passkey")
    sample = task.samples(count_tokens=len, context_length=1000, num_samples=1, seed=0, data_dir=None)[0]
    ctx, question = PromptEncoder(tok, "auto", question_first=True).encode(task, sample, query_aware=query_aware)
    user = "What is the pass key?\n\n" + sample.prefix + sample.context + sample.question
    expected = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert ctx + question == expected + tok.encode(sample.answer_prefix, add_special_tokens=False)
    plain_ctx, plain_q = PromptEncoder(tok, "no", question_first=True).encode(task, sample, query_aware=query_aware)
    assert tok.decode(plain_ctx[1:] + plain_q) == user + sample.answer_prefix  # no template: BOS, then the same text
    default_ctx, _ = PromptEncoder(tok, "no").encode(task, sample, query_aware=query_aware)
    assert tok.decode(default_ctx[1:]).startswith(sample.prefix)  # off by default


def test_the_needle_answer_prefix_reaches_the_niah_prompts_only():
    """--answer_prefix=needle: the sweep draws the niah samples with the needle's opening as their answer prefix
    (the prompt's last words, fed after compression), and vt's with its own."""
    from kvjax.eval import plan, sweep
    from kvjax.eval.config import EvalConfig
    from kvjax.eval.runner import PromptEncoder
    from kvjax.eval.tasks import get
    from kvjax.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    encoder = PromptEncoder(tok, "no")
    for prefix in ("task", "needle"):
        config = EvalConfig(methods=("full",), tasks=("ruler/niah_multikey_1", "ruler/vt"), context_lengths=(2000,),
                            max_samples=2, answer_prefix=prefix)
        loaded = sweep._load_samples(config, encoder, tok, plan.cells(config))
        (task, samples), (_, vt_samples) = loaded[("ruler/niah_multikey_1", 2000)], loaded[("ruler/vt", 2000)]
        for sample in samples:
            _, question = encoder.encode(task, sample, query_aware=False)
            key = sample.metadata["query"]
            want = (f"One of the special magic numbers for {key} is:" if prefix == "needle" else
                    f"The special magic numbers for {key} mentioned in the provided text are")
            assert tok.decode(question).endswith(want)
        assert [s.answer_prefix for s in vt_samples] == [
            s.answer_prefix for s in get("ruler/vt").samples(count_tokens=encoder.count_tokens, context_length=2000,
                                                             num_samples=2, seed=0, data_dir=None)]


def test_question_first_needs_query_aware_when_compressing(model_dir, tmp_path):
    """The question would sit in the compressed context: refused for query-agnostic compression, before tracing."""
    bad = run_cmd(_cmd(model_dir, tmp_path, "--method=full,snapkv", "--budget=64", "--question_first",
                              "--dry_run"), capture_output=True, text=True, env=_env(), timeout=120)
    assert bad.returncode == 2 and "--query_aware" in bad.stderr and "snapkv" in bad.stderr
    assert "Traceback" not in bad.stderr
    for extra in (["--method=full"], ["--method=snapkv", "--budget=64", "--query_aware"]):
        ok = run_cmd(_cmd(model_dir, tmp_path, *extra, "--question_first", "--dry_run"), capture_output=True,
                            text=True, env=_env(), timeout=120)
        assert ok.returncode == 0, ok.stderr


def test_rerun_with_other_weights_is_refused_not_resumed(tmp_path):
    """Resuming keys on the model's name; changed weights under the same name must not reuse old results."""
    model = hf_tiny.make_llama(tmp_path / "m", name="tiny", max_position_embeddings=1024)
    save_char_tokenizer(model)
    out = tmp_path / "out"
    first = run_cmd(_cmd(model, out, "--method=full", "--max_samples=2"), capture_output=True, text=True,
                           env=_env(), timeout=300)
    assert first.returncode == 0, first.stderr
    again = run_cmd(_cmd(model, out, "--method=full", "--max_samples=2"), capture_output=True, text=True,
                           env=_env(), timeout=300)
    assert again.returncode == 0, again.stderr  # same weights: resumes (nothing left to do)
    hf_tiny.make_llama(tmp_path / "m", name="tiny", seed=1, max_position_embeddings=1024)  # new weights, same dir
    changed = run_cmd(_cmd(model, out, "--method=full", "--max_samples=2"), capture_output=True,
                             text=True, env=_env(), timeout=300)
    assert changed.returncode == 2 and "different model" in changed.stderr, changed.stderr
    assert "Traceback" not in changed.stderr


def test_new_presets_are_known_to_the_cli(tmp_path, monkeypatch):
    """Without weights, a new preset is found and the error says where to put them (one line, exit 2)."""
    monkeypatch.delenv("KVJAX_MODEL_DIR", raising=False)
    env = None
    proc = run_cmd(_cmd("qwen3-8b", tmp_path / "out", "--method=full", f"--model_dir={tmp_path / 'none'}"),
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "no local weights for preset 'qwen3-8b' (Qwen/Qwen3-8B)" in proc.stderr
