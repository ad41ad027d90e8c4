"""`observed_attention`: the attention each prompt token received, averaged over the prompt queries that saw it
(kvpress's `ObservedAttentionPress`, after H2O's accumulated attention: Zhang et al., NeurIPS 2023).

Per query head, `S_j = (1 / (n - j)) sum_{i >= j} softmax(q_i K^T / sqrt(d))[j]`: the column sum of the causal
attention over every prompt row (H2O's accumulated score, float32, blockwise, never `T x T`) divided by the
number of rows that could attend token `j` (`n - j` for a prompt of `n` tokens at positions `0 .. n - 1`), so
late tokens are not penalised for being seen by fewer queries. Scores are averaged over each GQA group (kvpress),
and each KV head keeps its `budget` best tokens after prefill; nothing is protected and nothing is evicted
during decoding.

This is not `h2o`: H2O keeps the raw sums (no division by `n - j`), protects a recent window and evicts at
every decode step. With chunked prefill each chunk scores with its own rows (the average over the chunk's rows
at or after `j`), and the cache is brought back to its budget after every chunk.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.methods.base import Step
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.scoring import accumulated_scores

Array = jax.Array


def rows_seeing(q_pos: Array, k_pos: Array) -> Array:
    """`[B, K, C]` how many valid query rows (positions `q_pos` `[B, T]`, -1 = padding, contiguous per example)
    sit at or after each key position `k_pos` `[B, K, C]`."""
    valid = q_pos >= 0
    first = jnp.min(jnp.where(valid, q_pos, jnp.iinfo(jnp.int32).max), axis=1)[:, None, None]
    last = jnp.max(jnp.where(valid, q_pos, -1), axis=1)[:, None, None]
    return jnp.clip(last - jnp.maximum(k_pos, first) + 1, 0, None)


@register
@dataclasses.dataclass(frozen=True)
class ObservedAttention(ScoringMethod):
    """Keep the tokens with the highest attention averaged over the prompt queries that saw them."""

    name = "observed_attention"
    layer_inputs = frozenset({"attention_lse"})

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        stored = kvc.stored_mask(cache)
        lse = step.attention_lse if cache.attend is None else None
        sums = accumulated_scores(q, step.positions, cache.k, cache.pos, stored, group_reduce="mean", lse=lse)
        count = rows_seeing(step.positions, cache.pos)
        return jnp.where(stored & (count > 0), sums / jnp.maximum(count, 1).astype(jnp.float32), 0.0)
