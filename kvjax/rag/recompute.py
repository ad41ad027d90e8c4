"""The recompute executor: runs a set of context tokens ("rows") through the model's layers over an
assembled KV table, replacing (or fusing, Eq. 4) their stored K/V with freshly computed ones.

Every multi-context strategy is a plan for this one function: which rows, from which layer, and at
which layers each row's fresh K/V is written. At layer `m`:

1. the rows' queries / keys / values are computed from their hidden states (RoPE at their global
   positions);
2. rows with `write[m]` put their fresh K/V into their own slot of the table (overwrite), or the
   Eq. 4 blend `theta * fresh + (1 - theta) * old` with `theta = clip(cos(fresh, old), 0, 1)` per
   token and KV head (fusion); the other rows' slots keep the stored K/V (SamKV's rule 2);
3. the rows attend, causally by global position, over every valid slot of the table (padding
   tokens with their stored K/V included; on a sliding-window layer, the slots within its window), then the MLP
   runs. Each layer rotates with its own RoPE (`kvjax.models.block.layer_rope`: Gemma 3's local layers have theirs).

With every token a row, written at every layer, this is exactly a full prefill of the assembled
prompt (the Recompute baseline). Cost: `O(rows x table)` attention per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.models import block
from kvjax.ops.attention import prefill_attention

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Table:
    """The assembled context of one request: k, v one `[K, T, H]` array per layer (keys at global positions),
    pos / tokens `[T]`.

    `pos` is -1 for an empty slot. Slot order is free (masking is by position).
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    pos: Array
    tokens: Array

    @property
    def size(self) -> int:
        return int(self.pos.shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def with_layer(self, layer: int, k: Array, v: Array) -> Table:
        """This table with layer `layer`'s K/V replaced."""
        ks, vs = list(self.k), list(self.v)
        ks[layer], vs[layer] = k, v
        return dataclasses.replace(self, k=tuple(ks), v=tuple(vs))


def fuse(fresh: Array, old: Array, eps: float = 1e-6) -> Array:
    """Eq. 4: `theta * fresh + (1 - theta) * old`, `theta = cos(fresh, old)` over the last axis, clipped to [0, 1]."""
    f, o = fresh.astype(jnp.float32), old.astype(jnp.float32)
    cos = jnp.sum(f * o, axis=-1) / jnp.maximum(jnp.linalg.norm(f, axis=-1) * jnp.linalg.norm(o, axis=-1), eps)
    theta = jnp.clip(cos, 0.0, 1.0)[..., None]
    return theta * f + (1.0 - theta) * o


def embed(config: Any, weights: dict, tokens: Array) -> Array:
    """Input embeddings of `tokens` (any shape)."""
    return block.embed(config, weights, tokens)


def fresh_kv(config: Any, weights: dict, rope: tuple, layer: int, x: Array, row_pos: Array) -> tuple[Array, Array]:
    """Fresh K/V `[K, R, H]` of rows with hidden states `x` `[R, D]` entering `layer` (no attention): what the
    decoder block's attention would read (`kvjax.models.block.attention_inputs`, with the layer's RoPE)."""
    _, k, v = block.attention_inputs(config, weights["layers"][layer], x[None], row_pos[None],
                                     block.layer_rope(config, rope, layer))
    return jnp.swapaxes(k[0], 0, 1), jnp.swapaxes(v[0], 0, 1)


def run_rows(
    config: Any,
    weights: dict,
    rope: tuple,
    table: Table,
    x: Array,
    row_slot: Array,
    row_pos: Array,
    write: Array,
    *,
    first: int = 0,
    last: int | None = None,
    fusion: bool = False,
    collect_q: bool = False,
) -> tuple[Table, Array, Array | None]:
    """Runs rows through layers `[first, last)` over `table`; see the module docstring.

    x `[R, D]`: hidden states entering layer `first`. row_slot `[R]` int32: each row's slot in the
    table (`table.size` = none; slots must be distinct). row_pos `[R]`: global positions (-1 = a
    padding row, which neither writes nor attends). write `[last - first, R]` bool.
    Returns the updated table, the rows' hidden states after layer `last - 1`, and, with
    `collect_q`, the post-RoPE query of each layer mean-pooled over the valid rows `[last - first, N, H]`.

    Each layer is `kvjax.models.block.decoder_block` with an attention that writes the rows' fresh K/V into
    the layer's table and attends over it; the layers are unrolled (each reads and writes its own buffers).
    """
    last = config.num_layers if last is None else last
    size = table.size
    kv_heads = config.num_kv_heads
    k_pos = jnp.broadcast_to(table.pos[None, None, :], (1, kv_heads, size))
    k_valid = k_pos >= 0
    live = (row_pos >= 0) & (row_slot < size)
    safe_slot = jnp.clip(row_slot, 0, size - 1)
    row_w = live.astype(jnp.float32)
    positions = row_pos[None]

    q_means = []
    x = x[None]
    for layer in range(first, last):
        k_l, v_l = table.k[layer], table.v[layer]  # [K, T, H]
        w = write[layer - first]
        window = config.layer_window(layer)

        def attention(q: Array, k: Array, v: Array, k_l: Array = k_l, v_l: Array = v_l, w: Array = w,
                      window: int | None = window):
            k_new, v_new = jnp.swapaxes(k[0], 0, 1), jnp.swapaxes(v[0], 0, 1)  # [K, R, H]
            if fusion:
                k_new = fuse(k_new, jnp.take(k_l, safe_slot, axis=1))
                v_new = fuse(v_new, jnp.take(v_l, safe_slot, axis=1))
            dst = jnp.where(w & live, row_slot, size)
            k_l = k_l.at[:, dst].set(k_new.astype(k_l.dtype), mode="drop")
            v_l = v_l.at[:, dst].set(v_new.astype(v_l.dtype), mode="drop")
            attn = prefill_attention(q, positions, k_l[None], v_l[None], k_pos, k_valid, sliding_window=window)
            q_mean = None
            if collect_q:
                q_mean = jnp.tensordot(row_w, q[0].astype(jnp.float32), axes=(0, 0)) / jnp.maximum(jnp.sum(row_w), 1.0)
            return attn, (k_l, v_l, q_mean)

        x, (k_l, v_l, q_mean) = block.decoder_block(config, weights["layers"][layer], x, positions,
                                                    block.layer_rope(config, rope, layer), attention)
        table = table.with_layer(layer, k_l, v_l)
        q_means.append(q_mean)
    return table, x[0], jnp.stack(q_means) if collect_q else None
