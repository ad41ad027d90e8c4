"""Scores of whole blocks of the cache against a query, for retrieval methods (XLA reference), float32.

* `page_scores`: Quest's upper bound on a page's attention logit from the element-wise minimum and
  maximum of its keys, `sum_c max(q_c min_c, q_c max_c)`, per query head or reduced over the GQA group
  (`kvjax.methods.quest`).
* `representative_scores`: similarity (dot or cosine) of a probe query with each memory block's
  representative vector, flattened over query heads (InfLLM / Q-LLM / ActQKV, `kvjax.methods.block_memory`).

Both take an optional live count per row (`num_pages` `[B, K]`, `num_blocks` `[B]`): entries at or past
it score 0 (whatever the stored summary holds), and the kernels skip those blocks.

`implementation="pallas"` runs the kernels of `kvjax.pallas.block_scoring` (their own block sizes), per
shard under a mesh (`kvjax.ops._shard`): `page_scores` with the batch on `data` and the KV heads on
`model`; `representative_scores` on `data` only, since its vectors span every query head (a split over
`model` would need a sum across devices), so on a `model` axis it runs whole on every device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax._kernel_common import GROUP_REDUCE, SIMILARITIES
from kvjax._kernel_common import NORM_EPS as _NORM_EPS
from kvjax._kernel_common import check_choice as _check_choice
from kvjax.ops._impl import resolve
from kvjax.ops._shard import per_shard

Array = jax.Array


def page_scores(
    q: Array,
    page_min: Array,
    page_max: Array,
    *,
    num_pages: Array | None = None,
    group_reduce: str | None = None,
    implementation: str = "auto",
) -> Array:
    """Quest's bound `sum_c max(q_c min_c, q_c max_c)` of each page.

    q `[B, K, G, H]` (the `G` query heads of each KV head), page_min / page_max `[B, K, P, H]`. The
    larger product takes `max` where `q_c > 0` and `min` elsewhere, so it is two matmuls. Returns
    `[B, K, G, P]` float32, or `[B, K, P]` reduced over the group with `group_reduce="mean"` / `"max"`;
    pages at or past `num_pages` `[B, K]` (default: all pages live) score 0.
    """
    _check_choice("page_scores", "group_reduce", group_reduce, GROUP_REDUCE)
    if resolve("page_scores", implementation) == "pallas":
        from kvjax.pallas import block_scoring as kernels

        def call(q: Array, lo: Array, hi: Array, live: Array | None) -> Array:
            return kernels.page_scores(q, lo, hi, num_pages=live, group_reduce=group_reduce)

        b, kv = q.shape[:2]
        if num_pages is not None:
            num_pages = jnp.broadcast_to(jnp.asarray(num_pages, jnp.int32), (b, kv))
        out_role = "bh.." if group_reduce is None else "bh."
        return per_shard(call, (q, page_min, page_max, num_pages), ("bh..", "bh..", "bh..", "bh"), out_role,
                         batch=b, heads=kv)
    lo, hi = page_min.astype(jnp.float32), page_max.astype(jnp.float32)
    qf = q.astype(jnp.float32)
    s = jnp.einsum("bkgh,bkph->bkgp", jnp.maximum(qf, 0.0), hi) + jnp.einsum(
        "bkgh,bkph->bkgp", jnp.minimum(qf, 0.0), lo
    )
    if group_reduce == "mean":
        s = jnp.mean(s, axis=2)
    elif group_reduce == "max":
        s = jnp.max(s, axis=2)
    if num_pages is None:
        return s
    live = jnp.arange(s.shape[-1], dtype=jnp.int32) < jnp.asarray(num_pages)[..., None]  # [B, K, P]
    return jnp.where(live if group_reduce is not None else live[:, :, None], s, 0.0)


def representative_scores(
    probe: Array,
    rep: Array,
    *,
    num_blocks: Array | None = None,
    kind: str = "dot",
    implementation: str = "auto",
) -> Array:
    """Similarity of a probe `[B, d]` with each block's representative `[B, NB, d]` -> `[B, NB]` float32.

    `kind="dot"`: the dot product; `"cosine"`: both sides divided by their L2 norm (at least 1e-6).
    Blocks at or past `num_blocks` `[B]` (default: all blocks live) score 0.
    """
    _check_choice("representative_scores", "kind", kind, SIMILARITIES)
    if resolve("representative_scores", implementation) == "pallas":
        from kvjax.pallas import block_scoring as kernels

        def call(probe: Array, rep: Array, live: Array | None) -> Array:
            return kernels.representative_scores(probe, rep, num_blocks=live, kind=kind)

        b = rep.shape[0]
        if num_blocks is not None:
            num_blocks = jnp.broadcast_to(jnp.asarray(num_blocks, jnp.int32), (b,))
        return per_shard(call, (probe, rep, num_blocks), ("b.", "b..", "b"), "b.", batch=b, heads=1)
    p = probe.astype(jnp.float32)
    r = rep.astype(jnp.float32)
    if kind == "cosine":
        p = p / jnp.maximum(jnp.linalg.norm(p, axis=-1, keepdims=True), _NORM_EPS)
        r = r / jnp.maximum(jnp.linalg.norm(r, axis=-1, keepdims=True), _NORM_EPS)
    s = jnp.einsum("bd,bnd->bn", p, r)
    if num_blocks is None:
        return s
    live = jnp.arange(s.shape[-1], dtype=jnp.int32) < jnp.asarray(num_blocks)[..., None]
    return jnp.where(live, s, 0.0)
