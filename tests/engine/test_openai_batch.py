"""`python -m kvjax.run` on a file in OpenAI's batch format: each output line against the engine run on the requests
built by hand, resume after a cut, and every line kvjax would not run as asked refused.

Oracle: the test renders each request's tokens itself (the chat template for a chat line, the prompt as it is for a
completions line) and runs them through an `Engine` of the job's own settings; each choice's text, finish reason,
log-probabilities and usage must be that answer's, and its choices every sample the line's `n` asks for.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from test_run_cli import ROOT, _records, _write, run_cli
from tiny import tiny_config

from kvjax.engine import Engine, Request, openai_batch, stops
from kvjax.engine.request import Completion
from kvjax.models.char_tokenizer import build_char_tokenizer
from kvjax.models.export import save_hf
from kvjax.models.model import DecoderLM, load_model
from kvjax.models.tokenizer import load_tokenizer

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'developer' %}{{ raise_exception('no developer turns') }}"
            "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
            "{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny random model, its character tokenizer given a chat template."""
    path = tmp_path_factory.mktemp("model")
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(path))
    config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=1024)
    save_hf(config, DecoderLM.random(config, seed=0, scale=0.3).weights(), path)
    return path


def _chat(cid, messages, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"model": "any", "messages":
                                                                                          messages, **body}}


def _completion(cid, prompt, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


LINES = [
    _chat("a", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha beta gamma"}],
          max_tokens=6, logprobs=True),
    _chat("b", [{"role": "user", "content": [{"type": "text", "text": "delta"}, {"type": "text", "text": "zeta"}]}],
          max_completion_tokens=5, n=2, temperature=0.8, seed=3),
    _completion("c", "epsilon eta theta iota", max_tokens=7, logprobs=0),
    _completion("d", "kappa lambda", stream=False, temperature=0, max_tokens=None),  # the length: --max_new_tokens
]
ARGS = ["--slots=4", "--steps=3", "--max_new_tokens=6", "--progress=false"]


def _oracle(model_dir) -> dict:
    """The engine's answers to the four lines, their tokens rendered here: {(custom_id, sample): Completion}."""
    tokenizer = load_tokenizer(str(model_dir))
    chat = lambda messages: tokenizer.encode(tokenizer.apply_chat_template(  # noqa: E731
        messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    requests = [
        Request(id="a", tokens=chat(LINES[0]["body"]["messages"]), max_new_tokens=6, logprobs=True),
        Request(id="b", tokens=chat([{"role": "user", "content": "delta\nzeta"}]), max_new_tokens=5, samples=2,
                temperature=0.8, seed=3),
        Request(id="c", tokens=tokenizer.encode("epsilon eta theta iota"), max_new_tokens=7, logprobs=True),
        Request(id="d", tokens=tokenizer.encode("kappa lambda"), max_new_tokens=6),
    ]
    engine = Engine(load_model(str(model_dir)), max_prompt_tokens=max(len(r.tokens) for r in requests),
                    max_new_tokens=7, slots=4, steps=3, sampling=True, max_stop_ids=0, tokenizer=tokenizer)
    return {(c.id, c.sample or 0): c for c in engine.run(requests)}


def test_each_line_answers_as_the_engine_on_its_rendered_tokens(model_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    job = [f"--model={model_dir}", f"--input={_write(tmp_path / 'in.jsonl', map(json.dumps, LINES))}",
           f"--output={out}", *ARGS]
    dry = run_cli(*job, "--dry_run")
    assert dry.returncode == 0 and "4 requests (5 answers) (OpenAI batch: 2 chat, 2 completions)" in dry.stdout, \
        dry.stdout + dry.stderr
    proc = run_cli(*job)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = _oracle(model_dir)
    tokenizer = load_tokenizer(str(model_dir))
    lines = _records(out)
    assert sorted(line["custom_id"] for line in lines) == ["a", "b", "c", "d"]
    for line in lines:
        cid, body = line["custom_id"], line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None and body["model"] == str(model_dir)
        chat = cid in ("a", "b")
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        assert [c["index"] for c in body["choices"]] == list(range(2 if cid == "b" else 1))
        for choice in body["choices"]:
            ref = want[cid, choice["index"]]
            text = choice["message"]["content"] if chat else choice["text"]
            assert choice["message"]["role"] == "assistant" if chat else "message" not in choice
            assert choice["kvjax"]["tokens"] == ref.tokens and choice["finish_reason"] == ref.finish_reason
            assert text == tokenizer.decode(ref.tokens, skip_special_tokens=True)
            if cid == "a":
                content = choice["logprobs"]["content"]
                assert [c["logprob"] for c in content] == ref.logprobs
                assert "".join(c["token"] for c in content) == text
            elif cid == "c":
                assert choice["logprobs"]["token_logprobs"] == ref.logprobs
                assert [text[o:] for o in choice["logprobs"]["text_offset"]] == [
                    "".join(choice["logprobs"]["tokens"][i:]) for i in range(len(ref.tokens))]
            else:
                assert choice["logprobs"] is None
        assert body["usage"] == {"prompt_tokens": want[cid, 0].prompt_tokens,
                                 "completion_tokens": sum(len(c["kvjax"]["tokens"]) for c in body["choices"]),
                                 "total_tokens": want[cid, 0].prompt_tokens + body["usage"]["completion_tokens"]}
    b = next(line for line in lines if line["custom_id"] == "b")["response"]["body"]["choices"]
    assert b[0]["kvjax"]["tokens"] != b[1]["kvjax"]["tokens"]  # two draws, not one answer twice


def test_a_stop_string_cuts_a_choice_as_in_a_kvjax_job(model_dir, tmp_path):
    """`body.stop`: the choice ends at the first token whose text holds the string, the text cut where it starts."""
    plain = tmp_path / "plain.jsonl"
    line = _completion("c", "epsilon eta theta iota", max_tokens=6)
    assert run_cli(f"--model={model_dir}", f"--input={_write(tmp_path / 'a.jsonl', [json.dumps(line)])}",
                   f"--output={plain}", *ARGS).returncode == 0
    (choice,) = _records(plain)[0]["response"]["body"]["choices"]
    stop = choice["text"][2:4]
    assert len(choice["text"]) >= 4, choice
    out = tmp_path / "out.jsonl"
    line["body"]["stop"] = [stop, "\u0001never"]
    assert run_cli(f"--model={model_dir}", f"--input={_write(tmp_path / 'b.jsonl', [json.dumps(line)])}",
                   f"--output={out}", *ARGS).returncode == 0
    (cut,) = _records(out)[0]["response"]["body"]["choices"]
    tokenizer = load_tokenizer(str(model_dir))
    tokens = choice["kvjax"]["tokens"]
    n = next(n for n in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:n], skip_special_tokens=True))
    assert cut["kvjax"]["tokens"] == tokens[:n] and cut["text"] == stops.cut(choice["text"], stop)
    assert cut["finish_reason"] == "stop" and cut["kvjax"]["stop"] == stop


def test_a_cut_job_resumes_with_the_lines_not_written(model_dir, tmp_path):
    """Lines already written are skipped (a request's choices are one line, written once all finished), a line torn
    by a kill is dropped; an output whose choices do not match the input's `n` is refused."""
    source = _write(tmp_path / "in.jsonl", map(json.dumps, LINES))
    whole = tmp_path / "whole.jsonl"
    assert run_cli(f"--model={model_dir}", f"--input={source}", f"--output={whole}", *ARGS).returncode == 0
    done = _records(whole)
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in done[:2]) + '{"id": "kvjax_req_x", "custom_id": "b", "re')
    shutil.copy(f"{whole}.run.json", f"{out}.run.json")  # the settings the cut job recorded before its answers
    rerun = run_cli(f"--model={model_dir}", f"--input={source}", f"--output={out}", *ARGS)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    skipped = sum(len(r["response"]["body"]["choices"]) for r in done[:2])
    assert f"({skipped} already done)" in rerun.stdout, rerun.stdout
    strip = lambda r: [(c["index"], c["kvjax"]["tokens"], c["finish_reason"])  # noqa: E731
                       for c in r["response"]["body"]["choices"]]
    got = {r["custom_id"]: strip(r) for r in _records(out)}
    assert len(_records(out)) == 4 and got == {r["custom_id"]: strip(r) for r in done}

    b = next(r for r in done if r["custom_id"] == "b")
    b["response"]["body"]["choices"] = b["response"]["body"]["choices"][:1]
    out.write_text(json.dumps(b) + "\n")
    proc = run_cli(f"--model={model_dir}", f"--input={source}", f"--output={out}", *ARGS)
    assert proc.returncode == 2 and "out.jsonl:1: choices [0] for custom_id 'b', whose request asks for n=2" in \
        proc.stderr, proc.stderr

    other = [dict(line, body={**line["body"], "prompt": "another prompt, same id"}) if line["custom_id"] == "c"
             else line for line in LINES]  # another batch file whose ids are the same
    for output, message in (([r for r in done if r["custom_id"] == "c"], "out.jsonl:1: id 'c' was answered for a "
                             "prompt of 23 tokens; the input's has 24 (another job's output?)"),
                            ([dict(done[0], response={**done[0]["response"], "body": {
                                **done[0]["response"]["body"], "model": "another-model"}})],
                             "out.jsonl:1: id 'a' was answered by model 'another-model'")):
        out.write_text("".join(json.dumps(r) + "\n" for r in output))
        proc = run_cli(f"--model={model_dir}", f"--input={_write(tmp_path / 'other.jsonl', map(json.dumps, other))}",
                       f"--output={out}", *ARGS)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


BAD = {
    "url": (_completion("x", "a") | {"url": "/v1/embeddings"}, "url must be one of /v1/chat/completions, "
                                                               "/v1/completions, got '/v1/embeddings'"),
    "method": (_completion("x", "a") | {"method": "GET"}, "method must be \"POST\", got 'GET'"),
    "custom_id": (_completion("", "a"), "custom_id must be a non-empty string, got ''"),
    "line field": (_completion("x", "a") | {"extra": 1}, "unknown field 'extra' of a batch line"),
    "stream": (_chat("x", [{"role": "user", "content": "a"}], stream=True),
               "body.stream must be false (a batch job writes whole answers), got True"),
    "penalty": (_completion("x", "a", presence_penalty=0.5), "body.presence_penalty must be 0 (kvjax applies no "
                                                             "penalty), got 0.5"),
    "top logprobs": (_chat("x", [{"role": "user", "content": "a"}], logprobs=True, top_logprobs=3),
                     "body.top_logprobs must be 0 (kvjax gives the chosen tokens' log-probabilities only), got 3"),
    "completion logprobs": (_completion("x", "a", logprobs=2), "body.logprobs must be 0"),
    "tools": (_chat("x", [{"role": "user", "content": "a"}], tools=[]), "body.tools is not run by kvjax"),
    "prompt list": (_completion("x", ["a", "b"]), "body.prompt must be one string (one request per line)"),
    "image": (_chat("x", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
              "body.messages[0].content[0] is a 'image_url' part; kvjax reads text parts only"),
    "max_tokens": (_completion("x", "a", max_tokens=0), "body.max_tokens must be an integer >= 1, got 0"),
    "both lengths": (_chat("x", [{"role": "user", "content": "a"}], max_tokens=3, max_completion_tokens=4),
                     "body.max_tokens=3 and body.max_completion_tokens=4 disagree"),
    "n": (_completion("x", "a", n=0), "body.n must be an integer >= 1, got 0"),
    "stop": (_completion("x", "a", stop=["y", ""]), "body.stop[1] must be a non-empty string, got ''"),
    "stop type": (_completion("x", "a", stop=3), "body.stop must be a string or a list of strings, got 3"),
    "tool call": (_chat("x", [{"role": "assistant", "content": "a", "tool_calls": []}]),
                  "body.messages[0] has 'tool_calls'"),
    "false penalty": (_completion("x", "a", frequency_penalty=False), "body.frequency_penalty must be 0"),
    "template": (_chat("x", [{"role": "developer", "content": "a"}]), "the tokenizer's chat template refused these "
                                                                      "messages (TemplateError: no developer turns)"),
    "greedy n": (_completion("x", "a", n=2), "samples=2 at temperature 0 would be 2 identical greedy answers; give a "
                                             "temperature > 0 (in an OpenAI line, body.n gives samples"),
    "n past the slots": (_completion("x", "a", n=3, temperature=1), "samples=3 needs as many slots at once, more than "
                                                                   "--slots=2 (in an OpenAI line, body.n gives"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_line_kvjax_would_not_run_as_asked_exits_2_naming_it(model_dir, tmp_path, case):
    line, message = BAD[case]
    source = _write(tmp_path / "in.jsonl", [json.dumps(_completion("ok", "a b c")), json.dumps(line)])
    proc = run_cli(f"--model={model_dir}", f"--input={source}", f"--output={tmp_path / 'out.jsonl'}", "--dry_run",
                   "--slots=2")
    assert proc.returncode == 2, proc.stderr
    (text,) = proc.stderr.strip().splitlines()
    assert f"in.jsonl:2: {message}" in text, text


def test_a_file_mixing_the_formats_is_refused(model_dir, tmp_path):
    for lines, message in (([_completion("x", "a"), {"id": 1, "prompt": "b"}],
                            "in.jsonl:2: a line without custom_id in an OpenAI batch file"),
                           ([{"id": 1, "prompt": "b"}, _completion("x", "a")],
                            "in.jsonl:2: an OpenAI batch line (custom_id) in a kvjax job file")):
        proc = run_cli(f"--model={model_dir}", f"--input={_write(tmp_path / 'in.jsonl', map(json.dumps, lines))}",
                       f"--output={tmp_path / 'out.jsonl'}", "--dry_run")
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_the_shipped_example_file_is_a_valid_job(model_dir, tmp_path):
    """`examples/openai_batch.jsonl` (docs/engine.md's SmolLM2 run) passes every check."""
    example = os.path.join(ROOT, "examples", "openai_batch.jsonl")
    proc = run_cli(f"--model={model_dir}", f"--input={example}", f"--output={tmp_path / 'out.jsonl'}", "--dry_run")
    assert proc.returncode == 0, proc.stderr
    assert "3 requests (4 answers) (OpenAI batch: 2 chat, 1 completion)" in proc.stdout, proc.stdout


def _byte_level_tokenizer():
    """A byte-level BPE tokenizer without merges (one token per byte), as GPT-2's family splits unseen text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from kvjax._transformers import import_transformers

    vocab = {t: i for i, t in enumerate(["<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return import_transformers().PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("kind", ["byte-level", "characters"])
def test_log_probability_pieces_join_into_the_text(model_dir, kind):
    """Each token's piece is what it adds to the text: the pieces join into the decoded answer (a prefix of it, cut
    anywhere, too), and a character split over byte tokens belongs to the token that completes it."""
    tokenizer = _byte_level_tokenizer() if kind == "byte-level" else load_tokenizer(str(model_dir))
    text = "Café \u6771\u4eac \U0001f642 ok, it's  fine." if kind == "byte-level" else "alpha, beta  gamma."
    ids = tokenizer.encode(text, add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        pieces = openai_batch.token_pieces(tokenizer, ids[:n] + [tokenizer.eos_token_id])  # an answer cut anywhere
        assert "".join(pieces) == tokenizer.decode(ids[:n], skip_special_tokens=True)
    if kind == "byte-level":
        pieces = openai_batch.token_pieces(tokenizer, ids)
        assert pieces[:5] == ["C", "a", "f", "", "\u00e9"] and "\U0001f642" in pieces
        assert "".join(pieces) == text


def test_choices_are_written_in_index_order_whatever_order_they_finish():
    tokenizer = _byte_level_tokenizer()
    request = Request(id="r", tokens=(5, 6), max_new_tokens=4, samples=3, temperature=1.0)
    writer = openai_batch.Writer([request], {"r": "completions"}, tokenizer, "m")
    done = [Completion(id="r", tokens=[40 + i], finish_reason="length", prompt_tokens=2, kept_tokens=2.0,
                       kept_generated_tokens=1.0, prefill_s=0.0, decode_s=0.0, sample=i) for i in (2, 0, 1)]
    assert writer.add(done[0]) == [] and writer.add(done[1]) == []
    (line,) = writer.add(done[2])
    choices = line["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and [c["kvjax"]["tokens"] for c in choices] == [[40], [41], [42]]
    assert line["response"]["body"]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
