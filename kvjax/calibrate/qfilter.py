"""Q-Filters from calibration text (Godey et al., 2025, arXiv 2503.02812; the recipe of the official
`make_filters.py`, reimplemented).

Per layer and query head (the global layers of a model with sliding-window layers, the ones `qfilter` acts on): the
post-RoPE queries of the calibration prompts (a seeded random subset of
`svd_samples` positions, the same positions for every head) form a matrix `Q` `[S, H]`, uncentred; its first
right singular vector `v` is the head's direction, its sign chosen so that most of the sampled queries project
positively on it (more than half of the first left singular vector's entries positive). The filter stored is
`-v`: kvjax's `qfilter` scores a key `-<f, k>` = `<v, k>`, so the keys kept are those the typical query attends.
A KV head's filter is the mean of its GQA group's query-head filters (query head `n` belongs to KV head
`n // group`, the layout of `q_proj` and of the fused `qkv`), not renormalised, as the official code averages
them.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.calibrate.activations import run_layers
from kvjax.methods.qfilter import DIR_SUFFIX, write_qfilters

#: The official script's defaults: 3000 sampled query positions per layer, 2048-token sequences.
SVD_SAMPLES = 3000


def sample_positions(lengths: list[int], count: int, seed: int) -> list[np.ndarray]:
    """For prompts of `lengths` tokens, the positions of each prompt among `count` drawn uniformly without
    replacement from all of them (seeded; every position when they hold fewer)."""
    total = sum(lengths)
    chosen = np.sort(np.random.default_rng(seed).permutation(total)[:count])
    starts = np.cumsum([0, *lengths])
    return [chosen[(chosen >= a) & (chosen < b)] - a for a, b in zip(starts[:-1], starts[1:], strict=True)]


@jax.jit
def _head_filters(queries: jax.Array) -> jax.Array:
    """`[N, H]` query-head filters `-sign * v1` of queries `[N, S, H]` (float32 SVD per head)."""
    u, _, vh = jnp.linalg.svd(queries.astype(jnp.float32), full_matrices=False)
    sign = jnp.where(jnp.mean((u[:, :, 0] > 0).astype(jnp.float32), axis=-1) > 0.5, 1.0, -1.0)
    return -sign[:, None] * vh[:, 0, :]


def filters_from_queries(queries: np.ndarray, kv_heads: int) -> np.ndarray:
    """`[K, H]` float32 filters of one layer from its sampled post-RoPE queries `[S, N, H]`."""
    s, n, h = queries.shape
    per_head = np.asarray(_head_filters(jnp.asarray(np.swapaxes(queries, 0, 1))))
    return per_head.reshape(kv_heads, n // kv_heads, h).mean(axis=1).astype(np.float32)


def collect_queries(model: Any, prompts: list[list[int]], svd_samples: int, seed: int,
                    progress: Callable[[], None] | None = None) -> list[np.ndarray]:
    """Per global layer (every layer of a model without sliding windows; on Gemma 3 the ones a method acts on,
    `ModelConfig.global_layers`), the post-RoPE queries `[S, N, H]` at the sampled positions of every prompt, in
    order; `progress()`: after each prompt."""
    picks = sample_positions([len(p) for p in prompts], svd_samples, seed)
    per_layer: dict[int, list[np.ndarray]] = {layer: [] for layer in model.config.global_layers}

    def add(a: Any, rows: np.ndarray) -> None:
        if a.layer in per_layer:
            per_layer[a.layer].append(a.q[rows])

    for tokens, rows in zip(prompts, picks, strict=True):
        if len(rows):
            run_layers(model, tokens, lambda a, rows=rows: add(a, rows))
        if progress is not None:
            progress()
    return [np.concatenate(chunks) for chunks in per_layer.values()]


def calibrate(model: Any, prompts: list[list[int]], out: pathlib.Path, *, model_name: str, seed: int,
              svd_samples: int = SVD_SAMPLES, log: Any = print,
              progress: Callable[[], None] | None = None) -> pathlib.Path:
    """Writes `out/<model_name>_qfilt` (the published layout `qfilter` reads) and returns it."""
    start = time.perf_counter()
    queries = collect_queries(model, prompts, svd_samples, seed, progress)
    filters = np.stack([filters_from_queries(q, model.config.num_kv_heads) for q in queries])
    directory = write_qfilters(out / f"{model_name}{DIR_SUFFIX}", filters)
    log(f"qfilter: {len(queries)} layers x {filters.shape[1]} KV heads from {queries[0].shape[0]} queries per head "
        f"({len(prompts)} prompts) in {time.perf_counter() - start:.1f} s -> {directory}")
    return directory


__all__ = ["SVD_SAMPLES", "calibrate", "collect_queries", "filters_from_queries", "sample_positions"]
