"""Needle in a haystack over a depth x length grid.

The haystack is a local text file (``haystack_file``, e.g. Paul Graham's essays as in the original test)
or the built-in essay-like filler; the needle is inserted between sentences at each depth (percent of the
context) for each total length. ``num_samples`` samples are laid over the grid cell by cell (lengths
outer, depths inner); a second pass over the grid uses other filler. ``num_samples <= 0`` means one sample
per cell. Metadata carries ``depth`` (percent) and ``length`` (tokens) for the report's heatmaps.

Two needle kinds:

* ``needle_type="sentence"`` (default): the classic "best thing to do in San Francisco" needle; scores
  ``rouge_l_recall`` (primary: how much of the reference answer the reply reproduces, in LCS words,
  case and punctuation ignored),
  ``rouge_l`` (F1) and ``string_match`` (the whole reference answer appears, case-insensitive). Pass
  ``needle``, ``question`` and ``answer`` to use another sentence.
* ``needle_type="number"``: "The special magic number is: <7 digits>." with a fresh number per sample,
  scored by ``string_match``, which suits small models trained on retrieval.
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
    LengthError,
    Sample,
    check_length,
    default_aggregate,
    fit_sample,
)
from kvjax.tasks.passkey import check_depths

__all__ = ["DEFAULT_DEPTHS", "NeedleTask"]

DEFAULT_DEPTHS = tuple(float(d) for d in range(0, 101, 10))
NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
PREFIX = "Read the following document. A question about it follows.\n\n"


def _refuse_repeats(task: str, option: str, keys: list[str]) -> None:
    """Each grid cell is one sample id: two equal entries of `option` would give two samples one id (the second
    overwriting the first in the results)."""
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ConfigError(f"{task}: {option} repeat {repeated}; each grid cell is one sample, give each value once")


class NeedleTask(BaseTask):
    """Needle in a haystack; see the module docstring for the options."""

    options = {
        "depths": DEFAULT_DEPTHS,
        "lengths": None,
        "needle_type": "sentence",
        "needle": NEEDLE,
        "question": QUESTION,
        "answer": ANSWER,
        "haystack": "essay",
    }
    max_new_tokens = 64

    def __init__(self, name: str = "needle", **kw: Any) -> None:
        super().__init__(name, **kw)
        self.depths = check_depths(self.opts["depths"], name) or list(DEFAULT_DEPTHS)
        _refuse_repeats(name, "depths", [f"{d:g}" for d in self.depths])  # a cell's sample id holds `depth:g`
        if self.opts["needle_type"] not in ("sentence", "number"):
            raise ConfigError(f"{name}: needle_type must be 'sentence' or 'number'")
        self.metric = "rouge_l_recall" if self.opts["needle_type"] == "sentence" else "string_match"

    def _lengths(self, context_length: int) -> list[int]:
        lengths: Sequence[int] = self.opts["lengths"] or (context_length,)
        out = [int(x) for x in lengths]
        _refuse_repeats(self.name, "lengths", [str(x) for x in out])
        bad = [x for x in out if x <= self.max_new_tokens or x > context_length]
        if bad:
            raise LengthError(
                f"{self.name}: lengths {bad} must be in ({self.max_new_tokens}, context_length={context_length}]"
            )
        return out

    def _renderer(self, sid: str, depth: float, rng: random.Random) -> Callable[[int], Sample]:
        if self.opts["needle_type"] == "number":
            value = hs.random_number(rng, 7)
            needle = f"The special magic number is: {value}."
            question, answer = "What is the special magic number?", value
        else:
            needle, question, answer = self.opts["needle"], self.opts["question"], self.opts["answer"]
        filler = hs.make_filler(self.opts["haystack"], seed=sid, haystack_file=self.haystack_file)

        def render(n: int) -> Sample:
            return Sample(
                id=sid,
                prefix=PREFIX,
                context=hs.join_with_inserts(filler.units(n), [(depth / 100.0, needle)]),
                question=f"\n\nQuestion: {question} Answer using the document.",
                answer_prefix="\nAnswer:",
                answers=(answer,),
                max_new_tokens=self.max_new_tokens,
                metric=self.metric,
                metadata={"needle": needle},
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
        cells = [(length, depth) for length in self._lengths(context_length) for depth in self.depths]
        total = num_samples if num_samples > 0 else len(cells)
        out = []
        for i in range(total):
            length, depth = cells[i % len(cells)]
            rep = i // len(cells)
            sid = f"{self.name}:{length}:{depth:g}:{seed}:{rep}"
            rng = random.Random(f"{self.name}:{seed}:{i}")
            target = length - self.max_new_tokens
            _, sample, _ = fit_sample(
                self._renderer(sid, depth, rng), count_tokens, target, task=self.name,
                index=i, seed=seed, depth=depth, length=length, context_length=context_length,
            )
            out.append(sample)
        return out

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        answer = sample.answers[0]
        found = metrics.string_match_all(prediction, [answer])
        if self.opts["needle_type"] == "number":
            return {"string_match": found}
        return {
            "rouge_l_recall": metrics.rouge_l_recall(prediction, answer),
            "rouge_l": metrics.rouge_l(prediction, answer),
            "string_match": found,
        }

    def aggregate(self, records: Sequence[Any]) -> dict[str, Any]:
        """Default means plus ``grid``: ``{length: {depth: score}}`` of the primary metric (x100)."""
        out = default_aggregate(records)
        cells: dict[tuple[int, float], list[float]] = {}
        for r in records:
            md = r.get("metadata", {})
            if "length" in md and "depth" in md and out["metric"] in r.get("scores", {}):
                key = (int(md["length"]), float(md["depth"]))
                cells.setdefault(key, []).append(float(r["scores"][out["metric"]]))
        grid: dict[str, dict[str, float]] = {}
        for (length, depth), vals in sorted(cells.items()):
            grid.setdefault(str(length), {})[f"{depth:g}"] = 100.0 * sum(vals) / len(vals)
        out["grid"] = grid
        return out
