"""A synthetic multi-document QA task for the multi-context (RAG) strategies, generated offline.

Shaped after the multi-document QA SamKV evaluates (LongBench's 2WikiMQA / HotpotQA / MuSiQue: a
question, a handful of retrieved passages, most of them distractors): every sample holds ``D``
independent documents (``Sample.documents``, each prefilled and cached on its own by ``kvjax.rag``), each
a ``Passage <k>:`` of essay-like filler with one fact in it, ``One of the special magic numbers for <key>
is: <value>.`` (RULER's needle sentence); documents are separated by a space, not a newline, as RULER's
haystack sentences are. The question asks for the numbers of ``facts`` keys (1 or
2) whose facts sit in that many different documents, so a two-fact answer needs two documents, like
HotpotQA's comparison questions; the other documents are distractors whose facts look the same but name
other keys. The wording is RULER's ``niah_multikey`` ("... hidden within the following text ..."), so a
model trained on RULER (kvjax-tiny) reads it as a retrieval task.

Names: ``multidoc/synthetic`` (2 facts) and ``multidoc/synthetic_1fact``; ``_<D>docs`` sets the number of
documents (``multidoc/synthetic_8docs_1fact``), which is otherwise ``clip(context_length // 512, 4, 10)``.
The whole prompt (instruction + documents + question + answer prefix) is fitted to ``context_length -
max_new_tokens`` tokens as RULER's are (every document grows by the same number of sentences), so
``--context_length`` sets the documents' length. Metric: ``string_match_all`` (the share of the asked
numbers in the answer); ``qa_f1_score`` (LongBench's QA F1, SamKV's metric) against the numbers joined by
spaces is reported beside it. Nothing is downloaded.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from kvjax.errors import ConfigError
from kvjax.tasks import haystack as hs
from kvjax.tasks import metrics
from kvjax.tasks.base import BaseTask, CountTokens, LengthError, Sample, check_length, fit_sample
from kvjax.tasks.ruler import postprocess

__all__ = ["NAME_PATTERN", "SYNTHETIC_TASKS", "SyntheticMultiDocTask", "synthetic_task"]

#: ``multidoc/synthetic[_<D>docs][_<k>fact]``.
NAME_PATTERN = re.compile(r"multidoc/synthetic(?:_(\d+)docs)?(?:_(\d+)fact)?")
MIN_DOCS, MAX_DOCS = 2, 64


def default_num_documents(context_length: int) -> int:
    """Documents of about 512 tokens, at least 4 (two facts and two distractors) and at most 10 (LongBench's
    2WikiMQA / HotpotQA passage count)."""
    return max(4, min(10, context_length // 512))


class SyntheticMultiDocTask(BaseTask):
    """``num_documents`` passages (None: ``default_num_documents``), ``facts`` of them holding the answer."""

    max_new_tokens = 32  # LongBench's multi-document QA answer length
    metric = "string_match_all"
    options = {"num_documents": None, "facts": 2, "haystack": "essay"}

    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        docs, facts = self.opts["num_documents"], self.opts["facts"]
        if facts not in (1, 2):
            raise ConfigError(f"{name}: facts must be 1 or 2, got {facts!r}")
        if docs is not None and not (isinstance(docs, int) and MIN_DOCS <= docs <= MAX_DOCS and docs >= facts):
            raise ConfigError(f"{name}: the number of documents must be in [{max(MIN_DOCS, facts)}, {MAX_DOCS}], "
                              f"got {docs!r}")

    def _renderer(self, sid: str, seed_key: str, num_docs: int) -> Callable[[int], Sample]:
        rng = random.Random(seed_key)
        facts = int(self.opts["facts"])
        used: set[str] = set()
        keys = [hs.random_key(rng, used) for _ in range(num_docs)]
        values = [hs.random_number(rng, 7) for _ in range(num_docs)]
        while len(set(values)) < num_docs:  # distinct numbers: a distractor's can never be an answer
            values = [hs.random_number(rng, 7) for _ in range(num_docs)]
        holders = sorted(rng.sample(range(num_docs), facts))  # the documents holding the asked facts
        asked = rng.sample(holders, facts)  # question order independent of document order
        depths = [rng.random() for _ in range(num_docs)]
        fillers = [hs.make_filler(self.opts["haystack"], seed=f"{sid}:doc{d}", haystack_file=self.haystack_file)
                   for d in range(num_docs)]
        query = ", and ".join(keys[d] for d in asked)  # RULER's multi-query wording
        prefix = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                  "I will quiz you about the numbers afterwards.\n")
        question = f"\nWhat are all the special magic numbers for {query} mentioned in the provided text?"
        answer_prefix = f" The special magic numbers for {query} mentioned in the provided text are"
        answers = tuple(values[d] for d in asked)

        def render(n: int) -> Sample:
            docs = []
            for d in range(num_docs):
                needle = f"One of the special magic numbers for {keys[d]} is: {values[d]}."
                body = hs.join_with_inserts(fillers[d].units(n), [(depths[d], needle)])
                docs.append(f"{' ' if d else ''}Passage {d + 1}: {body}")  # no newlines: RULER's layout
            return Sample(
                id=sid, prefix=prefix, context="".join(docs), question=question, answer_prefix=answer_prefix,
                answers=answers, max_new_tokens=self.max_new_tokens, metric=self.metric, documents=tuple(docs),
                metadata={"query": query, "num_documents": num_docs, "answer_documents": [d + 1 for d in asked],
                          "depths": [depths[d] for d in asked]},
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
        num_docs = self.opts["num_documents"] or default_num_documents(context_length)
        out = []
        for i in range(num_samples):
            sid = f"{self.name}:{context_length}:{seed}:{i}"
            render = self._renderer(sid, f"{self.name}:{seed}:{i}", num_docs)
            n, sample, tokens = fit_sample(render, count_tokens, target, task=self.name, index=i, seed=seed,
                                           context_length=context_length)
            if n == 0:
                raise LengthError(f"{self.name}: {num_docs} documents do not fit --context_length={context_length} "
                                  "with any filler; raise it or ask for fewer documents (multidoc/synthetic_<D>docs)")
            sample.metadata["filler_units"] = n
            out.append(sample)
        return out

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        pred = postprocess(prediction)
        return {
            "string_match_all": metrics.string_match_all(pred, sample.answers),
            "qa_f1_score": metrics.qa_f1(pred, " ".join(sample.answers)),
        }


def synthetic_task(name: str, **options: Any) -> SyntheticMultiDocTask | None:
    """The task a ``multidoc/synthetic...`` name spells (None for any other name)."""
    m = NAME_PATTERN.fullmatch(name)
    if m is None:
        return None
    if m.group(1) is not None:
        options.setdefault("num_documents", int(m.group(1)))
    if m.group(2) is not None:
        options.setdefault("facts", int(m.group(2)))
    return SyntheticMultiDocTask(name, **options)


#: Registry entries: task name -> factory(**options).
SYNTHETIC_TASKS: dict[str, Callable[..., BaseTask]] = {
    "multidoc/synthetic": lambda **kw: SyntheticMultiDocTask("multidoc/synthetic", **kw),
    "multidoc/synthetic_1fact": lambda **kw: SyntheticMultiDocTask("multidoc/synthetic_1fact", facts=1, **kw),
}
