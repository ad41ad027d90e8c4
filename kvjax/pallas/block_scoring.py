"""Pallas kernels scoring whole blocks of the cache against a query (retrieval methods).

* `page_scores`: Quest's upper bound on a page's attention logit from its element-wise key minimum and
  maximum, `sum_c max(q_c min_c, q_c max_c) = relu(q) @ max^T + min(q, 0) @ min^T` (two MXU matmuls per
  block of pages), for the `G` query heads of a KV head at once, optionally reduced over the group.
  Behind `kvjax.ops.blocks.page_scores` (its XLA twin; used by `kvjax.methods.quest`).
* `representative_scores`: InfLLM / Q-LLM / ActQKV's similarity of a probe query with each memory
  block's representative vector (dot or cosine), behind `kvjax.ops.blocks.representative_scores` (its
  XLA twin, masked `where(block < formed, score, 0)`; used by `kvjax.methods.block_memory`).

Both take the number of live pages / blocks per row (scalar-prefetched): later blocks are skipped
(clamped `index_map`, no DMA) and score 0, and entries past the count in a partly live block are set
to 0, so NaN-poisoned unused pages cannot leak.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax import tuning
from kvjax._kernel_common import GROUP_REDUCE, SIMILARITIES
from kvjax._kernel_common import NORM_EPS as _NORM_EPS
from kvjax.errors import ConfigError
from kvjax.pallas._common import (
    Interpret,
    block_size,
    check_lane_block,
    compiler_params,
    dot_nt,
    interpret_mode,
    pad_axis,
    round_up,
)

Array = jax.Array



def _clamped(j: Array, live: Array, block: int) -> Array:
    """Block index `j` clamped to the last block holding one of `live` entries (0 when none).

    `lax.div` (truncating, exact for `live >= 0`): Python's `//` lowers through `sign`, whose Mosaic rule
    asks the TPU generation and so fails when exporting for TPU from a CPU host."""
    return jnp.maximum(jnp.minimum(j, jax.lax.div(live + block - 1, block) - 1), 0)


# ------------------------------------------------------------------------------------------------
# Quest pages
# ------------------------------------------------------------------------------------------------


def _page_kernel(live_ref: Array, q_ref: Array, lo_ref: Array, hi_ref: Array, o_ref: Array, *,
                 kv_heads: int, block: int, group_reduce: str | None) -> None:
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    live = live_ref[b * kv_heads + h]

    @pl.when(j * block < live)
    def _score() -> None:
        q = q_ref[...]  # [G, H] float32
        s = dot_nt(jnp.maximum(q, 0.0), hi_ref[...].astype(jnp.float32))
        s = s + dot_nt(jnp.minimum(q, 0.0), lo_ref[...].astype(jnp.float32))  # [G, bp]
        if group_reduce == "mean":
            s = jnp.mean(s, axis=0, keepdims=True)
        elif group_reduce == "max":
            s = jnp.max(s, axis=0, keepdims=True)
        page = j * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        o_ref[...] = jnp.where(page < live, s, 0.0)

    @pl.when(j * block >= live)
    def _dead() -> None:
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)


def page_scores(
    q: Array,
    page_min: Array,
    page_max: Array,
    *,
    num_pages: Array | None = None,
    group_reduce: str | None = None,
    block_pages: int | None = None,
    interpret: Interpret = None,
) -> Array:
    """Quest's bound: q `[B, K, G, H]`, page_min / page_max `[B, K, P, H]` -> `[B, K, G, P]` float32
    (`[B, K, P]` with group_reduce "mean" / "max"). Pages at or past `num_pages` `[B, K]` (default: all)
    score 0. `block_pages` pages per grid step (default: the current tuning's `tpu_page_block`)."""
    if group_reduce not in GROUP_REDUCE:
        raise ConfigError(f"page_scores: group_reduce must be one of {list(GROUP_REDUCE)}, got {group_reduce!r}")
    b, kv, g, h = q.shape
    p = page_min.shape[2]
    bp = block_size(tuning.current().tpu_page_block if block_pages is None else block_pages, p)
    p_pad = round_up(p, bp)
    check_lane_block("page_scores", bp, p_pad // bp, interpret)
    live = jnp.full((b, kv), p, jnp.int32) if num_pages is None else jnp.minimum(num_pages, p).astype(jnp.int32)
    g_out = g if group_reduce is None else 1
    page_spec = pl.BlockSpec((None, None, bp, h), lambda bi, hi, j, lv: (bi, hi, _clamped(j, lv[bi * kv + hi], bp), 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, kv, p_pad // bp),
        in_specs=[pl.BlockSpec((None, None, g, h), lambda bi, hi, j, lv: (bi, hi, 0, 0)), page_spec, page_spec],
        out_specs=pl.BlockSpec((None, None, g_out, bp), lambda bi, hi, j, lv: (bi, hi, 0, j)),
    )
    out = pl.pallas_call(
        functools.partial(_page_kernel, kv_heads=kv, block=bp, group_reduce=group_reduce),
        out_shape=jax.ShapeDtypeStruct((b, kv, g_out, p_pad), jnp.float32),
        grid_spec=grid_spec,
        compiler_params=compiler_params(("parallel", "parallel", "parallel")),
        interpret=interpret_mode(interpret),
        name="kvjax_quest_page_scores",
    )(live.reshape(-1), q.astype(jnp.float32), pad_axis(page_min, 2, p_pad, 0), pad_axis(page_max, 2, p_pad, 0))
    out = out[..., :p]
    return out if group_reduce is None else out[:, :, 0]


# ------------------------------------------------------------------------------------------------
# InfLLM / ActQKV representatives
# ------------------------------------------------------------------------------------------------


def _rep_kernel(live_ref: Array, probe_ref: Array, rep_ref: Array, o_ref: Array, *, block: int,
                kind: str) -> None:
    b, j = pl.program_id(0), pl.program_id(1)
    live = live_ref[b]

    @pl.when(j * block < live)
    def _score() -> None:
        p = probe_ref[...]  # [1, d] float32
        r = rep_ref[...].astype(jnp.float32)  # [bn, d]
        s = dot_nt(p, r)  # [1, bn]
        if kind == "cosine":
            p_norm = jnp.sqrt(jnp.sum(p * p, axis=1, keepdims=True))
            r_norm = jnp.sqrt(dot_nt(jnp.ones(p.shape, jnp.float32), r * r))  # [1, bn], lane-dense
            s = s / (jnp.maximum(p_norm, _NORM_EPS) * jnp.maximum(r_norm, _NORM_EPS))
        blk = j * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        o_ref[...] = jnp.where(blk < live, s, 0.0)

    @pl.when(j * block >= live)
    def _dead() -> None:
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)


def representative_scores(
    probe: Array,
    rep: Array,
    *,
    num_blocks: Array | None = None,
    kind: str = "dot",
    block_blocks: int | None = None,
    interpret: Interpret = None,
) -> Array:
    """probe `[B, d]` against representatives `[B, NB, d]` -> `[B, NB]` float32 (dot or cosine); blocks at
    or past `num_blocks` `[B]` (default: all) score 0. `block_blocks` memory blocks per grid step (default:
    the current tuning's `tpu_representative_block`)."""
    if kind not in SIMILARITIES:
        raise ConfigError(f"representative_scores: kind must be one of {list(SIMILARITIES)}, got {kind!r}")
    b, nb, d = rep.shape
    bn = block_size(tuning.current().tpu_representative_block if block_blocks is None else block_blocks, nb)
    nb_pad = round_up(nb, bn)
    check_lane_block("representative_scores", bn, nb_pad // bn, interpret)
    live = jnp.full((b,), nb, jnp.int32) if num_blocks is None else jnp.minimum(num_blocks, nb).astype(jnp.int32)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, nb_pad // bn),
        in_specs=[
            pl.BlockSpec((None, 1, d), lambda bi, j, lv: (bi, 0, 0)),
            pl.BlockSpec((None, bn, d), lambda bi, j, lv: (bi, _clamped(j, lv[bi], bn), 0)),
        ],
        out_specs=pl.BlockSpec((None, 1, bn), lambda bi, j, lv: (bi, 0, j)),
    )
    out = pl.pallas_call(
        functools.partial(_rep_kernel, block=bn, kind=kind),
        out_shape=jax.ShapeDtypeStruct((b, 1, nb_pad), jnp.float32),
        grid_spec=grid_spec,
        compiler_params=compiler_params(("parallel", "parallel")),
        interpret=interpret_mode(interpret),
        name="kvjax_representative_scores",
    )(live, probe.astype(jnp.float32).reshape(b, 1, d), pad_axis(rep, 1, nb_pad, 0))
    return out[:, 0, :nb]
