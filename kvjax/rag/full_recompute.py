"""`recompute`: a plain full prefill of the concatenated context (the accuracy upper bound / baseline).

The stored document caches are not used: this is what serving without any reuse costs. Each layer is the
model's decoder block with the runtime's per-layer cache step as its attention (`kvjax.runtime.step`,
composed as `kvjax.runtime.forward.prefill_chunk` composes them), unrolled inside the strategy's program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.methods.full import Full
from kvjax.models import block
from kvjax.rag.assemble import EMPTY, Request, compact, take_virtual
from kvjax.rag.base import Assembled, Strategy, register
from kvjax.runtime import step
from kvjax.runtime.generate import init_cache

Array = jax.Array
_FULL = Full()


@register
@dataclasses.dataclass(frozen=True)
class Recompute(Strategy):
    """Every context token through every layer, as one prompt."""

    name = "recompute"

    def build(self, config: Any, weights: dict, rope: tuple, req: Request) -> Assembled:
        idx = compact(req.kind != EMPTY, req.t_pad)
        tokens = take_virtual(req, req.tokens, idx, 0)
        pos = take_virtual(req, req.pos, idx, -1)[None]
        cache = init_cache(_FULL, config, 1, req.t_pad, req.k[0].dtype)
        budget = jnp.full((1,), req.t_pad, jnp.int32)
        x = block.embed(config, weights, tokens[None])
        for i, lw in enumerate(weights["layers"]):
            layer, window = cache.layer(i), config.layer_window(i)

            def attention(q: Array, k: Array, v: Array, i: int = i, layer: KVCache = layer,
                          window: int | None = window):
                if window is not None:  # a sliding-window layer's ring (rows run 0 .. n - 1: a fresh prefill)
                    return step.prefill_window_layer(layer, q, k, v, pos, window=window, fresh=True)
                return step.prefill_layer(_FULL, layer, q, k, v, pos, budget, layer=i, inv_freq=rope[0],
                                          num_layers=config.num_layers)

            x, layer = block.decoder_block(config, lw, x, pos, block.layer_rope(config, rope, i), attention)
            cache = cache.with_layer(i, layer)
        n = jnp.sum(pos >= 0).astype(jnp.int32)
        per_layer = jnp.full((config.num_layers,), n, jnp.int32)
        return Assembled(cache=cache, kept=per_layer, recomputed=per_layer, selected=n, details={})
