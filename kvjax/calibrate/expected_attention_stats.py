"""Expected Attention's query statistics from calibration text (the recipe of kvpress's `collect_queries` in
`expected_attention_with_stats.py`, reimplemented, on kvjax's synthetic tasks instead of BookSum).

Per layer the method acts on (every layer of a model without sliding windows; on Gemma 3 its global layers) and
query head: the pre-RoPE queries (after biases and QK-norm, before RoPE and any query scale) of every calibration
prompt, its first `n_sink` positions left out, pooled over the prompts; their mean and their covariance divided by
the count minus one. Accumulated in float64 (count, sum, sum of outer products), so only one layer's queries of one
prompt are held at a time. Written in kvpress's `ExpectedAttentionStats` layout, which `expected_attention_stats`
reads (`stats=`) and kvpress's `ExpectedAttentionStatsPress(stats_folder=...)` loads.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvjax.calibrate.activations import CALIBRATION_TASKS, run_layers
from kvjax.methods.expected_attention_stats import write_statistics

#: kvpress's default: the first 4 positions of each text are outliers (attention sinks).
N_SINK = 4
#: The directory `calibrate` writes under `--out`.
DIR_NAME = "expected_attention_stats"


def query_statistics(model: Any, prompts: list[list[int]], n_sink: int = N_SINK,
                     progress: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """`(mean [L, N, H], cov [L, N, H, H], queries per head)` of the pre-RoPE queries over `prompts`, float32."""
    layers = list(model.config.global_layers)
    n, h = model.config.num_heads, model.config.head_dim
    count = 0
    sums = np.zeros((len(layers), n, h))
    outer = np.zeros((len(layers), n, h, h))
    index = {layer: i for i, layer in enumerate(layers)}

    def add(a: Any) -> None:
        if a.layer in index:
            q = a.q_pre[n_sink:].astype(np.float64)  # [T - n_sink, N, H]
            sums[index[a.layer]] += q.sum(axis=0)
            outer[index[a.layer]] += np.einsum("tni,tnj->nij", q, q)

    for tokens in prompts:
        run_layers(model, tokens, add)
        count += max(len(tokens) - n_sink, 0)
        if progress is not None:
            progress()
    if count < 2:
        raise ValueError(f"{count} queries per head after the first {n_sink} positions of each prompt; need 2")
    mean = sums / count
    cov = (outer - count * np.einsum("lni,lnj->lnij", mean, mean)) / (count - 1)
    return mean.astype(np.float32), cov.astype(np.float32), count


def calibrate(model: Any, prompts: list[list[int]], out: pathlib.Path, *, model_name: str, seed: int,
              n_sink: int = N_SINK, log: Any = print, progress: Callable[[], None] | None = None) -> pathlib.Path:
    """Writes `out/expected_attention_stats` (the layout `expected_attention_stats` reads) and returns it."""
    start = time.perf_counter()
    mean, cov, count = query_statistics(model, prompts, n_sink, progress)
    folder = write_statistics(out / DIR_NAME, mean, cov, model_name=model_name,
                              dataset_name=f"kvjax synthetic tasks ({', '.join(CALIBRATION_TASKS)}), seed {seed}",
                              num_samples=len(prompts), sample_seq_len=max(len(p) for p in prompts), n_sink=n_sink)
    log(f"expected_attention_stats: {mean.shape[0]} layers x {mean.shape[1]} query heads from {count} queries per "
        f"head ({len(prompts)} prompts) in {time.perf_counter() - start:.1f} s -> {folder}")
    return folder


__all__ = ["DIR_NAME", "N_SINK", "calibrate", "query_statistics"]
