"""A DuoAttention head pattern estimated on the fly: kvpress's `duo_attention_on_the_fly` (its experimental
fallback for models without published patterns), reimplemented. NOT the paper's trained gates: DuoAttention
(Xiao et al., 2024) learns a gate per KV head by distilling the full-attention model on synthetic passkey data,
which is too heavy here.

The estimate, per prompt and layer: the mean pre-RoPE query of each query head and the mean pre-RoPE key of each
KV head (over the prompt's tokens) are placed at every position `0 .. q_len-1` (500) and rotated there; the last
position's query attends the `q_len` keys (softmax of `q . k / sqrt(head_dim)`, with the family's query scale), and
the head's score is the area under the cumulative attention curve (the mean over positions of the running sum of
the weights). A head whose attention, with the content averaged out, falls on the most recent positions scores
low; one that reaches back far scores high. Query heads are averaged over their GQA group, then the scores over
the prompts. `duo_attention` makes the lowest-scoring heads streaming heads; kvpress pairs this estimate with
`sink_size=128`, `recent_size=256`, written into the pattern's `config.json`.
"""

from __future__ import annotations

import functools
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.calibrate.activations import LayerActivations, run_layers
from kvjax.methods.duo_attention import CONFIG_FILE, write_attention_pattern
from kvjax.rope import apply_rope

#: kvpress's on-the-fly constants: the synthetic sequence length, and the sink / recent sizes it pairs them with.
Q_LEN = 500
SINK_SIZE = 128
RECENT_SIZE = 256


@functools.partial(jax.jit, static_argnums=(4, 5))
def head_scores(q_mean: jax.Array, k_mean: jax.Array, inv_freq: jax.Array, rope_scaling: jax.Array, q_len: int,
                query_scale: float) -> jax.Array:
    """`[K]` float32 scores of one layer from its mean pre-RoPE queries `[N, H]` and keys `[K, H]`."""
    n, h = q_mean.shape
    kv = k_mean.shape[0]
    positions = jnp.arange(q_len, dtype=jnp.int32)[None]
    keys = apply_rope(jnp.broadcast_to(k_mean.astype(jnp.float32), (1, q_len, kv, h)), positions, inv_freq,
                      rope_scaling)[0]  # [P, K, H]
    last = apply_rope(q_mean.astype(jnp.float32)[None, None], positions[:, -1:], inv_freq, rope_scaling)[0, 0]
    keys = keys[:, jnp.arange(n) // (n // kv)]  # [P, N, H]
    logits = jnp.einsum("nh,pnh->np", last * query_scale, keys) / np.sqrt(h)
    weights = jax.nn.softmax(logits, axis=-1)
    area = jnp.mean(jnp.cumsum(weights, axis=-1), axis=-1)  # [N]
    return area.reshape(kv, n // kv).mean(axis=1)


def estimate(model: Any, prompts: list[list[int]], q_len: int = Q_LEN, visit: Any = None,
             progress: Callable[[], None] | None = None) -> np.ndarray:
    """`[layers, K]` float64 scores averaged over `prompts`, a row per global layer (every layer of a model without
    sliding windows; on Gemma 3 the ones `duo_attention` acts on, `ModelConfig.global_layers`, with their RoPE).
    `visit(activations, scores)`: per such layer (tests); `progress()`: after each prompt."""
    config = model.config
    rows = {layer: row for row, layer in enumerate(config.global_layers)}
    scores = np.zeros((len(rows), config.num_kv_heads))
    inv_freq, scaling = model.rope(q_len)[:2]
    scale = float(getattr(config, "query_scale", 1.0))

    def add(a: LayerActivations) -> None:
        if a.layer not in rows:  # a sliding-window layer: no method acts on it
            return
        s = np.asarray(head_scores(a.q_pre.mean(0), a.k_pre.mean(0), inv_freq, jnp.float32(scaling), q_len, scale))
        scores[rows[a.layer]] += s.astype(np.float64) / len(prompts)
        if visit is not None:
            visit(a, s)

    for tokens in prompts:
        run_layers(model, tokens, add)
        if progress is not None:
            progress()
    return scores


def calibrate(model: Any, prompts: list[list[int]], out: pathlib.Path, *, model_name: str, seed: int,
              q_len: int = Q_LEN, log: Any = print, progress: Callable[[], None] | None = None) -> pathlib.Path:
    """Writes the pattern directory `out/duo_attention` (the official layout `duo_attention` reads)."""
    start = time.perf_counter()
    scores = estimate(model, prompts, q_len, progress=progress)
    directory = write_attention_pattern(out / "duo_attention", scores, sink_size=SINK_SIZE, recent_size=RECENT_SIZE,
                                        model_name=model_name)
    config = directory / CONFIG_FILE
    meta = json.loads(config.read_text())
    meta["kvjax_calibration"] = dict(recipe="kvpress duo_attention_on_the_fly (an estimate, not trained gates)",
                                     q_len=q_len, samples=len(prompts), seed=seed)
    config.write_text(json.dumps(meta, indent=1) + "\n")
    log(f"duo_attention: {scores.shape[0]} layers x {scores.shape[1]} KV heads from {len(prompts)} prompts in "
        f"{time.perf_counter() - start:.1f} s -> {directory}")
    return directory


__all__ = ["Q_LEN", "RECENT_SIZE", "SINK_SIZE", "calibrate", "estimate", "head_scores"]
