"""`compactor`: Compactor, "Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores"
(Chari and Van Durme, 2025; kvpress's `CompactorPress`). The leaderboard runs it under Ada-KV's head budgets:
`adakv` with `base="compactor"` (its scores are z-scores over every head of the layer, so they compare across
heads).

Two query-agnostic signals, each z-normalised over the layer's heads and the scored tokens, blended:

1. Approximate leverage of the pre-RoPE keys: with `X` the keys centred over the sequence and a right Gaussian
   sketch `Phi` (`d x sketch_dimension`, entries `N(0, 1 / sketch_dimension)`), `l_i = x_i Phi (Phi^T X^T X
   Phi + ridge I)^{-1} Phi^T x_i^T`, the statistical leverage of token `i` in the sketched key matrix: outlier
   keys, which no mixture of the others reproduces, score high. Where the Cholesky factor of that matrix fails
   (float32, an ill-conditioned layer), the ridge grows as kvpress's jitter does (`ridge`, then 10x, up to 5
   tries; the example's heads together).
2. Non-causal chunked attention: the prompt is cut into chunks of `chunk_size` tokens; inside each, every query
   attends every key of the chunk (no causal mask, unscaled logits as kvpress), and a key scores the sum of the
   attention its chunk's queries pay it, averaged over the GQA group, times `||v_i||`, then average-pooled over
   3 neighbours. A partial last chunk of `m < chunk_size` tokens (`partial_chunk`): "fill" (default, the
   authors' code: kvpress's `CompactorPress` pads it to a full chunk whose missing query rows spread uniform
   attention over the chunk, so each of its keys gains `(chunk_size - m) / chunk_size`, and compactor-vllm fills
   its last 64-row tile alike; its queries attend its real keys only); "kvpress" (kvpress 0.5.5 as it runs: also
   its zero padding keys sit in every real query's softmax at logit 0, a mask value of -1e-9 where compactor-vllm
   masks them out); "drop" (the real tokens only, no filled mass).

`score = blending * z(l) + z(attention)`; the first `sink_size_start` and the last `sink_size_end` tokens are
always kept (the budget counts them: a smaller budget keeps the first ones, then the last) and are left out of both
signals. Defaults are kvpress 0.5.5's
(`sink_size_start=8`, `sink_size_end=4`, `chunk_size=256`, `sketch_dimension=48`, `ridge=1e-2`: the jitter of
its Cholesky solve, `blending=None`: the compression ratio, or with `budget=` each example's `1 - budget / n`).

Departures (no flag): the sketch comes from `seed` and the layer index (`gaussian_sketch`; kvpress draws it from
torch's global generator; with a ridge the leverage depends on the sketch even when `sketch_dimension >=
head_dim`); z-scores and the jitter escalation are per example (kvpress's span the batch). One-shot only: the
chunk attention needs every prompt query, so a chunked prefill (`chunk_size=` smaller than the prompt) is
refused with an error, as kvpress supports prefill only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.common import PARTIAL_CHUNK, cache_key_leverage, chunk_attention_scores, z_scores
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.select import protect_regions
from kvjax.validation import check_int, check_number

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class Compactor(ScoringMethod):
    """Blend of sketched key leverage and non-causal chunked attention (z-scores); `sink_size_start` 8 and
    `sink_size_end` 4 tokens kept. kvpress's `CompactorPress` defaults."""

    name = "compactor"
    reads_every_query_row = True

    sink_size_start: int = 8
    sink_size_end: int = 4
    chunk_size: int = 256
    sketch_dimension: int = 48
    blending: float | None = None
    ridge: float = 1e-2
    seed: int = 0
    partial_chunk: str = "fill"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "sink_size_start", self.sink_size_start, 0)
        check_int(self.name, "sink_size_end", self.sink_size_end, 0)
        check_int(self.name, "chunk_size", self.chunk_size, 1)
        check_int(self.name, "sketch_dimension", self.sketch_dimension, 1)
        check_int(self.name, "seed", self.seed, 0)
        if self.partial_chunk not in PARTIAL_CHUNK:
            raise ConfigError(f"{self.name}: partial_chunk must be one of {PARTIAL_CHUNK}, got {self.partial_chunk!r}")
        check_number(self.name, "blending", self.blending, 0, optional=True)
        check_number(self.name, "ridge", self.ridge, 0)

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array:
        """The first `sink_size_start` and last `sink_size_end` tokens, never more than the budget: a smaller budget
        keeps the first ones first (kvjax's ties: the lower position), then the last."""
        start = jnp.minimum(self.sink_size_start, budget)
        end = jnp.minimum(self.sink_size_end, budget - start)
        return protect_regions(cache, sink=start, recent=end, last=False)

    def blend(self, cache: KVCache, step: Step) -> Array:
        """`[B, 1, 1]` weight of the leverage z-scores."""
        if self.blending is not None:
            weight = jnp.full(step.budget.shape, self.blending, jnp.float32)
        elif self.compression_ratio is not None:
            weight = jnp.full(step.budget.shape, self.compression_ratio, jnp.float32)
        else:
            seen = jnp.maximum(jnp.sum(step.positions >= 0, axis=1), 1).astype(jnp.float32)
            weight = jnp.maximum(1.0 - step.budget.astype(jnp.float32) / seen, 0.0)
        return weight[:, None, None]

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        if not step.final_chunk:
            raise ConfigError(f"{self.name}: scores with every prompt query at once; chunked prefill is not supported")
        stored = kvc.stored_mask(cache)
        middle = stored if protect is None else stored & ~protect
        leverage = cache_key_leverage(cache, middle, step, self.seed, self.sketch_dimension, self.ridge)
        attention = chunk_attention_scores(q, cache, middle, self.sink_size_start, self.chunk_size,
                                           self.partial_chunk)
        score = self.blend(cache, step) * z_scores(leverage, middle) + z_scores(attention, middle)
        return jnp.where(middle, score, 0.0)
