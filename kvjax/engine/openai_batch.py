"""OpenAI's batch file format for `kvjax.run`: request lines read into the job's own fields, answers written back as
the batch API's output lines.

A request line: `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" or "/v1/completions",
"body": {...}}`. A chat body gives `messages` (rendered with the tokenizer's chat template; a message's content is
text, or a list of text parts joined by newlines; `name` is handed to the template); a completions body gives
`prompt`, one string, tokenized as it is (no chat template, whatever `--chat_template` says). The body's settings
map onto the job's:

| body | job field |
|---|---|
| `max_tokens` / `max_completion_tokens` | `max_new_tokens` |
| `temperature`, `top_p`, `seed`, `stop` | the same names |
| `n` | `samples` (the n choices of one line come from one prefill) |
| `logprobs` (chat: true; completions: 0) | `logprobs` (the chosen tokens' log-probabilities) |

A setting a body leaves out takes the job's default (the `kvjax.run` flag), not the OpenAI server's (whose
temperature is 1 and answer length unbounded), and so does a setting given as null. `model`, `user` and `metadata`
are read and ignored: the job runs `--model`. Anything kvjax would not do as asked is refused, naming it: streaming,
top log-probabilities, a penalty or logit bias, a tool, a response format, a non-text content part, a list of
prompts.

An output line: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}`, the body
a `chat.completion` or `text_completion` object with its n `choices` (`message` or `text`, `finish_reason`,
`logprobs`), `usage` and, per choice, kvjax's own figures under `kvjax` (`tokens`, `stop`, `kept_tokens`,
`kept_generated_tokens`, `prefill_s`, `decode_s`). A line is written once its request's last choice finishes.
A log-probability's token is the text it adds to the answer (`token_pieces`), so the tokens join into the text.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from kvjax.engine import stops
from kvjax.engine.request import Completion, Request

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
LINE_FIELDS = ("custom_id", "method", "url", "body")
IGNORED = ("model", "user", "metadata")
# A body field kvjax takes when it holds the value that changes nothing: (the neutral value's test, what it is).
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (lambda v: v is False, "false (a batch job writes whole answers)"),
    "frequency_penalty": (lambda v: v == 0 and not isinstance(v, bool), "0 (kvjax applies no penalty)"),
    "presence_penalty": (lambda v: v == 0 and not isinstance(v, bool), "0 (kvjax applies no penalty)"),
    "logit_bias": (lambda v: v == {}, "{} (kvjax applies no bias)"),
    "top_logprobs": (lambda v: v == 0 and not isinstance(v, bool),
                     "0 (kvjax gives the chosen tokens' log-probabilities only)"),
}
SETTINGS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
            "top_p": "top_p", "seed": "seed", "n": "samples"}
BODY = {
    "chat": ("messages", "logprobs", "stop", *SETTINGS, *NEUTRAL, *IGNORED),
    "completions": ("prompt", "logprobs", "stop", *SETTINGS, *NEUTRAL, *IGNORED),
}


class LineError(ValueError):
    """A request line that is not one kvjax runs; the message names the field."""


def is_batch_line(obj: Any) -> bool:
    """Whether a JSON line is in OpenAI's batch format (it has a `custom_id`)."""
    return isinstance(obj, dict) and "custom_id" in obj


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise LineError(f"{where}[{i}] is a {kind!r} part; kvjax reads text parts only")
            texts.append(part["text"])
        return "\n".join(texts)
    raise LineError(f"{where} must be text or a list of text parts, got {content!r}")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise LineError("body.messages must be a non-empty list of {\"role\": ..., \"content\": ...}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise LineError(f"body.messages[{i}] must be an object with a string role and a content")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise LineError(f"body.messages[{i}] has {extra[0]!r}; kvjax reads role, content and name (tool calls "
                            "and the like are not run)")
        if "name" in message and not isinstance(message["name"], str):
            raise LineError(f"body.messages[{i}].name must be a string, got {message['name']!r}")
        out.append({**message, "content": _content(f"body.messages[{i}].content", message["content"])})
    return out


def translate(obj: dict, setting_problem: Callable[[str, Any], str | None]) -> tuple[dict, str]:
    """(the job's fields, the endpoint: "chat" or "completions") of one request line; raises `LineError` naming the
    field (as `body.max_tokens`) and what a good value is, `setting_problem` judging the settings as the job's own."""
    unknown = sorted(set(obj) - set(LINE_FIELDS))
    if unknown:
        raise LineError(f"unknown field {unknown[0]!r} of a batch line (fields: {', '.join(LINE_FIELDS)})")
    rid = obj["custom_id"]
    if not isinstance(rid, str) or not rid:
        raise LineError(f"custom_id must be a non-empty string, got {rid!r}")
    if obj.get("method", "POST") != "POST":
        raise LineError(f"method must be \"POST\", got {obj['method']!r}")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineError(f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    endpoint = ENDPOINTS[url]
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(f"body must be an object, got {body!r}")
    body = {k: v for k, v in body.items() if v is not None}  # null: the default, as OpenAI's API reads it
    unknown = sorted(set(body) - set(BODY[endpoint]))
    if unknown:
        raise LineError(f"body.{unknown[0]} is not run by kvjax (a {url} body may give: "
                        f"{', '.join(sorted(BODY[endpoint]))})")
    for name, (neutral, want) in NEUTRAL.items():
        if name in body and not neutral(body[name]):
            raise LineError(f"body.{name} must be {want}, got {body[name]!r}")
    fields: dict[str, Any] = {"id": rid}
    if endpoint == "chat":
        fields["messages"] = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise LineError(f"body.prompt must be one string (one request per line), got {prompt!r}")
        fields["prompt"] = prompt
    if "max_tokens" in body and "max_completion_tokens" in body and \
            body["max_tokens"] != body["max_completion_tokens"]:
        raise LineError(f"body.max_tokens={body['max_tokens']!r} and body.max_completion_tokens="
                        f"{body['max_completion_tokens']!r} disagree")
    for name, field in SETTINGS.items():
        if name in body:
            problem = setting_problem(field, body[name])
            if problem:
                raise LineError(f"body.{name} {problem}")
            fields[field] = body[name]
    if "stop" in body:
        stop = body["stop"]
        stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
        problem = stops.stop_problem(stop, "body.stop")
        if problem:
            raise LineError(problem if isinstance(stop, tuple) else
                            f"body.stop must be a string or a list of strings, got {stop!r}")
        fields["stop"] = list(stop)
    if "logprobs" in body:
        asked = body["logprobs"]
        if endpoint == "chat" and not isinstance(asked, bool):
            raise LineError(f"body.logprobs must be true or false, got {asked!r}")
        if endpoint == "completions" and (isinstance(asked, bool) or asked != 0):
            raise LineError(f"body.logprobs must be 0 (the chosen tokens' log-probabilities; kvjax computes no top "
                            f"alternatives) or null, got {asked!r}")
        fields["logprobs"] = asked is True or endpoint == "completions"
    return fields, endpoint


#: Tokens decoded before a token to find its text: enough for a tokenizer's spacing rules and a character's bytes.
PIECE_CONTEXT = 8


def token_pieces(tokenizer: Any, tokens: list[int]) -> list[str]:
    """Each token's text, such that the pieces join into the decoded answer: the text a token adds to the decoding of
    the `PIECE_CONTEXT` tokens before it (decoding a token alone loses a SentencePiece token's leading space and
    splits a character across byte-level tokens). A token that ends inside a character gives "", the token that
    completes the character gives all of it."""
    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")  # an unfinished character

    pieces = []
    for i in range(len(tokens)):
        start = max(0, i - PIECE_CONTEXT)
        before, after = text(tokens[start:i]), tokenizer.decode(tokens[start:i + 1], skip_special_tokens=True)
        if i + 1 < len(tokens):
            after = after.rstrip("\ufffd")
        pieces.append(after[len(os.path.commonprefix([before, after])):])
    return pieces


class Writer:
    """Answers -> output lines: a request's choices gathered until its last one finishes, then one line."""

    def __init__(self, requests: list[Request], endpoints: dict[Any, str], tokenizer: Any, model: str):
        self.requests = {r.id: r for r in requests}
        self.endpoints, self.tokenizer, self.model = endpoints, tokenizer, model
        self.pending: dict[Any, list[Completion]] = {}

    def add(self, done: Completion) -> list[dict]:
        """The lines complete with this answer (none while the request has choices still running)."""
        request = self.requests[done.id]
        gathered = self.pending.setdefault(done.id, [])
        gathered.append(done)
        if len(gathered) < request.sample_count:
            return []
        del self.pending[done.id]
        return [self.line(sorted(gathered, key=lambda c: c.sample or 0))]

    def _choice(self, done: Completion, chat: bool) -> dict:
        text = stops.cut(self.tokenizer.decode(done.tokens, skip_special_tokens=True), done.stop)
        logprobs = None
        if done.logprobs is not None:
            pieces = token_pieces(self.tokenizer, done.tokens)
            if chat:
                logprobs = {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                                        for p, lp in zip(pieces, done.logprobs, strict=True)]}
            else:
                offsets = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
                logprobs = {"tokens": pieces, "token_logprobs": done.logprobs, "top_logprobs": None,
                            "text_offset": offsets}
        choice: dict[str, Any] = {"index": done.sample or 0}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        choice |= {"logprobs": logprobs, "finish_reason": done.finish_reason, "kvjax": {
            "tokens": done.tokens, "stop": done.stop, "kept_tokens": round(done.kept_tokens, 3),
            "kept_generated_tokens": round(done.kept_generated_tokens, 3), "prefill_s": round(done.prefill_s, 4),
            "decode_s": round(done.decode_s, 4)}}
        return choice

    def line(self, choices: list[Completion]) -> dict:
        """The output line of a request's finished choices."""
        rid = choices[0].id
        chat = self.endpoints[rid] == "chat"
        generated = sum(len(c.tokens) for c in choices)
        body = {
            "id": f"kvjax-{rid}", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model,
            "choices": [self._choice(c, chat) for c in choices],
            "usage": {"prompt_tokens": choices[0].prompt_tokens, "completion_tokens": generated,
                      "total_tokens": choices[0].prompt_tokens + generated},
        }
        return {"id": f"kvjax_req_{rid}", "custom_id": rid,
                "response": {"status_code": 200, "request_id": f"kvjax-{rid}", "body": body}, "error": None}


def answers(record: dict, samples: int) -> list[tuple[Any, int | None]]:
    """The `(id, sample)` answers an output line holds (every choice of its request); raises `LineError` for a line
    whose choices do not match a request of `samples` samples."""
    choices = record["response"]["body"]["choices"]
    indices = sorted(c["index"] for c in choices)
    if indices != list(range(samples)):
        raise LineError(f"choices {indices} for custom_id {record['custom_id']!r}, whose request asks for n={samples}")
    return [(record["custom_id"], None)] if samples == 1 else [(record["custom_id"], i) for i in indices]
