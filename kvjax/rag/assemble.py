"""Assembly of one request: `[prefix][doc_1]...[doc_D][query]` from per-document caches.

The host side (`build_request`) lays the stored caches out in a fixed-shape *virtual context*:
the prefix (padded to its own bucket) followed by `D_max` documents, each padded to `N_max`
tokens, so one compiled program serves every request of the same bucket (`D_max`: the number of
documents rounded up to a power of two; `N_max`: the largest document bucket). Per virtual token
it records the token id, its global position (`-1` for padding), the RoPE shift from the stored
local position to the global one, its role (prefix / kept init+local / middle) and SamKV block id.

The traced side gathers any subset of the virtual context into a `Table` (`gather`), re-rotating
the stored keys to their global positions on the way (`R(o + t) = R(o) R(t)`, each layer with its own RoPE), and
turns a table plus per-layer keep masks into the `ModelCache` the query prefill and the decode loop consume
(`to_cache`; a sliding-window layer gets the ring of the context's last window instead).
K/V are per layer everywhere (one `[K, V, H]` array per layer in a request, one `[K, T, H]` per layer in a
table, one `KVCache` per layer in the assembled cache), as the runtime keeps them: no `[L, ...]` stack.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import ModelCache
from kvjax.errors import KvjaxError
from kvjax.models import block
from kvjax.rag.analysis import BlockLayout
from kvjax.rag.recompute import Table
from kvjax.rag.store import DocumentCache
from kvjax.rope import rotate_by
from kvjax.runtime import sharding
from kvjax.runtime.generate import bucket_length

Array = jax.Array

EMPTY, PREFIX, KEEP, MIDDLE = 0, 1, 2, 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Request:
    """Traced inputs of one request (virtual context of `V = p_pad + d_max * n_max` tokens).

    tokens, pos, delta, kind, doc, local, block: `[V]` int32. k, v: one `[K, V, H]` array per layer, the
    stored (local-RoPE) K/V. query, query_pos: `[q_pad]`. n_ctx: real context tokens. doc_valid / doc_offset / doc_len:
    `[D_max]`. stats: SamKV's per-document statistics stacked on `[D_max]` (or None). scalars: ints
    a strategy computed on the host.
    """

    tokens: Array
    pos: Array
    delta: Array
    kind: Array
    doc: Array
    local: Array
    block: Array
    k: tuple[Array, ...]
    v: tuple[Array, ...]
    query: Array
    query_pos: Array
    n_ctx: Array
    doc_valid: Array
    doc_offset: Array
    doc_len: Array
    stats: dict[str, Array] | None
    scalars: dict[str, Array]
    p_pad: int = dataclasses.field(metadata=dict(static=True))
    d_max: int = dataclasses.field(metadata=dict(static=True))
    n_max: int = dataclasses.field(metadata=dict(static=True))
    mb: int = dataclasses.field(metadata=dict(static=True))
    t_pad: int = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(metadata=dict(static=True))
    keep_tokens: int = dataclasses.field(metadata=dict(static=True))

    @property
    def size(self) -> int:
        return int(self.pos.shape[0])


@dataclasses.dataclass(frozen=True)
class RequestInfo:
    """Host-side facts about a request (for strategies' host arithmetic and the report)."""

    num_docs: int
    prefix_len: int
    doc_lens: tuple[int, ...]
    doc_offsets: tuple[int, ...]
    query_len: int
    layout: BlockLayout

    @property
    def context_len(self) -> int:
        return self.prefix_len + sum(self.doc_lens)

    @property
    def doc_tokens(self) -> int:
        return sum(self.doc_lens)


def _pad_axis(x: Array, axis: int, size: int) -> Array:
    if x.shape[axis] == size:
        return x
    width = [(0, 0)] * x.ndim
    width[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, width)


def build_request(
    prefix: DocumentCache | None,
    docs: Sequence[DocumentCache],
    query_ids: Sequence[int],
    *,
    with_stats: bool,
    scalars: dict[str, int] | None = None,
) -> tuple[Request, RequestInfo]:
    """Lays out the stored caches of one request in the fixed-shape virtual context (host side)."""
    if not docs:
        raise KvjaxError("a request needs at least one document")
    layout = docs[0].layout
    num_docs = len(docs)
    d_max = 1 << (num_docs - 1).bit_length()
    n_max = max(d.padded_length for d in docs)
    p_len = prefix.length if prefix is not None else 0
    p_pad = prefix.padded_length if prefix is not None else 0
    lens = [d.length for d in docs]
    offsets = list(np.cumsum([p_len, *lens[:-1]]).astype(int))
    n_ctx = p_len + sum(lens)
    size = p_pad + d_max * n_max

    tokens = np.zeros(size, np.int32)
    pos = np.full(size, -1, np.int32)
    delta = np.zeros(size, np.int32)
    kind = np.full(size, EMPTY, np.int32)
    doc = np.full(size, -1, np.int32)
    local = np.full(size, -1, np.int32)
    block = np.full(size, -1, np.int32)
    if prefix is not None:
        tokens[:p_len] = prefix.token_ids
        pos[:p_len] = np.arange(p_len)
        kind[:p_len] = PREFIX
        local[:p_len] = np.arange(p_len)
    mb = layout.block_capacity(n_max)
    bs = layout.block_size
    for i, (d, n, off) in enumerate(zip(docs, lens, offsets, strict=True)):
        s = p_pad + i * n_max
        t = np.arange(n)
        tokens[s : s + n] = d.token_ids
        pos[s : s + n] = off + t
        delta[s : s + n] = off
        doc[s : s + n] = i
        local[s : s + n] = t
        init_end = min(n, layout.init_blocks * bs)
        loc_start = max(init_end, n - layout.local_blocks * bs)
        mid = (t >= init_end) & (t < loc_start)
        kind[s : s + n] = np.where(mid, MIDDLE, KEEP)
        block[s : s + n] = np.where(mid, i * mb + (t - init_end) // bs, -1)

    k, v = _virtual_kv(None if prefix is None else (prefix.k, prefix.v), tuple((d.k, d.v) for d in docs), d_max, n_max)

    stats = _stack_stats(docs, d_max, n_max, mb, layout) if with_stats else None
    q = np.asarray(list(query_ids), np.int32)
    q_pad = bucket_length(len(q))
    query = np.zeros(q_pad, np.int32)
    query[: len(q)] = q
    query_pos = np.where(np.arange(q_pad) < len(q), n_ctx + np.arange(q_pad), -1).astype(np.int32)
    doc_valid = np.arange(d_max) < num_docs
    req = Request(
        tokens=jnp.asarray(tokens), pos=jnp.asarray(pos), delta=jnp.asarray(delta), kind=jnp.asarray(kind),
        doc=jnp.asarray(doc), local=jnp.asarray(local), block=jnp.asarray(block), k=k, v=v,
        query=jnp.asarray(query), query_pos=jnp.asarray(query_pos), n_ctx=jnp.int32(n_ctx),
        doc_valid=jnp.asarray(doc_valid),
        doc_offset=jnp.asarray(np.pad(offsets, (0, d_max - num_docs)).astype(np.int32)),
        doc_len=jnp.asarray(np.pad(lens, (0, d_max - num_docs)).astype(np.int32)),
        stats=stats, scalars={k_: jnp.int32(v_) for k_, v_ in (scalars or {}).items()},
        p_pad=p_pad, d_max=d_max, n_max=n_max, mb=mb, t_pad=bucket_length(n_ctx),
        block_size=layout.block_size, keep_tokens=layout.keep_tokens,
    )
    info = RequestInfo(num_docs=num_docs, prefix_len=p_len, doc_lens=tuple(lens), doc_offsets=tuple(offsets),
                       query_len=len(q), layout=layout)
    return req, info


KV = tuple[tuple[Array, ...], tuple[Array, ...]]  # (k, v), one array per layer


@functools.partial(jax.jit, static_argnums=(2, 3))
def _virtual_kv(prefix: KV | None, docs: tuple[KV, ...], d_max: int, n_max: int) -> KV:
    """The stored K / V of the virtual context, one `[K, V, H]` array per layer: the prefix, each document
    padded to `n_max` tokens, zeros for the `d_max - D` absent documents (one program per request bucket)."""
    def layer(field: int, i: int) -> Array:
        parts = [prefix[field][i]] if prefix is not None else []
        parts += [_pad_axis(d[field][i], 1, n_max) for d in docs]
        if d_max > len(docs):
            one = docs[0][field][i]
            parts.append(jnp.zeros((one.shape[0], (d_max - len(docs)) * n_max, one.shape[2]), one.dtype))
        return jnp.concatenate(parts, axis=1)

    num_layers = len(docs[0][0])
    return tuple(layer(0, i) for i in range(num_layers)), tuple(layer(1, i) for i in range(num_layers))


def place_request(req: Request, mesh: Any) -> Request:
    """`req` placed on `mesh`: each layer's stored k / v `[K, V, H]` with its KV heads on `model` (like the
    documents they come from), every other array replicated (a request is one example: no batch axis)."""
    def rep(tree: Any) -> Any:
        return jax.tree.map(lambda x: sharding.replicate(x, mesh), tree)

    def heads(layers: tuple[Array, ...]) -> tuple[Array, ...]:
        return tuple(sharding.shard_heads(x, mesh, 0) for x in layers)

    fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(req) if not f.metadata.get("static")}
    placed = {name: heads(x) if name in ("k", "v") else rep(x) for name, x in fields.items()}
    return dataclasses.replace(req, **placed)


def _stack_stats(docs: Sequence[DocumentCache], d_max: int, n_max: int, mb: int, layout: BlockLayout) -> dict:
    """SamKV statistics of every document, padded to `mb` blocks and stacked on `[D_max]`."""
    out: dict[str, list] = {k: [] for k in ("q_loc", "k_block", "k_anchor", "rep_token", "pauta", "b_max", "b_min")}
    valid = np.zeros((d_max, mb), bool)
    for i, d in enumerate(docs):
        out["q_loc"].append(d.q_loc)
        out["k_block"].append(_pad_axis(d.k_block, 1, mb))
        out["k_anchor"].append(d.k_anchor)
        out["rep_token"].append(jnp.pad(d.rep_token, ((0, 0), (0, mb - d.rep_token.shape[1])), constant_values=-1))
        out["pauta"].append(_pad_axis(d.pauta, 1, mb))
        out["b_max"].append(d.b_max)
        out["b_min"].append(d.b_min)
        valid[i, : layout.middle_blocks(d.length)] = True
    for _ in range(d_max - len(docs)):
        for name, xs in out.items():
            xs.append(jnp.zeros_like(xs[0]) if name != "rep_token" else jnp.full_like(xs[0], -1))
    stacked = {name: jnp.stack(xs) for name, xs in out.items()}
    stacked["block_valid"] = jnp.asarray(valid)
    return stacked


# ---------------------------------------------------------------------------------------------
# Traced helpers
# ---------------------------------------------------------------------------------------------
def compact(mask: Array, size: int) -> Array:
    """Indices of the set entries of `mask` `[V]`, ascending, padded with `V` to `size` entries."""
    return jnp.nonzero(mask, size=size, fill_value=mask.shape[-1])[0].astype(jnp.int32)


def _stored(req: Request, layer: int, idx: Array, inv_freq: Array) -> tuple[Array, Array]:
    """Layer `layer`'s stored K/V of the virtual-context slots `idx` `[T]` (`V` = empty: zeros) `[K, T, H]`, keys
    re-rotated from their local positions to their global ones with the layer's `inv_freq`."""
    size = req.size
    ok = idx < size
    safe = jnp.clip(idx, 0, size - 1)
    delta = jnp.where(ok, jnp.take(req.delta, safe), 0)
    zero = ~ok[None, :, None]
    stored_k, stored_v = req.k[layer], req.v[layer]
    k = jnp.take(stored_k, safe, axis=1)
    k = rotate_by(k, jnp.broadcast_to(delta[None, :], k.shape[:2]), inv_freq)
    k = jnp.where(zero, 0, k).astype(stored_k.dtype)
    v = jnp.where(zero, 0, jnp.take(stored_v, safe, axis=1)).astype(stored_v.dtype)
    return k, v


def gather(config: Any, rope: Any, req: Request, idx: Array) -> Table:
    """The virtual-context slots `idx` `[T]` (`V` = empty) as a `Table`, keys re-rotated to global positions (each
    layer with its own RoPE, `kvjax.models.block.layer_rope`)."""
    size = req.size
    ok = idx < size
    safe = jnp.clip(idx, 0, size - 1)
    kv = [_stored(req, i, idx, block.layer_rope(config, rope, i)[0]) for i in range(len(req.k))]
    return Table(
        k=tuple(k for k, _ in kv), v=tuple(v for _, v in kv),
        pos=jnp.where(ok, jnp.take(req.pos, safe), -1), tokens=jnp.where(ok, jnp.take(req.tokens, safe), 0),
    )


def take_virtual(req: Request, field: Array, idx: Array, fill: Any) -> Array:
    """`field[idx]` for a `[V]` field, `fill` where `idx` is out of range."""
    return jnp.where(idx < req.size, jnp.take(field, jnp.clip(idx, 0, req.size - 1)), fill)


def _window_ring(req: Request, table: Table, layer: int, window: int, inv_freq: Array) -> kvc.KVCache:
    """A sliding-window layer's decode cache: the context's last `window` positions, each with the K/V the table
    holds for it (recomputed where the strategy recomputed it) or else its stored K/V re-rotated, written into an
    empty ring by `kvjax.cache.ring_append` (slot `p % window`), as a prefill leaves a ring."""
    n_ctx, size = req.n_ctx, table.size
    pos = jnp.maximum(n_ctx - window, 0) + jnp.arange(window, dtype=jnp.int32)
    ok = pos < n_ctx  # the positions past the context (a context shorter than the window) come last, as padding
    span = req.t_pad  # every context position is below it

    def where_held(positions: Array, count: int) -> Array:  # position -> index (`count`: none)
        at = jnp.where(positions >= 0, positions, span)
        return jnp.full((span,), count, jnp.int32).at[at].set(jnp.arange(count, dtype=jnp.int32), mode="drop")

    safe = jnp.clip(pos, 0, span - 1)
    t_idx = jnp.where(ok, jnp.take(where_held(table.pos, size), safe), size)
    v_idx = jnp.where(ok, jnp.take(where_held(req.pos, req.size), safe), req.size)
    stored_k, stored_v = _stored(req, layer, v_idx, inv_freq)
    fresh = (t_idx < size)[None, :, None]
    k = jnp.where(fresh, jnp.take(table.k[layer], t_idx, axis=1, mode="fill", fill_value=0), stored_k)
    v = jnp.where(fresh, jnp.take(table.v[layer], t_idx, axis=1, mode="fill", fill_value=0), stored_v)
    kv_heads, _, head_dim = k.shape
    empty = kvc.init(1, kv_heads, window, head_dim, k.dtype, ring=True)
    return kvc.ring_append(empty, jnp.swapaxes(k, 0, 1)[None], jnp.swapaxes(v, 0, 1)[None],
                           jnp.where(ok, pos, -1)[None])


def to_cache(config: Any, rope: Any, req: Request, table: Table, keep: Array, capacity: int) -> ModelCache:
    """A one-example `ModelCache`: per global layer a `KVCache` `[1, K, capacity, H]` holding the slots `keep[l]`
    (`keep` `[L, T]` bool); per sliding-window layer the ring of the context's last window (`_window_ring`: its
    `keep` row is not read).

    Kept slots are packed at the front in table order; `pos` is per layer (SamKV keeps different
    tokens in different layers).
    """
    keep = keep & (table.pos >= 0)[None, :]
    size = table.size

    def layer(k: Array, v: Array, keep_l: Array) -> kvc.KVCache:
        idx = compact(keep_l, capacity)  # [C]
        pos = jnp.where(idx < size, jnp.take(table.pos, jnp.clip(idx, 0, size - 1)), -1)
        kv_heads = k.shape[0]
        count = jnp.minimum(jnp.sum(keep_l), capacity).astype(jnp.int32)
        return kvc.KVCache(
            k=jnp.take(k, idx, axis=1, mode="fill", fill_value=0)[None],
            v=jnp.take(v, idx, axis=1, mode="fill", fill_value=0)[None],
            pos=jnp.broadcast_to(pos[None, None, :], (1, kv_heads, capacity)),
            length=jnp.broadcast_to(count, (1, kv_heads)),
        )

    def one(i: int) -> kvc.KVCache:
        window = config.layer_window(i)
        if window is None:
            return layer(table.k[i], table.v[i], keep[i])
        return _window_ring(req, table, i, window, block.layer_rope(config, rope, i)[0])

    return ModelCache(tuple(one(i) for i in range(table.num_layers)))
