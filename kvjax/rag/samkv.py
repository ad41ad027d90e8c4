"""`samkv`: sparse attention across multiple-context KV caches (Cao et al., SamKV, 2025).

Request-time stages (spec §2.3-2.6), over documents prefilled with `analyze=True`:

A. **Generic query.** The query is prefilled on a composite cache (the prefix plus every document's
   init + local tokens, re-rotated to their global positions; query positions continue after the
   *full* context); its post-RoPE queries, mean-pooled per layer, give `Q_que`.
B. **Personalised queries (Eq. 1)** `Q_i = Q_que + 1/(D-1) sum_{j != i} |cos(Q_que, q_loc_j)| q_loc_j`
   (cosine over the flattened heads). **Top-P (Eq. 2-3)** from the anchor / max / min block scores
   `s = sum_h <Q_i[h], K[h // G]>`, averaged over the stable layers `N*`; `round(P_i M_i)` middle
   blocks per document and layer, then a cross-document filter keeping the
   `floor(sum_i n_i / D)` best min-max-normalised blocks of the pooled selection.
C. **Recomputation** of the sparse union over layers: the init + local tokens of every document
   at every layer, plus the PauTa representative tokens of kept blocks (A.1), each propagated from
   layer 0 (rule 1); tokens not recomputed at a layer, and the "padding" tokens kept only at other
   layers, take part with their stored K/V (rule 2). Update by `overwrite` or `fusion` (Eq. 4).
D. The per-layer sparse caches (same size in every layer, different tokens) are what the query is
   prefilled on again and the answer decoded from.

Fixed shapes: every count has a static cap derived from the request bucket (spec §6).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError
from kvjax.models import block
from kvjax.rag.assemble import KEEP, MIDDLE, PREFIX, Request, RequestInfo, compact, gather, to_cache
from kvjax.rag.base import Assembled, Strategy, register
from kvjax.rag.recompute import Table, embed, run_rows
from kvjax.rope import rotate_by

Array = jax.Array

#: Appendix A.2's stable layers, as (model_type, num_layers) -> how many final layers.
_STABLE = {("qwen2", 36): 5, ("mistral", 32): 5, ("llama", 32): 4}


def default_stable_layers(config: Any) -> tuple[int, ...]:
    """The paper's N* (Qwen2.5-3B: last 5 of 36, Mistral-7B: last 5, Llama-3.1-8B: last 4); else the last 4."""
    n = min(_STABLE.get((config.model_type, config.num_layers), 4), config.num_layers)
    return tuple(range(config.num_layers - n, config.num_layers))


# ---------------------------------------------------------------------------------------------
# Pure selection logic (Eq. 1-3)
# ---------------------------------------------------------------------------------------------
def personalised_queries(q_que: Array, q_loc: Array, doc_valid: Array, eps: float = 1e-8) -> Array:
    """Eq. 1. q_que `[L, N, H]`, q_loc `[D, L, N, H]` (global positions), doc_valid `[D]` -> `[D, L, N, H]`.

    The cosine is over the flattened `N * H` vector of each layer; with one document the bias is 0.
    """
    d, layers = q_loc.shape[:2]
    qq = q_que.reshape(layers, -1).astype(jnp.float32)
    ql = q_loc.reshape(d, layers, -1).astype(jnp.float32)
    cos = jnp.sum(ql * qq[None], -1) / jnp.maximum(jnp.linalg.norm(ql, axis=-1) * jnp.linalg.norm(qq, axis=-1), eps)
    w = jnp.abs(cos) * doc_valid[:, None]  # [D, L]
    not_self = 1.0 - jnp.eye(d, dtype=jnp.float32)
    others = jnp.einsum("ij,jlf->ilf", not_self, w[..., None] * ql)  # sum over j != i
    num_docs = jnp.sum(doc_valid)
    bias = others / jnp.maximum(num_docs - 1, 1).astype(jnp.float32)
    return (qq[None] + bias).reshape(q_loc.shape)


def scores(q_hat: Array, keys: Array) -> Array:
    """`<Q, K>` summed over query heads with GQA: q_hat `[D, L, N, H]`, keys `[D, L, ..., K, H]` -> `[D, L, ...]`."""
    d, layers, n, h = q_hat.shape
    kv = keys.shape[-2]
    q_group = q_hat.reshape(d, layers, kv, n // kv, h).sum(axis=3)  # sum_g <q[k, g], K[k]> = <sum_g q[k, g], K[k]>
    extra = keys.ndim - 4
    q_group = q_group.reshape(d, layers, *([1] * extra), kv, h)
    return jnp.sum(q_group * keys.astype(jnp.float32), axis=(-2, -1))


def top_p(s_anc: Array, s_max: Array, s_min: Array, stable_layers: tuple[int, ...],
          below_min_gives_one: bool = False) -> tuple[Array, Array]:
    """Eq. 2 per layer and Eq. 3 over the stable layers: returns `(P [D], P_layer [D, L])`.

    `P^(n) = (s_max - s_anc) / (s_max - s_min)` when `s_min < s_anc <= s_max`, else 0 (or 1 below
    `s_min` with `below_min_gives_one`).
    """
    span = s_max - s_min
    inside = (s_anc > s_min) & (s_anc <= s_max) & (span > 0)
    p = jnp.where(inside, (s_max - s_anc) / jnp.where(span > 0, span, 1.0), 0.0)
    if below_min_gives_one:
        p = jnp.where((s_anc <= s_min) & (span > 0), 1.0, p)
    return jnp.mean(p[:, jnp.asarray(stable_layers)], axis=1), p


def num_selected(p: Array, num_blocks: Array) -> Array:
    """`round_half_up(P * M)`, clipped to `[0, M]` (int32)."""
    return jnp.clip(jnp.floor(p * num_blocks + 0.5), 0, num_blocks).astype(jnp.int32)


def _rank(values: Array, axis: int = -1) -> Array:
    """Rank of every entry along `axis` in descending order (ties: lower index first)."""
    order = jnp.argsort(-values, axis=axis, stable=True)
    return jnp.argsort(order, axis=axis, stable=True)


def select_blocks(block_scores: Array, block_valid: Array, n_sel: Array, doc_valid: Array,
                  cross_doc: bool = True, eps: float = 1e-6) -> tuple[Array, Array]:
    """Per-document top-`n_sel` middle blocks, then the cross-document filter (§3.2).

    block_scores `[D, L, MB]`, block_valid `[D, MB]`, n_sel `[D]`, doc_valid `[D]`. Returns
    `(selected, kept)` `[D, L, MB]` bool: `kept` keeps, per layer, the `floor(sum n_sel / D)` selected
    blocks with the largest per-document min-max-normalised scores.
    """
    valid = block_valid[:, None, :]
    s = jnp.where(valid, block_scores, -jnp.inf)
    selected = valid & (_rank(s) < n_sel[:, None, None])
    if not cross_doc:
        return selected, selected
    lo = jnp.min(jnp.where(valid, block_scores, jnp.inf), axis=-1, keepdims=True)
    hi = jnp.max(jnp.where(valid, block_scores, -jnp.inf), axis=-1, keepdims=True)
    norm = (block_scores - lo) / (hi - lo + eps)
    d, layers, mb = s.shape
    pooled = jnp.where(selected, norm, -jnp.inf).transpose(1, 0, 2).reshape(layers, d * mb)
    k_fin = jnp.sum(n_sel * doc_valid) // jnp.maximum(jnp.sum(doc_valid), 1)
    rank = _rank(pooled).reshape(layers, d, mb).transpose(1, 0, 2)
    return selected, selected & (rank < k_fin)


# ---------------------------------------------------------------------------------------------
# The strategy
# ---------------------------------------------------------------------------------------------
@register
@dataclasses.dataclass(frozen=True)
class SamKV(Strategy):
    """SamKV; the block layout (block size, init / local blocks) is the documents' (`prefill_documents`).

    update: "overwrite" | "fusion" (Eq. 4). stable_layers: N* (default: `default_stable_layers`).
    selection / personalised_bias: the Table 4 ablation switches. recompute: "default" (init + local
    + PauTa tokens), "all" (every kept document token, every layer) or "none". cross_doc_filter: the
    floor(sum n / D) pooled filter. minmax_mode: "static" (A.1 max / min blocks) or "query" (the
    highest / lowest scoring block). p_override: force P for every document (tests, ablations).
    """

    name = "samkv"
    needs_stats = True
    update: str = "fusion"
    stable_layers: tuple[int, ...] | None = None
    selection: bool = True
    personalised_bias: bool = True
    recompute: str = "default"
    cross_doc_filter: bool = True
    minmax_mode: str = "static"
    below_min_gives_one: bool = False
    p_override: float | None = None

    def __post_init__(self) -> None:
        choices = {"update": ("overwrite", "fusion"), "recompute": ("default", "all", "none"),
                   "minmax_mode": ("static", "query")}
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ConfigError(f"samkv: {field} must be one of {allowed}, got {getattr(self, field)!r}")
        for field in ("selection", "personalised_bias", "cross_doc_filter", "below_min_gives_one"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"samkv: {field} must be True or False, got {getattr(self, field)!r}")
        if self.p_override is not None and not (
            isinstance(self.p_override, int | float) and 0.0 <= self.p_override <= 1.0
        ):
            raise ConfigError(f"samkv: p_override must be in [0, 1] or None, got {self.p_override!r}")
        if self.stable_layers is not None:
            layers = tuple(self.stable_layers) if isinstance(self.stable_layers, list | tuple) else ()
            if not layers or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in layers):
                raise ConfigError(f"samkv: stable_layers must be a non-empty list of layer indices >= 0, got "
                                  f"{self.stable_layers!r}")
            object.__setattr__(self, "stable_layers", layers)

    def layers_for(self, config: Any) -> tuple[int, ...]:
        return self.stable_layers if self.stable_layers is not None else default_stable_layers(config)

    def validate(self, info: RequestInfo, config: Any) -> None:
        bad = [n for n in self.layers_for(config) if n >= config.num_layers]
        if bad:
            raise ConfigError(f"samkv: stable_layers {bad} out of range for a {config.num_layers}-layer model")

    def build(self, config: Any, weights: dict, rope: tuple, req: Request) -> Assembled:
        st = req.stats
        inv_freq = rope[0]
        num_layers, d, mb, bs = config.num_layers, req.d_max, req.mb, req.block_size
        keep_per_doc = min(req.n_max, req.keep_tokens)
        k_cap = mb if self.cross_doc_filter else d * mb
        always = (req.kind == PREFIX) | (req.kind == KEEP)

        # Stage A: the generic query from the composite (prefix + init / local) cache.
        n_comp = req.p_pad + d * keep_per_doc
        comp = gather(config, rope, req, compact(always, n_comp))
        q_pad = req.query.shape[0]
        pad = jnp.zeros((comp.k[0].shape[0], q_pad, comp.k[0].shape[2]), comp.k[0].dtype)
        composite = Table(k=tuple(jnp.concatenate([k, pad], 1) for k in comp.k),
                          v=tuple(jnp.concatenate([v, pad], 1) for v in comp.v),
                          pos=jnp.concatenate([comp.pos, req.query_pos]),
                          tokens=jnp.concatenate([comp.tokens, req.query]))
        _, _, q_que = run_rows(config, weights, rope, composite, embed(config, weights, req.query),
                               n_comp + jnp.arange(q_pad, dtype=jnp.int32), req.query_pos,
                               jnp.ones((num_layers, q_pad), bool), collect_q=True)

        # Stage B: Eq. 1-3 on the pooled vectors `[D, L, ...]`, rotated to the documents' global offsets (each layer
        # with its RoPE: Gemma 3's local layers have their own).
        def at_offset(x: Array) -> Array:
            off = req.doc_offset.reshape((d,) + (1,) * (x.ndim - 2))
            if len(rope) < 3 or rope[2] is None:  # one RoPE for every layer
                return rotate_by(x, jnp.broadcast_to(off, x.shape[:-1]), inv_freq)
            return jnp.stack([rotate_by(x[:, i], jnp.broadcast_to(off, x.shape[:-1])[:, i],
                                        block.layer_rope(config, rope, i)[0]) for i in range(num_layers)], axis=1)

        q_loc = at_offset(st["q_loc"])
        if self.personalised_bias:
            q_hat = personalised_queries(q_que, q_loc, req.doc_valid)
        else:
            q_hat = jnp.broadcast_to(q_que[None], q_loc.shape)
        block_scores = scores(q_hat, at_offset(st["k_block"]))  # [D, L, MB]
        s_anc = scores(q_hat, at_offset(st["k_anchor"])[:, :, None])[..., 0]
        block_valid = st["block_valid"]
        if self.minmax_mode == "static":
            s_max = jnp.take_along_axis(block_scores, st["b_max"][..., None], axis=2)[..., 0]
            s_min = jnp.take_along_axis(block_scores, st["b_min"][..., None], axis=2)[..., 0]
        else:
            s_max = jnp.max(jnp.where(block_valid[:, None], block_scores, -jnp.inf), axis=-1)
            s_min = jnp.min(jnp.where(block_valid[:, None], block_scores, jnp.inf), axis=-1)
        p, p_layers = top_p(s_anc, s_max, s_min, self.layers_for(config), self.below_min_gives_one)
        if self.p_override is not None:
            p = jnp.full_like(p, self.p_override)
        n_sel = num_selected(p, jnp.sum(block_valid, axis=-1)) * req.doc_valid
        selected, kept_blocks = select_blocks(block_scores, block_valid, n_sel, req.doc_valid, self.cross_doc_filter)
        if not self.selection:
            kept_blocks = jnp.zeros_like(kept_blocks)

        # Per-layer kept set S and recompute set R over the virtual context.
        flat_keep = kept_blocks.transpose(1, 0, 2).reshape(num_layers, d * mb)
        in_block = jnp.take(flat_keep, jnp.clip(req.block, 0, d * mb - 1), axis=1) & (req.block >= 0)[None]
        keep_s = always[None] | in_block  # [L, V]
        doc_token = (req.kind == KEEP) | (req.kind == MIDDLE)
        if self.recompute == "all":
            recomp = keep_s & doc_token[None]
        elif self.recompute == "none":
            recomp = jnp.zeros_like(keep_s)
        else:
            rep = st["rep_token"]  # [D, L, MB] local index
            flagged = st["pauta"] & kept_blocks & (rep >= 0)
            virt = req.p_pad + jnp.arange(d)[:, None, None] * req.n_max + rep
            target = jnp.where(flagged, virt, req.size).transpose(1, 0, 2).reshape(num_layers, -1)
            rows_l = jnp.broadcast_to(jnp.arange(num_layers)[:, None], target.shape)
            recomp = (req.kind == KEEP)[None] | jnp.zeros_like(keep_s).at[rows_l, target].set(True, mode="drop")

        # Stage C: recompute over the union of the per-layer sets (padding blocks at other layers).
        u_max = min(req.size, req.p_pad + d * keep_per_doc + min(d * mb, num_layers * k_cap) * bs)
        u_idx = compact(jnp.any(keep_s, axis=0), u_max)
        table = gather(config, rope, req, u_idx)
        u_ok = u_idx < req.size
        u_safe = jnp.clip(u_idx, 0, req.size - 1)
        keep_u = jnp.take(keep_s, u_safe, axis=1) & u_ok[None]
        recomp_u = jnp.take(recomp, u_safe, axis=1) & u_ok[None]
        if self.recompute != "none":
            r_max = u_max if self.recompute == "all" else min(u_max, d * keep_per_doc + min(d * mb, num_layers * k_cap))
            rows = compact(jnp.any(recomp_u, axis=0), r_max)
            r_safe = jnp.clip(rows, 0, u_max - 1)
            row_ok = rows < u_max
            row_pos = jnp.where(row_ok, jnp.take(table.pos, r_safe), -1)
            write = jnp.take(recomp_u, r_safe, axis=1) & row_ok[None]
            table, _, _ = run_rows(config, weights, rope, table, embed(config, weights, jnp.take(table.tokens, r_safe)),
                                   rows, row_pos, write, fusion=self.update == "fusion")

        # Stage D: the per-layer sparse caches.
        t_keep = min(u_max, req.p_pad + d * keep_per_doc + k_cap * bs)
        valid = req.pos >= 0
        return Assembled(
            cache=to_cache(config, rope, req, table, keep_u, t_keep),
            kept=jnp.sum(keep_s & valid[None], axis=1).astype(jnp.int32),
            recomputed=jnp.sum(recomp & valid[None], axis=1).astype(jnp.int32),
            selected=jnp.sum(jnp.any(recomp, axis=0) & valid).astype(jnp.int32),
            details={"q_que": q_que, "q_hat": q_hat, "p": p, "p_layers": p_layers, "n_selected": n_sel,
                     "block_scores": block_scores, "selected_blocks": selected, "kept_blocks": kept_blocks},
        )
