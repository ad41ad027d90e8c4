"""`epic`: LegoLink (Hu et al., EPIC, 2024): recompute the first `k` tokens of every document.

Those tokens (the per-document attention sinks that make isolated prefills disagree with a joint
one) run through every layer from layer 0, their fresh K/V overwriting the stored ones at each
layer, attending with an exact causal mask over all context tokens (stored K/V for the others).
The instruction prefix is exact and not recomputed; the query is prefilled afterwards, which is
what recomputing "all tokens of the final query chunk" amounts to. The paper sweeps `k` in
1..32 (the official long-context default is 16); `k >= ` document length recomputes everything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError
from kvjax.rag.assemble import EMPTY, KEEP, MIDDLE, Request, compact, gather, take_virtual, to_cache
from kvjax.rag.base import Assembled, Strategy, register
from kvjax.rag.recompute import embed, run_rows

Array = jax.Array


def first_tokens(kind: Array, local: Array, k: int) -> Array:
    """Mask of the document tokens among the first `k` of their document."""
    return ((kind == KEEP) | (kind == MIDDLE)) & (local >= 0) & (local < k)


@register
@dataclasses.dataclass(frozen=True)
class Epic(Strategy):
    """Recompute the first `k` tokens of each document at every layer (LegoLink)."""

    name = "epic"
    k: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ConfigError(f"epic: k must be a positive integer, got {self.k!r}")

    def build(self, config: Any, weights: dict, rope: tuple, req: Request) -> Assembled:
        num_layers, size = config.num_layers, req.t_pad
        idx = compact(req.kind != EMPTY, size)
        table = gather(req, idx, rope[0])
        recompute = first_tokens(take_virtual(req, req.kind, idx, EMPTY), take_virtual(req, req.local, idx, -1),
                                 self.k)
        capacity = min(size, req.d_max * min(self.k, req.n_max))
        rows = compact(recompute, capacity)
        safe = jnp.clip(rows, 0, size - 1)
        row_pos = jnp.where(rows < size, jnp.take(table.pos, safe), -1)
        x = embed(weights, jnp.take(table.tokens, safe))
        table, _, _ = run_rows(config, weights, rope, table, x, rows, row_pos,
                               jnp.ones((num_layers, capacity), bool))
        valid = table.pos >= 0
        n = jnp.sum(recompute).astype(jnp.int32)
        return Assembled(
            cache=to_cache(table, jnp.broadcast_to(valid, (num_layers, size)), size),
            kept=jnp.full((num_layers,), jnp.sum(valid), jnp.int32),
            recomputed=jnp.full((num_layers,), n, jnp.int32), selected=n,
            details={"recomputed_positions": row_pos},
        )
