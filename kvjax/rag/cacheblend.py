"""`cacheblend`: selective KV recomputation by KV deviation (Yao et al., CacheBlend, 2024).

As in the official implementation (spec §2.1): layers `0 .. check_layer - 1` are recomputed for
every context token; at the check layer fresh K/V are computed for every token, the document
tokens whose value deviation `sum_{heads, dims} (v_fresh - v_stored)^2` is largest are selected
(`floor(recompute_ratio * document tokens)` of them), and the check layer's K/V are replaced by the
fresh ones for all tokens; from the check layer on only the selected tokens continue as queries,
their fresh K/V overwriting the stored ones at every layer, attending with an exact causal mask
over all tokens (stored K/V for the unselected). The query is prefilled afterwards on the blended
cache, which equals forcing the whole query suffix into the selection. The paper's gradual
filtering over several check layers is reduced to one check layer, as in the official code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError
from kvjax.rag.assemble import EMPTY, KEEP, MIDDLE, Request, RequestInfo, compact, gather, take_virtual, to_cache
from kvjax.rag.base import Assembled, Strategy, register
from kvjax.rag.recompute import embed, fresh_kv, run_rows

Array = jax.Array


def deviation_top(deviation: Array, candidate: Array, n_select: Array, capacity: int) -> Array:
    """Slots of the `n_select` candidates with the largest deviation, ascending, padded with `len(deviation)`.

    Ties go to the lower slot. `capacity` is the static maximum of `n_select`.
    """
    size = deviation.shape[0]
    score = jnp.where(candidate, deviation, -jnp.inf)
    order = jnp.argsort(-score, stable=True)[:capacity].astype(jnp.int32)
    chosen = (jnp.arange(capacity) < n_select) & jnp.take(candidate, order)
    return jnp.sort(jnp.where(chosen, order, size))


@register
@dataclasses.dataclass(frozen=True)
class CacheBlend(Strategy):
    """Recompute the `recompute_ratio` most-deviating document tokens from `check_layer` on."""

    name = "cacheblend"
    recompute_ratio: float = 0.15
    check_layer: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.recompute_ratio, int | float) or not 0.0 <= self.recompute_ratio <= 1.0:
            raise ConfigError(f"cacheblend: recompute_ratio must be in [0, 1], got {self.recompute_ratio!r}")
        if isinstance(self.check_layer, bool) or not isinstance(self.check_layer, int) or self.check_layer < 0:
            raise ConfigError(f"cacheblend: check_layer must be an integer >= 0, got {self.check_layer!r}")

    def validate(self, info: RequestInfo, config: Any) -> None:
        if self.check_layer >= config.num_layers:
            raise ConfigError(
                f"cacheblend: check_layer={self.check_layer} but the model has {config.num_layers} layers"
            )

    def scalars(self, info: RequestInfo) -> dict[str, int]:
        return {"n_select": min(info.doc_tokens, math.floor(self.recompute_ratio * info.doc_tokens + 1e-9))}

    def build(self, config: Any, weights: dict, rope: tuple, req: Request) -> Assembled:
        num_layers, check, size = config.num_layers, self.check_layer, req.t_pad
        idx = compact(req.kind != EMPTY, size)
        table = gather(config, rope, req, idx)
        kind = take_virtual(req, req.kind, idx, EMPTY)
        valid = table.pos >= 0
        rows = jnp.arange(size, dtype=jnp.int32)
        x = embed(config, weights, table.tokens)
        if check > 0:
            table, x, _ = run_rows(config, weights, rope, table, x, rows, table.pos,
                                   jnp.ones((check, size), bool), first=0, last=check)
        k_new, v_new = fresh_kv(config, weights, rope, check, x, table.pos)
        dev = jnp.sum((v_new.astype(jnp.float32) - table.v[check].astype(jnp.float32)) ** 2, axis=(0, 2))
        capacity = min(size, math.ceil(self.recompute_ratio * size))
        n_select = req.scalars["n_select"]
        if capacity == 0:
            sel = jnp.zeros((0,), jnp.int32)
        else:
            sel = deviation_top(dev, valid & ((kind == KEEP) | (kind == MIDDLE)), n_select, capacity)
        fresh = valid[None, :, None]
        table = table.with_layer(
            check,
            jnp.where(fresh, k_new, table.k[check]).astype(table.k[check].dtype),
            jnp.where(fresh, v_new, table.v[check]).astype(table.v[check].dtype),
        )
        if capacity > 0:
            row_ok = sel < size
            safe = jnp.clip(sel, 0, size - 1)
            row_pos = jnp.where(row_ok, jnp.take(table.pos, safe), -1)
            table, _, _ = run_rows(config, weights, rope, table, jnp.take(x, safe, axis=0), sel, row_pos,
                                   jnp.ones((num_layers - check, capacity), bool), first=check, last=num_layers)
        n_ctx = jnp.sum(valid).astype(jnp.int32)
        keep = jnp.broadcast_to(valid, (num_layers, size))
        layer_ids = jnp.arange(num_layers)
        recomputed = jnp.where(layer_ids <= check, n_ctx, n_select).astype(jnp.int32)
        return Assembled(
            cache=to_cache(config, rope, req, table, keep, size), kept=jnp.full((num_layers,), n_ctx, jnp.int32),
            recomputed=recomputed, selected=jnp.asarray(n_select, jnp.int32),
            details={"selected_positions": jnp.where(sel < size, jnp.take(table.pos, jnp.clip(sel, 0, size - 1)), -1),
                     "deviation": dev},
        )
