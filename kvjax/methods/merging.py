"""`merging`: merge-on-evict around any scoring method (kvpress 0.5.5's `MergingPress`; no paper: kvpress cites
Token Merging, Bolya et al., ICLR 2023, and D2O, Wan et al., 2024).

A scorer's eviction drops what attention would still have read from the evicted values. Here the base method
(`base`, `base_args`; default KNorm) compresses the prompt as it would alone, and each evicted pair first folds its
value into the kept pair whose key it resembles most. Per layer and KV head:

* an evicted pair `j` finds its most similar kept key: `s_j = max_i cos(k_j, k_i)` over the kept pairs `i`
  (float32; each norm clamped at 1e-6), `t_j` the kept pair that reaches it;
* it merges when `s_j >= similarity_threshold` and, with `merge_fraction < 1`, when `s_j` is at least the
  `1 - merge_fraction` quantile of the head's evicted similarities, those under the threshold counted as `-inf`
  (torch's linear interpolation, float32 rank, as kvpress's `Tensor.quantile`);
* its weight is `w_j = max(s_j, 0) ||v_j|| / (||v_j|| + ||v_t|| + 1e-6)`;
* a kept value that received merges becomes `(v_i + sum_j w_j v_j) / (1 + sum_j w_j)` (float32, then stored in the
  cache's dtype); the others, and every key, are left as they are (RoPE-safe).

Defaults are kvpress's (`similarity_threshold=0.0`, `merge_fraction=1.0`); kvpress has no default scorer, its
evaluation names `merging_knorm` first. Decode appends, as kvpress's press acts at prefill only.

Departures (no flag): the base may be any kvjax scoring method, its wrappers included (kvpress takes a `ScorerPress`);
the kept set is whatever the base keeps (its own selection, per-layer or per-head budgets), and the similarities
read the keys as they were before the base acted (so a base that re-rotates its kept keys, `key_rerotation`,
is compared at the original positions). Similarity ties go to the kept pair at the lowest position (kvpress: the
first in its top-k order). Under chunked prefill every chunk's compression merges what it evicts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.methods.wrapper import Wrapper
from kvjax.ops.scoring import map_slot_blocks
from kvjax.validation import check_number, check_ratio

Array = jax.Array

#: kvpress's `_EPS`: the norm clamp of the cosine and the weight's denominator term.
EPS = 1e-6
#: Evicted slots whose similarities are taken at once (`[B, K, block, kept]` float32 at a time).
SIMILARITY_BLOCK = 512


def source_slots(before: KVCache, after: KVCache) -> tuple[Array, Array]:
    """Where each slot of `after` came from in `before` (same positions, per example and KV head):
    `[B, K, C']` int32 slot of `before` (0 where the slot is empty) and `[B, K, C']` bool whether it holds a token."""
    stored = kvc.stored_mask(before)
    big = jnp.iinfo(jnp.int32).max
    keyed = jnp.where(stored, before.pos, big)
    order = jnp.argsort(keyed, axis=-1).astype(jnp.int32)
    sorted_pos = jnp.take_along_axis(keyed, order, axis=-1)
    held = kvc.stored_mask(after)
    find = jax.vmap(jax.vmap(lambda row, queries: jnp.searchsorted(row, queries)))
    rank = jnp.minimum(find(sorted_pos, jnp.where(held, after.pos, big)), before.capacity - 1)
    found = held & (jnp.take_along_axis(sorted_pos, rank, axis=-1) == after.pos)
    return jnp.where(found, jnp.take_along_axis(order, rank, axis=-1), 0), found


def _unit(x: Array) -> Array:
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), EPS)


def nearest_kept(keys: Array, kept_keys: Array, kept: Array) -> tuple[Array, Array]:
    """Each slot's most cosine-similar kept key: `keys` `[B, K, C, H]`, `kept_keys` `[B, K, C', H]` with `kept`
    `[B, K, C']` marking the real ones. Returns `[B, K, C]` float32 similarity and int32 kept slot (ties: the
    lowest), blockwise over `C`."""
    targets = _unit(kept_keys.astype(jnp.float32))

    def block(kb: Array) -> Array:
        sim = jnp.einsum("bkch,bkjh->bkcj", _unit(kb.astype(jnp.float32)), targets,
                         precision=jax.lax.Precision.HIGHEST)
        sim = jnp.where(kept[:, :, None], sim, -jnp.inf)
        best = jnp.argmax(sim, axis=-1)
        return jnp.stack([jnp.max(sim, axis=-1), best.astype(jnp.float32)])

    out = map_slot_blocks(block, (keys,), SIMILARITY_BLOCK)
    return out[0], out[1].astype(jnp.int32)


def torch_quantile(values: Array, count: Array, q: float) -> Array:
    """The `q` quantile of the first `count` `[B, K]` of `values` `[B, K, C]` sorted ascending (the rest `+inf`),
    as torch computes it: float32 rank `q * (count - 1)`, then `lerp(below, above, rank - floor(rank))` by its
    two-sided formula (so `-inf` among the two neighbours gives `-inf` or NaN, as in torch)."""
    ranked = jnp.sort(values, axis=-1)
    rank = jnp.float32(q) * (count - 1).astype(jnp.float32)
    below = jnp.floor(rank).astype(jnp.int32)
    above = jnp.ceil(rank).astype(jnp.int32)
    weight = rank - below.astype(jnp.float32)
    last = values.shape[-1] - 1
    lo = jnp.take_along_axis(ranked, jnp.clip(below, 0, last)[..., None], axis=-1)[..., 0]
    hi = jnp.take_along_axis(ranked, jnp.clip(above, 0, last)[..., None], axis=-1)[..., 0]
    return jnp.where(weight < 0.5, lo + weight * (hi - lo), hi - (hi - lo) * (1.0 - weight))


def merge_evicted(before: KVCache, after: KVCache, *, similarity_threshold: float, merge_fraction: float) -> KVCache:
    """`after` (a compression of `before`) with the values of the pairs it evicted merged into its kept ones (the
    module docstring's rule)."""
    source, held = source_slots(before, after)
    stored = kvc.stored_mask(before)
    slots = before.capacity
    batch_idx = jnp.arange(source.shape[0])[:, None, None]
    head_idx = jnp.arange(source.shape[1])[None, :, None]
    kept_before = jnp.zeros(stored.shape, bool).at[batch_idx, head_idx, jnp.where(held, source, slots)].set(
        True, mode="drop")
    evicted = stored & ~kept_before

    keys = kvc.keys(before, jnp.float32)
    kept_keys = jnp.take_along_axis(keys, source[..., None], axis=2)
    similarity, target = nearest_kept(keys, kept_keys, held)
    merge = evicted & (similarity >= jnp.float32(similarity_threshold))
    if merge_fraction < 1.0:
        candidates = jnp.where(evicted, jnp.where(merge, similarity, -jnp.inf), jnp.inf)
        cut = torch_quantile(candidates, jnp.sum(evicted, axis=-1), 1.0 - merge_fraction)
        merge &= similarity >= cut[..., None]

    values = kvc.values(before, jnp.float32)
    kept_values = kvc.values(after)
    kept_f32 = kept_values.astype(jnp.float32)
    own_norm = jnp.linalg.norm(values, axis=-1)
    target_norm = jnp.take_along_axis(jnp.linalg.norm(kept_f32, axis=-1), target, axis=-1)
    weight = jnp.where(merge, jnp.maximum(similarity, 0.0), 0.0) * own_norm / (own_norm + target_norm + EPS)
    into = jnp.where(merge, target, after.capacity)  # out of range: dropped
    added = jnp.zeros(kept_f32.shape, jnp.float32).at[batch_idx, head_idx, into].add(
        weight[..., None] * values, mode="drop")
    total = jnp.zeros(held.shape, jnp.float32).at[batch_idx, head_idx, into].add(weight, mode="drop")
    merged = ((kept_f32 + added) / (1.0 + total)[..., None]).astype(kept_values.dtype)
    return kvc.with_values(after, jnp.where((total > 0)[..., None], merged, kept_values))


@register
@dataclasses.dataclass(frozen=True)
class Merging(Wrapper):
    """The base method's compression (`base`, "knorm"; `base_args`) with each evicted value merged into its most
    key-similar kept pair: `similarity_threshold` (0.0), `merge_fraction` (1.0)."""

    name = "merging"

    base: str = "knorm"
    base_args: Any = ()
    similarity_threshold: float = 0.0
    merge_fraction: float = 1.0

    def check_own_hyperparameters(self) -> None:
        if not self.compresses:
            raise ConfigError(f"{self.name}: needs budget= (tokens) or compression_ratio=")
        check_ratio(self.name, "similarity_threshold", self.similarity_threshold)
        check_number(self.name, "merge_fraction", self.merge_fraction, above=0.0, maximum=1.0)

    def check_base(self, inner: ScoringMethod) -> None:
        if not inner.decode_appends_only:
            raise ConfigError(f"{self.name}: base {self.base!r} evicts or observes while decoding; merging acts at "
                              "prefill only, so choose a one-shot scorer such as knorm, snapkv or expected_attention")

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.inner.capacity(prompt_len, max_new_tokens)

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...] | None:
        return self.inner.layer_capacities(prompt_len, max_new_tokens, num_layers)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        kept = self.inner.prefill(cache, q, step)
        return merge_evicted(cache, kept, similarity_threshold=self.similarity_threshold,
                             merge_fraction=self.merge_fraction)


__all__ = ["Merging", "merge_evicted", "nearest_kept", "source_slots", "torch_quantile"]
