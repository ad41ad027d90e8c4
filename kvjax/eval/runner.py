"""Evaluates one cell (`kvjax.eval.cell.Cell`: a method at one amount, task, context length and cache format) into
a resumable run directory; `kvjax.eval.sweep` runs a sweep's cells."""

from __future__ import annotations

import dataclasses
import shlex
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvjax import rag
from kvjax.chat import ChatTemplateError, use_chat_template, user_turn
from kvjax.errors import ConfigError
from kvjax.eval.cell import Cell
from kvjax.eval.results import RunDir, make_record, summarize
from kvjax.quant.spec import KVQuant
from kvjax.runtime.generate import decode, prefill
from kvjax.tasks.base import DataError, Sample

#: The name older code gives a planned cell (`kvjax.eval.cell.Cell`).
Setting = Cell


@dataclasses.dataclass
class CellRun:
    """A planned cell with what running it needs: its task, this process's share of the samples and its run
    directory."""

    cell: Cell
    task: Any
    samples: list[Sample]
    run_dir: RunDir

    @property
    def setting(self) -> Cell:  # the name `sweep` used
        return self.cell

    def todo(self) -> int:
        """Samples of this process not yet in the run directory."""
        done = self.run_dir.done_ids()
        return sum(1 for s in self.samples if s.id not in done)


def check_sample_ids(run_dir: RunDir, task: Any, samples: Sequence[Sample], *, count_tokens: Callable[[str], int],
                     context_length: int, seed: int, data_dir: str | None) -> None:
    """Refuses a cell whose predictions hold a record of a sample `task` never produces at this length and seed (a
    line pasted from another cell or task, an edited id): it would be counted in the cell's score. DataError naming
    the file, line and id, and how to drop it. Records of the task's samples beyond this run's `samples` (an earlier
    run with a larger --max_samples) are kept: when some id is not among `samples`, the task's first N samples are
    drawn again (N: the records held) to tell the two apart."""
    known = {s.id for s in samples}
    foreign = run_dir.records_outside(known)
    if foreign:
        n = len(run_dir.done_ids())
        key = (task.name, context_length, seed, data_dir, n)
        if key not in _MORE_IDS:
            more = task.samples(count_tokens=count_tokens, context_length=context_length, num_samples=n, seed=seed,
                                data_dir=data_dir)
            _MORE_IDS[key] = frozenset(s.id for s in more)
        foreign = [f for f in foreign if f[2] not in _MORE_IDS[key]]
    if foreign:
        path, line, sample_id = foreign[0]
        others = f" (and {len(foreign) - 1} more such records)" if len(foreign) > 1 else ""
        raise DataError(
            f"{path}:{line}: a record of sample {sample_id!r}, which {task.name} never produces at "
            f"--context_length={context_length} and --seed={seed}{others}: it would be counted in the score; delete "
            f"that line (sed -i '{line}d' {shlex.quote(path)}) or use another --output_dir"
        )


#: Ids of the first N samples of (task, length, seed, data_dir, N), drawn again by `check_sample_ids`: once per sweep.
_MORE_IDS: dict[tuple, frozenset[str]] = {}


def kv_bits_per_value(kv_dtype: KVQuant | None, model: Any) -> float:
    """Stored bits per cached K / V value: the model dtype's width, or the quantized format's codes plus its scales
    and zero points (`KVQuant.bits_per_value`; KIVI's full-precision residual ring not counted)."""
    if kv_dtype is None:
        return float(np.dtype(model.dtype).itemsize * 8)
    return float(kv_dtype.bits_per_value(model.config.head_dim))


class PromptEncoder:
    """Turns a sample into (context ids, question ids), with the tokenizer's chat template if asked.

    `question_first` also states the question at the top of the prompt, before the context (Liu et al.,
    2023, "Lost in the Middle", query-aware contextualization); the question still follows the context.
    """

    def __init__(self, tokenizer: Any, chat_template: str = "auto", *, question_first: bool = False):
        self.tokenizer = tokenizer
        self.question_first = question_first
        self.use_template = use_chat_template(tokenizer, chat_template)
        self._layout = self._template_layout() if self.use_template else ("", "")

    def _template_layout(self) -> tuple[str, str]:
        """The chat template's text (before, after) a user message, rendered once; a template that refuses a lone
        user message, or drops its text, is one ConfigError (before weights load), not a jinja2 traceback later."""
        try:
            return user_turn(self.tokenizer)
        except ChatTemplateError as e:
            raise ConfigError(f"{e}; pass --chat_template=no") from None

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _lead(self, sample: Sample) -> str:
        """The question stated before the context under `question_first` (else nothing)."""
        question = sample.question.strip()
        return f"{question}\n\n" if self.question_first and question else ""

    def _wrap(self, sample: Sample, head: str, tail: str) -> tuple[list[int], str]:
        """(ids of `head` with BOS or the chat template's opening, `tail` with the template's closing).

        With the template, the answer prefix goes after the assistant header (kvpress's layout: the
        question stays in the user turn, the assistant's reply starts with the prefix). Hybrid-thinking models
        (Qwen3) answer without a reasoning trace, as kvpress renders them (`enable_thinking=False`, which other
        templates ignore).
        """
        if self.use_template and sample.chat_template:
            before, after = self._layout
            prefix = sample.answer_prefix if sample.answer_prefix and tail.endswith(sample.answer_prefix) else ""
            question = tail[: len(tail) - len(prefix)]
            return self.tokenizer.encode(before + head, add_special_tokens=False), question + after + prefix
        return self.tokenizer.encode(head, add_special_tokens=True), tail

    def encode(self, task: Any, sample: Sample, *, query_aware: bool) -> tuple[list[int], list[int]]:
        """(context ids, question ids): the question part is fed after the context is compressed."""
        context, question = task.build_prompt(sample, question_in_context=query_aware)
        ctx_ids, question = self._wrap(sample, self._lead(sample) + context, question)
        return ctx_ids, self.tokenizer.encode(question, add_special_tokens=False) if question else []

    def encode_documents(self, sample: Sample, *, query_aware: bool) -> tuple[list[int], list[list[int]], list[int]]:
        """(prefix ids, one id list per document, query ids) of a multi-document sample."""
        head = self._lead(sample) + sample.prefix
        prefix_ids, question = self._wrap(sample, head, sample.question + sample.answer_prefix)
        docs = [self.tokenizer.encode(d, add_special_tokens=False) for d in sample.documents]
        return prefix_ids, [d for d in docs if d], self.tokenizer.encode(question, add_special_tokens=False)


def kept_tokens(pos: Any, prompt_lengths: Any, generated: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokens a final cache holds per example, mean over layers and KV heads: (prompt, generated).

    `pos` is the cache's original positions per layer (-1 for an empty slot): an `[L, B, K, C]` array or one
    `[B, K, C]` array per layer (`layer_positions`); a slot holds a prompt token (context and question) when
    its position is below the example's prompt length, and one of its `generated` tokens (all positions
    beyond the prompt when None) after that. In a batch, a row that stopped early is frozen from its last token
    on (`decode` stores and evicts nothing for it), so its counts are those it had when it finished, whatever the
    batch.
    """
    layers = [np.asarray(p) for p in pos]
    limit = np.asarray(prompt_lengths).reshape(-1, 1, 1)
    end = np.inf if generated is None else limit + np.asarray(generated).reshape(-1, 1, 1)
    prompt = np.mean([((p >= 0) & (p < limit)).sum(-1).mean(axis=1) for p in layers], axis=0)
    new = np.mean([((p >= limit) & (p < end)).sum(-1).mean(axis=1) for p in layers], axis=0)
    return prompt, new


def layer_positions(cache: Any) -> list[np.ndarray]:
    """Each layer's `[B, K, C]` original positions of a model's cache (`kvjax.cache.ModelCache`), on the host."""
    return [np.asarray(layer.pos) for layer in cache.layers]


def _batches(items: Sequence[Sample], size: int) -> list[list[Sample]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def run_setting(
    *,
    model: Any,
    encoder: PromptEncoder,
    task: Any,
    samples: Sequence[Sample],
    setting: Setting,
    run_dir: RunDir,
    batch_size: int,
    query_aware: bool,
    seed: int,
    chunk_size: int | None = None,
    mesh: Any = None,
    progress: Callable[[int], None] | None = None,
    throttle_s: float = 0.0,
) -> dict[str, Any]:
    """Runs the samples not yet in `run_dir`, appending one record per finished sample; returns metrics."""
    done = run_dir.done_ids()
    todo = [s for s in samples if s.id not in done]
    tokenizer = encoder.tokenizer
    if setting.rag_strategy is not None:
        for sample in todo:
            run_dir.append(_run_rag_sample(model, encoder, task, sample, setting, query_aware, mesh))
            if progress is not None:
                progress(1)
            if throttle_s:
                time.sleep(throttle_s)
        todo = []
    for batch in _batches(todo, batch_size):
        encoded = [encoder.encode(task, s, query_aware=query_aware) for s in batch]
        max_new = max(s.max_new_tokens for s in batch)
        start = time.perf_counter()
        state = prefill(
            model,
            [c for c, _ in encoded],
            method=setting.method,
            max_new_tokens=max_new,
            question_ids=[q for _, q in encoded],
            chunk_size=chunk_size,
            mesh=mesh,
            kv_dtype=setting.kv_dtype,
        )
        state.logits.block_until_ready()
        prefill_s = time.perf_counter() - start
        cache_bytes = state.cache.nbytes // len(batch)
        prompt_lengths = np.asarray(state.prompt_lengths)
        start = time.perf_counter()
        tokens, counts, final_cache = decode(model, state, max_new_tokens=max_new, seed=seed)
        decode_s = time.perf_counter() - start
        kept_prompt, kept_generated = kept_tokens(layer_positions(final_cache), prompt_lengths, counts)
        timings = {"prefill_s": prefill_s / len(batch), "decode_s": decode_s / len(batch), "ttft_s": prefill_s}
        bits = kv_bits_per_value(setting.kv_dtype, model)
        for i, sample in enumerate(batch):
            run_dir.append(batch_record(task, tokenizer, setting, sample, encoded[i], tokens[i], counts[i], timings,
                                        (kept_prompt[i], kept_generated[i], prompt_lengths[i]), cache_bytes,
                                        kv_bits_per_value=bits))
            if progress is not None:
                progress(1)
            if throttle_s:
                time.sleep(throttle_s)
    return finish_setting(run_dir, setting)


def batch_record(
    task: Any, tokenizer: Any, setting: Setting, sample: Sample, encoded: tuple[list[int], list[int]],
    tokens: np.ndarray, count: Any, timings: dict[str, float], kept: tuple[float, float, int], cache_bytes: int,
    **extra: Any,
) -> dict[str, Any]:
    """The record of one sample of a batched prefill + decode (`tokens`: its row of generated ids; `kept`:
    `kept_tokens`' prompt and generated counts for it and its prompt length)."""
    kept_prompt, kept_generated, prompt_length = kept
    n = min(int(count), sample.max_new_tokens)
    text = tokenizer.decode(tokens[:n].tolist(), skip_special_tokens=True)
    return make_record(
        sample,
        text,
        task.score(text, sample),
        method=setting.method_name,
        budget=setting.budget,
        compression_ratio=setting.compression_ratio,
        timings=timings,
        context_tokens=len(encoded[0]),
        question_tokens=len(encoded[1]),
        kept_tokens=float(kept_prompt),
        kept_fraction=float(kept_prompt) / max(1, int(prompt_length)),
        kept_generated_tokens=float(kept_generated),
        budget_above_prompt=setting.budget is not None and setting.budget >= len(encoded[0]),
        cache_bytes=int(cache_bytes),
        context_length=setting.context_length,
        **extra,
    )


def finish_setting(run_dir: RunDir, setting: Setting) -> dict[str, Any]:
    """Summarises `run_dir`'s records into its metrics file; returns the metrics."""
    metrics = summarize(run_dir.records(), task=setting.task_name)
    records = run_dir.records()
    for key in ("sequence_ratio", "recompute_ratio", "layer_recompute_ratio", "kept_tokens", "kept_fraction",
                "kv_bits_per_value", "ttft_s"):
        values = [r.get(key) if key != "ttft_s" else r.get("timings", {}).get("ttft_s") for r in records]
        values = [v for v in values if v is not None]
        if values:
            metrics[f"mean_{key}"] = float(np.mean(values))
    above = sum(1 for r in records if r.get("budget_above_prompt"))
    if above:
        metrics["budget_above_prompt_samples"] = above  # these samples ran with the whole prompt kept
    metrics.update(
        method=setting.method_name,
        budget=setting.budget,
        compression_ratio=setting.compression_ratio,
        task=setting.task_name,
        context_length=setting.context_length,
    )
    if setting.kv_dtype is not None:
        metrics["kv_dtype"] = setting.kv_dtype_name
    run_dir.write_metrics(metrics)
    return metrics


def _run_rag_sample(
    model: Any, encoder: PromptEncoder, task: Any, sample: Sample, setting: Setting, query_aware: bool,
    mesh: Any = None,
) -> dict[str, Any]:
    """One multi-document sample through `kvjax.rag`: documents prefilled alone, then the strategy."""
    prefix_ids, doc_ids, query_ids = encoder.encode_documents(sample, query_aware=query_aware)
    start = time.perf_counter()
    docs = rag.prefill_documents(model, doc_ids, analyze=setting.rag_strategy.needs_stats, mesh=mesh,
                                 kv_dtype=setting.kv_dtype)
    doc_prefill_s = time.perf_counter() - start
    eos = encoder.tokenizer.eos_token_id
    result = rag.answer(
        model,
        docs,
        query_ids,
        strategy=setting.rag_strategy,
        prefix=prefix_ids or None,
        max_new_tokens=sample.max_new_tokens,
        eos_token_id=eos,
        mesh=mesh,
    )
    tokens = [int(t) for t in result.tokens[: sample.max_new_tokens]]
    text = encoder.tokenizer.decode(tokens, skip_special_tokens=True)
    report = result.report
    return make_record(
        sample,
        text,
        task.score(text, sample),
        method=setting.method_name,
        timings={"document_prefill_s": doc_prefill_s, "ttft_s": report.ttft_s},
        context_tokens=report.context_tokens,
        question_tokens=report.query_tokens,
        kept_tokens=float(report.kept_tokens),
        kept_fraction=float(report.kept_tokens) / max(1, report.context_tokens + report.query_tokens),
        cache_bytes=int(report.cache_bytes),
        sequence_ratio=float(report.sequence_ratio),
        recompute_ratio=float(report.recompute_ratio),
        layer_recompute_ratio=float(report.layer_recompute_ratio),
        num_documents=report.num_documents,
        context_length=setting.context_length,
        kv_bits_per_value=kv_bits_per_value(setting.kv_dtype, model),
    )
