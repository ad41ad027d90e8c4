"""A batch job's files: the prompts file read and checked line by line, the output file resumed and appended.

Input: JSONL (`.jsonl` / `.json`), one object per line: `id` (a string or an integer, unique), and `prompt` (text)
or `messages` (a chat, `[{"role": ..., "content": ...}, ...]`, rendered with the tokenizer's chat template);
optional `question` (text fed after the prompt: uncompressed after a query-agnostic method compressed the prompt, or
where a query-aware layout reads it), `max_new_tokens`, `temperature`, `top_p`, `seed`, `stop_ids` (ids ending the
answer besides EOS), `stop` (a string or a list of strings: the answer ends once its text holds one, and its text is
cut where it starts; `[]` for none, whatever `--stop` says), `logprobs` (true: each generated token's log-
probability), `samples` (answers drawn from one prefill of the prompt; needs a temperature > 0). Any other file: one
prompt per line, its id the line number. Lines end at LF, CRLF or CR only: a prompt may hold any other character
(a JSON string U+2028 or U+0085, a text prompt a form feed). Blank (or whitespace-only) lines of either are skipped.

Output: JSONL, one line per finished answer, flushed as it is written: `id`, `text`, `tokens` (the generated ids),
`prompt_tokens`, `generated_tokens`, `finish_reason`, `stop` (the stop string that ended it, when one did),
`kept_tokens` and `kept_generated_tokens` (what its cache held at its end, mean over layers and KV heads; after a
stop string, at the end of the decode call that found it), `prefill_s`, `decode_s`, `logprobs` when asked, and,
after the id, `sample` (0..n-1) for a request of n > 1 samples: one line per sample. Resume: the ids (and samples)
already in the output are skipped; a line cut short by a kill is dropped first (`kvjax.run` checks first that
the output's answers were made under its settings: `kvjax.engine.run_record`).

A JSONL file whose first non-blank line has a `custom_id` is read in OpenAI's batch format instead, and its output
written in it (`kvjax.engine.openai_batch`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from kvjax.chat import ChatTemplateError, has_chat_template, use_chat_template, user_turn
from kvjax.engine import openai_batch, stops
from kvjax.engine.request import Completion, Request
from kvjax.errors import KvjaxError
from kvjax.validation import is_seed

FIELDS = ("id", "prompt", "messages", "question", "max_new_tokens", "temperature", "top_p", "seed", "stop_ids",
          "stop", "logprobs", "samples")


class JobError(KvjaxError):
    """Bad input, one line naming the file and line."""


@dataclasses.dataclass(frozen=True)
class Defaults:
    """Settings of requests that do not give their own."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    logprobs: bool = False
    samples: int = 1
    stop: tuple[str, ...] = ()


class PromptEncoder:
    """Text -> ids: the tokenizer's chat template around a prompt (`chat_template` "auto": when the tokenizer has
    one), else the prompt with the tokenizer's special tokens. A question goes in the same user turn after the
    prompt, as the eval lays out context and question (`kvjax.eval.runner.PromptEncoder`)."""

    def __init__(self, tokenizer: Any, chat_template: str = "auto"):
        self.tokenizer = tokenizer
        self.template = use_chat_template(tokenizer, chat_template)
        self._no_template_reason = ("--chat_template=no turns the chat template off" if has_chat_template(tokenizer)
                                    else "this model's tokenizer has no chat template (a pretrained, not an "
                                         "instruction-tuned, model); give the text as 'prompt'")
        self._turn: tuple[str, str] | ChatTemplateError | None = None  # the user turn's layout, rendered once

    def _render(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=False)
        except Exception as e:  # noqa: BLE001 (the template's own error: jinja2's, raised by the file's messages)
            raise ValueError(f"the tokenizer's chat template refused these messages ({type(e).__name__}: {e})") \
                from None

    def _user_turn(self) -> tuple[str, str]:
        """The chat template's text around a prompt (`kvjax.chat.user_turn`); a template that cannot lay out a lone
        user message refuses every 'prompt' line, while 'messages' lines may still render."""
        if self._turn is None:
            try:
                self._turn = user_turn(self.tokenizer)
            except ChatTemplateError as e:
                self._turn = e
        if isinstance(self._turn, ChatTemplateError):
            raise ValueError(f"{self._turn}: give the prompt as 'messages', or turn the template off with "
                             "--chat_template=no")
        return self._turn

    def encode(self, prompt: str | None, messages: list | None, question: str | None) -> tuple[list[int], list[int]]:
        """(prompt ids, question ids)."""
        encode = self.tokenizer.encode
        if messages is not None:
            if not self.template:
                raise ValueError(f"'messages' needs a chat template, and {self._no_template_reason}")
            if question:
                raise ValueError("'question' goes with 'prompt', not with 'messages'")
            return encode(self._render(messages), add_special_tokens=False), []
        if not self.template:
            return encode(prompt, add_special_tokens=True), (encode(question, add_special_tokens=False)
                                                             if question else [])
        before, after = self._user_turn()
        if question:
            return encode(before + prompt, add_special_tokens=False), encode(question + after,
                                                                            add_special_tokens=False)
        return encode(before + prompt + after, add_special_tokens=False), []

    def encode_text(self, prompt: str) -> list[int]:
        """A prompt as it is, without the chat template (an OpenAI completions request)."""
        return self.tokenizer.encode(prompt, add_special_tokens=True)


# The settings a line may give and a flag may default: (types, test, what a good value is).
_SETTINGS: dict[str, tuple[type | tuple, Callable[[Any], bool], str]] = {
    "max_new_tokens": (int, lambda v: v >= 1, "an integer >= 1"),
    "temperature": ((int, float), lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
    "top_p": ((int, float), lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "seed": (int, is_seed, "an integer in [0, 2**32)"),
    "logprobs": (bool, lambda v: True, "true or false"),
    "samples": (int, lambda v: v >= 1, "an integer >= 1"),
}


def _problem(value: Any, kind: type | tuple, test: Callable[[Any], bool], want: str) -> str | None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds) or not test(value):
        return f"must be {want}, got {value!r}"
    return None


def setting_problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` for the request setting `name` ("must be ..., got ..."), or None when it is good:
    one rule for the job file's fields and for `kvjax.run`'s flags that default them."""
    return _problem(value, *_SETTINGS[name])


def _typed(line: str, value: Any, name: str, kind: type | tuple, test: Callable[[Any], bool], want: str) -> None:
    problem = _problem(value, kind, test, want)
    if problem:
        raise JobError(f"{line}: {name} {problem}")


def _record(line: str, obj: Any) -> dict:
    if not isinstance(obj, dict):
        raise JobError(f"{line}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise JobError(f"{line}: unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    if "id" not in obj:
        raise JobError(f"{line}: no 'id'")
    _typed(line, obj["id"], "id", (str, int), lambda v: v != "", "a non-empty string or an integer")
    if ("prompt" in obj) == ("messages" in obj):
        raise JobError(f"{line}: give exactly one of 'prompt' and 'messages'")
    if "prompt" in obj:
        _typed(line, obj["prompt"], "prompt", str, lambda v: True, "text")
    if "messages" in obj:
        ok = isinstance(obj["messages"], list) and obj["messages"] and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in obj["messages"])
        if not ok:
            raise JobError(f"{line}: messages must be a non-empty list of {{\"role\": ..., \"content\": ...}}")
    if "question" in obj:
        _typed(line, obj["question"], "question", str, lambda v: True, "text")
    for name, rule in _SETTINGS.items():
        if name in obj:
            _typed(line, obj[name], name, *rule)
    if "stop_ids" in obj:
        _typed(line, obj["stop_ids"], "stop_ids", list,
               lambda v: all(isinstance(t, int) and not isinstance(t, bool) for t in v), "a list of token ids")
    if "stop" in obj:
        _typed(line, obj["stop"], "stop", (str, list), lambda v: isinstance(v, str) or all(
            isinstance(s, str) for s in v), "a string or a list of strings")
    return obj


def _stops(value: str | list[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def is_jsonl(path: str) -> bool:
    """Whether the input is read as JSONL (else as one prompt per line): a `.jsonl` or `.json` name, in any case."""
    return path.lower().endswith((".jsonl", ".json"))


@dataclasses.dataclass
class Job:
    """A checked input file: its requests, and for an OpenAI batch file each request's endpoint ("chat" or
    "completions", by id; empty for kvjax's own format)."""

    requests: list[Request]
    endpoints: dict[Any, str]

    @property
    def openai(self) -> bool:
        return bool(self.endpoints)

    def writer(self, tokenizer: Any, model: str) -> Callable[[Completion], list[dict]]:
        """Answer -> the output lines it completes: one per answer in kvjax's format; one per request, once its
        last sample finishes, in OpenAI's."""
        if self.openai:
            return openai_batch.Writer(self.requests, self.endpoints, tokenizer, model).add
        return lambda done: [output_record(done, tokenizer)]


def _line(where: str, text: str, openai: bool | None) -> tuple[dict, str | None]:
    """One JSONL line checked: (the job's fields, the OpenAI endpoint or None); `openai` is the file's format (None
    on its first non-blank line, which decides it)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise JobError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    batch = openai_batch.is_batch_line(obj)
    if openai is not None and batch != openai:
        raise JobError(f"{where}: {'an OpenAI batch line (custom_id)' if batch else 'a line without custom_id'} in "
                       f"{'an OpenAI batch file' if openai else 'a kvjax job file'}; the first non-blank line sets the "
                       "format")
    if not batch:
        return _record(where, obj), None
    try:
        fields, endpoint = openai_batch.translate(obj, setting_problem)
    except openai_batch.LineError as e:
        raise JobError(f"{where}: {e}") from None
    return _record(where, fields), endpoint


def read_job(path: str, encoder: PromptEncoder, defaults: Defaults, check: Callable[[Request], None]) -> Job:
    """Every request of the file, each checked (`check`: the engine's, or a stand-in before the engine exists); the
    first bad line raises a `JobError` naming it."""
    jsonl = is_jsonl(path)
    try:
        with open(path, encoding="utf-8-sig") as f:  # universal newlines: \r\n and \r read as \n
            lines = f.read().split("\n")  # not splitlines(), which also breaks at U+2028, U+0085, \f, \v...
    except (OSError, UnicodeDecodeError) as e:
        raise JobError(f"cannot read the input {path!r}: {e}") from None
    out: list[Request] = []
    endpoints: dict[Any, str] = {}
    openai: bool | None = None
    seen: dict[Any, int] = {}
    for number, text in enumerate(lines, 1):
        where = f"{path}:{number}"
        endpoint = None
        if not text.strip():
            continue
        if jsonl:
            obj, endpoint = _line(where, text, openai)
            openai = endpoint is not None
        else:
            obj = {"id": number, "prompt": text}
        if obj["id"] in seen:
            raise JobError(f"{where}: duplicate id {obj['id']!r} (first on line {seen[obj['id']]})")
        seen[obj["id"]] = number
        if "prompt" in obj and not obj["prompt"].strip():
            raise JobError(f"{where}: empty prompt")
        try:
            if endpoint == "completions":
                tokens, question = encoder.encode_text(obj["prompt"]), []
            else:
                tokens, question = encoder.encode(obj.get("prompt"), obj.get("messages"), obj.get("question"))
        except (ValueError, TypeError) as e:
            raise JobError(f"{where}: {e}") from None
        if not tokens:
            raise JobError(f"{where}: empty prompt")
        request = Request(
            id=obj["id"], tokens=tuple(tokens), question=tuple(question),
            max_new_tokens=obj.get("max_new_tokens", defaults.max_new_tokens),
            temperature=obj.get("temperature", defaults.temperature), top_p=obj.get("top_p", defaults.top_p),
            seed=obj.get("seed", defaults.seed), stop_ids=tuple(obj.get("stop_ids", ())),
            logprobs=obj.get("logprobs", defaults.logprobs), samples=obj.get("samples", defaults.samples),
            stop=_stops(obj["stop"]) if "stop" in obj else defaults.stop,
        )
        try:
            check(request)
        except KvjaxError as e:
            message = str(e).removeprefix(f"request {request.id!r}: ")
            if endpoint is not None and any(name in message for name in ("samples", "new token", "max_new_tokens")):
                message += " (in an OpenAI line, body.n gives samples, body.max_tokens the new tokens)"
            raise JobError(f"{where}: {message}") from None
        out.append(request)
        if endpoint is not None:
            endpoints[request.id] = endpoint
    if not out:
        raise JobError(f"{path}: no prompts")
    return Job(out, endpoints)


def resume(path: str, requests: list[Request], *, openai: str | None = None) -> set:
    """The answers already finished in the output file `path`, as `(id, sample)` pairs (sample None for a request
    of one sample; none when the file does not exist); `openai`: the output is in OpenAI's batch format, a line
    holding every sample of its request, written by the model named so. A last line cut short by a kill is removed
    from the file; a complete line that is not a record, or an answer the input does not ask for (an unknown id, a
    sample index outside the request's `samples`, a prompt of another length, another model's OpenAI line),
    raises, the file left unchanged."""
    if not os.path.exists(path):
        return set()
    if os.path.isdir(path):
        raise JobError(f"the output {path!r} is a directory")
    with open(path, "rb") as f:
        data = f.read()
    keep = data.rfind(b"\n") + 1
    samples = {r.id: r.samples for r in requests}
    lengths = {r.id: r.sequence for r in requests}
    done: set = set()
    for number, raw in enumerate(data[:keep].splitlines(), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            rid = record["custom_id"] if openai else record["id"]
            hash(rid)  # an id is a string or an integer; a list or an object is no record's (TypeError)
            sample = None if openai else record.get("sample")
            body = record["response"]["body"] if openai else record
            prompt_tokens = body["usage"]["prompt_tokens"] if openai else record["prompt_tokens"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise JobError(f"{path}:{number}: not an output record{' of an OpenAI batch' if openai else ''}; move "
                           "the file away to start over") from None
        if rid not in samples:
            raise JobError(f"{path}:{number}: id {rid!r} is not in the input (another job's output?)")
        if prompt_tokens != lengths[rid]:
            raise JobError(f"{path}:{number}: id {rid!r} was answered for a prompt of {prompt_tokens} tokens; the "
                           f"input's has {lengths[rid]} (another job's output?)")
        if openai and body.get("model") != openai:
            raise JobError(f"{path}:{number}: id {rid!r} was answered by model {body.get('model')!r}, not "
                           f"{openai!r} (another job's output?)")
        asked = samples[rid]
        if openai:
            try:
                done.update(openai_batch.answers(record, asked))
            except (openai_batch.LineError, KeyError, TypeError) as e:
                raise JobError(f"{path}:{number}: {e} (another job's output?)") from None
            continue
        if (sample is None) != (asked == 1) or (sample is not None and sample not in range(asked)):
            got = "no sample index" if sample is None else f"sample {sample!r}"
            raise JobError(f"{path}:{number}: {got} for id {rid!r}, whose request asks for samples={asked} "
                           "(another job's output?)")
        done.add((rid, sample))
    if keep < len(data):  # a torn last line (the record was not finished when the process died), cut once every
        with open(path, "r+b") as f:  # complete line is a record: a file that is not this job's stays as it is
            f.truncate(keep)
    return done


def remaining(requests: list[Request], done: set) -> list[Request]:
    """The requests with answers still to give: a request of several samples keeps only its missing ones."""
    by_id: dict[Any, set] = {}
    for rid, sample in done:
        by_id.setdefault(rid, set()).add(sample)
    out = []
    for request in requests:
        have = by_id.get(request.id, set())  # `resume` held a one-sample request's answer to {None}
        if not have:
            out.append(request)
        elif len(have) < request.sample_count:
            missing = tuple(i for i in request.sample_indices if i not in have)
            out.append(dataclasses.replace(request, samples=missing))
    return out


def output_record(done: Completion, tokenizer: Any) -> dict:
    """The output line of a completion."""
    record: dict[str, Any] = {"id": done.id}
    if done.sample is not None:
        record["sample"] = done.sample
    record |= {
        "text": stops.cut(tokenizer.decode(done.tokens, skip_special_tokens=True), done.stop),
        "tokens": done.tokens, "prompt_tokens": done.prompt_tokens, "generated_tokens": len(done.tokens),
        "finish_reason": done.finish_reason,
    }
    if done.stop is not None:
        record["stop"] = done.stop
    record |= {
        "kept_tokens": round(done.kept_tokens, 3),
        "kept_generated_tokens": round(done.kept_generated_tokens, 3), "prefill_s": round(done.prefill_s, 4),
        "decode_s": round(done.decode_s, 4),
    }
    if done.logprobs is not None:
        record["logprobs"] = done.logprobs
    return record
