"""A request to the engine and what it gives back."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from kvjax.engine.stops import stop_problem
from kvjax.errors import KvjaxError
from kvjax.validation import is_int, is_seed


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to complete.

    `tokens`: the prompt's ids; `question`: ids fed after the prompt (uncompressed after a query-agnostic method
    compressed the prompt, or read by a query-aware layout as `kvjax.generate`'s `question_ids` are).
    `max_new_tokens`: this request's limit (at most the engine's); `stop_ids`: ids that end it besides the model's
    EOS; `stop`: strings (or one string) that end it once its text holds one (`kvjax.engine.stops`; the engine
    needs a tokenizer).
    `temperature` 0 is greedy; else temperature and nucleus (`top_p`) sampling from `seed` (the engine must
    be built with `sampling=True`). `logprobs`: return each generated token's log-probability. `samples`: how many
    answers to draw from one prefill of the prompt (an integer n: samples 0..n-1, each in its own slot, all admitted
    together), or which ones (a tuple of sample indices: a resumed job's missing samples). Sample i draws from
    (`seed`, i); sample 0 is the draw a request of one sample makes.
    """

    id: Any
    tokens: tuple[int, ...]
    max_new_tokens: int
    question: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    logprobs: bool = False
    samples: int | tuple[int, ...] = 1
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", _ids(self.tokens))
        if isinstance(self.stop, str) or self.stop is None:  # one string, or none
            object.__setattr__(self, "stop", () if self.stop is None else (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "question", () if self.question is None else _ids(self.question))  # None: none,
        object.__setattr__(self, "stop_ids", () if self.stop_ids is None else _ids(self.stop_ids))  # as `stop`'s
        if isinstance(self.samples, list | tuple):
            object.__setattr__(self, "samples", _ids(self.samples))
        for field in ("max_new_tokens", "seed", "samples"):  # a NumPy integer (a tokenizer's, a sweep's) as an int
            if is_int(getattr(self, field)):
                object.__setattr__(self, field, int(getattr(self, field)))

    @property
    def sequence(self) -> int:
        """Tokens before the first generated one (prompt + question)."""
        return len(self.tokens) + len(self.question)

    @property
    def sample_count(self) -> int:
        """How many answers this request draws (the slots it takes)."""
        return self.samples if isinstance(self.samples, int) else len(self.samples)

    @property
    def sample_indices(self) -> tuple[int, ...]:
        """The samples this request draws (`range(samples)` for an integer)."""
        return tuple(range(self.samples)) if isinstance(self.samples, int) else self.samples


def _ids(values: Any) -> Any:
    """Token ids (or sample indices) as a tuple, NumPy integers (an array's elements) as Python ints; anything
    else, and a value that is no sequence of ids (a number, a string), is kept as it is, for `check_request` to
    refuse by name."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        return values
    return tuple(int(v) if is_int(v) else v for v in values)


@dataclasses.dataclass
class Completion:
    """A finished request: the generated ids (the stop id included, as `generate` counts it, or the token that
    completed a stop string), why it stopped (`"stop"`: a stop / EOS id or a stop string, `"length"`: its
    `max_new_tokens`), the stop string that ended it (`stop`), what its cache kept when it finished (mean over
    layers and KV heads: prompt tokens and generated tokens, as the eval's `kept_tokens` counts them; for an answer
    a stop string ended, at the end of the decode call that found it, so with up to `steps` - 1 tokens decoded past
    its last one), its times
    (`prefill_s`: its prefill's wall time; `decode_s`: from its insertion to its last token) and, if asked, the
    log-probability of each generated token under the model's distribution (float32 log-softmax of the logits,
    before temperature)."""

    id: Any
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    kept_tokens: float
    kept_generated_tokens: float
    prefill_s: float
    decode_s: float
    logprobs: list[float] | None = None
    positions: list | None = None  # with `Engine(keep_positions=True)`: [layer][KV head] sorted kept positions
    sample: int | None = None  # which of the request's samples (None: a request of one sample, `samples=1`)
    stop: str | None = None  # the stop string that ended it (its text is cut where it starts: `stops.cut`)


def check_request(request: Request, *, vocab_size: int, max_new_tokens: int, max_stop_ids: int,
                  sampling: bool, vocab_note: str = "") -> None:
    """Refuses what the engine cannot run, naming the request and the field, before anything is traced; `vocab_note`
    ends the message of an id outside the vocabulary (what the caller knows of where the ids came from)."""
    name = f"request {request.id!r}"
    for field in ("tokens", "question", "stop_ids"):
        ids = getattr(request, field)
        if not isinstance(ids, tuple):
            raise KvjaxError(f"{name}: {field} must be a sequence of token ids, got {type(ids).__name__} {ids!r}")
    if not request.tokens:
        raise KvjaxError(f"{name}: empty prompt")
    for field in ("tokens", "question", "stop_ids"):
        for t in getattr(request, field):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise KvjaxError(f"{name}: {field} holds {t!r}; token ids are integers in [0, {vocab_size})"
                                 f"{vocab_note}")
    if isinstance(request.max_new_tokens, bool) or not isinstance(request.max_new_tokens, int) \
            or not 1 <= request.max_new_tokens <= max_new_tokens:
        raise KvjaxError(f"{name}: max_new_tokens={request.max_new_tokens!r} must be an integer in "
                         f"[1, {max_new_tokens}] (the engine's max_new_tokens)")
    if len(request.stop_ids) > max_stop_ids:
        raise KvjaxError(f"{name}: {len(request.stop_ids)} stop ids, more than the engine's max_stop_ids="
                         f"{max_stop_ids}")
    t, p = request.temperature, request.top_p
    if isinstance(t, bool) or not isinstance(t, int | float) or not (0 <= t < math.inf):
        raise KvjaxError(f"{name}: temperature must be a finite number >= 0, got {t!r}")
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
        raise KvjaxError(f"{name}: top_p must be in (0, 1], got {p!r}")
    if t > 0 and not sampling:
        raise KvjaxError(f"{name}: temperature={t} samples, but the engine was built greedy (sampling=False)")
    if not is_seed(request.seed):
        raise KvjaxError(f"{name}: seed must be an integer in [0, 2**32), got {request.seed!r}")
    if not isinstance(request.logprobs, bool):
        raise KvjaxError(f"{name}: logprobs must be true or false, got {request.logprobs!r}")
    problem = stop_problem(request.stop)
    if problem:
        raise KvjaxError(f"{name}: {problem}")
    problem = samples_problem(request.samples)
    if problem:
        raise KvjaxError(f"{name}: samples {problem}")
    if request.sample_count > 1 and t == 0:
        raise KvjaxError(f"{name}: samples={request.samples!r} at temperature 0 would be {request.sample_count} "
                         "identical greedy answers; give a temperature > 0")


#: Sample indices key the draw with the seed (uint32).
MAX_SAMPLE_INDEX = 2**32 - 1


def samples_problem(samples: object) -> str | None:
    """What is wrong with a `samples` value ("must be ..., got ..."), or None: an integer >= 1, or a non-empty tuple
    of distinct sample indices."""
    if isinstance(samples, int) and not isinstance(samples, bool):
        return None if 1 <= samples <= MAX_SAMPLE_INDEX + 1 else (f"must be an integer in [1, {MAX_SAMPLE_INDEX + 1}], "
                                                                   f"got {samples!r}")
    ok = isinstance(samples, tuple) and samples and len(set(samples)) == len(samples) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_SAMPLE_INDEX for i in samples)
    return None if ok else (f"must be an integer >= 1 or distinct sample indices in [0, {MAX_SAMPLE_INDEX}], "
                            f"got {samples!r}")
