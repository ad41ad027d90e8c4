"""Attention over a KV cache (XLA reference implementations), GQA-native.

Queries come in the model's layout `[B, T, N, H]`, with `N = K * G` query heads grouped over `K`
KV heads (query head `n` reads KV head `n // G`, as Hugging Face's `repeat_kv`). Keys and values
come in the cache layout `[B, K, C, H]` with original positions `[B, K, C]` and a validity mask.
Masking is by position, so it stays causal however the cache was compressed or reordered.

Keys and values may also come as quantized stores (`kvjax.quant.QuantizedKV`, a cache made with `kv_dtype=`):
the XLA paths dequantize them to float32 where they read them (the scores and softmax are float32 anyway);
the GPU decode kernel (`kvjax.pallas.gpu_attention`) reads the codes and scales and dequantizes each block
in registers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import tuning
from kvjax._kernel_common import NEG as _NEG
from kvjax._kernel_common import check_window
from kvjax._kernel_common import pad_to_multiple as _pad_axis
from kvjax.errors import ConfigError
from kvjax.ops._impl import resolve
from kvjax.ops._shard import batch_heads_role, check_query_heads, per_shard
from kvjax.quant.storage import QuantizedKV, dequantize

Array = jax.Array


def _as_array(x: Array | QuantizedKV, dtype: Any = None) -> Array:
    """A K / V operand as an array: a quantized store dequantized (to `dtype`, default its model dtype)."""
    if isinstance(x, QuantizedKV):
        return dequantize(x, x.dtype if dtype is None else dtype)
    return x


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


def _is_16bit(dtype: Any) -> bool:
    """bfloat16 / float16: the inputs the fused attention paths (cuDNN) take."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _cudnn_max_head_dim() -> int:
    """The largest head_dim cuDNN's fused attention takes on this GPU: 256 from Hopper (compute capability 9.0)
    on, 128 before (jax's `check_is_flash_attention`)."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major = int(str(capability).split(".")[0])
    except ValueError:
        major = 0
    return 256 if major >= 9 else 128


def _sdpa_implementation(dtype: Any, head_dim: int) -> str:
    """`jax.nn.dot_product_attention`'s backend: cuDNN on a GPU for 16-bit inputs with a head_dim it takes (a
    multiple of 8, at most `_cudnn_max_head_dim`: Gemma 3's 256 needs Hopper), else jax's XLA implementation
    (cuDNN rejects float32 and raises NotImplementedError for other head dims)."""
    if jax.default_backend() != "gpu" or not _is_16bit(dtype) or head_dim % 8:
        return "xla"
    return "cudnn" if head_dim <= _cudnn_max_head_dim() else "xla"


#: A position no key or query reaches: the empty side of a block's span.
_FAR = 2**29  # differences of two spans stay inside int32

#: `_tile_mode` values: the `lax.switch` branches of the blockwise prefill.
TILE_SKIP, TILE_WHOLE, TILE_MASKED = 0, 1, 2


def _key_block_span(k_pos: Array, k_valid: Array) -> tuple[Array, Array, Array]:
    """Per key block (`[..., bk]` slots): lowest and highest valid position, and whether every slot is valid.
    A block with no valid slot spans (+far, -far), which no query can see."""
    low = jnp.min(jnp.where(k_valid, k_pos, _FAR), axis=-1)
    high = jnp.max(jnp.where(k_valid, k_pos, -_FAR), axis=-1)
    return low, high, jnp.all(k_valid, axis=-1)


def _query_block_span(q_pos: Array) -> tuple[Array, Array, Array]:
    """`_key_block_span` of a query block `[B, bq]` (-1 = padding row), shaped `[B, 1]` to meet `[B, K]`."""
    low, high, whole = _key_block_span(q_pos, q_pos >= 0)
    return low[:, None], high[:, None], whole[:, None]


def _tile_mode(query_span: tuple[Array, Array, Array], key_span: tuple[Array, Array, Array],
               sliding_window: int | None) -> Array:
    """What a (query block, key block) tile needs, from the blocks' position spans alone (never the mask):
    `TILE_SKIP` when no query can see any key, `TILE_WHOLE` when every query sees every key (all valid,
    all keys at or before the earliest query, inside the window), else `TILE_MASKED`. Conservative: a
    tile that is neither is masked exactly, so the result equals masking every tile."""
    q_low, q_high, q_whole = query_span
    k_low, k_high, k_whole = key_span  # each [B, K]
    nothing = k_low > q_high
    everything = q_whole & k_whole & (k_high <= q_low)
    if sliding_window is not None:
        nothing |= q_low - k_high >= sliding_window
        everything &= q_high - k_low < sliding_window
    return jnp.where(jnp.all(nothing), TILE_SKIP, jnp.where(jnp.all(everything), TILE_WHOLE, TILE_MASKED))


def _switch_tile(mode: Array, tile: Callable[..., Any], carry: Any, *operands: Any) -> Any:
    """One tile of a blockwise loop by its `_tile_mode`: `carry` unchanged when skipped, else
    `tile(carry, *operands, masked=...)`, masked only when the mode says so."""
    branches = [None] * 3
    branches[TILE_SKIP] = lambda c, *_: c
    branches[TILE_WHOLE] = functools.partial(tile, masked=False)
    branches[TILE_MASKED] = functools.partial(tile, masked=True)
    return jax.lax.switch(mode, branches, carry, *operands)


def prefill_blocks(block_q: int | None = None, block_k: int | None = None) -> tuple[int, int]:
    """The `(block_q, block_k)` to use: given values win, else the current tuning's `prefill_blocks`
    (`kvjax.tuning`; 128 x 128 on CPU, 512 x 1024 on accelerators). A given value must be a positive integer."""
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"prefill_attention: {name} must be a positive integer, got {value!r}")
    dq, dk = tuning.current().prefill_blocks
    return (dq if block_q is None else block_q), (dk if block_k is None else block_k)


def prefill_attention(
    q: Array,
    q_pos: Array,
    k: Array,
    v: Array,
    k_pos: Array,
    k_valid: Array,
    *,
    sliding_window: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    implementation: str = "auto",
) -> Array | tuple[Array, Array]:
    """Causal attention of a chunk of queries over cached keys, blockwise (flash style).

    q `[B, T, N, H]`, q_pos `[B, T]` (-1 = padding row, output 0); k, v `[B, K, C, H]`, k_pos and
    k_valid `[B, K, C]`. Never materialises more than `block_q x block_k` scores per head: an online
    softmax runs over key blocks (`lax.scan`) inside a map over query blocks. Each tile's position spans
    decide its branch (`_tile_mode`): skipped when no query of the block may attend any key (causally
    future or empty), unmasked when every query sees every key, masked otherwise. float32 softmax. Block
    sizes default to the current tuning's `prefill_blocks` (`kvjax.tuning`).
    Returns `[B, T, N, H]` in q's dtype and, with `return_lse`, each row's float32 log-sum-exp of its
    scaled logits `[B, K, G, T]` (+inf for a row with no visible key), so that a caller can rebuild the
    exact probabilities `exp(s - lse)` in one more pass (H2O's column sums, `ops.scoring`).

    `implementation`: "auto" and "xla" run this blockwise XLA path (the reference); "dot_product_attention"
    runs `jax.nn.dot_product_attention` per query block with the position mask (cuDNN's fused attention
    on NVIDIA GPUs for bfloat16 / float16 inputs; jax's XLA implementation for float32 and elsewhere),
    tested against this one;
    "pallas" runs the Pallas TPU flash-attention kernel of `jax.experimental.pallas.ops.tpu` per query block
    with the mask as an additive bias (TPU only: it has no interpret mode; its lowering is tested from CPU).
    "auto" takes the current tuning's `auto_prefill` path for bfloat16 / float16 inputs without `return_lse`
    (cuDNN on GPU, measured faster there; `kvjax.tuning`), else XLA. Quantized K / V are dequantized into their
    model dtype first.
    """
    check_window("prefill_attention", sliding_window)
    check_query_heads("prefill_attention", q.shape[2], k.shape[1])
    k, v = _as_array(k), _as_array(v)
    if implementation == "auto" and not return_lse and _is_16bit(q.dtype):
        implementation = tuning.current().auto_prefill
    if implementation in ("dot_product_attention", "pallas"):
        if return_lse:
            raise ConfigError("prefill_attention: return_lse needs implementation='xla' (or 'auto')")
        bq = min(prefill_blocks(block_q, block_k)[0], q.shape[1])
        fused = _dot_product_attention if implementation == "dot_product_attention" else _tpu_flash_attention
        return fused(q, q_pos, k, v, k_pos, k_valid, sliding_window, bq)
    if implementation not in ("auto", "xla"):
        raise ConfigError(
            "prefill_attention: implementation must be 'auto', 'xla', 'dot_product_attention' or 'pallas', "
            f"got {implementation!r}"
        )
    batch, t, n, h = q.shape
    kv_heads = k.shape[1]
    g = n // kv_heads
    scale = 1.0 / math.sqrt(h)
    block_q, block_k = prefill_blocks(block_q, block_k)
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

    # Key blocks on a leading axis: [nk, B, K, bk, ...].
    kb = kk.reshape(batch, kv_heads, nk, bk, h).transpose(2, 0, 1, 3, 4).astype(jnp.float32)
    vb = vv.reshape(batch, kv_heads, nk, bk, h).transpose(2, 0, 1, 3, 4).astype(jnp.float32)
    kpb = kp.reshape(batch, kv_heads, nk, bk).transpose(2, 0, 1, 3)
    kvb = kvld.reshape(batch, kv_heads, nk, bk).transpose(2, 0, 1, 3)
    key_span = _key_block_span(kpb, kvb)

    def one_query_block(args: tuple[Array, Array]) -> Array:
        q_blk, qp_blk = args  # [B, K, G * bq, H] (scaled, float32), [B, bq]
        query_span = _query_block_span(qp_blk)

        def update(carry: tuple[Array, Array, Array], j: Array, *, masked: bool) -> tuple[Array, Array, Array]:
            m, l, acc = carry
            k_blk = jax.lax.dynamic_index_in_dim(kb, j, 0, keepdims=False)
            v_blk = jax.lax.dynamic_index_in_dim(vb, j, 0, keepdims=False)
            # The GQA group and the query rows form one matrix of G * bq rows: one GEMM per KV head.
            s = jnp.einsum("bkrh,bkch->bkrc", q_blk, k_blk)
            if masked:
                mask = _key_mask(qp_blk, kpb[j], kvb[j], sliding_window)  # [B, K, bq, bk]
                s = jnp.where(mask[:, :, None], s.reshape(batch, kv_heads, g, bq, bk), _NEG)
                s = s.reshape(batch, kv_heads, g * bq, bk)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            # Masked logits are -1e30, so exp() zeroes them; a row with no visible key yet (m_new still
            # -1e30) gathers junk that the first visible key's correction exp(m - m_new) = 0 wipes out,
            # and a row that never sees one is zeroed at the end.
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            l_new = l * corr + jnp.sum(p, axis=-1)
            acc_new = acc * corr[..., None] + jnp.einsum("bkrc,bkch->bkrh", p, v_blk)
            return m_new, l_new, acc_new

        def step(carry: tuple[Array, Array, Array], j: Array):
            # Tiles no query may attend (empty slots of an extended cache, future keys) are skipped, and
            # tiles every query sees whole (below the causal diagonal) skip the mask.
            mode = _tile_mode(query_span, jax.tree.map(lambda x: x[j], key_span), sliding_window)
            return _switch_tile(mode, update, carry, j), None

        rows = q_blk.shape[:-1]
        init = (jnp.full(rows, _NEG, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros(q_blk.shape, jnp.float32))
        (m, l, acc), _ = jax.lax.scan(step, init, jnp.arange(nk))
        seen = m > _NEG / 2
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0), lse

    q_blocks = qg.reshape(batch, kv_heads, g, nq, bq, h).transpose(3, 0, 1, 2, 4, 5)
    q_blocks = q_blocks.reshape(nq, batch, kv_heads, g * bq, h).astype(jnp.float32) * scale
    qp_blocks = qp.reshape(batch, nq, bq).transpose(1, 0, 2)
    out, lse = jax.lax.map(one_query_block, (q_blocks, qp_blocks))  # [nq, B, K, G * bq, H], [nq, B, K, G * bq]
    out = out.reshape(nq, batch, kv_heads, g, bq, h).transpose(1, 2, 3, 0, 4, 5)
    out = out.reshape(batch, kv_heads, g, nq * bq, h)[:, :, :, :t]
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, t, n, h).astype(q.dtype)
    if not return_lse:
        return out
    lse = lse.reshape(nq, batch, kv_heads, g, bq).transpose(1, 2, 3, 0, 4).reshape(batch, kv_heads, g, nq * bq)
    return out, lse[..., :t]


def causal_prefix_attention(
    q: Array,
    k: Array,
    v: Array,
    lengths: Array,
    *,
    sliding_window: int | None = None,
    implementation: str = "auto",
) -> Array:
    """Causal self-attention of prompts that start at position 0: q `[B, T, N, H]`, k / v `[B, T, K, H]`
    (the prompt's own keys, in the projections' layout), `lengths` `[B]`: row `t < lengths[b]` of example
    `b` sits at position `t`, later rows are padding (output 0). Returns `[B, T, N, H]` in q's dtype.

    The same attention as `prefill_attention` with positions `arange(T)` (that is its reference,
    `implementation="xla"`), for the case where a fused kernel needs no position mask at all:
    "dot_product_attention" makes one `jax.nn.dot_product_attention` call with `is_causal` and the
    sequence lengths (cuDNN's flash attention on NVIDIA GPUs for 16-bit inputs: causal tiles skipped, no
    mask tensor; jax's XLA implementation for float32 and elsewhere),
    where `prefill_attention`'s path feeds it a `[B, N, block, T]` mask per query block. "auto" takes that
    call for bfloat16 / float16 inputs when the current tuning's `auto_causal_prefix` is set (GPU;
    `kvjax.tuning`), else `prefill_attention(implementation="auto")`.
    """
    check_window("causal_prefix_attention", sliding_window)
    check_query_heads("causal_prefix_attention", q.shape[2], k.shape[2])
    batch, t = q.shape[:2]
    if implementation == "auto":
        fused = tuning.current().auto_causal_prefix and _is_16bit(q.dtype)
        implementation = "dot_product_attention" if fused else "prefill_attention"
    if implementation == "dot_product_attention":
        lengths = lengths.astype(jnp.int32)
        window = None if sliding_window is None else (sliding_window - 1, 0)
        out = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            local_window_size=window, implementation=_sdpa_implementation(q.dtype, q.shape[-1]),
        )
        real = jnp.arange(t, dtype=jnp.int32)[None, :] < lengths[:, None]  # padding rows give 0
        return jnp.where(real[:, :, None, None], out, 0).astype(q.dtype)
    if implementation not in ("prefill_attention", "xla"):
        raise ConfigError(
            "causal_prefix_attention: implementation must be 'auto', 'xla', 'prefill_attention' or "
            f"'dot_product_attention', got {implementation!r}"
        )
    positions = jnp.where(jnp.arange(t, dtype=jnp.int32)[None, :] < lengths[:, None],
                          jnp.arange(t, dtype=jnp.int32)[None, :], -1)
    k_pos = jnp.broadcast_to(positions[:, None, :], (batch, k.shape[2], t))
    return prefill_attention(
        q, positions, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), k_pos, k_pos >= 0,
        sliding_window=sliding_window, implementation="auto" if implementation == "prefill_attention" else "xla",
    )


def _dot_product_attention(
    q: Array, q_pos: Array, k: Array, v: Array, k_pos: Array, k_valid: Array, sliding_window: int | None, bq: int
) -> Array:
    """`prefill_attention` through `jax.nn.dot_product_attention`, a `[B, N, bq, C]` mask per query block."""
    batch, t, n, h = q.shape
    g = n // k.shape[1]
    impl = _sdpa_implementation(q.dtype, q.shape[-1])
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, C, K, H], the layout it takes
    qq = _pad_axis(q, 1, bq, 0)
    qp = _pad_axis(q_pos, 1, bq, -1)
    nq = qq.shape[1] // bq

    def block(args: tuple[Array, Array]) -> Array:
        q_blk, qp_blk = args  # [B, bq, N, H], [B, bq]
        mask = jnp.repeat(_key_mask(qp_blk, k_pos, k_valid, sliding_window), g, axis=1)  # [B, N, bq, C]
        out = jax.nn.dot_product_attention(q_blk, kt, vt, mask=mask, implementation=impl)
        seen = jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]  # a row with no visible key gives 0
        return jnp.where(seen, out, 0).astype(q.dtype)

    q_blocks = qq.reshape(batch, nq, bq, n, h).transpose(1, 0, 2, 3, 4)
    qp_blocks = qp.reshape(batch, nq, bq).transpose(1, 0, 2)
    out = jax.lax.map(block, (q_blocks, qp_blocks))  # [nq, B, bq, N, H]
    return out.transpose(1, 0, 2, 3, 4).reshape(batch, nq * bq, n, h)[:, :t]


def _tpu_flash_attention(
    q: Array, q_pos: Array, k: Array, v: Array, k_pos: Array, k_valid: Array, sliding_window: int | None, bq: int
) -> Array:
    """`prefill_attention` through the Pallas TPU flash-attention kernel: KV heads repeated to the query
    heads (it has no GQA), slots and query blocks padded to its 128 tiles, a `[B, N, bq, C]` bias per block."""
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

    batch, t, n, h = q.shape
    g = n // k.shape[1]
    tile = 128
    bq = -(-bq // tile) * tile
    kk = jnp.repeat(_pad_axis(k, 2, tile, 0), g, axis=1)  # [B, N, C', H]
    vv = jnp.repeat(_pad_axis(v, 2, tile, 0), g, axis=1)
    kp, kvld = _pad_axis(k_pos, 2, tile, -1), _pad_axis(k_valid, 2, tile, False)
    qq, qp = _pad_axis(q, 1, bq, 0), _pad_axis(q_pos, 1, bq, -1)
    nq = qq.shape[1] // bq

    def block(args: tuple[Array, Array]) -> Array:
        q_blk, qp_blk = args  # [B, bq, N, H], [B, bq]
        mask = jnp.repeat(_key_mask(qp_blk, kp, kvld, sliding_window), g, axis=1)  # [B, N, bq, C']
        bias = jnp.where(mask, 0.0, _NEG).astype(jnp.float32)
        out = flash_attention(q_blk.transpose(0, 2, 1, 3), kk, vv, ab=bias, sm_scale=1.0 / math.sqrt(h))
        out = jnp.where(jnp.any(mask, axis=-1)[..., None], out, 0)  # a row with no visible key gives 0
        return out.transpose(0, 2, 1, 3).astype(q.dtype)

    q_blocks = qq.reshape(batch, nq, bq, n, h).transpose(1, 0, 2, 3, 4)
    qp_blocks = qp.reshape(batch, nq, bq).transpose(1, 0, 2)
    out = jax.lax.map(block, (q_blocks, qp_blocks))  # [nq, B, bq, N, H]
    return out.transpose(1, 0, 2, 3, 4).reshape(batch, nq * bq, n, h)[:, :t]


def decode_kernel_unsupported(head_dim: int, groups: int, per_query_head: bool) -> str | None:
    """Why the decode kernels cannot take these shapes (None: they can): compiled on a GPU (Triton) a head_dim
    that is no power of two; a per-query-head mask of more than 32 query heads per KV head (one bit each)."""
    if jax.default_backend() == "gpu" and head_dim & (head_dim - 1):
        return f"compiled for GPU (Triton), head_dim must be a power of two, got {head_dim}"
    if per_query_head and groups > 32:
        return f"a per-query-head mask needs at most 32 heads per group, got {groups}"
    return None


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
    mesh, see `kvjax.ops._shard`); on a GPU backend its Triton twin `kvjax.pallas.gpu_attention`. "auto" takes the
    kernel where the current tuning lists it and the kernel takes the shapes (`decode_kernel_unsupported`), else XLA.

    The XLA path computes the scores as `K q^T` when the current tuning's `decode_keys_as_rows` is set (CPU;
    `kvjax.tuning`), else as `q K^T`.

    `k` / `v` may be quantized stores (`kvjax.quant.QuantizedKV`): the XLA path dequantizes them to float32 as
    it reads them; the GPU kernel takes the codes and scales of the per-token layouts (int8, fp8, int4) and
    KIVI's, dequantizing each block in registers; the TPU kernel gets them dequantized first.
    """
    check_window("decode_attention", sliding_window)
    check_query_heads("decode_attention", q.shape[1], k.shape[1])
    kernel_fits = implementation != "auto" or decode_kernel_unsupported(q.shape[2], q.shape[1] // k.shape[1],
                                                                        k_valid.ndim == 4) is None
    if resolve("decode_attention", implementation) == "pallas" and kernel_fits:
        gpu = jax.default_backend() == "gpu"
        if gpu:  # Mosaic TPU kernels cannot compile there: the Triton twin
            from kvjax.pallas.gpu_attention import decode_attention as kernel
        else:
            from kvjax.pallas.decode_attention import decode_attention as kernel
        if isinstance(k, QuantizedKV) or isinstance(v, QuantizedKV):
            return _quantized_kernel_call(gpu, q, q_pos, k, v, k_pos, k_valid,
                                          sliding_window, return_weights)

        def call(q: Array, q_pos: Array, k: Array, v: Array, k_pos: Array, k_valid: Array):
            return kernel(q, q_pos, k, v, k_pos, k_valid, sliding_window=sliding_window, return_weights=return_weights)

        roles = ("bh.", "b", "bh..", "bh..", "bh.", batch_heads_role(k_valid.ndim))
        return per_shard(call, (q, q_pos, k, v, k_pos, k_valid), roles, ("bh.", "bh..") if return_weights else "bh.",
                         batch=q.shape[0], heads=k.shape[1])
    batch, n, h = q.shape
    kv_heads = k.shape[1]
    g = n // kv_heads
    k, v = _as_array(k, jnp.float32), _as_array(v, jnp.float32)
    knobs = tuning.current()
    narrow = knobs.decode_dots_in_cache_dtype and jnp.dtype(k.dtype).itemsize < 4
    qf = q.reshape(batch, kv_heads, g, h).astype(jnp.float32) / math.sqrt(h)
    if narrow:  # K / V read as stored, float32 results (`Tuning.decode_dots_in_cache_dtype`)
        qk = q.reshape(batch, kv_heads, g, h).astype(k.dtype)
        s = jnp.einsum("bkgh,bkch->bkgc", qk, k, preferred_element_type=jnp.float32) / math.sqrt(h)
    elif knobs.decode_keys_as_rows:
        # The cache as the matmul's row operand, then the small [G, C] transpose on its own (a barrier keeps
        # XLA from folding it back into the dot).
        s = jnp.einsum("bkch,bkgh->bkcg", k.astype(jnp.float32), qf)
        s = jnp.swapaxes(jax.lax.optimization_barrier(s), -1, -2)
    else:
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
    if narrow:
        out = jnp.einsum("bkgc,bkch->bkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    else:
        out = jnp.einsum("bkgc,bkch->bkgh", p, v.astype(jnp.float32))
    out = out.reshape(batch, n, h).astype(q.dtype)
    return (out, p) if return_weights else out


def _quantized_kernel_call(gpu: bool, q: Array, q_pos: Array, k: Array | QuantizedKV, v: Array | QuantizedKV,
                           k_pos: Array, k_valid: Array, sliding_window: int | None, return_weights: bool) -> Any:
    """`decode_attention(implementation="pallas")` over quantized K / V: on a GPU the fused kernel of
    `kvjax.pallas.gpu_quantized` reads the stores (per shard under a mesh: every leaf is `[B, K, ...]`) where it
    takes their layout; otherwise the dense kernel gets them dequantized."""
    if not gpu:  # the Mosaic kernel over dequantized K / V
        return decode_attention(q, q_pos, _as_array(k), _as_array(v), k_pos, k_valid, sliding_window=sliding_window,
                                return_weights=return_weights, implementation="pallas")
    from kvjax.pallas import gpu_quantized

    check_query_heads("decode_attention", q.shape[1], k.shape[1])
    block_k = tuning.current().tile(quantized=True)[0]
    if not gpu_quantized.supports(k, v, block_k, k_valid, return_weights):  # the dense kernel, dequantized
        return decode_attention(q, q_pos, _as_array(k), _as_array(v), k_pos, k_valid, sliding_window=sliding_window,
                                return_weights=return_weights, implementation="pallas")
    k_leaves, k_tree = jax.tree.flatten(k)
    v_leaves, v_tree = jax.tree.flatten(v)
    nk = len(k_leaves)

    def call(q: Array, q_pos: Array, k_pos: Array, k_valid: Array, *leaves: Array):
        kk, vv = jax.tree.unflatten(k_tree, leaves[:nk]), jax.tree.unflatten(v_tree, leaves[nk:])
        return gpu_quantized.decode_attention(q, q_pos, kk, vv, k_pos, k_valid, sliding_window=sliding_window,
                                              block_k=block_k)

    leaves = (*k_leaves, *v_leaves)
    roles = ("bh.", "b", "bh.", batch_heads_role(k_valid.ndim), *(batch_heads_role(x.ndim) for x in leaves))
    return per_shard(call, (q, q_pos, k_pos, k_valid, *leaves), roles, "bh.", batch=q.shape[0], heads=k.shape[1])
