"""Shared-forward cells: the cells of a sweep that can share a prefill run batch by batch together
(`kvjax.eval.sweep` picks them with `shared_cells` and runs them with `run_queued`).

For the cells of one (task, context length) whose methods compress in one shot after the whole prompt
attended (`kvjax.runtime.shared_prefill.shares_prefill`), each batch of samples is prefilled once
(`shared_prefill.record`), then every cell replays its method's prefill hooks on the recording, appends
the question and decodes. A replay is deterministic, so a cell gives the same predictions whether it
runs in a sweep or alone with `--shared_prefill=yes`; against the ordinary per-cell prefill
(`--shared_prefill=no`) it agrees up to float rounding (see `shared_prefill`).

Methods that read the question as the end of the prompt (the `QuestionReader` capability: Quest) share a recording
of their own, the question appended to each prompt, as their ordinary prefill does.

`--shared_prefill=auto` (default) shares when at least two cells of one group qualify; `yes`
replays every qualifying cell, even alone; `no` never shares.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvjax.errors import ConfigError
from kvjax.eval.cell import Cell
from kvjax.eval.runner import (
    CellRun,
    PromptEncoder,
    _batches,
    batch_record,
    finish_setting,
    kept_tokens,
    kv_bits_per_value,
    layer_positions,
)
from kvjax.methods import capabilities as caps
from kvjax.runtime import decode, shared_prefill
from kvjax.runtime.compiled_memory import release_if_needed

MODES = ("auto", "yes", "no")


def shared_cells(settings: Sequence[Cell], mode: str, *, chunk_size: int | None, mesh: Any) -> set[int]:
    """Indices of `settings` to run through a shared prefill (grouped later by task and length)."""
    if mode not in MODES:
        raise ConfigError(f"--shared_prefill must be one of {list(MODES)}, got {mode!r}")
    if mode == "no":
        return set()
    groups: dict[tuple[str, int, bool], list[int]] = {}
    for i, s in enumerate(settings):
        if s.rag_strategy is None and shared_prefill.shares_prefill(s.method, chunk_size=chunk_size, mesh=mesh):
            groups.setdefault(_group_key(s), []).append(i)
    return {i for cells in groups.values() if mode == "yes" or len(cells) > 1 for i in cells}


def _group_key(setting: Cell) -> tuple[str, int, bool]:
    """Cells with the same key replay one recording: same task, length and place of the question."""
    return setting.task_name, setting.context_length, caps.question_in_prompt(setting.method)


def run_group(
    *,
    model: Any,
    encoder: PromptEncoder,
    cells: Sequence[CellRun],
    batch_size: int,
    query_aware: bool,
    seed: int,
    progress: Callable[[int], None] | None = None,
    throttle_s: float = 0.0,
) -> list[dict[str, Any]]:
    """Runs cells of one group (`_group_key`), one recorded prefill per batch; returns each cell's metrics."""
    task, samples = cells[0].task, cells[0].samples
    question_in_prompt = caps.question_in_prompt(cells[0].setting.method)
    # The layer inputs some cell reads are recorded for the whole group; no other (hidden states cost L * B * T * D).
    layer_inputs = shared_prefill.recorded_inputs(cell.setting.method for cell in cells)
    tokenizer = encoder.tokenizer
    done = [cell.run_dir.done_ids() for cell in cells]
    todo = [s for s in samples if any(s.id not in d for d in done)]
    for batch in _batches(todo, batch_size):
        encoded = [encoder.encode(task, s, query_aware=query_aware) for s in batch]
        max_new = max(s.max_new_tokens for s in batch)
        start = time.perf_counter()
        rec = shared_prefill.record(model, [c for c, _ in encoded], question_ids=[q for _, q in encoded],
                                    question_in_prompt=question_in_prompt, layer_inputs=layer_inputs)
        rec.last_hidden.block_until_ready()
        shared_s = time.perf_counter() - start
        for cell, cell_done in zip(cells, done, strict=True):
            if all(s.id in cell_done for s in batch):
                continue
            release_if_needed()  # each cell compiles its own programs (see kvjax.runtime.compiled_memory)
            method = cell.setting.method
            replayed_before = shared_prefill.replay_seconds(rec, method, max_new_tokens=max_new) > 0
            start = time.perf_counter()
            state = shared_prefill.prefill_from(model, rec, method, max_new_tokens=max_new,
                                                kv_dtype=cell.setting.kv_dtype)
            state.logits.block_until_ready()
            compress_s = time.perf_counter() - start
            # A context replay (KVzip) runs once per batch for every amount: each cell is charged its full cost.
            replay_s = shared_prefill.replay_seconds(rec, method, max_new_tokens=max_new)
            if not replayed_before:
                compress_s -= replay_s
            prompt_lengths = np.asarray(state.prompt_lengths)
            cache_bytes = state.cache.nbytes // len(batch)
            start = time.perf_counter()
            tokens, counts, final_cache = decode(model, state, max_new_tokens=max_new, seed=seed)
            decode_s = time.perf_counter() - start
            kept_prompt, kept_generated = kept_tokens(layer_positions(final_cache), prompt_lengths, counts)
            n = len(batch)
            # prefill_s / ttft_s: what this cell alone would have paid (the shared forward + its compression).
            ttft = shared_s + replay_s + compress_s
            timings = {
                "prefill_s": ttft / n, "decode_s": decode_s / n, "ttft_s": ttft,
                "shared_forward_s": shared_s / n, "compress_s": compress_s / n,
            }
            if replay_s:
                timings["replay_s"] = replay_s / n
            for i, sample in enumerate(batch):
                if sample.id in cell_done:
                    continue
                cell.run_dir.append(batch_record(
                    task, tokenizer, cell.setting, sample, encoded[i], tokens[i], counts[i], timings,
                    (kept_prompt[i], kept_generated[i], prompt_lengths[i]), cache_bytes, shared_prefill=True,
                    kv_bits_per_value=kv_bits_per_value(cell.setting.kv_dtype, model),
                ))
                if progress is not None:
                    progress(1)
                if throttle_s:
                    time.sleep(throttle_s)
    return [finish_setting(cell.run_dir, cell.setting) for cell in cells]


def run_queued(cells: Sequence[CellRun], **kwargs: Any) -> list[dict[str, Any]]:
    """`run_group` over the queued cells grouped by `_group_key`, in the order first queued."""
    groups: dict[tuple[str, int, bool], list[CellRun]] = {}
    for cell in cells:
        groups.setdefault(_group_key(cell.setting), []).append(cell)
    rows = []
    for group in groups.values():
        rows += run_group(cells=group, **kwargs)
    return rows
