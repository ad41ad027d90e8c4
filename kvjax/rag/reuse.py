"""`reuse`: concatenate the stored per-document caches, keys re-rotated, nothing recomputed (the lower bound)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from kvjax.rag.assemble import EMPTY, Request, compact, gather, to_cache
from kvjax.rag.base import Assembled, Strategy, register


@register
@dataclasses.dataclass(frozen=True)
class Reuse(Strategy):
    """Cross-document attention is simply missing; each document sees only itself."""

    name = "reuse"

    def build(self, config: Any, weights: dict, rope: tuple, req: Request) -> Assembled:
        table = gather(config, rope, req, compact(req.kind != EMPTY, req.t_pad))
        keep = jnp.broadcast_to(table.pos >= 0, (config.num_layers, table.size))
        zeros = jnp.zeros((config.num_layers,), jnp.int32)
        return Assembled(cache=to_cache(config, rope, req, table, keep, req.t_pad),
                         kept=jnp.sum(keep, axis=1).astype(jnp.int32),
                         recomputed=zeros, selected=jnp.int32(0), details={})
