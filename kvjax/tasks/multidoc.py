"""Multi-document QA for the multi-context (RAG) methods: SamKV and its baselines.

``multidoc/<dataset>`` (2wikimqa, musique, hotpotqa) reads the LongBench file ``<dataset>.jsonl`` and
splits the context into its passages at LongBench's ``Passage <k>:`` headers, which start a line. Each
passage, header included, becomes one entry of ``Sample.documents`` (so ``"".join(documents) ==
context``); text before the first header joins the prompt prefix. The prompt and the 32-token answer
length are LongBench's; the score is LongBench's QA F1 (max over answers), the metric SamKV reports.

If a prompt exceeds ``context_length - max_new_tokens`` tokens, whole passages are dropped from the middle
(never cut inside a passage) until it fits; ``metadata["dropped_documents"]`` counts them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

from kvjax.errors import ConfigError
from kvjax.tasks import metrics
from kvjax.tasks.base import (
    BaseTask,
    CountTokens,
    DataError,
    LengthError,
    Sample,
    as_answers,
    check_length,
)
from kvjax.tasks.longbench import (
    MAX_NEW_TOKENS,
    PROMPTS,
    LongBenchTask,
    row_text,
    split_template,
)

__all__ = ["DATASETS", "MULTIDOC_TASKS", "MultiDocTask", "split_passages"]

DATASETS = ("2wikimqa", "musique", "hotpotqa")
_HEADER = re.compile(r"^Passage \d+:\n", re.MULTILINE)


def split_passages(context: str) -> tuple[str, list[str]]:
    """``(text_before_first_header, passages)``; each passage starts with its ``Passage <k>:`` header."""
    starts = [m.start() for m in _HEADER.finditer(context)]
    if not starts:
        return "", [context]
    bounds = [*starts, len(context)]
    return context[: starts[0]], [context[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


class MultiDocTask(BaseTask):
    """LongBench multi-document QA with the passages as separate documents."""

    options = {"max_prompt_tokens": None}
    reads_data = True

    def __init__(self, name: str, *, dataset: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        if dataset not in DATASETS:
            raise ConfigError(f"multidoc supports {list(DATASETS)}, not {dataset!r}")
        self.dataset = dataset
        self.metric = "qa_f1_score"
        self.max_new_tokens = MAX_NEW_TOKENS[dataset]
        # Reuse LongBench's file lookup and row validation.
        self._lb = LongBenchTask(name, dataset=dataset, skip_malformed=self.skip_malformed, tokenizer=self.tokenizer)

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
        path, rows = self._lb._rows(data_dir, num_samples)
        out = []
        for row in rows:
            where = f"{path}: row {row['_id']}"
            head, question = split_template(PROMPTS[self.dataset], row_text(row, "input", where))
            lead, docs = split_passages(row_text(row, "context", where))
            prefix = head + lead
            dropped = 0
            tokens = count_tokens(prefix + "".join(docs) + question)
            while tokens > budget and len(docs) > 1:
                docs.pop(len(docs) // 2)
                dropped += 1
                tokens = count_tokens(prefix + "".join(docs) + question)
            if tokens > budget:
                raise LengthError(
                    f"{self.name} row {row['_id']}: {tokens} tokens with a single passage, more than "
                    f"the {budget} available"
                )
            answers = as_answers(row["answers"], where)
            if not answers:
                raise DataError(f"{path}: row {row['_id']} has no answers")
            out.append(
                Sample(
                    id=str(row["_id"]),
                    prefix=prefix,
                    context="".join(docs),
                    question=question,
                    answers=answers,
                    max_new_tokens=self.max_new_tokens,
                    metric=self.metric,
                    documents=tuple(docs),
                    metadata={
                        "task": self.name,
                        "dataset": self.dataset,
                        "num_documents": len(docs),
                        "dropped_documents": dropped,
                        "num_tokens": tokens,
                        "length": row.get("length"),
                        "context_length": context_length,
                    },
                )
            )
        return out

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        return {self.metric: metrics.max_over_answers(metrics.qa_f1, prediction, sample.answers)}


#: Registry entries: task name -> factory(**options).
MULTIDOC_TASKS: dict[str, Callable[..., BaseTask]] = {
    f"multidoc/{d}": partial(MultiDocTask, f"multidoc/{d}", dataset=d) for d in DATASETS
}
