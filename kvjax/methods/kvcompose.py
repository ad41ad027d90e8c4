"""`kvcompose`: KVCompose, "Efficient Structured KV Cache Compression with Composite Tokens" (Akulov et al., 2025,
arXiv 2509.05165; kvpress 0.5.5's `KVComposePress`).

Scoring. After the prompt (`n` tokens, positions `0 .. n - 1`) is prefilled uncompressed, the model reads the
prompt again over its own cache: the replayed tokens sit at positions `n .. 2n - 1`, and at every layer each replayed
query `t` of query head `h` attends the whole cache and the replay's own tokens up to itself (causal, float32
softmax): `a_t = softmax([q_t K_ctx^T, q_t K_rep[:t+1]^T] / sqrt(d))`. Only the context columns are read:

    A_h[c]  = agg_task over replay rows t of a_t[c]              (agg_task "max", or "mean" over the n rows)
    S_k[c]  = agg_group over the query heads h of KV head k      (agg_group "mean", or "max")
    S_k[c] *= ||v_k[c]||                                          (add_v_norm, off by default)
    S_k[c] += mean over the layer's KV heads k' of S_k'[c]        (add_mean_across_heads, on by default)

Composite tokens (`structured=True`, the paper's method and the default). Each head's scores sorted in descending
order, `sort(S_k)[i]`, are its i-th best token; the layer's i-th composite token is all its heads' i-th best, scored
`C_l[i] = agg_head over k of sort(S_k)[i]` (agg_head "mean"). Layer 0's curve is replaced by the largest over all
layers, `C_0[i] = max_l C_l[i]` (kvpress: so that the first layer is the longest). One ranking over every layer's
composite scores keeps the best `T = max(1, floor(L * n * (1 - compression_ratio)))` (kvpress's `compute_n_kept` over
`L * n` entries; with `budget=`, `T = budget * L`); layer `l` keeps `n_l` of them, floored at
`max(1, keep_token_lower_bound)`, and every KV head of the layer keeps its own best `n_l` tokens: the layer stays a
dense `[K, n_l]` block. `keep_token_lower_bound` first puts each layer's best `keep_token_lower_bound` composite
tokens ahead of everything else.

`structured=False` (the unstructured variant): one ranking over every layer's and head's scores `S_k[c]` keeps the
best `max(1, floor(L * K * n * (1 - compression_ratio)))` (`budget * L * K`), each head's best
`keep_token_lower_bound` first; heads keep different counts.

Defaults are kvpress's (the paper gives no code; kvpress's press is the authors' reference): `structured=True`,
`agg_task="max"`, `agg_group="mean"`, `agg_head="mean"`, `add_v_norm=False`, `add_mean_across_heads=True`,
`keep_token_lower_bound=0`.

Memory: kvjax's caches have static shapes, so every layer is allocated at one per-head capacity,
`min(ceil(budget * max_head_share), n)` slots (`max_head_share` 2.0, as kvzip's) plus the new tokens; a layer's
count `n_l` (or a head's, unstructured) is capped there, and the capped layers' overflow goes to the next-best
composite tokens elsewhere (the best allocation under the cap; a large `max_head_share` matches kvpress, which is
uncapped). A layer that keeps fewer tokens leaves its other slots empty: decode attention reads `n_l`, the
allocation is the cap. The prefill holds the whole prompt's cache and scores the replay rows in blocks of
`REPLAY_ROW_BLOCK` (kvpress: the `[n, 2n]` weights of every head at once, and a cache of `2n`).

Runtime: the method has the `ContextReplay` capability: `kvjax.generate` prefills uncompressed, replays the prompt
once (`kvjax.runtime.replay`) and allocates every layer at once. Through the plain per-layer step API (no replay)
`prefill` scores each slot by the prompt's own causal attention instead (the same aggregation over the call's
rows) and each layer keeps `budget` per head (structured) or `budget * K` shared by its heads.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Method, Step
from kvjax.methods.capabilities import ContextReplay
from kvjax.methods.common import descending_rank, head_cap, self_read_probs
from kvjax.methods.registry import register
from kvjax.validation import check_bool, check_choice, check_number

Array = jax.Array

#: Replay rows scored at a time (their softmax over the cache and the rows is held for one block only).
REPLAY_ROW_BLOCK = 256

AGGREGATIONS = ("max", "mean")


def _aggregate(x: Array, how: str, axis: int) -> Array:
    return jnp.max(x, axis=axis) if how == "max" else jnp.mean(x, axis=axis)


def ratio_table(entries: int, capacity: int, ratio: float) -> np.ndarray:
    """`[capacity + 1]` int32: `max(1, int(entries * n * (1 - ratio)))` for `n = 0 .. capacity` (float64)."""
    tokens = (entries * np.arange(capacity + 1, dtype=np.int64)).astype(np.float64)
    return np.maximum(1, (tokens * (1.0 - float(ratio))).astype(np.int64)).astype(np.int32)


def allocate(scores: tuple[Array, ...], stored: tuple[Array, ...], total: Array, cap: Array, lower_bound: int,
             structured: bool, agg_head: str) -> tuple[Array, ...]:
    """Which slots each layer keeps (`[B, K, C]` bool per layer) from its final scores `[B, K, C]`.

    Structured: composite scores (each head's sorted scores aggregated over heads, layer 0 the largest over layers)
    ranked over every layer; layer `l` keeps `n_l` = its count among the best `total` `[B]`, floored at
    `max(1, lower_bound)`, capped at `cap` `[B]`, and each of its heads keeps its own best `n_l`. Unstructured: the
    best `total` scores over every layer and head, each head's best `lower_bound` first, at most `cap` per head.
    Ties: lower layer, head, then slot first."""
    keys = [jnp.where(ok, s.astype(jnp.float32), -jnp.inf) for s, ok in zip(scores, stored, strict=True)]
    ranks = [descending_rank(k) for k in keys]  # each head's own order of its tokens
    batch = keys[0].shape[0]
    cap = cap.astype(jnp.int32)
    low = jnp.minimum(lower_bound, cap)
    if not structured:
        flat = jnp.concatenate([jnp.where(ok & (r < low[:, None, None]), jnp.inf,
                                          jnp.where(r < cap[:, None, None], k, -jnp.inf)).reshape(batch, -1)
                                for k, r, ok in zip(keys, ranks, stored, strict=True)], axis=-1)
        picked = jnp.split((descending_rank(flat) < total[:, None]) & (flat > -jnp.inf), len(keys), axis=-1)
        return tuple(x.reshape(k.shape) for x, k in zip(picked, keys, strict=True))
    width = keys[0].shape[-1]
    sorted_ = [-jnp.sort(-k, axis=-1) for k in keys]  # [B, K, C], descending, unstored last
    composite = jnp.stack([_aggregate(s, agg_head, 1) for s in sorted_], axis=1)  # [B, L, C]
    rank = jnp.arange(width, dtype=jnp.int32)
    composite = jnp.where((rank < low[:, None])[:, None] & (composite > -jnp.inf), jnp.inf, composite)
    composite = composite.at[:, 0].set(jnp.max(composite, axis=1))
    composite = jnp.where((rank < cap[:, None])[:, None], composite, -jnp.inf)
    flat = composite.reshape(batch, -1)
    picked = (descending_rank(flat) < total[:, None]) & (flat > -jnp.inf)
    counts = jnp.sum(picked.reshape(composite.shape), axis=-1)  # [B, L]
    held = jnp.sum(stored[0][:, 0], axis=-1)  # [B] tokens per head (every head holds the prompt)
    counts = jnp.maximum(counts, jnp.maximum(1, lower_bound))
    counts = jnp.minimum(counts, jnp.minimum(cap, held)[:, None])
    return tuple(ok & (r < counts[:, i, None, None]) for i, (r, ok) in enumerate(zip(ranks, stored, strict=True)))


@register
@dataclasses.dataclass(frozen=True)
class KVCompose(Method, ContextReplay):
    """Composite tokens from the prompt's replayed attention (see the module docstring): `structured` (True),
    `agg_task` ("max"), `agg_group` ("mean"), `agg_head` ("mean"), `add_v_norm` (False), `add_mean_across_heads`
    (True), `keep_token_lower_bound` (0), `max_head_share` (2.0, the per-head capacity in units of the budget)."""

    name = "kvcompose"
    uses_score = True

    structured: bool = True
    agg_task: str = "max"
    agg_group: str = "mean"
    agg_head: str = "mean"
    add_v_norm: bool = False
    add_mean_across_heads: bool = True
    keep_token_lower_bound: int = 0
    max_head_share: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.compresses:
            raise ConfigError(f"{self.name}: needs budget= (tokens) or compression_ratio=")
        for field in ("structured", "add_v_norm", "add_mean_across_heads"):
            check_bool(self.name, field, getattr(self, field))
        for field in ("agg_task", "agg_group", "agg_head"):
            check_choice(self.name, field, getattr(self, field), AGGREGATIONS)
        lb = self.keep_token_lower_bound
        if not isinstance(lb, int | np.integer) or isinstance(lb, bool) or lb < 0:
            raise ConfigError(f"{self.name}: keep_token_lower_bound must be a non-negative integer, got {lb!r}")
        check_number(self.name, "max_head_share", self.max_head_share, 1)

    # ---- sizes -----------------------------------------------------------------------------------
    def head_capacity(self, prompt_len: int) -> int:
        """Static per-head slots for the prompt: `min(ceil(budget * max_head_share), prompt_len)`."""
        return min(head_cap(self.prompt_budget(prompt_len), self.max_head_share), prompt_len)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.head_capacity(prompt_len) + max_new_tokens

    def replay_width(self, context: int) -> int:
        """The replay is the prompt itself: one row of the prompt's length."""
        return max(context, 1)

    # ---- scores ----------------------------------------------------------------------------------
    def _finish(self, best: Array, cache: KVCache) -> Array:
        """`[B, K, C]` a layer's final scores from each query head's row aggregate `best` `[B, K, G, C]`."""
        scores = _aggregate(best, self.agg_group, 2)
        if self.add_v_norm:
            scores = scores * jnp.linalg.norm(kvc.values(cache, jnp.float32), axis=-1)
        if self.add_mean_across_heads:
            scores = scores + jnp.mean(scores, axis=1, keepdims=True)
        return scores

    def replay_rows(self, tokens: np.ndarray, lengths: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        rows = np.zeros((len(lengths), self.replay_width(int(lengths.max()))), np.int32)
        for b, n in enumerate(lengths):
            rows[b, :n] = tokens[b, :n]
        spans = np.stack([np.zeros_like(lengths), lengths], axis=-1).astype(np.int32)
        return [(rows, lengths.astype(np.int32), spans)]

    def replay_scores(self, cache: KVCache, q: Array, k: Array, positions: Array, span: Array, step: Step) -> KVCache:
        batch, rows, num_heads, dim = q.shape
        kv_heads = cache.pos.shape[1]
        group = num_heads // kv_heads
        keys = kvc.keys(cache, jnp.float32)
        stored = kvc.stored_mask(cache)[:, :, None, None, :]  # [B, K, 1, 1, C]
        own_k = jnp.swapaxes(k, 1, 2).astype(jnp.float32)  # [B, K, R, H]
        real = positions >= 0
        qg = jnp.moveaxis(q.astype(jnp.float32).reshape(batch, rows, kv_heads, group, dim), 1, 3)  # [B, K, G, R, H]
        scale = 1.0 / math.sqrt(dim)
        block = min(rows, REPLAY_ROW_BLOCK) if rows % min(rows, REPLAY_ROW_BLOCK) == 0 else rows
        width = keys.shape[2]

        def block_stats(carry: tuple[Array, Array], start: Array) -> tuple[tuple[Array, Array], None]:
            q_rows = jax.lax.dynamic_slice_in_dim(qg, start, block, axis=3)  # [B, K, G, b, H]
            real_rows = jax.lax.dynamic_slice_in_dim(real, start, block, axis=1)[:, None, None, :, None]
            causal = (jnp.arange(rows)[None, :] <= (start + jnp.arange(block))[:, None])[None] & real[:, None, :]
            ctx = jnp.einsum("bkgrh,bkch->bkgrc", q_rows, keys) * scale
            own = jnp.einsum("bkgrh,bksh->bkgrs", q_rows, own_k) * scale
            logits = jnp.concatenate([jnp.where(stored, ctx, -jnp.inf),
                                      jnp.where(causal[:, None, None], own, -jnp.inf)], axis=-1)
            probs = jax.nn.softmax(jnp.where(real_rows, logits, 0.0), axis=-1)[..., :width]
            probs = jnp.where(real_rows & stored, probs, 0.0)
            best, total = carry
            return (jnp.maximum(best, jnp.max(probs, axis=3)), total + jnp.sum(probs, axis=3)), None

        zeros = jnp.zeros((batch, kv_heads, group, width), jnp.float32)  # probabilities are >= 0: max from 0
        starts = jnp.arange(0, rows, block, dtype=jnp.int32)
        (best, total), _ = jax.lax.scan(block_stats, (zeros, zeros), starts)
        if self.agg_task == "mean":  # over the example's replay rows (its prompt length)
            count = jnp.maximum(jnp.sum(real, axis=-1), 1).astype(jnp.float32)
            best = total / count[:, None, None, None]
        return cache.replace(score=jnp.where(kvc.stored_mask(cache), self._finish(best, cache), 0.0))

    def _totals(self, stored: Array, budget: Array, entries: int) -> Array:
        """`[B]` pairs kept over `entries` scores per token (see `ratio_table`; `budget * entries` with a budget)."""
        if self.compression_ratio is None:
            return budget.astype(jnp.int32) * entries
        held = jnp.sum(stored[:, 0], axis=-1)  # [B] the prompt's tokens (every head holds them after the prefill)
        return jnp.asarray(ratio_table(entries, stored.shape[-1], self.compression_ratio))[held]

    def replay_compress(self, layers: tuple[KVCache, ...], budget: Array, capacity: int) -> tuple[KVCache, ...]:
        stored = tuple(kvc.stored_mask(x) for x in layers)
        entries = len(layers) * (1 if self.structured else layers[0].pos.shape[1])
        keep = allocate(tuple(x.score for x in layers), stored, self._totals(stored[0], budget, entries),
                        head_cap(budget, self.max_head_share), self.keep_token_lower_bound, self.structured,
                        self.agg_head)
        return tuple(kvc.keep_where(x, m, capacity) for x, m in zip(layers, keep, strict=True))

    # ---- the plain step API (no replay) ----------------------------------------------------------
    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Without a replay: each slot is scored by the call's own rows (causal softmax over the cache, the same
        aggregations), then this layer keeps `budget` per head (structured) or `budget * K` (unstructured)."""
        kv_heads = cache.pos.shape[1]
        probs, real = self_read_probs(cache, q, step)
        if self.agg_task == "max":
            best = jnp.max(probs, axis=3)
        else:
            best = jnp.sum(probs, axis=3) / jnp.maximum(jnp.sum(real, axis=-1), 1)[:, None, None, None]
        stored = kvc.stored_mask(cache)
        cache = cache.replace(score=jnp.where(stored, self._finish(best, cache), 0.0))
        total = step.budget.astype(jnp.int32) * (1 if self.structured else kv_heads)
        cap = jnp.minimum(head_cap(step.budget, self.max_head_share), step.capacity)
        keep = allocate((cache.score,), (stored,), total, cap, self.keep_token_lower_bound, self.structured,
                        self.agg_head)
        return kvc.keep_where(cache, keep[0], step.capacity)


__all__ = ["KVCompose", "allocate", "ratio_table"]
