"""`block`: the prompt compressed block by block, as if it streamed in, around any scoring method (kvpress's
`BlockPress`, which simulates the block-wise prompt processing of KeyDiff, Park et al., 2025).

With `n` prompt tokens and `n_kept` to keep, the kept set starts as the first `n_kept` positions. Then the rest of
the prompt is read in blocks of `block_size` consecutive positions (the last block may be partial): the base
(`base`, default SnapKV) scores the kept set together with the next block, as if those tokens were the whole
prompt, and the best `n_kept` of them (the base's protected tokens first) become the new kept set. The cache never
needs more than `n_kept + block_size` tokens at a time, which is the point of the paper's setting; here, as in
kvpress, the whole prompt is prefilled first and only the selection runs block by block (`keydiff` with `block_size`
prefills in blocks that attend the compressed cache instead). Cost: `ceil((n - n_kept) / block_size)` scoring passes
of `n_kept + block_size` tokens each (for a long prompt, quadratic in `n`).

The base reads the block's queries: a SnapKV-style window is the block's last queries, voting over the kept keys
and the block's. `query_rope="kvpress"` rotates them as kvpress's presses do (with the RoPE of the prompt's last
positions, as `chunk` does); the default `"own"` keeps them at their own positions. Key-only bases (KNorm, KeyDiff,
...) read no query. The kept tokens sit ahead of the block in the order of their last ranking (best first), as in
kvpress; only a base that pools along the slots (SnapKV's clustering) sees that order.

Departures (no flag): kvpress hands its base the hidden states of the kept tokens as well, cut per KV head, so a
base whose window reaches past a partial last block into the kept tokens reads rows this wrapper does not have;
here such a window is the block's rows alone (the kept tokens have no queries). A base that scores every token with
its own query (Compactor, NonCausalAttn) is refused for the same reason, as are the bases `chunk` refuses (prompt-wide
statistics, layer inputs, compression while the prompt is read). Tied scores rank by their place in the
kept-then-block order (kvpress: torch's `topk` order, which for SnapKV's window, all scored alike, is its own).
One-shot only: a chunked prefill is refused.
"""

from __future__ import annotations

import dataclasses

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
from kvjax.rope import rotate_between
from kvjax.validation import check_choice, check_int

Array = jax.Array


def _gather_slots(x: Array, slots: Array) -> Array:
    """`x` `[B, K, C, ...]` at `slots` `[B, K, W]` -> `[B, K, W, ...]`."""
    return jnp.take_along_axis(x, slots.reshape(*slots.shape, *([1] * (x.ndim - 3))), axis=2)


@register
@dataclasses.dataclass(frozen=True)
class Block(ScorerWrapper):
    """The kept set re-chosen after every block of `block_size` (128) positions by the base scorer (`base`,
    "snapkv") over the kept tokens and the block. kvpress's `BlockPress`."""

    name = "block"

    block_size: int = 128
    query_rope: str = "own"

    def check_own_hyperparameters(self) -> None:
        check_int(self.name, "block_size", self.block_size, 1)
        check_choice(self.name, "query_rope", self.query_rope, QUERY_ROPE)

    def check_base(self, inner: ScoringMethod) -> None:
        check_self_contained_base(self.name, inner, "a block scored with the kept tokens")
        if inner.reads_every_query_row:
            raise ConfigError(f"{self.name}: base {inner.name} scores every token with its own query, which the kept "
                              "tokens no longer have when a later block is scored")

    def layer_budget(self, cache: KVCache, step: Step) -> Array:
        return step.budget

    def max_layer_budget(self, prompt_len: int) -> int:
        return self.prompt_budget(prompt_len)

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...] | None:
        return None  # every layer keeps the wrapper's budget (a base's per-layer budgets are not read, as kvpress)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        if not step.final_chunk:
            raise ConfigError(f"{self.name}: re-scores the prompt block by block after it is prefilled; chunked "
                              "prefill is not supported")
        batch, heads, rows = cache.batch_size, cache.num_kv_heads, q.shape[1]
        block = min(self.block_size, rows)
        most = min(self.prompt_budget(rows), cache.capacity)  # static bound of every example's kept set
        width = most + block
        lengths = jnp.max(cache.length, axis=-1)  # one-shot: slot j holds position j in every head
        n_kept = jnp.minimum(step.budget, lengths)
        blocks = (lengths - n_kept + block - 1) // block  # [B] scoring passes of each example
        keys, values = kvc.keys(cache), kvc.values(cache)  # a quantized store is scored as its values
        slot = jnp.arange(width, dtype=jnp.int32)
        row = jnp.arange(block, dtype=jnp.int32)

        def one_block(t: Array, kept: Array) -> Array:
            start = n_kept + t * block  # [B] the block's first position
            size = jnp.clip(lengths - start, 0, block)
            from_kept = (slot[None] < n_kept[:, None])[:, None]  # [B, 1, W]: the kept set, then the block
            in_block = (~from_kept) & (slot[None] - n_kept[:, None] < size[:, None])[:, None]
            members = jnp.where(from_kept, kept[:, :, jnp.minimum(slot, most - 1)],
                                (start[:, None] + slot[None] - n_kept[:, None])[:, None])
            valid = from_kept | in_block
            members = jnp.where(valid, members, 0)
            part = KVCache(k=_gather_slots(keys, members), v=_gather_slots(values, members),
                           pos=jnp.where(valid, _gather_slots(cache.pos, members), -1),
                           length=jnp.broadcast_to((n_kept + size)[:, None], (batch, heads)))
            block_rows = jnp.minimum(start[:, None] + row[None], rows - 1)  # [B, block]
            queries = jnp.take_along_axis(q, block_rows[:, :, None, None], axis=1)
            positions = jnp.where(row[None] < size[:, None], jnp.take_along_axis(step.positions, block_rows, 1), -1)
            if self.query_rope == "kvpress":  # as if the block ended at the prompt's last token
                moved = jnp.maximum(positions, 0) + (lengths - start - size)[:, None]
                queries = rotate_between(queries.astype(jnp.float32), jnp.maximum(positions, 0)[..., None],
                                         moved[..., None], step.inv_freq)
            sub_step = dataclasses.replace(step, positions=positions, budget=n_kept, capacity=width)
            scored = score_layer(self.inner, part, queries, sub_step)
            rank = scored.scores.astype(jnp.float32)
            if scored.protect is not None:
                rank = jnp.where(scored.protect, jnp.inf, rank)
            _, best = jax.lax.top_k(jnp.where(valid, rank, -jnp.inf), most)  # best first, ties to the earlier slot
            chosen = jnp.take_along_axis(members, best, axis=-1)
            return jnp.where((t < blocks)[:, None, None], chosen, kept)

        start_set = jnp.broadcast_to(jnp.arange(most, dtype=jnp.int32), (batch, heads, most))
        kept = jax.lax.fori_loop(0, jnp.max(blocks), one_block, start_set)
        chosen = jnp.where(jnp.arange(most)[None, None] < n_kept[:, None, None], kept, cache.capacity)
        keep = jnp.zeros(cache.pos.shape, bool).at[
            jnp.arange(batch)[:, None, None], jnp.arange(heads)[None, :, None], chosen].set(True, mode="drop")
        return kvc.keep_where(cache, keep, step.capacity)


__all__ = ["Block"]
