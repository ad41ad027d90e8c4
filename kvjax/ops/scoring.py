"""Per-key importance scores over a KV cache (XLA reference implementations), GQA-native.

Layouts follow `kvjax.ops.attention`: queries `[B, T, N, H]` (post-RoPE, query head `n` reads KV
head `n // G`), query positions `[B, T]` (-1 = padding row), keys `[B, K, C, H]` in the cache
layout with positions and validity `[B, K, C]`. Masking is causal by position, so the scores are
right for a compressed (non-contiguous) cache too. Every score is float32, whatever the storage.

* `window_scores`: attention of the last `window` valid query rows over the cache, reduced per
  key (SnapKV's observation window, TOVA / SAGE-KV with `window=1`).
* `accumulated_scores`: column sums over all valid query rows (H2O's accumulated attention).
* `pool1d`: 1-D avg / max pooling along the slot axis with PyTorch `count_include_pad` semantics.
* `key_norm_scores`, `value_norm_scores`: L2 norms per slot.
* `gaussian_query_logits`: the expected logit of a Gaussian query against each key (ExpectedAttention).
* `projected_value_norms`: `||v W_o||` per slot and query head (CriticalKV), blockwise over slots.
* `map_slot_blocks`: a per-slot computation over blocks of the slot axis (bounded intermediates).

`implementation="pallas"` runs the kernels of `kvjax.pallas.scoring` (their own block sizes: the
`block_*` arguments tune this XLA path only), per shard under a mesh (`kvjax.ops._shard`).

Both attention scores run blockwise over keys in two passes (each row's softmax statistics first, then
the normalised probabilities summed per key), and `accumulated_scores` also over query blocks, skipping
block pairs with no visible logit (its first pass is skipped when the prefill attention's row
log-sum-exp is given), so at most `rows x block_k` logits per head exist at a time: a 128K-token prompt
never materialises `T x T` (nor `window x C` per head beyond one key block).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvjax import tuning
from kvjax._kernel_common import GROUP_REDUCE, POOLING, ROW_REDUCE
from kvjax._kernel_common import NEG as _NEG
from kvjax._kernel_common import check_choice as _check_choice
from kvjax._kernel_common import group_queries as _group_queries
from kvjax._kernel_common import pad_to_multiple as _pad_axis
from kvjax._kernel_common import row_scale as _row_scale
from kvjax.errors import ConfigError
from kvjax.ops._impl import resolve
from kvjax.ops._shard import check_query_heads, per_shard, rows_role
from kvjax.ops.attention import _key_block_span, _key_mask, _query_block_span, _switch_tile, _tile_mode, prefill_blocks

Array = jax.Array


def _key_blocks(k: Array, k_pos: Array, k_valid: Array, block_k: int) -> tuple[Array, Array, Array]:
    """Keys padded to a multiple of the block and split with the block index leading."""
    b, kv, c, h = k.shape
    bk = max(1, min(block_k, c))
    kk = _pad_axis(k, 2, bk, 0)
    nk = kk.shape[2] // bk
    kb = kk.reshape(b, kv, nk, bk, h).transpose(2, 0, 1, 3, 4)
    kpb = _pad_axis(k_pos, 2, bk, -1).reshape(b, kv, nk, bk).transpose(2, 0, 1, 3)
    kvb = _pad_axis(k_valid, 2, bk, False).reshape(b, kv, nk, bk).transpose(2, 0, 1, 3)
    return kb, kpb, kvb


def _column_probs(qg: Array, q_pos: Array, blocks: tuple[Array, Array, Array], num_keys: int,
                  weight_visible: bool = False) -> Array:
    """Sum over query rows of softmax probabilities per key: `[B, K, G, C]` float32.

    `weight_visible`: each row's probabilities are multiplied by the number of keys the row sees (Finch's
    normalisation of the causal mask: a late row spreads its mass over more keys).

    qg: `[B, K, G, R, H]` float32 queries already multiplied by their logit scale; q_pos `[B, R]`.
    Pass 1 scans key blocks for each row's max and normaliser; pass 2 maps over key blocks and
    sums the normalised probabilities over rows. Rows with no visible key contribute nothing.
    """

    def logits(blk: tuple[Array, Array, Array]) -> tuple[Array, Array]:
        k_blk, kp_blk, kv_blk = blk
        s = jnp.einsum("bkgrh,bkch->bkgrc", qg, k_blk.astype(jnp.float32))
        qp = q_pos[:, None, None, :, None]
        mask = kv_blk[:, :, None, None, :] & (kp_blk[:, :, None, None, :] <= qp) & (qp >= 0)
        return s, mask

    def stats(carry: tuple[Array, Array, Array], blk: tuple[Array, Array, Array]):
        m, l, seen = carry
        s, mask = logits(blk)
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        return (m_new, l * jnp.exp(m - m_new) + jnp.sum(p, axis=-1), seen + jnp.sum(mask, axis=-1)), None

    zeros = jnp.zeros(qg.shape[:-1], jnp.float32)
    (m, l, seen), _ = jax.lax.scan(stats, (jnp.full(qg.shape[:-1], _NEG, jnp.float32), zeros, zeros), blocks)
    inv_l = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    if weight_visible:
        inv_l = inv_l * seen

    def column(blk: tuple[Array, Array, Array]) -> Array:
        s, mask = logits(blk)
        p = jnp.where(mask, jnp.exp(jnp.where(mask, s, m[..., None]) - m[..., None]), 0.0)
        return jnp.sum(p * inv_l[..., None], axis=3)  # [B, K, G, bk]

    cols = jax.lax.map(column, blocks)  # [nk, B, K, G, bk]
    nk, b, kv, g, bk = cols.shape
    return cols.transpose(1, 2, 3, 0, 4).reshape(b, kv, g, nk * bk)[..., :num_keys]


def _reduce_group(x: Array, group_reduce: str | None) -> Array:
    """`[B, K, G, C]` -> `[B, K, C]` (mean / max over the group) or `[B, N, C]` (None)."""
    if group_reduce == "mean":
        return jnp.mean(x, axis=2)
    if group_reduce == "max":
        return jnp.max(x, axis=2)
    b, kv, g, c = x.shape
    return x.reshape(b, kv * g, c)


def _column_kernel_per_shard(
    kernel: Callable[..., Array],
    kwargs: dict,
    q: Array,
    q_pos: Array,
    k: Array,
    k_pos: Array,
    k_valid: Array,
    scale: float | Array | None,
    op: str,
) -> Array:
    """A `kvjax.pallas.scoring` column kernel, per shard under a mesh (batch on `data`, heads on `model`).

    A given `scale` travels as its `[B, T]` float32 broadcast (what the kernel makes of it anyway)."""
    b, t, n, _ = q.shape
    check_query_heads(op, n, k.shape[1])
    row_scale = None if scale is None else jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (b, t))

    def call(q: Array, q_pos: Array, k: Array, k_pos: Array, k_valid: Array, row_scale: Array | None) -> Array:
        return kernel(q, q_pos, k, k_pos, k_valid, scale=row_scale, **kwargs)

    return per_shard(call, (q, q_pos, k, k_pos, k_valid, row_scale), ("b.h.", "b.", "bh..", "bh.", "bh.", "b."),
                     "bh.", batch=b, heads=k.shape[1])


def window_scores(
    q: Array,
    q_pos: Array,
    k: Array,
    k_pos: Array,
    k_valid: Array,
    *,
    window: int,
    row_reduce: str = "sum",
    group_reduce: str | None = "mean",
    scale: float | Array | None = None,
    block_k: int | None = None,
    weight_visible: bool = False,
    implementation: str = "auto",
) -> Array:
    """Attention of each example's last `window` valid query rows over the cache, per key.

    The window rows are the `window` rows with the largest positions in `q_pos` (so right-padded
    batches with different lengths are handled per example); each row's softmax runs over every
    valid key at or before its position (float32). Per key, the probabilities are summed
    (`row_reduce="sum"`) or averaged over the example's valid window rows ("mean"), then averaged
    ("mean") or maxed ("max") over the GQA group of each KV head; `group_reduce=None` keeps one
    score per query head. `scale` (default `1/sqrt(H)`) may be a float or a per-row `[B, T]` array.
    `block_k` (default: the current tuning's `window_block_k`, `kvjax.tuning`) keys per block.
    `weight_visible`: each row's probabilities are first multiplied by the number of keys it sees (Finch's
    normalisation; XLA only, so it always takes the XLA path).

    Returns `[B, K, C]` float32 (`[B, N, C]` when `group_reduce=None`); invalid keys score 0.
    """
    if not weight_visible and resolve("window_scores", implementation) == "pallas":
        from kvjax.pallas import scoring as kernels

        kw = dict(window=window, row_reduce=row_reduce, group_reduce=group_reduce)
        return _column_kernel_per_shard(kernels.window_scores, kw, q, q_pos, k, k_pos, k_valid, scale, "window_scores")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"window_scores: window must be a positive integer, got {window!r}")
    _check_choice("window_scores", "row_reduce", row_reduce, ROW_REDUCE)
    _check_choice("window_scores", "group_reduce", group_reduce, GROUP_REDUCE)
    b, t, n, h = q.shape
    w = min(window, t)
    top_pos, rows = jax.lax.top_k(q_pos, w)  # the w latest positions of each example
    row_ok = top_pos >= 0
    qw = jnp.take_along_axis(q, rows[:, :, None, None], axis=1)
    row_scale = jnp.take_along_axis(_row_scale(scale, h, b, t), rows, axis=1)
    qg = _group_queries(qw, k.shape[1]) * row_scale[:, None, None, :, None]
    block_k = tuning.current().window_block_k if block_k is None else block_k
    sums = _column_probs(qg, jnp.where(row_ok, top_pos, -1), _key_blocks(k, k_pos, k_valid, block_k), k.shape[2],
                         weight_visible=weight_visible)
    if row_reduce == "mean":
        count = jnp.maximum(jnp.sum(row_ok, axis=-1), 1).astype(jnp.float32)
        sums = sums / count[:, None, None, None]
    return _reduce_group(sums, group_reduce)


def _accumulated_query_blocks(qg: Array, q_pos: Array, bq: int) -> tuple[Array, Array]:
    """`[B, K, G, T, H]` scaled queries, `[B, T]` positions -> `[nq, B, K, G * bq, H]`, `[nq, B, bq]`."""
    b, kv, g, _, h = qg.shape
    qg = _pad_axis(qg, 3, bq, 0)
    nq = qg.shape[3] // bq
    q_blocks = qg.reshape(b, kv, g, nq, bq, h).transpose(3, 0, 1, 2, 4, 5).reshape(nq, b, kv, g * bq, h)
    qp_blocks = _pad_axis(q_pos, 1, bq, -1).reshape(b, nq, bq).transpose(1, 0, 2)
    return q_blocks, qp_blocks


def _tile_spans(qp_blocks: Array, blocks: tuple[Array, Array, Array]) -> tuple[tuple, tuple]:
    """Position spans of every query block (`[nq, B, 1]` each) and key block (`[nk, B, K]` each)."""
    _, kpb, kvb = blocks
    return jax.vmap(_query_block_span)(qp_blocks), _key_block_span(kpb, kvb)


def _row_lse(q_blocks: Array, qp_blocks: Array, blocks: tuple[Array, Array, Array], g: int) -> Array:
    """Per query row, the log-sum-exp of its visible logits: `[nq, B, K, G * bq]` (+inf: no visible key).

    One online pass over the key blocks of each query block; each (query, key) block pair is skipped,
    taken whole or masked as the blocks' position spans say (`ops.attention._tile_mode`)."""
    query_spans, key_spans = _tile_spans(qp_blocks, blocks)

    def one_query_block(args: tuple[Array, Array, tuple]) -> Array:
        qb, qp, q_span = args
        b, kv, rows, _ = qb.shape

        def step(carry: tuple[Array, Array], blk: tuple[Array, Array, Array, tuple]):
            k_blk, kp_blk, kv_blk, k_span = blk

            def update(carry: tuple[Array, Array], *, masked: bool) -> tuple[Array, Array]:
                m, l = carry
                s = jnp.einsum("bkrh,bkch->bkrc", qb, k_blk)
                if masked:
                    mask = _key_mask(qp, kp_blk, kv_blk, None)  # [B, K, bq, bk]
                    s = s.reshape(b, kv, g, -1, k_blk.shape[2])
                    s = jnp.where(mask[:, :, None], s, _NEG).reshape(b, kv, rows, -1)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                return m_new, l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(s - m_new[..., None]), axis=-1)

            return _switch_tile(_tile_mode(q_span, k_span, None), update, carry), None

        init = (jnp.full((b, kv, rows), _NEG, jnp.float32), jnp.zeros((b, kv, rows), jnp.float32))
        (m, l), _ = jax.lax.scan(step, init, (*blocks, key_spans))
        seen = m > _NEG / 2
        return jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)

    return jax.lax.map(one_query_block, (q_blocks, qp_blocks, query_spans))


def _column_sums(
    q_blocks: Array, qp_blocks: Array, lse_blocks: Array, blocks: tuple[Array, Array, Array], g: int, num_keys: int
) -> Array:
    """Per key, the sum over every row of its exact probability `exp(s - lse)`: `[B, K, G, C]` float32.

    One pass: a map over key blocks, each summing over the query blocks (`lax.scan`) that may see it.
    A (query, key) block pair no row may see is skipped, one whose every row sees every key (below the
    causal diagonal) is summed without a mask, the rest are masked (`ops.attention._tile_mode`)."""
    query_spans, key_spans = _tile_spans(qp_blocks, blocks)

    def one_key_block(blk: tuple[Array, Array, Array, tuple]) -> Array:
        k_blk, kp_blk, kv_blk, k_span = blk
        b, kv, bk, _ = k_blk.shape

        def step(col: Array, qargs: tuple[Array, Array, Array, tuple]):
            qb, qp, lse, q_span = qargs  # [B, K, G * bq, H], [B, bq], [B, K, G * bq], spans

            def add(col: Array, *, masked: bool) -> Array:
                p = jnp.exp(jnp.einsum("bkrh,bkch->bkrc", qb, k_blk) - lse[..., None]).reshape(b, kv, g, -1, bk)
                if masked:
                    p = jnp.where(_key_mask(qp, kp_blk, kv_blk, None)[:, :, None], p, 0.0)  # [B, K, 1, bq, bk]
                return col + jnp.sum(p, axis=3)

            return _switch_tile(_tile_mode(q_span, k_span, None), add, col), None

        col, _ = jax.lax.scan(step, jnp.zeros((b, kv, g, bk), jnp.float32),
                              (q_blocks, qp_blocks, lse_blocks, query_spans))
        return col

    cols = jax.lax.map(one_key_block, (*blocks, key_spans))  # [nk, B, K, G, bk]
    nk, b, kv, g, bk = cols.shape
    return cols.transpose(1, 2, 3, 0, 4).reshape(b, kv, g, nk * bk)[..., :num_keys]


def accumulated_scores(
    q: Array,
    q_pos: Array,
    k: Array,
    k_pos: Array,
    k_valid: Array,
    *,
    group_reduce: str | None = "mean",
    scale: float | Array | None = None,
    lse: Array | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    implementation: str = "auto",
) -> Array:
    """H2O's accumulated attention: per key, the sum over every valid query row of its softmax
    probability (causal by position, float32), reduced over the GQA group as in `window_scores`.

    Blockwise over query and key blocks (at most `block_q x block_k` logits per head at a time; the
    defaults are the current tuning's `accumulated_blocks`, else its `prefill_blocks`; `kvjax.tuning`), skipping block
    pairs with no visible logit and masking only those on the causal diagonal. Each
    row's log-sum-exp comes from one online pass, or is given as `lse` `[B, K, G, T]` (what
    `prefill_attention(..., return_lse=True)` returns for the same queries, keys and mask, with the default
    scale), then one pass sums the exact probabilities `exp(s - lse)` per key. Returns `[B, K, C]` float32
    (`[B, N, C]` with `group_reduce=None`).
    """
    if resolve("accumulated_scores", implementation) == "pallas":
        from kvjax.pallas import scoring as kernels

        kw = dict(group_reduce=group_reduce)
        return _column_kernel_per_shard(
            kernels.accumulated_scores, kw, q, q_pos, k, k_pos, k_valid, scale, "accumulated_scores"
        )
    _check_choice("accumulated_scores", "group_reduce", group_reduce, GROUP_REDUCE)
    b, t, n, h = q.shape
    kv, c = k.shape[1], k.shape[2]
    g = n // kv
    dq, dk = tuning.current().accumulated_blocks or prefill_blocks()
    block_q, block_k = (dq if block_q is None else block_q), (dk if block_k is None else block_k)
    bq = max(1, min(block_q, t))
    qg = _group_queries(q, kv) * _row_scale(scale, h, b, t)[:, None, None, :, None]
    q_blocks, qp_blocks = _accumulated_query_blocks(qg, q_pos, bq)
    kb, kpb, kvb = _key_blocks(k, k_pos, k_valid, block_k)
    blocks = (kb.astype(jnp.float32), kpb, kvb)
    if lse is None:
        lse_blocks = _row_lse(q_blocks, qp_blocks, blocks, g)
    else:
        nq = q_blocks.shape[0]
        lse_blocks = _pad_axis(lse.astype(jnp.float32), 3, bq, jnp.inf)
        lse_blocks = lse_blocks.reshape(b, kv, g, nq, bq).transpose(3, 0, 1, 2, 4).reshape(nq, b, kv, g * bq)
    return _reduce_group(_column_sums(q_blocks, qp_blocks, lse_blocks, blocks, g, c), group_reduce)


def pool1d(
    scores: Array,
    kernel: int,
    kind: str = "avg",
    *,
    valid: Array | None = None,
    implementation: str = "auto",
) -> Array:
    """1-D pooling along the last (slot) axis, stride 1, same length, float32.

    PyTorch semantics with `padding=kernel // 2`: "avg" divides by `kernel` always
    (`count_include_pad=True`, zero padding), "max" pads with -inf. Entries where `valid` is False
    are treated exactly like the padding. `kernel` must be odd.
    """
    if resolve("pool1d", implementation) == "pallas":
        from kvjax.pallas import scoring as kernels

        if valid is not None:
            valid = jnp.broadcast_to(valid, scores.shape)
        role = rows_role(scores.ndim)
        return per_shard(lambda x, ok: kernels.pool1d(x, kernel, kind, valid=ok), (scores, valid), (role, role), role,
                         batch=scores.shape[0] if scores.ndim > 1 else 1,
                         heads=scores.shape[1] if scores.ndim > 2 else 1)
    _check_choice("pool1d", "kind", kind, POOLING)
    if not isinstance(kernel, int) or isinstance(kernel, bool) or kernel < 1 or kernel % 2 == 0:
        raise ConfigError(f"pool1d: kernel must be a positive odd integer, got {kernel!r}")
    x = scores.astype(jnp.float32)
    if kernel == 1:
        return x if valid is None else jnp.where(valid, x, 0.0 if kind == "avg" else -jnp.inf)
    half = kernel // 2
    dims = (1,) * (x.ndim - 1) + (kernel,)
    strides = (1,) * x.ndim
    padding = [(0, 0)] * (x.ndim - 1) + [(half, half)]
    if kind == "avg":
        if valid is not None:
            x = jnp.where(valid, x, 0.0)
        return jax.lax.reduce_window(x, 0.0, jax.lax.add, dims, strides, padding) / kernel
    if valid is not None:
        x = jnp.where(valid, x, -jnp.inf)
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, strides, padding)


def _norms(x: Array, valid: Array | None, squared: bool) -> Array:
    xf = x.astype(jnp.float32)
    sq = jnp.sum(xf * xf, axis=-1)
    out = sq if squared else jnp.sqrt(sq)
    return out if valid is None else jnp.where(valid, out, 0.0)


def key_norm_scores(
    k: Array, valid: Array | None = None, *, squared: bool = False, implementation: str = "auto"
) -> Array:
    """L2 norm of each key `[B, K, C, H]` -> `[B, K, C]` float32 (squared with `squared=True`);
    0 where `valid` is False."""
    resolve("key_norm_scores", implementation)
    return _norms(k, valid, squared)


def value_norm_scores(
    v: Array, valid: Array | None = None, *, squared: bool = False, implementation: str = "auto"
) -> Array:
    """L2 norm of each value `[B, K, C, H]` -> `[B, K, C]` float32 (squared with `squared=True`);
    0 where `valid` is False."""
    resolve("value_norm_scores", implementation)
    return _norms(v, valid, squared)


def map_slot_blocks(fn: Callable[..., Array], arrays: tuple[Array, ...], block: int) -> Array:
    """`fn(*blocks)` over blocks of `block` slots of `arrays` (each `[B, K, C, ...]`, slot axis 2), its results
    (`[..., block]`, slots last) joined back to `[..., C]`. One block when `C <= block`; padding slots are zeros
    (their results are cut off), so `fn` must be per-slot (no reduction over the slot axis)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ConfigError(f"map_slot_blocks: block must be a positive integer, got {block!r}")
    c = arrays[0].shape[2]
    if c <= block:
        return fn(*arrays)
    padded = [_pad_axis(x, 2, block, 0) for x in arrays]
    nb = padded[0].shape[2] // block
    split = [jnp.moveaxis(x.reshape(*x.shape[:2], nb, block, *x.shape[3:]), 2, 0) for x in padded]
    out = jax.lax.map(lambda xs: fn(*xs), tuple(split))  # [nb, ..., block]
    out = jnp.moveaxis(out, 0, -2)
    return out.reshape(*out.shape[:-2], nb * block)[..., :c]


def gaussian_query_logits(
    mean: Array, cov: Array | None, k: Array, *, scale: float, block: int = 512, implementation: str = "auto"
) -> Array:
    """`E[exp(q . k * scale)] = exp(mean . k * scale + scale^2 k^T cov k / 2)` in log form, for a Gaussian query
    `q ~ N(mean, cov)` per query head: `mean` `[B, N, H]`, `cov` `[B, N, H, H]` (or None: the mean alone), keys
    `[B, K, C, H]` (query head `n` reads KV head `n // G`). Returns `[B, K, G, C]` float32 logits, blockwise over
    slots (the quadratic term's `[B, N, block, H]` intermediate)."""
    resolve("gaussian_query_logits", implementation)
    b, n, h = mean.shape
    kv = k.shape[1]
    mu = mean.astype(jnp.float32).reshape(b, kv, n // kv, h)
    sigma = None if cov is None else cov.astype(jnp.float32).reshape(b, kv, n // kv, h, h)

    def logits(kb: Array) -> Array:
        kf = kb.astype(jnp.float32)
        out = jnp.einsum("bkgh,bkch->bkgc", mu, kf) * scale
        if sigma is not None:
            quad = jnp.einsum("bkgij,bkci,bkcj->bkgc", sigma, kf, kf)
            out = out + quad * (scale * scale / 2.0)
        return out

    return map_slot_blocks(logits, (k,), block)


def projected_value_norms(
    v: Array, w_o: Array, *, ord: int = 1, block: int = 256, implementation: str = "auto"
) -> Array:
    """`||v W_o[n]||_ord` of every slot's value through each query head's slice of the output projection: values
    `[B, K, C, H]`, `w_o` `[N, H, D]` (query head `n` reads KV head `n // G`). Returns `[B, K, G, C]` float32,
    blockwise over slots (the `[B, N, block, D]` projection is never larger). `ord`: 1 (L1) or 2 (L2)."""
    resolve("projected_value_norms", implementation)
    if ord not in (1, 2) or isinstance(ord, bool):
        raise ConfigError(f"projected_value_norms: ord must be 1 or 2, got {ord!r}")
    n, h, d = w_o.shape
    kv = v.shape[1]
    w = w_o.astype(jnp.float32).reshape(kv, n // kv, h, d)

    def norms(vb: Array) -> Array:
        out = jnp.einsum("bkch,kghd->bkgcd", vb.astype(jnp.float32), w)
        return jnp.sum(jnp.abs(out), axis=-1) if ord == 1 else jnp.sqrt(jnp.sum(out * out, axis=-1))

    return map_slot_blocks(norms, (v,), block)
