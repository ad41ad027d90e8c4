"""`epic`: LegoLink (Hu et al., EPIC, 2024): recompute the first `k` tokens of every document.

Those tokens (the per-document attention sinks that make isolated prefills disagree with a joint
one) run through every layer from layer 0, their fresh K/V overwriting the stored ones at each
layer, attending with an exact causal mask over all context tokens (stored K/V for the others).
The instruction prefix is exact and not recomputed; the query is prefilled afterwards, which is
what recomputing "all tokens of the final query chunk" amounts to. The paper sweeps `k` in
1..32 (the official long-context default is 16); `k >= ` document length recomputes everything.

`recompute_ratio` (SamKV's comparison, Table 1: EPIC at a 14.1 % recomputation ratio) replaces the
fixed `k` by the smallest `k` per request whose recomputed tokens `sum_d min(k, len_d)` reach that
share of the context tokens (prefix + documents), so the realised ratio is at most `num_docs / context`
above it. `configs/samkv_multidoc.py` uses 0.141.
"""

from __future__ import annotations

import dataclasses
import math
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


def k_for_ratio(ratio: float, context_len: int, doc_lens: tuple[int, ...]) -> int:
    """Smallest `k >= 1` with `sum_d min(k, len_d) >= ratio * context_len` (capped at the longest document)."""
    target = ratio * context_len - 1e-9
    lo, hi = 1, max(1, max(doc_lens))
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(min(mid, n) for n in doc_lens) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


@register
@dataclasses.dataclass(frozen=True)
class Epic(Strategy):
    """Recompute the first `k` tokens of each document at every layer (LegoLink)."""

    name = "epic"
    k: int = 16
    recompute_ratio: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ConfigError(f"epic: k must be a positive integer, got {self.k!r}")
        r = self.recompute_ratio
        if r is not None and (isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 < r <= 1.0):
            raise ConfigError(f"epic: recompute_ratio must be in (0, 1] or None, got {r!r}")

    def scalars(self, info: Any) -> dict[str, int]:
        """`k` of this request: the fixed one, or the smallest reaching `recompute_ratio` of the context."""
        if self.recompute_ratio is None:
            return {"k": self.k}
        return {"k": k_for_ratio(self.recompute_ratio, info.context_len, info.doc_lens)}

    def build(self, config: Any, weights: dict, rope: tuple, req: Request) -> Assembled:
        num_layers, size = config.num_layers, req.t_pad
        idx = compact(req.kind != EMPTY, size)
        table = gather(config, rope, req, idx)
        recompute = first_tokens(take_virtual(req, req.kind, idx, EMPTY), take_virtual(req, req.local, idx, -1),
                                 req.scalars["k"])
        if self.recompute_ratio is None:
            capacity = min(size, req.d_max * min(self.k, req.n_max))
        else:  # ratio * context + one more k step (at most one token per document)
            capacity = min(size, math.ceil(self.recompute_ratio * size) + 1 + req.d_max)
        rows = compact(recompute, capacity)
        safe = jnp.clip(rows, 0, size - 1)
        row_pos = jnp.where(rows < size, jnp.take(table.pos, safe), -1)
        x = embed(config, weights, jnp.take(table.tokens, safe))
        table, _, _ = run_rows(config, weights, rope, table, x, rows, row_pos,
                               jnp.ones((num_layers, capacity), bool))
        valid = table.pos >= 0
        n = jnp.sum(recompute).astype(jnp.int32)
        return Assembled(
            cache=to_cache(config, rope, req, table, jnp.broadcast_to(valid, (num_layers, size)), size),
            kept=jnp.full((num_layers,), jnp.sum(valid), jnp.int32),
            recomputed=jnp.full((num_layers,), n, jnp.int32), selected=n,
            details={"recomputed_positions": row_pos},
        )
