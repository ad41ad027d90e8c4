"""Passkey retrieval: a random passkey hidden in filler text (Mohtashami & Jaggi's format).

``passkey`` uses 5 digits, ``passkey_64`` 64 digits (LagKV's hard case: a compressed cache must keep every
digit of a long needle); ``passkey_<n>`` gives any length. Scores: ``exact`` (the first run of digits in the
answer equals the passkey) and ``partial`` (the longest common prefix of that run and the passkey,
divided by the passkey length; see ``kvjax.tasks.metrics.passkey_partial``). The primary metric is
``exact`` for 5 digits and ``partial`` for longer keys, as LagKV reports.

Options: ``haystack`` (``noise`` -- the classic repeated "The grass is green..." -- or ``essay``; a
``haystack_file``, e.g. Paul Graham's essays as in LagKV's 64-digit test, replaces either) and ``depths``
(percentages; samples cycle through them, otherwise each sample draws a random depth). Metadata carries
``depth`` (percent) and ``length`` (the context length) for heatmaps.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from kvjax.errors import ConfigError
from kvjax.tasks import haystack as hs
from kvjax.tasks import metrics
from kvjax.tasks.base import (
    BaseTask,
    CountTokens,
    Sample,
    check_length,
    fit_sample,
)

__all__ = ["PasskeyTask", "check_depths"]

PREFIX = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there.\n"
)
QUESTION = "\nWhat is the pass key?"
ANSWER_PREFIX = " The pass key is"


def check_depths(depths: Sequence[float] | None, task: str) -> list[float] | None:
    """Validate depth percentages (each in [0, 100])."""
    if depths is None:
        return None
    out = [float(d) for d in depths]
    if not out or any(not 0.0 <= d <= 100.0 for d in out):
        raise ConfigError(f"{task}: depths must be percentages in [0, 100], got {list(depths)}")
    return out


class PasskeyTask(BaseTask):
    """Passkey retrieval at a target length (prompt + answer fit ``context_length``)."""

    options = {"haystack": "noise", "depths": None, "metric": None}

    def __init__(self, name: str, *, digits: int, **kw: Any) -> None:
        super().__init__(name, **kw)
        if digits < 1:
            raise ConfigError(f"{name}: the passkey needs at least one digit")
        self.digits = digits
        self.depths = check_depths(self.opts["depths"], name)
        self.metric = self.opts["metric"] or ("exact" if digits <= 5 else "partial")
        if self.metric not in ("exact", "partial"):
            raise ConfigError(f"{name}: metric must be 'exact' or 'partial', got {self.metric!r}")
        # Room for the digits whatever the tokenizer (some use one token per digit) plus a few words.
        self.max_new_tokens = digits + 16

    def _renderer(self, sid: str, depth: float, key: str) -> Callable[[int], Sample]:
        kind = "file" if self.haystack_file else self.opts["haystack"]
        filler = hs.Filler(kind, seed=sid, path=self.haystack_file)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."

        def render(n: int) -> Sample:
            return Sample(
                id=sid,
                prefix=PREFIX,
                context=hs.join_with_inserts(filler.units(n), [(depth / 100.0, needle)]),
                question=QUESTION,
                answer_prefix=ANSWER_PREFIX,
                answers=(key,),
                max_new_tokens=self.max_new_tokens,
                metric=self.metric,
                metadata={},
            )

        return render

    def samples(
        self,
        *,
        count_tokens: CountTokens,
        context_length: int,
        num_samples: int,
        seed: int,
        data_dir: str | None = None,
    ) -> list[Sample]:
        check_length(context_length, num_samples)
        target = self.prompt_budget(context_length)
        out = []
        for i in range(num_samples):
            rng = random.Random(f"{self.name}:{seed}:{i}")
            key = hs.random_digits(rng, self.digits)
            depth = self.depths[i % len(self.depths)] if self.depths else round(100 * rng.random(), 1)
            sid = f"{self.name}:{context_length}:{seed}:{i}"
            _, sample, _ = fit_sample(
                self._renderer(sid, depth, key), count_tokens, target, task=self.name,
                index=i, seed=seed, depth=depth, length=context_length, context_length=context_length,
            )
            out.append(sample)
        return out

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        key = sample.answers[0]
        return {
            "exact": metrics.passkey_exact(prediction, key),
            "partial": metrics.passkey_partial(prediction, key),
        }
