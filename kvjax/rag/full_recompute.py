"""`recompute`: a plain full prefill of the concatenated context (the accuracy upper bound / baseline).

The stored document caches are not used: this is what serving without any reuse costs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.methods.full import Full
from kvjax.models import transformer
from kvjax.rag.assemble import EMPTY, Request, compact, take_virtual
from kvjax.rag.base import Assembled, Strategy, register

_FULL = Full()


@register
@dataclasses.dataclass(frozen=True)
class Recompute(Strategy):
    """Every context token through every layer, as one prompt."""

    name = "recompute"

    def build(self, config: Any, weights: dict, rope: tuple, req: Request) -> Assembled:
        idx = compact(req.kind != EMPTY, req.t_pad)
        tokens = take_virtual(req, req.tokens, idx, 0)
        pos = take_virtual(req, req.pos, idx, -1)
        cache = kvc.init(1, config.num_kv_heads, req.t_pad, config.head_dim, req.k.dtype,
                         num_layers=config.num_layers)
        _, cache = transformer.prefill_chunk(config, weights, rope, _FULL, cache, tokens[None], pos[None],
                                             jnp.full((1,), req.t_pad, jnp.int32))
        n = jnp.sum(pos >= 0).astype(jnp.int32)
        per_layer = jnp.full((config.num_layers,), n, jnp.int32)
        return Assembled(cache=cache, kept=per_layer, recomputed=per_layer, selected=n, details={})
