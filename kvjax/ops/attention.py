"""Attention over a KV cache (XLA reference implementations), GQA-native.

Queries come in the model's layout `[B, T, N, H]`, with `N = K * G` query heads grouped over `K`
KV heads (query head `n` reads KV head `n // G`, as Hugging Face's `repeat_kv`). Keys and values
come in the cache layout `[B, K, C, H]` with original positions `[B, K, C]` and a validity mask.
Masking is by position, so it stays causal however the cache was compressed or reordered.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvjax.ops._impl import resolve
from kvjax.ops._shard import batch_heads_role, check_query_heads, per_shard

Array = jax.Array
_NEG = -1e30


def _key_mask(
    q_pos: Array, k_pos: Array, k_valid: Array, sliding_window: int | None
) -> Array:
    """`[B, K, Tq, Ck]` bool: causal by position, valid keys, valid queries, optional window."""
    qp = q_pos[:, None, :, None]
    kp = k_pos[:, :, None, :]
    mask = k_valid[:, :, None, :] & (kp <= qp) & (qp >= 0)
    if sliding_window is not None:
        mask &= qp - kp < sliding_window
    return mask


def _pad_axis(x: Array, axis: int, multiple: int, fill: float | int | bool) -> Array:
    size = x.shape[axis]
    target = -(-size // multiple) * multiple
    if target == size:
        return x
    width = [(0, 0)] * x.ndim
    width[axis] = (0, target - size)
    return jnp.pad(x, width, constant_values=fill)


def prefill_attention(
    q: Array,
    q_pos: Array,
    k: Array,
    v: Array,
    k_pos: Array,
    k_valid: Array,
    *,
    sliding_window: int | None = None,
    block_q: int = 512,
    block_k: int = 1024,
) -> Array:
    """Causal attention of a chunk of queries over cached keys, blockwise (flash style).

    q `[B, T, N, H]`, q_pos `[B, T]` (-1 = padding row, output 0); k, v `[B, K, C, H]`, k_pos and
    k_valid `[B, K, C]`. Never materialises more than `block_q x block_k` scores per head: an online
    softmax runs over key blocks (`lax.scan`) inside a map over query blocks, skipping key blocks that
    no query of the block may attend (causally future or empty). float32 softmax.
    Returns `[B, T, N, H]` in q's dtype.
    """
    batch, t, n, h = q.shape
    kv_heads = k.shape[1]
    g = n // kv_heads
    scale = 1.0 / math.sqrt(h)
    bq = min(block_q, t)
    bk = min(block_k, k.shape[2])

    qg = q.reshape(batch, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    qg = _pad_axis(qg, 3, bq, 0)
    qp = _pad_axis(q_pos, 1, bq, -1)
    kk = _pad_axis(k, 2, bk, 0)
    vv = _pad_axis(v, 2, bk, 0)
    kp = _pad_axis(k_pos, 2, bk, -1)
    kvld = _pad_axis(k_valid, 2, bk, False)
    nq, nk = qg.shape[3] // bq, kk.shape[2] // bk

    # Key blocks as the scan axis: [nk, B, K, bk, ...].
    kb = kk.reshape(batch, kv_heads, nk, bk, h).transpose(2, 0, 1, 3, 4)
    vb = vv.reshape(batch, kv_heads, nk, bk, h).transpose(2, 0, 1, 3, 4)
    kpb = kp.reshape(batch, kv_heads, nk, bk).transpose(2, 0, 1, 3)
    kvb = kvld.reshape(batch, kv_heads, nk, bk).transpose(2, 0, 1, 3)

    def one_query_block(args: tuple[Array, Array]) -> Array:
        q_blk, qp_blk = args  # [B, K, G, bq, H], [B, bq]
        qf = q_blk.astype(jnp.float32) * scale

        def step(carry: tuple[Array, Array, Array], blk: tuple[Array, ...]):
            k_blk, v_blk, kp_blk, kv_blk = blk
            mask = _key_mask(qp_blk, kp_blk, kv_blk, sliding_window)[:, :, None]

            def attend(carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
                m, l, acc = carry
                s = jnp.einsum("bkgqh,bkch->bkgqc", qf, k_blk.astype(jnp.float32))
                s = jnp.where(mask, s, _NEG)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                l_new = l * corr + jnp.sum(p, axis=-1)
                acc_new = acc * corr[..., None] + jnp.einsum("bkgqc,bkch->bkgqh", p, v_blk.astype(jnp.float32))
                return m_new, l_new, acc_new

            # Blocks no query may attend (empty slots of an extended cache, future keys) are skipped.
            return jax.lax.cond(jnp.any(mask), attend, lambda c: c, carry), None

        init = (
            jnp.full(q_blk.shape[:-1], _NEG, jnp.float32),
            jnp.zeros(q_blk.shape[:-1], jnp.float32),
            jnp.zeros(q_blk.shape, jnp.float32),
        )
        (_, l, acc), _ = jax.lax.scan(step, init, (kb, vb, kpb, kvb))
        return acc / jnp.where(l > 0, l, 1.0)[..., None]

    q_blocks = qg.reshape(batch, kv_heads, g, nq, bq, h).transpose(3, 0, 1, 2, 4, 5)
    qp_blocks = qp.reshape(batch, nq, bq).transpose(1, 0, 2)
    out = jax.lax.map(one_query_block, (q_blocks, qp_blocks))  # [nq, B, K, G, bq, H]
    out = out.transpose(1, 2, 3, 0, 4, 5).reshape(batch, kv_heads, g, nq * bq, h)[:, :, :, :t]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, t, n, h).astype(q.dtype)


def decode_attention(
    q: Array,
    q_pos: Array,
    k: Array,
    v: Array,
    k_pos: Array,
    k_valid: Array,
    *,
    sliding_window: int | None = None,
    return_weights: bool = False,
    implementation: str = "auto",
) -> Array | tuple[Array, Array]:
    """One query token per example over a padded cache with per-head validity.

    q `[B, N, H]`, q_pos `[B]`; k, v `[B, K, C, H]`; k_pos `[B, K, C]`; k_valid `[B, K, C]`, or
    `[B, K, G, C]` when each query head of a group sees its own slots. Returns `[B, N, H]`
    and, with `return_weights`, the float32 attention probabilities `[B, K, G, C]`.
    `implementation="pallas"`: the split-K kernel of `kvjax.pallas.decode_attention` (per shard under a
    mesh, see `kvjax.ops._shard`); on a GPU backend its Triton twin `kvjax.pallas.gpu_attention`.
    """
    if resolve("decode_attention", implementation) == "pallas":
        if jax.default_backend() == "gpu":  # Mosaic TPU kernels cannot compile there: the Triton twin
            from kvjax.pallas.gpu_attention import decode_attention as kernel
        else:
            from kvjax.pallas.decode_attention import decode_attention as kernel

        check_query_heads("decode_attention", q.shape[1], k.shape[1])

        def call(q: Array, q_pos: Array, k: Array, v: Array, k_pos: Array, k_valid: Array):
            return kernel(q, q_pos, k, v, k_pos, k_valid, sliding_window=sliding_window, return_weights=return_weights)

        roles = ("bh.", "b", "bh..", "bh..", "bh.", batch_heads_role(k_valid.ndim))
        return per_shard(call, (q, q_pos, k, v, k_pos, k_valid), roles, ("bh.", "bh..") if return_weights else "bh.",
                         batch=q.shape[0], heads=k.shape[1])
    batch, n, h = q.shape
    kv_heads = k.shape[1]
    g = n // kv_heads
    qf = q.reshape(batch, kv_heads, g, h).astype(jnp.float32) / math.sqrt(h)
    s = jnp.einsum("bkgh,bkch->bkgc", qf, k.astype(jnp.float32))
    if k_valid.ndim == 4:  # per-query-head visibility [B, K, G, C]
        mask = _key_mask(q_pos[:, None], k_pos, jnp.any(k_valid, axis=2), sliding_window) & k_valid
    else:
        mask = _key_mask(q_pos[:, None], k_pos, k_valid, sliding_window)  # [B, K, 1, C]
    s = jnp.where(mask, s, _NEG)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgc,bkch->bkgh", p, v.astype(jnp.float32))
    out = out.reshape(batch, n, h).astype(q.dtype)
    return (out, p) if return_weights else out
