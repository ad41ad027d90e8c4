"""Block-sparse decode attention over retrieved blocks (InfLLM / Q-LLM / ActQKV / Quest style), XLA reference.

Each (example, KV head) attends a few dense slot ranges (the sinks, the local window) plus a list of
retrieved blocks of `block_size` consecutive cache slots (a block memory's top-k blocks, Quest's top
pages), intersected with the usual validity, causality and window of `decode_attention`. The reference
builds that slot mask and runs the dense XLA decode attention (it reads the whole cache); the kernel of
`kvjax.pallas.gpu_attention` reads only the listed slots.

Contract (the kernel relies on it): the live entries of a block list do not overlap each other; a block
may overlap a range (those slots count once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax._kernel_common import check_window
from kvjax.errors import ConfigError
from kvjax.ops._impl import resolve
from kvjax.ops._shard import check_query_heads, per_shard
from kvjax.ops.attention import decode_attention

Array = jax.Array


def sparse_slot_mask(capacity: int, block_starts: Array, num_blocks: Array, ranges: Array, block_size: int) -> Array:
    """`[B, K, C]` bool: slots inside a range `ranges [B, K, R, 2]` (half-open) or inside one of the first
    `num_blocks [B, K]` blocks starting at `block_starts [B, K, S]`."""
    slot = jnp.arange(capacity, dtype=jnp.int32)
    lo, hi = ranges[..., 0, None], ranges[..., 1, None]  # [B, K, R, 1]
    in_range = jnp.any((slot >= lo) & (slot < hi), axis=2)
    live = jnp.arange(block_starts.shape[2], dtype=jnp.int32) < jnp.asarray(num_blocks)[..., None]  # [B, K, S]
    start = block_starts[..., None]
    in_block = jnp.any(live[..., None] & (slot >= start) & (slot < start + block_size), axis=2)
    return in_range | in_block


def kernel_unsupported(head_dim: int, block_size: int) -> str | None:
    """Why the Triton kernel cannot take these shapes (None: it can): `block_size` is one of its tiles (a power
    of two >= 16), and compiled on a GPU `head_dim` must be a power of two."""
    if block_size < 16 or block_size & (block_size - 1):
        return f"block_size must be a power of two >= 16 (a Triton tile), got {block_size}"
    if jax.default_backend() == "gpu" and head_dim & (head_dim - 1):
        return f"compiled for GPU (Triton), head_dim must be a power of two, got {head_dim}"
    return None


def block_sparse_decode_attention(
    q: Array,
    q_pos: Array,
    k: Array,
    v: Array,
    k_pos: Array,
    k_valid: Array,
    block_starts: Array,
    num_blocks: Array,
    ranges: Array,
    *,
    block_size: int,
    sliding_window: int | None = None,
    implementation: str = "auto",
) -> Array:
    """One query token per example over the ranges and retrieved blocks of its KV heads.

    q `[B, N, H]`, q_pos `[B]`; k, v `[B, K, C, H]`; k_pos, k_valid `[B, K, C]`; `block_starts`
    `[B, K, S]` int (first slot of each block), `num_blocks` `[B, K]` (live entries of the list),
    `ranges` `[B, K, R, 2]` int (half-open slot ranges always attended). Returns `[B, N, H]`.
    `implementation="pallas"`: the Triton kernel of `kvjax.pallas.gpu_attention` (compiled on GPU, in
    interpret mode elsewhere; `block_size` a power of two >= 16 there, and on a GPU a power-of-two head_dim);
    "auto" takes the kernel where the current tuning lists it and it takes these shapes, else XLA.
    """
    if block_size < 1:
        raise ConfigError(f"block_sparse_decode_attention: block_size must be >= 1, got {block_size}")
    if ranges.ndim != 4 or ranges.shape[-1] != 2:
        raise ConfigError(f"block_sparse_decode_attention: ranges must be [B, K, R, 2], got {ranges.shape}")
    check_window("block_sparse_decode_attention", sliding_window)
    check_query_heads("block_sparse_decode_attention", q.shape[1], k.shape[1])
    batch, kv = k.shape[:2]
    num_blocks = jnp.broadcast_to(jnp.asarray(num_blocks, jnp.int32), (batch, kv))
    kernel_fits = implementation != "auto" or kernel_unsupported(q.shape[-1], block_size) is None
    if resolve("block_sparse_decode_attention", implementation) == "pallas" and kernel_fits:
        from kvjax.pallas.gpu_attention import block_sparse_decode_attention as kernel

        def call(q: Array, q_pos: Array, k: Array, v: Array, k_pos: Array, k_valid: Array, starts: Array,
                 count: Array, ranges: Array) -> Array:
            return kernel(q, q_pos, k, v, k_pos, k_valid, starts, count, ranges, block_size=block_size,
                          sliding_window=sliding_window)

        roles = ("bh.", "b", "bh..", "bh..", "bh.", "bh.", "bh.", "bh", "bh..")
        return per_shard(call, (q, q_pos, k, v, k_pos, k_valid, block_starts, num_blocks, ranges), roles, "bh.",
                         batch=batch, heads=kv)
    mask = sparse_slot_mask(k.shape[2], block_starts, num_blocks, ranges, block_size)
    return decode_attention(q, q_pos, k, v, k_pos, k_valid & mask, sliding_window=sliding_window,
                            implementation="xla")
