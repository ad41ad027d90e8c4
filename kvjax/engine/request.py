"""A request to the engine and what it gives back."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kvjax.errors import KvjaxError


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to complete.

    `tokens`: the prompt's ids; `question`: ids fed after the prompt (uncompressed after a query-agnostic method
    compressed the prompt, or read by a query-aware layout as `kvjax.generate`'s `question_ids` are).
    `max_new_tokens`: this request's limit (at most the engine's); `stop_ids`: ids that end it besides the model's
    EOS. `temperature` 0 is greedy; else temperature and nucleus (`top_p`) sampling from `seed` (the engine must
    be built with `sampling=True`). `logprobs`: return each generated token's log-probability.
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "question", tuple(self.question))
        object.__setattr__(self, "stop_ids", tuple(self.stop_ids))

    @property
    def sequence(self) -> int:
        """Tokens before the first generated one (prompt + question)."""
        return len(self.tokens) + len(self.question)


@dataclasses.dataclass
class Completion:
    """A finished request: the generated ids (the stop id included, as `generate` counts it), why it stopped
    (`"stop"`: a stop / EOS id, `"length"`: its `max_new_tokens`), what its cache kept when it finished (mean over
    layers and KV heads: prompt tokens and generated tokens, as the eval's `kept_tokens` counts them), its times
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


def check_request(request: Request, *, vocab_size: int, max_new_tokens: int, max_stop_ids: int,
                  sampling: bool) -> None:
    """Refuses what the engine cannot run, naming the request and the field, before anything is traced."""
    name = f"request {request.id!r}"
    if not request.tokens:
        raise KvjaxError(f"{name}: empty prompt")
    for field in ("tokens", "question", "stop_ids"):
        for t in getattr(request, field):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise KvjaxError(f"{name}: {field} holds {t!r}; token ids are integers in [0, {vocab_size})")
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
    if isinstance(request.seed, bool) or not isinstance(request.seed, int):
        raise KvjaxError(f"{name}: seed must be an integer, got {request.seed!r}")
    if not isinstance(request.logprobs, bool):
        raise KvjaxError(f"{name}: logprobs must be true or false, got {request.logprobs!r}")
