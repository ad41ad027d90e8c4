"""`chunk`: every chunk of the prompt compressed on its own, around any scoring method (kvpress's `ChunkPress`,
after FINCH's chunked prompt reading, Corallo and Papotti, TACL 2024).

A global top-k can spend the whole budget on one region of a long context and keep nothing of the rest. Here the
prompt is cut into chunks of `chunk_length` consecutive positions from its first token, and each chunk keeps its
own share: a chunk of `m` tokens keeps `max(1, floor(m * (1 - compression_ratio)))` of them (the last chunk may be
partial), chosen by the base method (`base`, default SnapKV) scoring that chunk as if it were the whole prompt:
its keys, values and queries alone (SnapKV's observation window is the chunk's last queries, KeyDiff's anchor the
chunk's mean key, ...). The base's protected tokens in a chunk (SnapKV's window) come first and count against the
chunk's share. Every head keeps the same number of tokens of each chunk.

kvpress's `ChunkPress` takes a compression ratio only, and so does this wrapper (`budget=` is refused): the tokens
kept are the sum of the chunks' shares, which can exceed `floor(n * (1 - ratio))` by up to one token a chunk.

kvpress hands each chunk's press the RoPE tables of the whole prompt, and its presses that recompute queries from
hidden states (SnapKV's window, NonCausalAttn's rows) take the tables' last rows: a chunk's queries are rotated as
if the chunk ended at the prompt's last token. `query_rope="kvpress"` does the same (each chunk's queries rotated
on by the distance from the chunk's end to the prompt's); the default, `"own"`, scores with the queries the
prefill computed, at their own positions (key-only scorers are the same either way).

Departure (no flag): a sink of the base (`pos < n_sink`) is the prompt's first tokens, not each chunk's. One-shot
only: the chunks need every prompt query, so a chunked prefill (`chunk_size=` of `generate` smaller than the prompt)
is refused with an error, as kvpress compresses at prefill only. Bases that keep state across chunks or read more
than the cache and the queries (ExpectedAttention's statistics, H2O's attention sums, KVzap's hidden states, ...)
are refused, as is one that compresses as the prompt is read (KeyDiff with `block_size`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.common import QUERY_ROPE
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod, score_layer
from kvjax.methods.wrapper import ScorerWrapper, check_self_contained_base
from kvjax.ops.select import keep_mask, topk_keep
from kvjax.rope import rotate_between
from kvjax.validation import check_choice, check_int

Array = jax.Array

def share_of(tokens: int, ratio: float) -> int:
    """Tokens a chunk of `tokens` keeps: kvpress's `max(1, int(tokens * (1 - ratio)))` (0 for an empty chunk)."""
    return max(1, int(tokens * (1.0 - ratio))) if tokens > 0 else 0


def chunk_shares(lengths: Array, chunk: int, count: int, ratio: float) -> Array:
    """`[B, count]` int32 tokens each chunk keeps (`share_of` its tokens, 0 past the prompt), read from a table of the
    `chunk + 1` possible sizes made on the host in float64, so they are kvpress's to the token."""
    table = jnp.asarray([share_of(m, ratio) for m in range(chunk + 1)], jnp.int32)
    m = jnp.clip(lengths[:, None] - chunk * jnp.arange(count)[None], 0, chunk)
    return table[m]


def _chunked(x: Array, axis: int, chunk: int, count: int, fill: float | int | bool) -> Array:
    """`x` with `axis` padded to `count * chunk` (with `fill`) and cut into `count` chunks folded into the batch
    axis (0): `[B, ..., count * chunk, ...]` -> `[B * count, ..., chunk, ...]`."""
    width = count * chunk
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, max(0, width - x.shape[axis]))
    x = jax.lax.slice_in_dim(jnp.pad(x, pad, constant_values=fill), 0, width, axis=axis)
    x = x.reshape(*x.shape[:axis], count, chunk, *x.shape[axis + 1:])
    x = jnp.moveaxis(x, axis, 1)
    return x.reshape(x.shape[0] * count, *x.shape[2:])


def _unchunked(x: Array, batch: int, slots: int) -> Array:
    """`_chunked`'s inverse for a `[B * count, K, chunk]` array: `[B, K, slots]` (the padding cut off)."""
    count, k, chunk = x.shape[0] // batch, x.shape[1], x.shape[2]
    x = jnp.moveaxis(x.reshape(batch, count, k, chunk), 1, 2).reshape(batch, k, count * chunk)
    return x[:, :, :slots] if count * chunk >= slots else jnp.pad(x, ((0, 0), (0, 0), (0, slots - count * chunk)))


@register
@dataclasses.dataclass(frozen=True)
class Chunk(ScorerWrapper):
    """Each chunk of `chunk_length` (1024) positions keeps its share, chosen by the base scorer (`base`, "snapkv")
    over that chunk alone. kvpress's `ChunkPress`."""

    name = "chunk"

    chunk_length: int = 1024
    query_rope: str = "own"

    def check_own_hyperparameters(self) -> None:
        check_int(self.name, "chunk_length", self.chunk_length, 1)
        check_choice(self.name, "query_rope", self.query_rope, QUERY_ROPE)
        if self.budget is not None or self.compression_ratio is None:
            raise ConfigError(f"{self.name}: keeps a share of each chunk; give compression_ratio (not budget)")

    def check_base(self, inner: ScoringMethod) -> None:
        check_self_contained_base(self.name, inner, "a chunk scored alone")

    def prompt_budget(self, prompt_len: int) -> int:
        return sum(share_of(min(self.chunk_length, prompt_len - start), self.compression_ratio)
                   for start in range(0, prompt_len, self.chunk_length))

    def max_layer_budget(self, prompt_len: int) -> int:
        return self.prompt_budget(prompt_len)

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...] | None:
        return None  # every layer keeps the chunks' shares (a base's per-layer budgets are not read)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        if not step.final_chunk:
            raise ConfigError(f"{self.name}: scores each chunk with all its queries at once; chunked prefill is not "
                              "supported")
        chunk, batch, slots = self.chunk_length, cache.batch_size, cache.capacity
        count = max(1, math.ceil(q.shape[1] / chunk))
        lengths = jnp.max(cache.length, axis=-1)  # one-shot: slot j holds position j in every head
        shares = chunk_shares(lengths, chunk, count, self.compression_ratio).reshape(-1)

        def fold(x: Array, fill: float | int | bool) -> Array:  # a [B, K, C, ...] cache field, chunk by chunk
            return _chunked(x, 2, chunk, count, fill)

        start = chunk * jnp.arange(count, dtype=jnp.int32)
        parts = KVCache(  # a quantized store is scored as its values (what `kvc.keys` gives any scorer)
            k=fold(kvc.keys(cache), 0), v=fold(kvc.values(cache), 0), pos=fold(cache.pos, -1),
            length=jnp.clip(jnp.repeat(cache.length, count, axis=0) - jnp.tile(start, batch)[:, None], 0, chunk),
        )
        sub_step = dataclasses.replace(step, positions=_chunked(step.positions, 1, chunk, count, -1), budget=shares,
                                       capacity=chunk)
        queries = _chunked(q, 1, chunk, count, 0)
        if self.query_rope == "kvpress":  # as if each chunk ended at the prompt's last token
            ends = jnp.minimum(lengths[:, None], chunk * (jnp.arange(count)[None] + 1))
            own = jnp.maximum(sub_step.positions, 0)
            moved = own + (lengths[:, None] - ends).reshape(-1, 1)
            queries = rotate_between(queries, own[..., None], moved[..., None], step.inv_freq)
        scored = score_layer(self.inner, parts, queries, sub_step)
        indices, counts = topk_keep(scored.scores.astype(jnp.float32), kvc.stored_mask(parts), shares[:, None],
                                    capacity=chunk, protect=scored.protect, positions=parts.pos)
        keep = _unchunked(keep_mask(indices, counts, chunk), batch, slots)
        return kvc.keep_where(cache, keep, step.capacity)


__all__ = ["QUERY_ROPE", "Chunk", "chunk_shares", "share_of"]
