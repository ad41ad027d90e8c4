"""LongBench (Bai et al., 2023) from local JSONL files in the published format.

``longbench/<dataset>`` reads ``<data_dir>/<dataset>.jsonl`` (or ``<data_dir>/data/<dataset>.jsonl``, the
layout of the released archive); ``longbench/<dataset>_e`` reads LongBench-E's ``<dataset>_e.jsonl`` and adds
the 0-4k / 4-8k / 8k+ length buckets (by the row's ``length`` field) to the summary. Each row has
``input``, ``context``, ``answers``, ``all_classes``, ``length``, ``dataset``, ``language`` and ``_id``.

Per dataset, the benchmark's published prompt template, generation length and metric are used (tables
below). Scores follow LongBench's rules: for TREC, TriviaQA and SAMSum only the first line of the
prediction is scored, and a sample's score is the maximum over its reference answers. Chat templates are
not applied to the few-shot and code datasets (``Sample.chat_template`` is False there; the CLI applies
templates).

Truncation: the context is cut in the middle so that the whole prompt fits ``context_length -
max_new_tokens`` tokens (``max_prompt_tokens`` overrides that budget). LongBench cuts the middle of the
full prompt instead; since its instructions are short and sit at both ends, cutting the context keeps the
same tokens except that the instructions always survive intact.

The Chinese datasets (multifieldqa_zh, dureader, vcsum, lsht, passage_retrieval_zh) need jieba word
segmentation for their metrics and are not supported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
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
    default_aggregate,
    read_jsonl,
    require_file,
    truncate_middle,
)

__all__ = [
    "CHINESE_DATASETS",
    "DATASETS",
    "E_DATASETS",
    "LongBenchTask",
    "MAX_NEW_TOKENS",
    "METRIC",
    "PROMPTS",
    "length_bucket",
    "row_text",
    "split_template",
]

_QA_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
    "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\n"
    "Answer:"
)

#: Published prompt templates per dataset (``{context}`` and ``{input}`` are filled from the row).
PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer "
        "the question asconcisely as you can, using a single phrase if possible. Do not provide any "
        "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely "
        "as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
        "{input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you "
        "can, using a single phrase or sentence if possible. If the question cannot be answered based "
        'on the information in the article, write "unanswerable". If the question is a yes/no '
        'question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\n'
        "Article: {context}\n\n Answer the question based on the above article as concisely as you "
        "can, using a single phrase or sentence if possible. If the question cannot be answered based "
        'on the information in the article, write "unanswerable". If the question is a yes/no '
        'question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\n'
        "Question: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
        "question based on the above text, only give me the answer and do not output any other "
        "words.\n\nQuestion: {input}\nAnswer:"
    ),
    "hotpotqa": _QA_PASSAGES,
    "2wikimqa": _QA_PASSAGES,
    "musique": _QA_PASSAGES,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer "
        "the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based "
        "on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
        "{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output "
        "any other words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
        "Please carefully read these paragraphs and determine how many unique paragraphs there are "
        "after removing duplicates. In other words, how many non-repeating paragraphs are there in "
        "total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing "
        "duplicates. The output format should only contain the number, such as 1, 2, 3, and so on."
        "\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
        "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format must be "
        'like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: '
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

#: Published maximum generation lengths per dataset.
MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "lcc": 64,
    "repobench-p": 64,
}

#: Metric per dataset (named after LongBench's scoring functions).
METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1_score",
    "qasper": "qa_f1_score",
    "multifieldqa_en": "qa_f1_score",
    "hotpotqa": "qa_f1_score",
    "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score",
    "gov_report": "rouge_score",
    "qmsum": "rouge_score",
    "multi_news": "rouge_score",
    "trec": "classification_score",
    "triviaqa": "qa_f1_score",
    "samsum": "rouge_score",
    "passage_count": "count_score",
    "passage_retrieval_en": "retrieval_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}

_SCORERS: dict[str, Callable[..., float]] = {
    "qa_f1_score": metrics.qa_f1,
    "rouge_score": metrics.rouge_l_longbench,
    "classification_score": metrics.classification_score,
    "count_score": metrics.count_score,
    "retrieval_score": metrics.retrieval_score,
    "code_sim_score": metrics.code_sim_score,
}

DATASETS = tuple(PROMPTS)
#: Datasets that LongBench-E covers (English).
E_DATASETS = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
CHINESE_DATASETS = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
#: Scored on the first line of the prediction only.
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
#: Fed without a chat template.
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
REQUIRED_FIELDS = ("input", "context", "answers", "_id")


def length_bucket(length: float) -> str:
    """LongBench-E's bucket of a row's ``length``: ``0-4k``, ``4-8k`` or ``8k+``."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


def row_text(row: dict[str, Any], key: str, where: str) -> str:
    """A data row's text field; a null is refused (``where`` names the row) rather than prompted as the word
    "None"."""
    value = row[key]
    if value is None:
        raise DataError(f"{where} has a null {key!r}; fix or drop that row")
    return value if isinstance(value, str) else str(value)


def _length(row: dict[str, Any], path: Any) -> float:
    """A LongBench-E row's ``length`` (its words or characters), the number its bucket is chosen by."""
    value = row["length"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DataError(f"{path}: row {row.get('_id')} has a 'length' of {value!r}, not a number; fix or drop that row")
    return float(value)


def split_template(template: str, question_input: str) -> tuple[str, str]:
    """``(before_context, after_context)`` of a template with ``{input}`` filled in."""
    head, sep, tail = template.partition("{context}")
    if not sep:
        raise ConfigError(f"template has no {{context}} field: {template!r}")
    return head.replace("{input}", question_input), tail.replace("{input}", question_input)


def fit_context(
    prefix: str,
    context: str,
    question: str,
    budget: int,
    *,
    count_tokens: CountTokens,
    tokenizer: Any,
    what: str,
) -> tuple[str, int, bool]:
    """Middle-truncate ``context`` so ``prefix + context + question`` fits ``budget`` tokens.

    Returns ``(context, prompt_tokens, truncated)``; retries with a smaller context budget when token
    boundaries make the pieces count more together than apart.
    """
    total = count_tokens(prefix + context + question)
    if total <= budget:
        return context, total, False
    fixed = count_tokens(prefix + question)
    room = budget - fixed
    for _ in range(4):
        if room <= 0:
            raise LengthError(f"{what}: the instructions alone need {fixed} tokens, more than the {budget} available")
        cut = truncate_middle(context, room, tokenizer=tokenizer, count_tokens=count_tokens)
        total = count_tokens(prefix + cut + question)
        if total <= budget:
            return cut, total, True
        room -= total - budget
    raise LengthError(f"{what}: could not truncate the context to {budget} tokens")


class LongBenchTask(BaseTask):
    """One LongBench (or LongBench-E) dataset."""

    options = {"max_prompt_tokens": None}
    reads_data = True

    def __init__(self, name: str, *, dataset: str, e: bool = False, **kw: Any) -> None:
        super().__init__(name, **kw)
        if dataset not in PROMPTS:
            raise ConfigError(f"unknown LongBench dataset {dataset!r}; known: {sorted(PROMPTS)}")
        self.dataset = dataset
        self.e = e
        self.metric = METRIC[dataset]
        self.max_new_tokens = MAX_NEW_TOKENS[dataset]

    @property
    def filename(self) -> str:
        return f"{self.dataset}_e.jsonl" if self.e else f"{self.dataset}.jsonl"

    def _rows(self, data_dir: str | None, num_samples: int) -> tuple[str, list[dict[str, Any]]]:
        path = require_file(data_dir, (self.filename, os.path.join("data", self.filename)), self.name)
        rows = read_jsonl(
            path,
            required=REQUIRED_FIELDS,
            skip_malformed=self.skip_malformed,
            limit=num_samples if num_samples > 0 else None,
            id_field="_id",
        )
        return path, rows

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
        path, rows = self._rows(data_dir, num_samples)
        out = []
        for row in rows:
            where = f"{path}: row {row['_id']}"
            prefix, question = split_template(PROMPTS[self.dataset], row_text(row, "input", where))
            context, tokens, truncated = fit_context(
                prefix,
                row_text(row, "context", where),
                question,
                budget,
                count_tokens=count_tokens,
                tokenizer=self.tokenizer,
                what=f"{self.name} row {row['_id']}",
            )
            answers = as_answers(row["answers"], where)
            if not answers:
                raise DataError(f"{path}: row {row['_id']} has no answers")
            metadata: dict[str, Any] = {
                "task": self.name,
                "dataset": self.dataset,
                "all_classes": list(row.get("all_classes") or []),
                "length": row.get("length"),
                "language": row.get("language"),
                "num_tokens": tokens,
                "truncated": truncated,
                "context_length": context_length,
            }
            if self.e and row.get("length") is not None:
                metadata["bucket"] = length_bucket(_length(row, path))
            out.append(
                Sample(
                    id=str(row["_id"]),
                    prefix=prefix,
                    context=context,
                    question=question,
                    answers=answers,
                    max_new_tokens=self.max_new_tokens,
                    metric=self.metric,
                    chat_template=self.dataset not in NO_CHAT_TEMPLATE,
                    metadata=metadata,
                )
            )
        return out

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        return {self.metric: score_longbench(self.dataset, prediction, sample)}

    def aggregate(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Default means, plus ``length_buckets`` (LongBench-E) of the primary metric (x100)."""
        out = default_aggregate(records)
        if self.e:
            buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
            for r in records:
                length = r.get("metadata", {}).get("length")
                if length is not None and self.metric in r.get("scores", {}):
                    buckets[length_bucket(float(length))].append(float(r["scores"][self.metric]))
            out["length_buckets"] = {k: (100.0 * sum(v) / len(v) if v else None) for k, v in buckets.items()}
        return out


def score_longbench(dataset: str, prediction: str, sample: Sample) -> float:
    """LongBench's per-sample score: first-line rule, then the max over the reference answers."""
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = _SCORERS[METRIC[dataset]]
    kwargs: dict[str, Any] = {}
    if METRIC[dataset] == "classification_score":
        kwargs["all_classes"] = sample.metadata.get("all_classes", [])
    return metrics.max_over_answers(fn, prediction, sample.answers, **kwargs)


def _unsupported(name: str) -> Callable[..., BaseTask]:
    def make(**kw: Any) -> BaseTask:
        raise ConfigError(
            f"task {name!r} is a Chinese LongBench dataset; its metric needs jieba word segmentation, "
            "which kvjax does not ship. Use the English datasets."
        )

    return make


#: Registry entries: task name -> factory(**options).
LONGBENCH_TASKS: dict[str, Callable[..., BaseTask]] = {
    **{f"longbench/{d}": partial(LongBenchTask, f"longbench/{d}", dataset=d) for d in DATASETS},
    **{f"longbench/{d}_e": partial(LongBenchTask, f"longbench/{d}_e", dataset=d, e=True) for d in E_DATASETS},
}
UNSUPPORTED_TASKS: dict[str, Callable[..., BaseTask]] = {
    f"longbench/{d}{suffix}": _unsupported(f"longbench/{d}{suffix}") for d in CHINESE_DATASETS for suffix in ("", "_e")
}
