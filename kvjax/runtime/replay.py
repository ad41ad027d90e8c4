"""The context replay of `ContextReplay` methods (KVzip): after an uncompressed prefill, the model reads the
method's replay rows (a repeat prompt + the context again, chunk by chunk) over the prompt's cache, every layer's
attention reports to the method, and the method compacts all layers at once into the compressed capacity.

The prefill plan (`kvjax.runtime.stages.plan`) calls `check` before allocating (the prompt is prefilled at its full
bucket), then the context-replay stage calls `run` (`score`, then `compact`); a shared-prefill sweep scores once per
batch and compacts once per cell.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from kvjax.cache import ModelCache
from kvjax.errors import ConfigError, KvjaxError
from kvjax.methods import capabilities as caps
from kvjax.methods.base import Method
from kvjax.runtime import forward

Array = jax.Array


def check(method: Method, config: Any, quant: Any, mesh: Any, longest: int) -> None:
    """Refuses what the replay does not support yet, with the reason, before anything is traced."""
    if quant is not None:
        raise ConfigError(f"{method.name}: the context replay needs the model-dtype cache (kv_dtype=None)")
    if mesh is not None:
        raise ConfigError(f"{method.name}: the context replay does not run on a mesh yet (mesh=None)")
    reach = longest + method.replay_width(longest)
    if reach > config.max_position_embeddings:
        raise KvjaxError(f"{method.name}: the prompt ({longest} tokens) and its replay rows reach position {reach}, "
                         f"beyond the model's {config.max_position_embeddings}")


def _bucket(n: int) -> int:
    """Replay rows' width: powers of two up to 256, then multiples of 256. A row is a chunk plus the repeat prompt's
    few dozen tokens, so a power of two would nearly double a 1K or 2K chunk's padded rows (1054 -> 2048)."""
    if n <= 256:
        return max(16, 1 << (max(n, 1) - 1).bit_length())
    return -(-n // 256) * 256


def run(config: Any, method: Method, weights: dict, rope: tuple, cache: ModelCache, tokens: np.ndarray,
        lengths: np.ndarray, budget: Any, capacity: int) -> ModelCache:
    """Every replay chunk of `method` over the prompts `tokens` `[B, T]` (`lengths` `[B]`) prefilled into `cache`,
    then the layers compacted into `capacity` slots (`budget` `[B]` tokens per KV head)."""
    return compact(method, config.layer_windows, capacity, score(config, method, weights, rope, cache, tokens, lengths),
                   budget)


def score(config: Any, method: Method, weights: dict, rope: tuple, cache: ModelCache, tokens: np.ndarray,
          lengths: np.ndarray) -> ModelCache:
    """The replay chunks alone: the uncompressed `cache` with the method's scores filled in. They depend on neither
    budget nor ratio, so cells that differ only in those can compact one scored cache each (the eval's sweeps)."""
    for rows, row_lengths, spans in method.replay_rows(tokens, lengths):
        width = _bucket(rows.shape[1])  # one compiled program per bucket, whatever the prompt
        padded = np.zeros((rows.shape[0], width), np.int32)
        padded[:, : rows.shape[1]] = rows
        steps = np.arange(width)[None]
        positions = np.where(steps < row_lengths[:, None], lengths[:, None] + steps, -1).astype(np.int32)
        chunk = forward.replay_gradient_chunk if caps.differentiates_replay(method) else forward.replay_chunk
        cache = chunk(config, weights, rope, method, cache, padded, positions, spans)
    return cache


def compact(method: Method, windows: tuple, capacity: int, scored: ModelCache, budget: Any) -> ModelCache:
    """A scored cache (`score`) compacted into `capacity` slots (`budget` `[B]` tokens per KV head); `scored` is
    left intact."""
    return _compress(method, windows, capacity, scored, np.asarray(budget, np.int32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))  # no donation: every output buffer is smaller
def _compress(method: Method, windows: tuple, capacity: int, cache: ModelCache, budget: Array) -> ModelCache:
    """The method compacts its layers (those without a window) at once; the rings stay as they are."""
    managed = [i for i, w in enumerate(windows) if w is None]
    compact = iter(method.replay_compress(tuple(cache.layers[i] for i in managed), budget, capacity))
    return cache.replace(layers=tuple(next(compact) if w is None else layer
                                      for layer, w in zip(cache.layers, windows, strict=True)))
