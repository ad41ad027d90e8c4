"""Shared pieces of every evaluation task: ``Sample``, the ``Task`` protocol, prompt splitting, length fitting,
middle truncation and a strict JSONL reader.

Prompt layout. A sample's full prompt is ``prefix + context + question + answer_prefix``:

* ``prefix``: the instruction before the context (e.g. "Some special magic numbers are hidden ...").
* ``context``: the long part a KV-compression method compresses (haystack, documents, book...).
* ``question``: the rendered text after the context (the query, with its separators and "Answer:" cues).
* ``answer_prefix``: text the answer continues (RULER's "The special magic numbers ... are").

``build_prompt`` splits this into the part prefilled (and compressed) first and the part fed afterwards,
for kvpress's query-agnostic (default) and query-aware modes. Lengths are measured on the raw prompt,
without a chat template.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from kvjax.errors import KvjaxError

__all__ = [
    "BaseTask",
    "DataError",
    "LengthError",
    "Sample",
    "Task",
    "build_prompt",
    "default_aggregate",
    "fit_length",
    "fit_sample",
    "full_prompt",
    "read_jsonl",
    "truncate_middle",
]

log = logging.getLogger(__name__)

CountTokens = Callable[[str], int]
T = TypeVar("T")


class DataError(KvjaxError):
    """Benchmark data is missing or malformed (message names the file and line)."""


class LengthError(KvjaxError):
    """A sample cannot be generated at the requested context length."""


@dataclass(frozen=True)
class Sample:
    """One evaluation example, independent of any model.

    ``answers`` are the references the metric compares against; ``metric`` names the primary score in the
    dict ``Task.score`` returns. ``documents`` (multi-document tasks) are the pieces of ``context``, in order,
    so that ``"".join(documents) == context``. ``chat_template`` is False where the benchmark feeds the raw
    prompt even to chat models (LongBench's few-shot and code datasets). ``metadata`` carries what reports
    group by (task, depth, length, num_tokens, ...); it must stay JSON-serialisable.
    """

    id: str
    context: str
    question: str
    answers: tuple[str, ...]
    max_new_tokens: int
    metric: str
    prefix: str = ""
    answer_prefix: str = ""
    documents: tuple[str, ...] = ()
    chat_template: bool = True
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)


def build_prompt(sample: Sample, *, question_in_context: bool) -> tuple[str, str]:
    """Split the prompt into ``(context_part, question_part)``.

    ``question_in_context=False`` (kvpress's default, query-agnostic): the context part is
    ``prefix + context`` and is compressed without seeing the question; the question part
    ``question + answer_prefix`` is fed after compression. ``question_in_context=True`` (query-aware): the
    question is compressed with the context and only ``answer_prefix`` follows.
    """
    if question_in_context:
        return sample.prefix + sample.context + sample.question, sample.answer_prefix
    return sample.prefix + sample.context, sample.question + sample.answer_prefix


def full_prompt(sample: Sample) -> str:
    """The whole prompt as one string (``prefix + context + question + answer_prefix``)."""
    return sample.prefix + sample.context + sample.question + sample.answer_prefix


@runtime_checkable
class Task(Protocol):
    """What the eval CLI needs from a task."""

    name: str

    def samples(
        self,
        *,
        count_tokens: CountTokens,
        context_length: int,
        num_samples: int,
        seed: int,
        data_dir: str | None,
    ) -> list[Sample]:
        """Generate or load ``num_samples`` samples (all of them when ``num_samples <= 0`` for file-based
        tasks) whose prompts fit ``context_length`` tokens including ``max_new_tokens``."""
        ...

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        """Scores in ``[0, 1]``; the key ``sample.metric`` is the primary one."""
        ...

    def build_prompt(self, sample: Sample, *, question_in_context: bool) -> tuple[str, str]:
        """``(context_part, question_part)``, see ``kvjax.tasks.base.build_prompt``."""
        ...

    def aggregate(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Summary (``metrics.json``) of per-sample records written by ``kvjax.eval.results``."""
        ...


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def default_aggregate(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean of every score over the records, times 100; ``score`` is the primary metric's mean.

    A record is a mapping with ``scores`` (name -> float in [0, 1]) and ``metric`` (the primary name).
    """
    keys: list[str] = []
    for r in records:
        for k in r.get("scores", {}):
            if k not in keys:
                keys.append(k)
    means = {k: 100.0 * _mean([float(r["scores"][k]) for r in records if k in r.get("scores", {})]) for k in keys}
    metric = next((str(r["metric"]) for r in records if r.get("metric")), keys[0] if keys else "")
    return {
        "num_samples": len(records),
        "metric": metric,
        "score": means.get(metric, 0.0),
        "scores": means,
    }


class BaseTask:
    """Common behaviour: option checking, prompt splitting, default aggregation.

    Subclasses set ``name`` and implement ``samples`` and ``score``. Options every task accepts (so the CLI
    can pass them uniformly): ``tokenizer`` (an object with ``encode``/``decode``, used for middle
    truncation), ``skip_malformed`` (skip bad JSONL lines with a warning instead of failing) and
    ``haystack_file`` (a local text file used as filler by synthetic tasks).
    """

    name: str = ""
    #: Tokens a sample's answer may take (a subclass sets it, per class or per instance).
    max_new_tokens: int = 0
    #: Whether ``samples`` reads files from ``data_dir`` (then ``data_dir`` is part of a cell's identity).
    reads_data: bool = False
    #: Extra keyword options a subclass accepts, with their defaults.
    options: Mapping[str, Any] = {}

    def __init__(
        self,
        name: str | None = None,
        *,
        tokenizer: Any = None,
        skip_malformed: bool = False,
        haystack_file: str | None = None,
        **options: Any,
    ) -> None:
        if name is not None:
            self.name = name
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            accepted = sorted({"tokenizer", "skip_malformed", "haystack_file", *self.options})
            raise KvjaxError(f"task {self.name!r} got unknown option(s) {unknown}; it accepts {accepted}")
        self.tokenizer = tokenizer
        self.skip_malformed = skip_malformed
        self.haystack_file = haystack_file
        self.opts: dict[str, Any] = {**self.options, **options}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def samples(
        self,
        *,
        count_tokens: CountTokens,
        context_length: int,
        num_samples: int,
        seed: int,
        data_dir: str | None,
    ) -> list[Sample]:
        raise NotImplementedError

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        raise NotImplementedError

    def prompt_budget(self, context_length: int) -> int:
        """The tokens a prompt may take: the ``max_prompt_tokens`` option where the task has it and it is set,
        else what ``context_length`` leaves after ``max_new_tokens``. A LengthError when that is none."""
        asked = self.opts.get("max_prompt_tokens")
        if asked:
            if asked < 0:
                raise LengthError(f"{self.name}: max_prompt_tokens must be > 0, got {asked}")
            return int(asked)
        budget = context_length - self.max_new_tokens
        if budget <= 0:
            raise LengthError(
                f"{self.name}: context_length {context_length} leaves no room for the prompt after "
                f"{self.max_new_tokens} generated tokens"
            )
        return int(budget)

    def build_prompt(self, sample: Sample, *, question_in_context: bool) -> tuple[str, str]:
        return build_prompt(sample, question_in_context=question_in_context)

    def aggregate(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return default_aggregate(records)


def check_length(context_length: int, num_samples: int) -> None:
    """Validate the common ``samples`` arguments."""
    if context_length <= 0:
        raise LengthError(f"context_length must be > 0, got {context_length}")
    if num_samples < 0:
        raise KvjaxError(f"num_samples must be >= 0, got {num_samples}")


# -------------------------------------------------------------------------------------------------
# Length fitting


def fit_sample(
    render: Callable[[int], Sample],
    count_tokens: CountTokens,
    target: int,
    *,
    task: str,
    max_units: int = 50_000_000,
    **metadata: Any,
) -> tuple[int, Sample, int]:
    """`fit_length` for a task prompt (whole prompt measured), then the sample's metadata filled in:
    `task`, `target_tokens`, `num_tokens` and the given extra keys. Returns (units, sample, tokens)."""
    n, sample, tokens = fit_length(
        render, lambda s: count_tokens(full_prompt(s)), target, what=f"{task} prompt", max_units=max_units
    )
    sample.metadata.update(task=task, **metadata, target_tokens=target, num_tokens=tokens)
    return n, sample, tokens


def fit_length(
    render: Callable[[int], T],
    measure: Callable[[T], int],
    target: int,
    *,
    tol: float = 0.02,
    what: str = "prompt",
    max_units: int = 50_000_000,
) -> tuple[int, T, int]:
    """Find the largest filler-unit count ``n`` with ``measure(render(n)) <= target``.

    ``render(n)`` builds the prompt with ``n`` filler units (sentences, words, ...) and ``measure`` counts
    its tokens. It starts from a per-unit estimate and corrects with secant steps on measured counts,
    falling back to bisection, so a long prompt is measured a handful of times rather than once per unit.
    Returns ``(n, rendered, tokens)``; stops early once ``tokens >= (1 - tol) * target``. Token counts
    must be non-decreasing in ``n`` (true for appending filler); ``max_units`` caps ``n`` for finite
    filler, and the result may then be shorter than asked. Raises ``LengthError`` if even ``n = 0``
    exceeds ``target``.
    """
    base = render(0)
    t0 = measure(base)
    if t0 > target:
        raise LengthError(
            f"the {what} needs {t0} tokens without any filler, more than the {target} available; "
            "increase --context_length"
        )
    lower = (1.0 - tol) * target
    if t0 >= lower:
        return 0, base, t0
    lo, lo_obj, t_lo = 0, base, t0  # largest n known to fit
    hi, t_hi = None, None  # smallest n known not to fit
    # Probe a few units for the tokens-per-unit rate.
    probe = 8
    n = probe
    for _ in range(64):
        if hi is not None and hi - lo <= 1:
            break
        obj = render(n)
        t = measure(obj)
        if t <= target:
            rate = (t - t_lo) / (n - lo) if n > lo else 0.0
            lo, lo_obj, t_lo = n, obj, t
            if t >= lower:
                return lo, lo_obj, t_lo
        else:
            rate = (t - t_lo) / (n - lo) if n > lo else 0.0
            hi, t_hi = n, t
        if hi is None:
            if rate <= 0:
                if lo > 8 * target + probe:
                    break  # the filler adds no tokens at all; give up rather than grow forever
                step = max(lo, probe)  # filler measured no tokens yet: grow geometrically
            else:
                step = max(1, int((target - t_lo) / rate))
            n = min(lo + step, max_units)
            if n <= lo:
                break  # out of filler: the caller decides whether the result is long enough
        else:
            assert t_hi is not None
            # Secant between the bracket ends, aiming just under the target, kept strictly inside.
            slope = (t_hi - t_lo) / (hi - lo)
            guess = lo + int((target - t_lo) / slope) if slope > 0 else (lo + hi) // 2
            if not lo < guess < hi:
                guess = (lo + hi) // 2
            n = guess
    return lo, lo_obj, t_lo


# -------------------------------------------------------------------------------------------------
# Truncation


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    try:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))
    except TypeError:
        return str(tokenizer.decode(list(ids)))


def truncate_middle(
    text: str,
    max_tokens: int,
    *,
    tokenizer: Any = None,
    count_tokens: CountTokens | None = None,
) -> str:
    """Cut the middle out of ``text`` so that it fits ``max_tokens`` (LongBench / InfiniteBench style).

    With a ``tokenizer`` (``encode``/``decode``): keep the first and the last ``max_tokens // 2`` tokens and
    decode each half separately, as LongBench does. Otherwise with ``count_tokens``: keep the longest equal
    numbers of leading and trailing characters whose concatenation counts at most ``max_tokens``. Without
    either, tokens are characters.
    """
    if max_tokens <= 0:
        return ""
    if tokenizer is not None:
        ids = _encode(tokenizer, text)
        if len(ids) <= max_tokens:
            return text
        half = max_tokens // 2
        if half == 0:
            return ""
        return _decode(tokenizer, ids[:half]) + _decode(tokenizer, ids[-half:])
    count = count_tokens or len
    total = count(text)
    if total <= max_tokens:
        return text

    def cut(k: int) -> str:
        return text[:k] + text[len(text) - k :] if k > 0 else ""

    # Largest k (chars kept at each end) with count(cut(k)) <= max_tokens; start from the char/token rate.
    lo, hi = 0, len(text) // 2 + 1
    guess = int(len(text) * max_tokens / (2 * total))
    if 0 < guess < hi:
        if count(cut(guess)) <= max_tokens:
            lo = guess
            # Widen the bracket upwards geometrically from the estimate.
            step = max(1, guess // 50)
            while lo + step < hi and count(cut(lo + step)) <= max_tokens:
                lo += step
                step *= 2
            hi = min(hi, lo + step)
        else:
            hi = guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(cut(mid)) <= max_tokens:
            lo = mid
        else:
            hi = mid
    return cut(lo)


# -------------------------------------------------------------------------------------------------
# Data files


def require_file(data_dir: str | None, names: Iterable[str], task: str) -> str:
    """The first of ``names`` that exists under ``data_dir``; a ``DataError`` naming all tried paths if none."""
    names = list(names)
    if not data_dir:
        raise DataError(f"task {task!r} reads local data: pass --data_dir=<dir> containing {' or '.join(names)}")
    if not os.path.isdir(data_dir):
        raise DataError(f"task {task!r}: data_dir {data_dir!r} is not a directory")
    tried = []
    for n in names:
        path = os.path.join(data_dir, n)
        if os.path.isfile(path):
            return path
        tried.append(path)
    raise DataError(f"task {task!r}: no data file found; tried {', '.join(tried)}")


def read_jsonl(
    path: str,
    *,
    required: Sequence[str] = (),
    skip_malformed: bool = False,
    limit: int | None = None,
    id_field: str | None = None,
) -> list[dict[str, Any]]:
    """Read a JSON-lines file of objects, checking each has the ``required`` keys.

    A line that is not a JSON object or lacks a key raises ``DataError("<path>:<line>: ...")``; with
    ``skip_malformed`` it is logged as a warning and skipped. So is a row whose ``id_field`` (where it has
    one) repeats an earlier row's: results and resume are keyed by sample id, so a second sample of one id
    would be run but never counted. Blank lines are ignored. ``limit`` stops after that many good rows.
    """
    rows: list[dict[str, Any]] = []
    first_line: dict[str, int] = {}
    try:
        f = open(path, "rb")  # noqa: SIM115  (bytes: a line that is not UTF-8 is named, not a traceback)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            row, problem = _parse_line(raw, required)
            if row is None and problem is None:  # a blank line
                continue
            if problem is None and id_field is not None and id_field in row:
                sample_id = str(row[id_field])
                if sample_id in first_line:
                    problem = (f"{id_field} {sample_id!r} repeats line {first_line[sample_id]}'s; each row needs "
                               "its own id")
                else:
                    first_line[sample_id] = lineno
            if problem is not None:
                msg = f"{path}:{lineno}: {problem}"
                if not skip_malformed:
                    raise DataError(msg)
                log.warning("skipping malformed line %s", msg)
                continue
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def _parse_line(raw: bytes, required: Sequence[str]) -> tuple[Any, str | None]:
    """One JSON-lines line -> (row, None), (None, None) when blank, or (None, what is wrong)."""
    try:
        line = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
    if not line.strip():
        return None, None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at column {e.colno})"
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {type(row).__name__}"
    if _SURROGATE_ESCAPE.search(raw):  # only a \uD800-\uDFFF escape gives one (raw UTF-8 cannot)
        problem = _lone_surrogate(row)
        if problem is not None:
            return None, problem
    missing = [k for k in required if k not in row]
    return (None, f"missing field(s) {missing}") if missing else (row, None)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(obj: Any, where: str = "a key") -> str | None:
    """What is wrong when a JSON value holds a lone UTF-16 surrogate (``"\\ud800"`` without its pair: valid JSON,
    but no text a tokenizer can encode), naming the top-level field; None when every string is text."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"{where} holds a lone surrogate \\u{ord(obj[e.start]):04x} at character {e.start + 1} (half of a "
                    "UTF-16 pair, not text)")
        return None
    if isinstance(obj, dict):
        for key, value in obj.items():
            problem = _lone_surrogate(key) or _lone_surrogate(value, where if where != "a key" else f"field {key!r}")
            if problem is not None:
                return problem
    elif isinstance(obj, list):
        for value in obj:
            problem = _lone_surrogate(value, where)
            if problem is not None:
                return problem
    return None


def read_json(path: str) -> Any:
    """Load a JSON file, raising ``DataError`` with the path on failure."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            return json.load(f)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None


def as_answers(value: Any, where: str) -> tuple[str, ...]:
    """Normalise an answer field (string, number or list of them) to a tuple of strings; `DataError` naming
    `where` for anything else (an object or a nested list, whose Python text no prediction would match)."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, list | tuple) else [value]
    bad = [v for v in items if not isinstance(v, str | int | float)]
    if bad:
        raise DataError(f"{where}: answers must be strings or numbers (or a list of them), got {_short(bad[0])}")
    return tuple(str(v) for v in items)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
