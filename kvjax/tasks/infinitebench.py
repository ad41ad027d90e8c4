"""InfiniteBench (Zhang et al., 2024) from local JSONL files in the published format.

``infinitebench/<task>`` reads ``<data_dir>/<task>.jsonl``; rows have ``id``, ``context``, ``input``,
``answer`` and ``options``. Supported tasks (those the ActQKV paper runs): passkey, number_string,
kv_retrieval, code_debug, math_find, longbook_choice_eng.

Prompts are the benchmark's generic templates (its model-specific variants are not reproduced); the
context is cut in the middle to fit ``context_length - max_new_tokens`` tokens (``max_prompt_tokens``
overrides). A row whose answer the rules below cannot compare (none, an empty string, a math_find answer that
is no number) is refused when the file is read. Generation lengths and scoring follow the official rules:

* passkey, number_string: the first run of digits in the prediction equals the answer;
* kv_retrieval: the answer is one of the prediction's words after ``\\n : " ' . , ? ! { }`` become spaces
  (a one-element answer list is unwrapped first, as for the other tasks);
* math_find: the first number (``\\d+\\.\\d+|\\d+``) equals the answer, compared as int or float like the
  answer's JSON type (a decimal against an integer answer counts as wrong);
* code_debug: the stripped prediction starts with "<letter>." / "<letter>:", or the text after the first
  of "answer is:", "is:", "answer:" found starts with the letter or the function name (a bare "B" scores
  0, as upstream);
* longbook_choice_eng: the first character is a letter in the label, or the prediction is the answer, or
  the text after "answer is:", "answer:", "answer is" or "option is" starts with the answer or letter, or
  the first standalone A-D word is the letter.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

from kvjax.errors import ConfigError
from kvjax.tasks.base import (
    BaseTask,
    CountTokens,
    DataError,
    Sample,
    as_answers,
    check_length,
    read_jsonl,
    require_file,
)
from kvjax.tasks.longbench import fit_context, row_text, split_template

__all__ = ["INFINITEBENCH_TASKS", "InfiniteBenchTask", "score_infinitebench"]

_HIDDEN = (
    "There is an important info hidden inside a lot of irrelevant text. Find it{what}. I will quiz "
    "you about the important information there.\n\n{{context}}\n\n{{input}}"
)
_OPTIONS = "A. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}"

TEMPLATES: dict[str, str] = {
    "passkey": _HIDDEN.format(what=" and memorize them"),
    "number_string": _HIDDEN.format(what=""),
    "kv_retrieval": (
        "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}"
    ),
    "code_debug": (
        "There is ONLY ONE function in the large project that is deliberately made to include an "
        "obvious error. Please find the function that contains the most obvious errors. I will give "
        "you four options to narrow your scope. You can inspect the options and think. Eventually, "
        "tell me the answer using one single letter (A, B, C, or D).\n\n{context}\n\nWhich funtion "
        "has deliberate error?\n" + _OPTIONS + "\n\nYou should first find the functions in the "
        "options. Repeat their content, inspect through code, and at last give me your answer for "
        "the function that has the deliberate and obvious error in A, B, C, or D."
    ),
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "longbook_choice_eng": (
        "Read the book and answer the question.\n\n{context}\n\nQuestion: {input}\n\nOnly one of "
        "the following options is correct, tell me the answer using one single letter (A, B, C, or "
        "D). Don't say anything else.\n" + _OPTIONS
    ),
}

MAX_NEW_TOKENS: dict[str, int] = {
    "passkey": 6,
    "number_string": 12,
    "kv_retrieval": 50,
    "code_debug": 5,
    "math_find": 3,
    "longbook_choice_eng": 40,
}

TASKS = tuple(TEMPLATES)
REQUIRED_FIELDS = ("context", "input", "answer")
_LETTERS = "ABCD"


def _first_int(text: str) -> str:
    for piece in re.split(r"[^0-9]", text):
        if piece:
            return piece
    return ""


def _label(task: str, row: dict[str, Any], where: str) -> list[Any]:
    """The official label: a one-element list, or ``[answer_text, letter]`` for multiple choice."""
    answer = row["answer"]
    if task not in ("code_debug", "longbook_choice_eng"):
        label = list(answer) if isinstance(answer, list) else [answer]
        first = label[0] if label else None
        if isinstance(first, bool) or not isinstance(first, str | int | float) or not str(first).strip():
            raise DataError(f"{where}: answer {answer!r} holds no answer (a string or a number)")
        if task == "math_find" and _math_value(first) is None:
            raise DataError(f"{where}: math_find's answer {answer!r} is not a number")
        return label
    options = row.get("options") or []
    if isinstance(answer, list) and len(answer) == 2 and answer[1] in _LETTERS:
        return list(answer)
    text = answer[0] if isinstance(answer, list) and answer else answer
    if isinstance(text, str) and text in options:
        return [text, _LETTERS[options.index(text)]]
    if isinstance(text, str) and len(text) == 1 and text in _LETTERS:
        idx = _LETTERS.index(text)
        return [options[idx] if idx < len(options) else text, text]
    raise DataError(f"{where}: answer {answer!r} is not one of the options {options!r}")


def _math_value(value: Any) -> int | float | None:
    """math_find's answer as the number it is compared with: an int or a float (JSON's type, or a string's
    spelling of one); None when it is no number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return value
    if isinstance(value, str):
        for cast in (int, float):
            try:
                return cast(value)
            except ValueError:
                pass
    return None


def score_infinitebench(task: str, prediction: str, label: list[Any]) -> float:
    """InfiniteBench's official per-sample score (1.0 or 0.0) for ``task``."""
    if task in ("passkey", "number_string"):
        return float(str(label[0]) == _first_int(prediction))
    if task == "kv_retrieval":
        pred = prediction
        for c in "\n:\"'.,?!{}":
            pred = pred.replace(c, " ")
        return float(str(label[0]) in pred.split())
    if task == "math_find":
        value = _math_value(label[0])
        if value is None:
            raise DataError(f"math_find's answer {label[0]!r} is not a number")
        m = re.search(r"\d+\.\d+|\d+", prediction)
        if m is None:
            return 0.0
        found = m.group(0)
        if isinstance(value, int):
            return float(found.isdigit() and int(found) == value)
        return float(float(found) == value)
    if task == "code_debug":
        return float(_code_debug(prediction, label))
    if task == "longbook_choice_eng":
        return float(_choice(prediction, label))
    raise ConfigError(f"unknown InfiniteBench task {task!r}")


def _squeeze(text: str, chars: str | tuple[str, ...]) -> str:
    for c in chars:
        text = text.replace(c, " ")
    while "  " in text:
        text = text.replace("  ", " ")
    return text


def _code_debug(prediction: str, label: list[Any]) -> bool:
    pred = prediction.strip()
    fn_name, letter = str(label[0]), str(label[1])
    if pred[:2] in (f"{letter}.", f"{letter}:"):
        return True
    pred = _squeeze(pred, ("\n", "`", "'", '"', "-", "*", "Option", "option"))
    for prefix in ("answer is:", "is:", "answer:", "correct option is:"):
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return False
        rest = pred[idx + len(prefix) + 1 :]
        return rest.startswith(letter) or rest.startswith(fn_name)
    return False


def _choice(prediction: str, label: list[Any]) -> bool:
    labels = [str(x) for x in label]
    pred = prediction.strip()
    if not pred:
        return False
    if pred[0] in _LETTERS:
        return pred[0] in labels
    if pred in labels:
        return True
    pred = _squeeze(pred, "\n\"'.,?!{}")
    for prefix in ("answer is:", "answer:", "answer is", "option is"):
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return False
        rest = pred[idx + len(prefix) + 1 :]
        return any(rest.startswith(s) for s in labels)
    for word in pred.split():
        if word in _LETTERS:
            return word in labels
    return False


def _math_prefix(question: str) -> str:
    """ "What is <the target> in the following list?" from "The <target> of ..." in the question."""
    found = re.findall(r"The .+ of", question)
    if not found:
        return ""
    return f"What is {found[0].lower()[:-3]} in the following list?"


class InfiniteBenchTask(BaseTask):
    """One InfiniteBench task (see the module docstring)."""

    options = {"max_prompt_tokens": None}
    reads_data = True

    def __init__(self, name: str, *, task: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        if task not in TEMPLATES:
            raise ConfigError(f"unsupported InfiniteBench task {task!r}; supported: {list(TASKS)}")
        self.task = task
        self.max_new_tokens = MAX_NEW_TOKENS[task]
        self.metric = "accuracy"

    def _template(self, row: dict[str, Any], where: str) -> str:
        template = TEMPLATES[self.task]
        if "{OPTION_A}" in template:
            options = row.get("options") or []
            if len(options) != 4:
                raise DataError(f"{where}: expected 4 options, got {options!r}")
            for letter, opt in zip(_LETTERS, options, strict=True):
                template = template.replace(f"{{OPTION_{letter}}}", str(opt))
        if "{prefix}" in template:
            template = template.replace("{prefix}", _math_prefix(row_text(row, "input", where)))
        return template

    def samples(
        self,
        *,
        count_tokens: CountTokens,
        context_length: int,
        num_samples: int,
        seed: int = 0,
        data_dir: str | None = None,
    ) -> list[Sample]:
        check_length(context_length, num_samples)
        budget = self.prompt_budget(context_length)
        path = require_file(data_dir, (f"{self.task}.jsonl",), self.name)
        rows = read_jsonl(
            path,
            required=REQUIRED_FIELDS,
            skip_malformed=self.skip_malformed,
            limit=num_samples if num_samples > 0 else None,
            id_field="id",
        )
        out = []
        for n, row in enumerate(rows):
            rid = str(row.get("id", n))
            where = f"{path} (id {rid})"
            label = _label(self.task, row, where)
            prefix, question = split_template(self._template(row, where), row_text(row, "input", where))
            context, tokens, truncated = fit_context(
                prefix,
                row_text(row, "context", where),
                question,
                int(budget),
                count_tokens=count_tokens,
                tokenizer=self.tokenizer,
                what=f"{self.name} id {rid}",
            )
            out.append(
                Sample(
                    id=rid,
                    prefix=prefix,
                    context=context,
                    question=question,
                    answers=as_answers(label, where),
                    max_new_tokens=self.max_new_tokens,
                    metric=self.metric,
                    metadata={
                        "task": self.name,
                        "label": label,
                        "options": list(row.get("options") or []),
                        "num_tokens": tokens,
                        "truncated": truncated,
                        "context_length": context_length,
                    },
                )
            )
        return out

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        label = sample.metadata.get("label") or list(sample.answers)
        return {"accuracy": score_infinitebench(self.task, prediction, label)}


#: Registry entries: task name -> factory(**options).
INFINITEBENCH_TASKS: dict[str, Callable[..., BaseTask]] = {
    f"infinitebench/{t}": partial(InfiniteBenchTask, f"infinitebench/{t}", task=t) for t in TASKS
}
