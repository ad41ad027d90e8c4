"""`non_causal_attention`: non-causal chunked attention, the query-reading half of Compactor ("Calibrated
Query-Agnostic KV Cache Compression with Approximate Leverage Scores", Chari and Van Durme, 2025; kvpress's
`NonCausalAttnPress`).

A causal prompt pass lets a key be attended only by the queries after it, so the last tokens look unimportant
whatever they hold. Here every query of a chunk attends every key of the chunk instead:

1. The prompt is cut into chunks of `chunk_size` tokens from its start; inside each, the softmax of the unscaled
   logits `q k^T` over the chunk's keys, without a causal mask.
2. A key scores the attention its chunk's queries pay it (summed over the rows, averaged over the GQA group),
   times `||v_i||`, average-pooled over 3 neighbours.
3. The scores are z-normalised over the example's heads and tokens, so `adakv` with `base="non_causal_attention"`
   compares them across heads.

A partial last chunk of `m < chunk_size` tokens (`partial_chunk`), as in `compactor`: "fill" (default, the
Compactor authors' code: the missing query rows spread uniform attention over the chunk, each of its keys gaining
`(chunk_size - m) / chunk_size`), "kvpress" (kvpress 0.5.5 as it runs: its zero padding keys also sit in every real
query's softmax at logit 0), "drop" (the real tokens only). Nothing is protected; each head keeps its `budget` best
keys. Defaults are kvpress 0.5.5's (`chunk_size=256`). `leverage` is Compactor's other half; `compactor` blends
the two (and protects sinks).

Departure (no flag), as Compactor's: the z-score is per example (kvpress's spans the batch; it changes no head's
ranking). One-shot only: the chunks need every prompt query, so a chunked prefill (`chunk_size=` of `generate`
smaller than the prompt) is refused with an error, as kvpress scores prefill only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.common import PARTIAL_CHUNK, chunk_attention_scores, z_scores
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.validation import check_int

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class NonCausalAttention(ScoringMethod):
    """Keep each head's keys of most non-causal chunked attention times `||v||` (z-scored). kvpress's
    `NonCausalAttnPress` defaults."""

    name = "non_causal_attention"
    reads_every_query_row = True

    chunk_size: int = 256
    partial_chunk: str = "fill"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "chunk_size", self.chunk_size, 1)
        if self.partial_chunk not in PARTIAL_CHUNK:
            raise ConfigError(f"{self.name}: partial_chunk must be one of {PARTIAL_CHUNK}, got {self.partial_chunk!r}")

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        if not step.final_chunk:
            raise ConfigError(f"{self.name}: scores with every prompt query at once; chunked prefill is not supported")
        stored = kvc.stored_mask(cache)
        attention = chunk_attention_scores(q, cache, stored, 0, self.chunk_size, self.partial_chunk)
        return jnp.where(stored, z_scores(attention, stored), 0.0)
