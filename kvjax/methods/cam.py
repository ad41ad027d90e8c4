"""`cam`: CaM, cache merging while decoding (Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs
Inference", ICML 2024), in kvpress 0.5.5's batched form (`CAMPress`, a `DecodingPress`).

Evicting a token drops what attention would still have read from its value. CaM first merges the value of an
evicted token into the kept tokens that follow it, with a probability that grows with the attention the token
received, then evicts. Per layer, while decoding:

* every decode step adds the step's attention (mean over each GQA group) to a running sum `A` per KV head and slot
  (float32; it starts at the first decode step, so prompt tokens start from 0);
* once `compression_interval` decode steps have passed and the cache holds more than `target_size` tokens (at every
  step while `target_size` is 1, as kvpress's hook compresses when `q_len >= target_size`), the base
  (`base`, default KNorm) scores every slot with the recent decode queries (the last `query_buffer_size`, as
  `decoding`), the scores are averaged over the KV heads, and the best `target_size` slots are kept, the same slots
  in every head;
* of the evicted slots, the `k` best scored (`k` = decode steps since the last compression; ties: the later slot
  first) are merged: a merged slot `i`'s window is the `merge_budget` kept slots after it (fewer at the end), and in
  each KV head its value joins them with probability `p = clamp(A_i / mean(A_window), 0, 1)`: a Bernoulli draw
  (a counter-based hash of `seed`, layer, head and position) adds `v_i / |window|` to every value of the window;
* the evicted slots go, with their running sums. The counter restarts.

`compression_interval=1` is CaM's own per-step merging. Slots, as in kvpress, are the cache's order (positions, as
kvjax keeps them). kvpress's base scores the buffered hidden states; here the base reads the buffered post-RoPE
queries (SnapKV's window is their last `window_size`). With `budget` / `compression_ratio` the base also compresses
the prompt (kvpress's `PrefillDecodingPress` combination), else the prompt is kept whole, as `CAMPress` alone.

Departures (no flag): the running sum is float32 (kvpress keeps it in the model's dtype), the values are merged in
float32 before they are stored in the cache's dtype, the top-`target_size` ties go to the lower slot, and the draws
are kvjax's hash, not torch's generator. kvpress compresses right after the step that reaches the interval has
attended; so does kvjax (`observe`), so the cache the next token attends is the same.

Capacity: the prompt's part (its budget) plus at most `compression_interval` tokens over `max(prompt part,
target_size)`, never more than the prompt plus the new tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.methods.base import Step
from kvjax.methods.capabilities import AttentionObserver
from kvjax.methods.common import token_uniform
from kvjax.methods.decoding import Decoding
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.methods.wrapper import check_self_contained_base
from kvjax.validation import check_int

Array = jax.Array

STEPS, QUERIES, QUERY_POS = "cam_steps", "cam_queries", "cam_query_pos"


def merge_windows(keep: Array, merge: Array, budget: int) -> tuple[Array, Array, Array]:
    """Where each merged slot's values go: the `budget` kept slots after it.

    `keep`, `merge`: `[B, C]` bool. Returns `(order, start, size)`: `order` `[B, C]` the kept slots first in slot
    order (`order[:, t]` is the t-th kept slot), `start` `[B, C]` the index among the kept slots of the first one
    after each slot, `size` `[B, C]` int32 its window's length (`min(budget, kept - start)`, 0 off `merge`)."""
    slots = jnp.arange(keep.shape[-1], dtype=jnp.int32)
    order = jnp.argsort(jnp.where(keep, slots, slots + keep.shape[-1]), axis=-1).astype(jnp.int32)
    start = jnp.cumsum(keep, axis=-1, dtype=jnp.int32)  # kept slots at or before each slot: after it, for a merged one
    kept = jnp.sum(keep, axis=-1, dtype=jnp.int32)[:, None]
    size = jnp.where(merge, jnp.clip(kept - start, 0, budget), 0)
    return order, start, size


@register
@dataclasses.dataclass(frozen=True)
class CAM(Decoding, AttentionObserver):
    """Every `compression_interval` (512) decode steps, back to `target_size` (2048) slots by `base`'s scores
    ("knorm") averaged over the heads, the best evicted ones first merged into the `merge_budget` (32) kept slots
    after them with CaM's attention-ratio probability. `decoding`'s hyperparameters, prompt budget and capacity
    (kvpress's `CAMPress` is a `DecodingPress`), compressing in `observe` instead of `decode`."""

    name = "cam"
    uses_score = True  # the running attention sum

    merge_budget: int = 32
    seed: int = 0

    def check_own_hyperparameters(self) -> None:
        super().check_own_hyperparameters()
        check_int(self.name, "merge_budget", self.merge_budget, 1)
        check_int(self.name, "seed", self.seed, 0)

    def check_base(self, inner: ScoringMethod) -> None:
        super().check_base(inner)
        check_self_contained_base(self.name, inner, "a scoring of the cache while decoding")

    @property
    def buffer(self) -> int:
        """Decode queries kept for scoring (the ring's length; the compression may come later than the interval)."""
        return max(1, self.query_buffer_size)

    def _bound(self, kept: int, total: int, max_new_tokens: int) -> int:
        """Slots of a layer whose prefill keeps at most `kept`: it grows by a token a step and is compressed back to
        `target_size`, in the step's `observe`, once `compression_interval` steps have passed and it holds more."""
        return min(kept + max_new_tokens, max(kept, self.target_size) + self.compression_interval)

    def init_cache_state(self, spec: Any) -> dict[str, Any]:
        state = dict(self.inner.init_cache_state(spec))
        state[STEPS] = np.zeros((spec.batch,), np.int32)
        state[QUERIES] = np.zeros((spec.batch, self.buffer, spec.num_heads, spec.head_dim), np.float32)
        state[QUERY_POS] = np.full((spec.batch, self.buffer), -1, np.int32)
        return state

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Keeps the step's query in the ring (at its position modulo the ring's length)."""
        real = step.positions[:, 0] >= 0
        hit = (jnp.arange(self.buffer)[None] == step.positions[:, :1] % self.buffer) & real[:, None]  # [B, W]
        state = dict(cache.state)
        state[QUERIES] = jnp.where(hit[..., None, None], q.astype(jnp.float32), state[QUERIES])
        state[QUERY_POS] = jnp.where(hit, step.positions, state[QUERY_POS])
        return cache.replace(state=state)

    def observe(self, cache: KVCache, weights: Array, step: Step) -> KVCache:
        """Adds the step's attention to the running sum; where the interval has passed and the cache holds more than
        `target_size`, merges and evicts (`merge_and_evict`)."""
        stored = kvc.stored_mask(cache)
        score = jnp.where(stored, cache.score + jnp.mean(weights, axis=2), 0.0)
        real = step.positions[:, 0] >= 0
        steps = cache.state[STEPS] + real.astype(jnp.int32)
        due = real & (steps >= self.compression_interval) & (jnp.max(cache.length, axis=-1) > self.target_size)
        due = due | (real & (self.target_size <= 1))  # kvpress: at every token while the target is one slot
        state = dict(cache.state)
        state[STEPS] = jnp.where(due, 0, steps)
        cache = cache.replace(score=score, state=state)
        return jax.lax.cond(jnp.any(due), lambda c: self.merge_and_evict(c, due, steps, step), lambda c: c, cache)

    def merge_and_evict(self, cache: KVCache, due: Array, merged: Array, step: Step) -> KVCache:
        """The compression of the rows `due` `[B]`; `merged` `[B]`: how many evicted slots each row merges."""
        batch, heads, slots = cache.pos.shape
        stored = kvc.stored_mask(cache)
        valid = stored[:, 0]  # [B, C]: every head holds the same number of slots
        target = jnp.full((batch,), self.target_size, jnp.int32)
        scoring = dataclasses.replace(step, positions=cache.state[QUERY_POS], budget=target)
        protect = self.inner.protected(cache, target, scoring)
        scores = self.inner.scores(cache, cache.state[QUERIES], scoring, protect).astype(jnp.float32)
        if protect is not None:
            scores = jnp.where(protect, jnp.inf, scores)
        mean = jnp.where(valid, jnp.mean(jnp.where(stored, scores, 0.0), axis=1), -jnp.inf)  # [B, C]
        slot = jnp.arange(slots, dtype=jnp.int32)
        rank = jnp.argsort(jnp.argsort(-mean, axis=-1, stable=True), axis=-1)  # 0 = best; ties to the lower slot
        keep = valid & (rank < self.target_size)
        evicted = valid & ~keep
        # the best evicted first, ties to the later slot (a stable sort of the evicted slots taken latest first)
        key = jnp.where(evicted, -mean, jnp.inf)
        by_score = jnp.lexsort((slots - 1 - slot[None].repeat(batch, 0), key), axis=-1)
        merge = evicted & (jnp.argsort(by_score, axis=-1) < merged[:, None])
        order, start, size = merge_windows(keep, merge, self.merge_budget)

        running = cache.score  # [B, K, C]
        values = kvc.values(cache, jnp.float32)

        def window_slots(offset: int | Array) -> tuple[Array, Array]:
            """The kept slot `offset` places into each merged slot's window `[B, C]`, and whether it is in it."""
            inside = offset < size
            return jnp.take_along_axis(order, jnp.minimum(start + offset, slots - 1), axis=-1), inside

        def window_sum(offset: Array, total: Array) -> Array:
            target_slot, inside = window_slots(offset)
            seen = jnp.take_along_axis(running, jnp.broadcast_to(target_slot[:, None], running.shape), axis=-1)
            return total + jnp.where(inside[:, None], seen, 0.0)

        total = jax.lax.fori_loop(0, self.merge_budget, window_sum, jnp.zeros_like(running))
        width = jnp.maximum(size, 1).astype(jnp.float32)[:, None]  # [B, 1, C]
        ratio = running / (total / width)
        ratio = jnp.where(jnp.isnan(ratio), 0.0, jnp.where(jnp.isinf(ratio), 1.0, ratio))
        draw = token_uniform(self.seed, step.layer, cache.pos) < jnp.clip(ratio, 0.0, 1.0)  # [B, K, C]
        share = jnp.where(draw & merge[:, None] & (size > 0)[:, None], 1.0 / width, 0.0)
        sent = values * share[..., None]  # [B, K, C, H] what each merged slot adds to each slot of its window

        def add(offset: Array, out: Array) -> Array:
            target_slot, inside = window_slots(offset)
            gift = jnp.where(inside[:, None, :, None], sent, 0.0)
            rows = jnp.arange(batch)[:, None, None]
            return out.at[rows, jnp.arange(heads)[None, :, None], target_slot[:, None, :]].add(gift)

        merged_values = jax.lax.fori_loop(0, self.merge_budget, add, values)
        after = kvc.keep_where(kvc.with_values(cache, merged_values), keep[:, None] & stored, cache.capacity)
        return kvc.select_rows(due, after, cache)  # a row not due (or inactive in the engine) stays as it was


__all__ = ["CAM", "merge_windows"]
