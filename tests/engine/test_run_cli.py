"""`python -m kvjax.run`: a job's output against `kvjax.generate`, kill and resume, and every bad input refused.

Oracles: the engine's tokens for a request equal `generate` of its prompt alone (tests/engine/engine_refs.py), so
the job's `text` must be the tokenizer's decoding of `generate`'s tokens; after a SIGKILL mid-job (a real
subprocess) and a rerun, the output holds every input id exactly once and each record equals an uninterrupted run's;
every bad input exits with 2 and one line naming the file and line, before a model is loaded.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from tiny import tiny_config

import kvjax
from kvjax.engine.jobs import PromptEncoder
from kvjax.models.char_tokenizer import save_char_tokenizer
from kvjax.models.export import save_hf
from kvjax.models.model import DecoderLM, load_model
from kvjax.models.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    vocab = save_char_tokenizer(path)
    config = tiny_config(vocab_size=vocab, max_position_embeddings=1024)
    save_hf(config, DecoderLM.random(config, seed=0, scale=0.3).weights(), path)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m kvjax.run *args` in this process (flags reset first), exit code and output captured."""
    from kvjax import run

    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run.FLAGS.unparse_flags()
            run.main(run._parse_flags(["kvjax.run", *args]))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _write(path, lines) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _prompts(n: int) -> list[str]:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    return [" ".join(words[(i + j) % len(words)] for j in range(3 + 2 * i)) for i in range(n)]


def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def test_a_job_writes_what_generate_gives(model_dir, tmp_path):
    prompts = _prompts(5)
    lines = [json.dumps({"id": f"p{i}", "prompt": p, "max_new_tokens": 6 + i}) for i, p in enumerate(prompts)]
    out = tmp_path / "out.jsonl"
    proc = run_cli(f"--model={model_dir}", f"--input={_write(tmp_path / 'in.jsonl', lines)}", f"--output={out}",
                   "--method=snapkv", "--budget=16", "--method_args=window_size=4", "--slots=2", "--progress=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "5 requests" in proc.stdout.splitlines()[-1]
    model = load_model(str(model_dir))
    tokenizer = load_tokenizer(str(model_dir))
    records = {r["id"]: r for r in _records(out)}
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        ref = kvjax.generate(model, [ids], method="snapkv", method_args={"budget": 16, "window_size": 4},
                             max_new_tokens=6 + 4)  # the job's longest answer sizes every request's cache
        n = min(int(ref.num_tokens[0]), 6 + i)
        record = records[f"p{i}"]
        assert record["tokens"] == ref.tokens[0][:n].tolist()
        assert record["text"] == tokenizer.decode(record["tokens"], skip_special_tokens=True)
        assert record["generated_tokens"] == len(record["tokens"]) and record["prompt_tokens"] == len(ids)
        assert record["finish_reason"] in ("stop", "length") and record["kept_tokens"] <= 16


def test_killed_mid_job_and_rerun_every_id_once(model_dir, tmp_path):
    lines = [json.dumps({"id": i, "prompt": p, "max_new_tokens": 12}) for i, p in enumerate(_prompts(10))]
    source = _write(tmp_path / "in.jsonl", lines)
    args = [f"--model={model_dir}", f"--input={source}", "--slots=2", "--steps=2", "--progress=false"]
    whole = tmp_path / "whole.jsonl"
    assert run_cli(*args, f"--output={whole}").returncode == 0
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "kvjax.run", *args, f"--output={out}", "--throttle_s=0.5"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and len(_records(out) if out.exists() else []) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = len(_records(out))
    assert proc.returncode == -signal.SIGKILL and 0 < written < len(lines), (proc.returncode, written)
    with open(out, "a") as f:
        f.write('{"id": 9, "text": "cut sh')  # a record cut short, as a kill mid-write leaves it
    rerun = run_cli(*args, f"--output={out}")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"({written} already done)" in rerun.stdout
    got = _records(out)
    assert sorted(r["id"] for r in got) == list(range(len(lines)))  # every id once
    want = {r["id"]: r for r in _records(whole)}
    for r in got:
        assert r["tokens"] == want[r["id"]]["tokens"] and r["kept_tokens"] == want[r["id"]]["kept_tokens"]
    again = run_cli(*args, f"--output={out}")
    assert again.returncode == 0 and "already in" in again.stdout and len(_records(out)) == len(lines)
    lines[3] = json.dumps({"id": 3, "prompt": "another prompt under an id already answered", "max_new_tokens": 12})
    other = run_cli(*args, f"--input={_write(tmp_path / 'other.jsonl', lines)}", f"--output={out}")
    assert other.returncode == 2 and "id 3 was answered for a prompt of" in other.stderr, other.stderr


def test_a_file_that_is_not_this_jobs_output_is_refused_and_left_unchanged(model_dir, tmp_path):
    """`--output` naming the input file (a slip of the shell) is refused before the model loads, and a resume that
    refuses a file (another job's output) cuts nothing from it: before, resume first cut the file's last line when
    it had no final newline, as a torn record, so the refused run deleted the input's last prompt."""
    from kvjax.engine.jobs import JobError, Request, resume

    for name, text in (("in.jsonl", '{"id": 1, "prompt": "hello"}\n{"id": 2, "prompt": "world"}'),
                       ("in.txt", "hello\nworld")):
        path = tmp_path / name
        path.write_text(text)
        proc = run_cli(f"--model={model_dir}", f"--input={path}", f"--output={path}", "--max_new_tokens=4")
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert f"--output {str(path)!r} is the --input file" in line, line
        assert path.read_text() == text
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "x", "prompt_tokens": 3, "tokens": []}\n{"id": "y", "prompt_tokens": 3, "tok')
    before = other.read_bytes()
    with pytest.raises(JobError, match="other.jsonl:1: id 'x' is not in the input"):
        resume(str(other), [Request(id="a", tokens=(1, 2, 3), max_new_tokens=4)])
    assert other.read_bytes() == before
    other.write_text('{"id": ["x"], "prompt_tokens": 3, "tokens": []}\n')  # before: TypeError, a traceback
    with pytest.raises(JobError, match="other.jsonl:1: not an output record"):
        resume(str(other), [Request(id="a", tokens=(1, 2, 3), max_new_tokens=4)])
    other.write_text('{"id": "a", "prompt_tokens": 3, "tokens": []}\n{"id": "b", "prompt_tokens": 3, "tok')
    assert resume(str(other), [Request(id="a", tokens=(1, 2, 3), max_new_tokens=4)]) == {("a", None)}
    assert other.read_text() == '{"id": "a", "prompt_tokens": 3, "tokens": []}\n'  # this job's torn line cut


def test_a_resume_under_other_settings_is_refused_naming_them(model_dir, tmp_path):
    """The settings that decide an answer are kept beside the output (`out.jsonl.run.json`) before its first answer;
    a rerun that changes one of them (the method's budget, a request default, the storage) is refused in one line
    naming each, the output left as it is, where before it appended the new settings' answers to the old ones'. The
    engine's sizes (`--slots`) change no answer and resume; an output with no settings file is refused."""
    source = _write(tmp_path / "in.txt", _prompts(4))
    args = [f"--model={model_dir}", f"--input={source}", "--method=snapkv", "--budget=16",
            "--method_args=window_size=4", "--max_new_tokens=5",
            "--slots=2", "--progress=false"]
    whole = tmp_path / "whole.txt.jsonl"
    assert run_cli(*args, f"--output={whole}").returncode == 0
    recorded = json.loads(open(f"{whole}.run.json").read())
    assert recorded["method"] == "snapkv" and recorded["method_args"]["budget"] == 16
    assert recorded["max_new_tokens"] == 5 and recorded["kv_dtype"] == "model"
    out = tmp_path / "out.jsonl"
    out.write_text("".join(line + "\n" for line in open(whole).read().splitlines()[:2]))
    shutil.copy(f"{whole}.run.json", f"{out}.run.json")
    before = out.read_bytes()
    for changed, named in (("--budget=32", "--method_args budget: 16 there, 32 now"),
                           ("--max_new_tokens=6", "--max_new_tokens: 5 there, 6 now"),
                           ("--kv_dtype=int8", '--kv_dtype: "model" there, "int8" now')):
        proc = run_cli(*[a for a in args if a.split("=")[0] != changed.split("=")[0]], changed, f"--output={out}")
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert "were made with other settings" in line and named in line, line
        assert out.read_bytes() == before
    resumed = run_cli(*[a for a in args if a not in ("--slots=2", args[0])], f"--model={model_dir}/", "--slots=3",
                      f"--output={out}")  # the same model directory, named with a slash
    assert resumed.returncode == 0 and "2 already done" in resumed.stdout, resumed.stderr[-2000:]
    assert {r["id"]: r["tokens"] for r in _records(out)} == {r["id"]: r["tokens"] for r in _records(whole)}

    os.remove(f"{out}.run.json")
    proc = run_cli(*args, f"--output={out}")
    assert proc.returncode == 2 and "have no out.jsonl.run.json beside them" in proc.stderr, proc.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    shutil.copy(f"{whole}.run.json", f"{empty}.run.json")  # a stale record binds nothing while there is no answer
    proc = run_cli(*[a for a in args if a != "--budget=16"], "--budget=32", f"--output={empty}")
    assert proc.returncode == 0 and len(_records(empty)) == 4, proc.stderr[-2000:]
    assert json.loads(open(f"{empty}.run.json").read())["method_args"]["budget"] == 32


def test_samples_write_a_line_each_and_resume_sample_by_sample(model_dir, tmp_path):
    """A line with `samples` gives one record per sample (`sample` after the id), a line without it one record with
    no `sample`; a job cut after some samples of a request resumes with only its missing ones, and its records equal
    an uninterrupted run's; an output whose samples do not match the input's is refused, naming its line."""
    lines = [json.dumps({"id": f"p{i}", "prompt": p, "max_new_tokens": 6, "temperature": 0.8, "seed": i,
                         **({"samples": 3} if i else {})}) for i, p in enumerate(_prompts(3))]
    source = _write(tmp_path / "in.jsonl", lines)
    args = [f"--model={model_dir}", f"--input={source}", "--slots=4", "--steps=2", "--progress=false"]
    whole = tmp_path / "whole.jsonl"
    proc = run_cli(*args, f"--output={whole}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3 requests (7 answers; 0 already done)" in proc.stdout
    records = _records(whole)
    assert sorted((r["id"], r.get("sample")) for r in records) == [("p0", None)] + [
        (f"p{i}", s) for i in (1, 2) for s in range(3)]
    assert all(list(r)[:2] == ["id", "sample"] for r in records if r["id"] != "p0")
    assert len({tuple(r["tokens"]) for r in records if r["id"] == "p1"}) > 1

    first = records[:3]  # the first answers to finish: a request's samples may be split across the cut
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in first))
    shutil.copy(f"{whole}.run.json", f"{out}.run.json")  # the settings the cut job recorded before its answers
    rerun = run_cli(*args, f"--output={out}")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "; 3 already done)" in rerun.stdout
    assert any(0 < sum(r["id"] == rid for r in first) < 3 for rid in ("p1", "p2"))  # a request cut mid-samples
    key = lambda r: (r["id"], r.get("sample", -1))  # noqa: E731
    strip = lambda r: {k: v for k, v in r.items() if not k.endswith("_s")}  # noqa: E731
    assert sorted(map(strip, _records(out)), key=key) == sorted(map(strip, records), key=key)

    out.write_text(json.dumps({**records[0], "sample": 0} if "sample" not in records[0] else
                              {k: v for k, v in records[0].items() if k != "sample"}) + "\n")
    proc = run_cli(*args, f"--output={out}")
    assert proc.returncode == 2 and "out.jsonl:1:" in proc.stderr and "whose request asks for samples=" in \
        proc.stderr, proc.stderr


def test_stop_strings_cut_each_answer_where_one_starts(model_dir, tmp_path):
    """A line's `stop` (a string or a list) and `--stop` (the default of the lines without one): each answer's tokens
    are the uninterrupted answer's up to the first token whose text holds a stop string, its text the uninterrupted
    text cut where the string starts, `finish_reason` "stop" and `stop` the string; answers that hold none are
    unchanged."""
    prompts = _prompts(4)
    base = [{"id": i, "prompt": p, "max_new_tokens": 12} for i, p in enumerate(prompts)]
    args = [f"--model={model_dir}", "--slots=2", "--steps=3", "--progress=false"]
    whole = tmp_path / "whole.jsonl"
    assert run_cli(*args, f"--input={_write(tmp_path / 'a.jsonl', map(json.dumps, base))}",
                   f"--output={whole}").returncode == 0
    plain = {r["id"]: r for r in _records(whole)}
    tokenizer = load_tokenizer(str(model_dir))
    texts = {i: r["text"] for i, r in plain.items()}
    assert all(len(t) >= 8 for t in texts.values()), texts
    lines = [{**base[0], "stop": texts[0][3:5]}, {**base[1], "stop": ["\u0001never", texts[1][5:8]]},
             {**base[2], "stop": "\u0001never"}, base[3]]  # the last one takes --stop
    out = tmp_path / "out.jsonl"
    job = [*args, f"--input={_write(tmp_path / 'b.jsonl', map(json.dumps, lines))}", f"--output={out}"]
    dry = run_cli(*job, "--dry_run")
    assert dry.returncode == 0 and "0 sampled, 3 with stop strings;" in dry.stdout, dry.stdout + dry.stderr
    proc = run_cli(*job, f"--stop={texts[3][2:4]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = {r["id"]: r for r in _records(out)}
    for i, stop in ((0, texts[0][3:5]), (1, texts[1][5:8]), (3, texts[3][2:4])):
        tokens = plain[i]["tokens"]
        n = next(n for n in range(1, len(tokens) + 1)
                 if stop in tokenizer.decode(tokens[:n], skip_special_tokens=True))
        assert got[i]["tokens"] == tokens[:n] and got[i]["text"] == texts[i][: texts[i].find(stop)]
        assert got[i]["finish_reason"] == "stop" and got[i]["stop"] == stop
    assert got[2]["tokens"] == plain[2]["tokens"] and "stop" not in got[2]


BAD = {
    "malformed": (['{"id": 1, "prompt": "a b c"}', '{"id": 2, "prompt": "oops"'], "in.jsonl:2: malformed JSON"),
    "duplicate": (['{"id": "x", "prompt": "a"}', '{"id": "y", "prompt": "b"}', '{"id": "x", "prompt": "c"}'],
                  "in.jsonl:3: duplicate id 'x' (first on line 1)"),
    "empty": (['{"id": 1, "prompt": "a"}', '{"id": 2, "prompt": "  "}'], "in.jsonl:2: empty prompt"),
    "too long": (['{"id": 1, "prompt": "' + "word " * 200 + '"}'], "in.jsonl:1: prompt of 1001 tokens + 256 new"),
    "unknown field": (['{"id": 1, "prompt": "a", "temprature": 0.5}'], "in.jsonl:1: unknown field 'temprature'"),
    "no id": (['{"prompt": "a"}'], "in.jsonl:1: no 'id'"),
    "bad value": (['{"id": 1, "prompt": "a", "top_p": 2}'], "in.jsonl:1: top_p must be a number in (0, 1]"),
    "not an object": (['[1, 2]'], "in.jsonl:1: expected a JSON object"),
    "samples": (['{"id": 1, "prompt": "a", "samples": 0}'], "in.jsonl:1: samples must be an integer >= 1, got 0"),
    "seed": (['{"id": 1, "prompt": "a", "seed": -1}'], "in.jsonl:1: seed must be an integer in [0, 2**32), got -1"),
    "greedy samples": (['{"id": 1, "prompt": "a", "samples": 2}'],
                       "in.jsonl:1: samples=2 at temperature 0 would be 2 identical greedy answers"),
    "stop type": (['{"id": 1, "prompt": "a", "stop": ["x", 3]}'],
                  "in.jsonl:1: stop must be a string or a list of strings, got ['x', 3]"),
    "empty stop": (['{"id": 1, "prompt": "a", "stop": ["x", ""]}'],
                   "in.jsonl:1: stop[1] must be a non-empty string, got ''"),
    "messages, no template": (['{"id": 1, "messages": [{"role": "user", "content": "a"}]}'],
                              "in.jsonl:1: 'messages' needs a chat template, and this model's tokenizer has no chat "
                              "template (a pretrained, not an instruction-tuned, model); give the text as 'prompt'"),
    "special stop": (['{"id": 1, "prompt": "a", "stop": "</s>"}'],
                     "in.jsonl:1: stop string '</s>' is a special token, which answers are decoded without; give its "
                     "id in stop_ids"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_with_one_line_naming_it(model_dir, tmp_path, case):
    lines, message = BAD[case]
    proc = run_cli(f"--model={model_dir}", f"--input={_write(tmp_path / 'in.jsonl', lines)}",
                   f"--output={tmp_path / 'out.jsonl'}")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert message in line, line
    assert not (tmp_path / "out.jsonl").exists()


BAD_FLAGS = {
    "--temperature=-1": "--temperature must be a finite number >= 0, got -1.0",
    "--temperature=nan": "--temperature must be a finite number >= 0, got nan",
    "--top_p=2": "--top_p must be a number in (0, 1], got 2.0",
    "--top_p=0": "--top_p must be a number in (0, 1], got 0.0",
    "--max_new_tokens=0": "--max_new_tokens must be an integer >= 1, got 0",
    "--memory_fraction=1.5": "--memory_fraction must be in (0, 1], got 1.5",
    "--memory_fraction=0": "--memory_fraction must be in (0, 1], got 0.0",
    "--samples=0": "--samples must be an integer >= 1, got 0",
    "--seed=4294967296": "--seed must be an integer in [0, 2**32), got 4294967296",  # drew as seed 0
    "--samples=2": "--samples=2 at --temperature=0 would be 2 identical greedy answers per prompt",
    "--samples=3 --temperature=1 --slots=2": "--samples=3 needs as many slots at once, more than --slots=2",
    "--stop=": "--stop[0] must be a non-empty string, got ''",
    "--prompt_store=pyproject.toml": "--prompt_store 'pyproject.toml' is a file, not a folder",  # run from the root
    "--prompt_store_max_gb=1": "--prompt_store_max_gb sizes a prompt store; give --prompt_store too",
    "--prompt_store=/tmp --prompt_store_max_gb=0": "--prompt_store_max_gb must be a finite number > 0, got 0.0",
    "--prompt_store=/tmp --prompt_store_max_gb=nan": "--prompt_store_max_gb must be a finite number > 0, got nan",
    "--prompt_store=/tmp --prompt_store_max_gb=inf": "--prompt_store_max_gb must be a finite number > 0, got inf",
    "--prompt_store=/tmp --prompt_store_max_gb=1e300": "--prompt_store_max_gb must be a finite number > 0, got 1e+300",
}


@pytest.mark.parametrize("flag", sorted(BAD_FLAGS))
def test_a_bad_default_is_refused_as_the_flag_before_the_model_loads(tmp_path, flag):
    """A flag that defaults every line's setting is named as the flag, not blamed on the file's first line (before,
    `--temperature=-1` read `in.txt:1: temperature must be ...`), and a `--memory_fraction` outside (0, 1] is not
    planned on; both before a model is looked for (the model path here does not exist)."""
    good = _write(tmp_path / "in.txt", ["a prompt"])
    proc = run_cli(f"--model={tmp_path / 'no_model'}", f"--input={good}", f"--output={tmp_path / 'o.jsonl'}",
                   *flag.split())
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert BAD_FLAGS[flag] in line and "in.txt" not in line, line
    assert not (tmp_path / "o.jsonl").exists()


def test_a_jsonl_name_in_capitals_is_read_as_jsonl(model_dir, tmp_path):
    """`PROMPTS.JSONL` (a Windows tool's name) is a JSONL file: its requests equal those of the same file named
    `prompts.jsonl` (before: read as text, each JSON line a prompt, and the job ran on the JSON's own text)."""
    from kvjax.engine.jobs import Defaults, read_job

    encoder = PromptEncoder(load_tokenizer(str(model_dir)), "auto")
    lines = [json.dumps({"id": "a", "prompt": "first prompt"}), json.dumps({"id": "b", "prompt": "second"})]
    read = lambda path: read_job(path, encoder, Defaults(), lambda request: None).requests  # noqa: E731
    lower, upper = read(_write(tmp_path / "prompts.jsonl", lines)), read(_write(tmp_path / "PROMPTS.JSONL", lines))
    assert upper == lower and [r.id for r in upper] == ["a", "b"]


@pytest.mark.parametrize("name", ["in.jsonl", "in.txt"])
def test_a_job_file_saved_with_a_byte_order_mark_reads_as_without(model_dir, tmp_path, name):
    """A UTF-8 byte order mark (Windows editors write one) is neither refused (before: `in.jsonl:1: malformed JSON`)
    nor read into the first prompt (before: a text file's first prompt began with U+FEFF): the requests equal those
    of the same file without it, CRLF line ends and all."""
    from kvjax.engine.jobs import Defaults, read_job

    lines = ([json.dumps({"id": "a", "prompt": "first prompt"}), json.dumps({"id": "b", "prompt": "second"})]
             if name.endswith(".jsonl") else ["first prompt", "second"])
    text = "\r\n".join(lines) + "\r\n"
    plain, marked = tmp_path / "plain" / name, tmp_path / "marked" / name
    for path, data in ((plain, text.encode()), (marked, b"\xef\xbb\xbf" + text.encode())):
        path.parent.mkdir()
        path.write_bytes(data)
    encoder = PromptEncoder(load_tokenizer(str(model_dir)), "auto")
    read = lambda path: read_job(str(path), encoder, Defaults(), lambda request: None).requests  # noqa: E731
    assert read(marked) == read(plain) and len(read(plain)) == 2


def test_a_line_ends_only_at_a_newline_not_at_other_unicode_line_breaks(model_dir, tmp_path):
    """A JSON string may hold U+2028 or U+0085 unescaped (`json.dumps(..., ensure_ascii=False)` writes them so) and a
    text prompt a form feed: each stays inside its line's prompt, one request per line, ids the file's line numbers
    (before: `str.splitlines` broke lines there, a valid JSONL line refused as malformed JSON and a text prompt split
    in two, the ids after it shifted)."""
    from kvjax.engine.jobs import Defaults, read_job

    encoder = PromptEncoder(load_tokenizer(str(model_dir)), "auto")
    read = lambda path: read_job(str(path), encoder, Defaults(), lambda request: None).requests  # noqa: E731
    prompts = ["first\u2028second", "a\u0085b\u2029c", "page one\x0cpage two\x0bend\x1cx"]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "prompt": p}, ensure_ascii=False) + "\n"
                             for i, p in enumerate(prompts[:2])), encoding="utf-8")
    text = tmp_path / "in.txt"
    text.write_text(f"{prompts[2]}\nlast line\n", encoding="utf-8")
    want = [encoder.encode(p, None, None)[0] for p in prompts]
    assert [(r.id, list(r.tokens)) for r in read(jsonl)] == [(0, want[0]), (1, want[1])]
    assert [(r.id, list(r.tokens)) for r in read(text)] == [(1, want[2]),
                                                           (2, encoder.encode("last line", None, None)[0])]


def test_blank_lines_of_a_text_file_are_skipped_and_ids_stay_line_numbers(model_dir, tmp_path):
    """A text file's blank or whitespace-only lines (a trailing empty line, paragraphs apart) are skipped as a JSONL
    file's are, where they used to stop the job (`in.txt:2: empty prompt`); each prompt keeps its line number as id,
    and its tokens are those of the same prompt in a file without the blank lines. A file of blank lines alone is
    refused."""
    from kvjax.engine.jobs import Defaults, JobError, read_job

    encoder = PromptEncoder(load_tokenizer(str(model_dir)), "auto")
    read = lambda path: read_job(str(path), encoder, Defaults(), lambda request: None).requests  # noqa: E731
    spaced = read(_write(tmp_path / "spaced.txt", ["first prompt", "", "third", "   ", "\t", "fifth", ""]))
    packed = read(_write(tmp_path / "packed.txt", ["first prompt", "third", "fifth"]))
    assert [r.id for r in spaced] == [1, 3, 6] and [r.id for r in packed] == [1, 2, 3]
    assert [r.tokens for r in spaced] == [r.tokens for r in packed]
    with pytest.raises(JobError, match="no prompts"):
        read(_write(tmp_path / "blank.txt", ["", "  "]))


def test_text_input_and_refusals_of_flags(model_dir, tmp_path):
    good = _write(tmp_path / "ok.txt", ["a prompt"])
    proc = run_cli(f"--model={model_dir}", f"--input={good}", f"--output={tmp_path / 'o.jsonl'}", "--method=samkv")
    assert proc.returncode == 2 and "samkv is a multi-context strategy" in proc.stderr
    proc = run_cli(f"--model={model_dir}", f"--input={good}", f"--output={tmp_path / 'o.jsonl'}", "--budget=8",
                   "--method_args=budget=9", "--method=snapkv")
    assert proc.returncode == 2 and "--budget and --method_args=budget" in proc.stderr
    # A special-token --stop is the flag's fault, named as such (before: blamed on `ok.txt:1`).
    proc = run_cli(f"--model={model_dir}", f"--input={good}", f"--output={tmp_path / 'o.jsonl'}", "--stop=</s>")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "--stop: stop string '</s>' is a special token" in line and "ok.txt" not in line, line


def test_dry_run_checks_every_line_without_the_weights(model_dir, tmp_path):
    """`--dry_run` checks the input as a run does and stops before the weights load: on a copy of the model without
    its weights file it succeeds where a run fails, says what the job holds, and writes no output."""
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    prompts = ["alpha beta", "gamma delta epsilon zeta", "eta theta iota"]
    lines = [json.dumps({"id": i, "prompt": p, **({"temperature": 0.7} if i == 1 else {})})
             for i, p in enumerate(prompts)]
    job = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    proc = run_cli(f"--model={bare}", f"--input={job}", f"--output={out}", "--dry_run", "--max_new_tokens=9")
    assert proc.returncode == 0, proc.stderr
    encoder = PromptEncoder(load_tokenizer(str(model_dir)), "auto")
    lengths = sorted(len(encoder.encode(p, None, None)[0]) for p in prompts)
    assert (f"dry run: 3 requests of {job} checked; prompts of {lengths[0]}-{lengths[-1]} (median {lengths[1]}) "
            "tokens, at most 9 new tokens each, 1 sampled") in proc.stdout, proc.stdout
    assert not out.exists()
    bad = _write(tmp_path / "in.jsonl", BAD["duplicate"][0])
    proc = run_cli(f"--model={bare}", f"--input={bad}", f"--output={out}", "--dry_run")
    assert proc.returncode == 2 and BAD["duplicate"][1] in proc.stderr, proc.stderr
    job = _write(tmp_path / "in.jsonl", lines)
    proc = run_cli(f"--model={bare}", f"--input={job}", f"--output={out}")  # the run needs the weights
    assert proc.returncode == 2 and "no safetensors weights" in proc.stderr and not out.exists(), proc.stderr


def test_the_documented_shard_name_is_the_one_a_process_writes():
    """docs/engine.md's multi-host example names the file `_shard_path` gives (before, the docs said
    `<output>.<index>-of-<count>.jsonl`, while `answers.jsonl`'s shard is `answers.001-of-004.jsonl`)."""
    import re

    from kvjax import run

    with open(os.path.join(ROOT, "docs", "engine.md"), encoding="utf-8") as f:
        bullet = " ".join(f.read().split("* **Multi-host**:", 1)[1].split("\n* ", 1)[0].split())
    flag, index, count, name = re.search(r"`--output=(\S+)`, process (\d+) of (\d+): `(\S+)`", bullet).groups()
    assert run._shard_path(flag, int(index), int(count)) == name
    assert run._shard_path(flag, 0, 1) == flag  # one process writes --output itself


def test_help_exits_0_and_lists_the_flags():
    """kvjax.run's flags live in a registry of their own, without absl's help flags: --help is answered anyway."""
    for flag in ("--help", "-h", "--helpfull"):
        proc = run_cli(flag)
        assert proc.returncode == 0, (flag, proc.stderr)
        assert "continuous-batching engine" in proc.stdout and "--slots" in proc.stdout and "--input" in proc.stdout


@pytest.mark.parametrize("where", ["a folder", "inside a file", "a folder that cannot be made"])
def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, where):
    """`--output` is checked with the other flags: the model path here does not exist, and the error names the
    output (before, such an output failed only once the model had loaded)."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me\n")
    output = {"a folder": str(tmp_path), "inside a file": str(a_file / "out.jsonl"),
              "a folder that cannot be made": "/sys/kvjax_no_such_dir/out.jsonl"}[where]
    good = _write(tmp_path / "in.txt", ["a prompt"])
    proc = run_cli(f"--model={tmp_path / 'no_model'}", f"--input={good}", f"--output={output}")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f"--output={output!r}" in line, line
    assert a_file.read_text() == "keep me\n"


def test_questions_about_one_context_share_its_prompt_pass(model_dir, tmp_path, monkeypatch):
    """Lines with the same `prompt` and other questions, listed together: one prompt pass for them (counted), and
    the answers of `--share_prompts=false` (a prompt pass each)."""
    from kvjax.runtime import stages

    context = " ".join(_prompts(4)[3:])
    lines = [json.dumps({"id": i, "prompt": context, "question": q, "max_new_tokens": 6})
             for i, q in enumerate(["who?", "what happened?", "where?"])]
    lines.append(json.dumps({"id": 3, "prompt": "another context", "question": "who?", "max_new_tokens": 6}))
    source = _write(tmp_path / "in.jsonl", lines)
    passes = []
    through = stages.through_prompt
    monkeypatch.setattr(stages, "through_prompt", lambda *a, **k: passes.append(1) or through(*a, **k))
    records = {}
    for share in ("true", "false"):
        out = tmp_path / f"{share}.jsonl"
        proc = run_cli(f"--model={model_dir}", f"--input={source}", f"--output={out}", "--method=snapkv",
                       "--budget=16", "--method_args=window_size=4", "--slots=4", "--progress=false",
                       f"--share_prompts={share}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        records[share] = {r["id"]: (r["tokens"], r["kept_tokens"]) for r in _records(out)}
    assert passes == [1] * (2 + 4)  # shared: the context and "another context"; unshared: one per line
    assert records["true"] == records["false"]


def test_a_prompt_store_is_read_back_by_a_later_job(model_dir, tmp_path, monkeypatch):
    """`--prompt_store`: the first job computes and writes each context's prompt pass; a second job with other
    questions about the same contexts (their lines interleaved) computes none, and answers as a job without a store
    (counted, and named in the summary line)."""
    from kvjax.runtime import stages

    contexts = [" ".join(_prompts(5)[3:]), " ".join(_prompts(5)[2:])]
    store = tmp_path / "store"

    def job(name, questions):
        lines = [json.dumps({"id": f"{name}{i}", "prompt": contexts[i % 2], "question": q, "max_new_tokens": 6})
                 for i, q in enumerate(questions)]
        return _write(tmp_path / f"{name}.jsonl", lines)

    passes = []
    through = stages.through_prompt
    monkeypatch.setattr(stages, "through_prompt", lambda *a, **k: passes.append(1) or through(*a, **k))
    flags = (f"--model={model_dir}", "--method=snapkv", "--budget=16", "--method_args=window_size=4", "--slots=2",
             "--progress=false")
    outputs = {}
    for name, questions, stored in (("first", ["who?", "what?"], True), ("second", ["where?", "when?", "why?"], True),
                                    ("plain", ["where?", "when?", "why?"], False)):
        out = tmp_path / f"{name}.out.jsonl"
        source = job("second" if name == "plain" else name, questions)
        before = len(passes)
        proc = run_cli(*flags, f"--input={source}", f"--output={out}",
                       *((f"--prompt_store={store}",) if stored else ()))
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs[name] = ({r["id"]: (r["tokens"], r["kept_tokens"]) for r in _records(out)}, len(passes) - before,
                         proc.stdout)
    assert outputs["first"][1] == 2 and "0 prompt passes read, 2 computed and written" in outputs["first"][2]
    assert outputs["second"][1] == 0 and "3 prompt passes read, 0 computed" in outputs["second"][2]
    assert outputs["plain"][1] == 3 and "prompt store" not in outputs["plain"][2]
    assert outputs["second"][0] == outputs["plain"][0]
    assert len(list(store.glob("*.safetensors"))) == 2
    # Sized for one and a half passes: the second job's contexts alternate, so each pass removes the other's.
    size = max(p.stat().st_size for p in store.glob("*.safetensors"))
    out = tmp_path / "sized.out.jsonl"
    before = len(passes)
    proc = run_cli(*flags, f"--input={job('second', ['where?', 'when?', 'why?'])}", f"--output={out}",
                   f"--prompt_store={tmp_path / 'sized'}", f"--prompt_store_max_gb={1.5 * size / 1e9}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(passes) - before == 3 and len(list((tmp_path / "sized").glob("*.safetensors"))) == 1
    assert "0 prompt passes read, 3 computed and written, 2 least recently used removed, 0 too large" in proc.stdout
    assert {r["id"]: (r["tokens"], r["kept_tokens"]) for r in _records(out)} == outputs["plain"][0]


def test_a_chat_template_that_drops_the_prompt_is_named(tmp_path):
    """A chat template that leaves out the user message's text cannot wrap a 'prompt': the job line's error says so
    (before: `in.txt:1: not enough values to unpack (expected 2, got 1)`); its 'messages' still render."""
    from kvjax.engine.jobs import Defaults, JobError, read_job
    from kvjax.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{% endfor %}"
    encoder = PromptEncoder(tok, "auto")
    with pytest.raises(JobError, match=r"in\.txt:1: the tokenizer's chat template leaves out the user message's"):
        read_job(_write(tmp_path / "in.txt", ["hello"]), encoder, Defaults(), lambda request: None)
    chat = json.dumps({"id": 1, "messages": [{"role": "user", "content": "hi"}]})
    (request,) = read_job(_write(tmp_path / "in.jsonl", [chat]), encoder, Defaults(), lambda r: None).requests
    assert list(request.tokens) == tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                                           add_generation_prompt=True)["input_ids"]


def test_kvzip_gets_its_repeat_prompt_from_the_tokenizer(model_dir, tmp_path):
    """`--method=kvzip` repeats the context inside the paper's repeat prompt built from the tokenizer
    (`kvzip.prompt_ids`), as `kvjax.eval` runs it (before: the bare context, a different KVzip than the eval's): the
    job's settings record it and each answer is `generate`'s with that method."""
    from kvjax import methods
    from kvjax.engine import run_record
    from kvjax.methods.kvzip import prompt_ids

    prompts = _prompts(2)
    lines = [json.dumps({"id": i, "prompt": p, "max_new_tokens": 4}) for i, p in enumerate(prompts)]
    out = tmp_path / "out.jsonl"
    proc = run_cli(f"--model={model_dir}", f"--input={_write(tmp_path / 'in.jsonl', lines)}", f"--output={out}",
                   "--method=kvzip", "--budget=8", "--progress=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokenizer = load_tokenizer(str(model_dir))
    ids = prompt_ids(tokenizer, chat_template=False)
    assert ids["repeat_ids"]
    recorded = json.loads(open(run_record.path_of(str(out))).read())["method_args"]
    assert {k: list(recorded[k]) for k in ("repeat_ids", "continue_ids", "suffix_ids")} == \
        {k: list(ids[k]) for k in ("repeat_ids", "continue_ids", "suffix_ids")}
    method = methods.get("kvzip", budget=8, **ids)
    model = load_model(str(model_dir))
    for record in _records(out):
        ref = kvjax.generate(model, [tokenizer.encode(prompts[record["id"]])], method=method, max_new_tokens=4)
        assert record["tokens"] == ref.tokens[0][: int(ref.num_tokens[0])].tolist()


def test_kvzip_with_a_chat_template_that_drops_the_message_is_refused(model_dir, tmp_path):
    """KVzip's repeat prompt needs the chat template's turn around a message: a template that leaves the message out
    is one line naming --method=kvzip and --chat_template=no, exit 2, before the model loads (not a traceback)."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}[{{ m['role'] }}]{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    line = json.dumps({"id": 1, "messages": [{"role": "user", "content": "hi"}]})
    out = tmp_path / "out.jsonl"
    proc = run_cli(f"--model={model}", f"--input={_write(tmp_path / 'in.jsonl', [line])}", f"--output={out}",
                   "--method=kvzip", "--budget=8", "--progress=false")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (error,) = proc.stderr.strip().splitlines()
    assert "--method=kvzip: its repeat prompt cannot be built" in error and "--chat_template=no" in error
    assert not out.exists()


def test_a_tokenizer_larger_than_the_models_vocabulary_is_named_in_the_refusal(tmp_path):
    """A line whose text encodes to an id past the model's vocabulary was refused as if the line were wrong; the
    message now says the tokenizer holds more tokens than the model (the two do not belong together)."""
    model = tmp_path / "model"
    vocab = save_char_tokenizer(model)
    config = tiny_config(vocab_size=vocab - 8, max_position_embeddings=256)
    save_hf(config, DecoderLM.random(config, seed=0, scale=0.3).weights(), model)
    tokenizer = load_tokenizer(str(model))
    last = tokenizer.convert_ids_to_tokens(vocab - 1)  # a character the smaller model has no row for
    line = json.dumps({"id": 1, "prompt": "ab" + last, "max_new_tokens": 2})
    out = tmp_path / "out.jsonl"
    proc = run_cli(f"--model={model}", f"--input={_write(tmp_path / 'in.jsonl', [line])}", f"--output={out}",
                   "--progress=false", "--chat_template=no")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"token ids are integers in [0, {vocab - 8}) (the tokenizer has {len(tokenizer)} tokens, more than the " \
        f"model's vocabulary of {vocab - 8}: is --model's tokenizer this model's own?)" in proc.stderr, proc.stderr
    assert not out.exists()
