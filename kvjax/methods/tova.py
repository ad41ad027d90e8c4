"""`tova`: TOVA, Token Omission Via Attention, from "Transformers are Multi-State RNNs" (Oren et al.,
EMNLP 2024).

The cache is a fixed-size multi-state of `budget` tokens. Whenever it would hold more, the token
with the lowest attention from the **current query** is dropped, the attention being the softmax
row of that query averaged over the heads of the layer (the reference `TOVACache.reduce` averages
the head axis and drops the same tokens from every head):

* Prefill: the last prompt token's attention row (`ops.scoring.window_scores` with `window=1`)
  ranks every prompt token; the top `budget` are kept (ties: lower position).
* Decode: the new token is appended and attends the `budget` kept tokens plus itself (capacity
  `budget + 1`); `observe` takes that same step's attention row and evicts its lowest token. As in
  the paper and the reference cache (which reduces after the attention of the current step), the
  current token is a candidate too: it is dropped if it gets the lowest weight from its own query.
  `protect_last=True` always keeps it (kvpress's TOVA protects the last prompt token this way).
  The protocol's `decode` hook runs before the token attends, so the eviction lives in `observe`,
  which receives the step's probabilities: no second attention row is computed.

Averaging (`head_reduce`): `"all"` (default, the paper) averages over every query head of the
layer, so all KV heads of a layer keep the same tokens (their slots stay aligned: prefill keeps
the same positions in position order and each step evicts the same slot); `"group"` averages each
KV head's GQA group and lets KV heads choose independently.

Budget semantics as `h2o`: `budget=` is the multi-state size (a short prompt's cache grows with
generated tokens up to it); with `compression_ratio`, each example's prompt budget.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.methods.base import Step
from kvjax.methods.capabilities import AttentionObserver
from kvjax.methods.common import cache_limit, lowest_slot, rolling_capacity
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.scoring import window_scores
from kvjax.ops.select import protect_regions
from kvjax.validation import check_bool, check_choice

Array = jax.Array

HEAD_REDUCE = ("all", "group")


@register
@dataclasses.dataclass(frozen=True)
class TOVA(ScoringMethod, AttentionObserver):
    """Keep the tokens the current query attends most (mean over the layer's heads); fixed size."""

    name = "tova"

    head_reduce: str = "all"
    protect_last: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.name, "head_reduce", self.head_reduce, HEAD_REDUCE)
        check_bool(self.name, "protect_last", self.protect_last)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return rolling_capacity(self, prompt_len, max_new_tokens)

    def _reduce(self, per_kv_head: Array) -> Array:
        """`[B, K, C]` group means -> the score each KV head ranks by."""
        if self.head_reduce == "group":
            return per_kv_head
        return jnp.broadcast_to(jnp.mean(per_kv_head, axis=1, keepdims=True), per_kv_head.shape)

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array | None:
        return protect_regions(cache, last=True) if self.protect_last else None

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        """The last query's attention over the cache, `[B, K, C]` float32."""
        stored = kvc.stored_mask(cache)
        row = window_scores(q, step.positions, kvc.keys(cache), cache.pos, stored, window=1, group_reduce="mean")
        return jnp.where(stored, self._reduce(row), 0.0)

    def observe(self, cache: KVCache, weights: Array, step: Step) -> KVCache:
        """Over the limit, drops the token the step's query attended least (ties: latest position)."""
        stored = kvc.stored_mask(cache)
        score = self._reduce(jnp.mean(weights, axis=2))
        candidates = stored
        if self.protect_last:
            candidates = stored & ~protect_regions(cache, last=True)
        over = (cache.length > cache_limit(self, step)[:, None]) & jnp.any(candidates, axis=-1)
        return kvc.evict(cache, lowest_slot(score, candidates, cache.pos), where=over)
