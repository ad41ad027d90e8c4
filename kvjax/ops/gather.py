"""Building the compressed cache from kept slot indices (XLA reference)."""

from __future__ import annotations

import jax

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.ops._impl import resolve
from kvjax.ops._shard import per_shard
from kvjax.ops.select import topk_keep
from kvjax.quant.storage import QuantizedKV

Array = jax.Array


def gather_kept(cache: KVCache, indices: Array, counts: Array, *, implementation: str = "auto") -> KVCache:
    """The cache holding only the slots `indices` `[B, K, C']` (the first `counts` `[B, K]` of each
    head), at capacity `C'`: K, V, positions and any score / attend leaves are gathered, the rest of
    each head is empty. A thin wrapper over `kvjax.cache.compact` behind `implementation=` (the Pallas
    gather runs per shard under a mesh, see `kvjax.ops._shard`). The kernel gathers a model-dtype cache: a
    quantized one (`kv_dtype=`: codes and scales, KIVI's regrouping) is compacted by XLA under "auto", and
    "pallas" refuses it."""
    kernel = resolve("gather_kept", implementation) == "pallas"
    if kernel and isinstance(cache.k, QuantizedKV):
        if implementation == "pallas":
            raise ConfigError(f"gather_kept: implementation='pallas' gathers a model-dtype cache, not a quantized "
                              f"one ({cache.k.spec.name}); use implementation='auto' or 'xla'")
        kernel = False
    if kernel:
        from kvjax.pallas import select as kernels

        def call(k: Array, v: Array, pos: Array, length: Array, score: Array | None, attend: Array | None,
                 indices: Array, counts: Array) -> tuple:
            part = kernels.gather_kept(KVCache(k=k, v=v, pos=pos, length=length, score=score, attend=attend),
                                       indices, counts)
            return part.k, part.v, part.pos, part.length, part.score, part.attend

        slots = "bh."
        roles = ("bh..", "bh..", slots, "bh", slots, slots, slots, "bh")
        outs = ("bh..", "bh..", slots, "bh", None if cache.score is None else slots,
                None if cache.attend is None else slots)
        k, v, pos, length, score, attend = per_shard(
            call, (cache.k, cache.v, cache.pos, cache.length, cache.score, cache.attend, indices, counts), roles,
            outs, batch=cache.batch_size, heads=cache.num_kv_heads,
        )
        return cache.replace(k=k, v=v, pos=pos, length=length, score=score, attend=attend)
    return kvc.compact(cache, indices, counts)


def keep_top(
    cache: KVCache,
    scores: Array,
    budget: Array | int,
    *,
    capacity: int,
    protect: Array | None = None,
    implementation: str = "auto",
) -> KVCache:
    """`topk_keep` over the stored slots (by position) followed by `gather_kept`, one layer."""
    indices, counts = topk_keep(
        scores, kvc.stored_mask(cache), budget, capacity=capacity, protect=protect,
        positions=cache.pos, implementation=implementation,
    )
    return gather_kept(cache, indices, counts, implementation=implementation)
