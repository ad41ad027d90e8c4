"""Block memory for InfLLM-style retrieval (InfLLM, Q-LLM, ActQKV): layout, scoring ops, base method.

Spec: `shared/specs/actqkv.md` section 2.1 (the InfLLM / Q-LLM framework ActQKV builds on).

**Layout.** Nothing is evicted: the cache holds every token, one slot per absolute position (prefill
appends chunk after chunk and decode appends one token per step, so `slot == position`). Its
positions split into three roles:

* sinks: positions `[0, n_init)`, always attended;
* the block memory: positions `[n_init, F)` cut into blocks of `block_size` tokens, block
  `b = (pos - n_init) // block_size`; a block is *formed* once its last token is `n_local` or more
  behind the start of the current step, so `F = n_init + block_size * nb` with
  `nb = max(0, (s - n_local - n_init) // block_size)` formed blocks at a step starting at `s`;
* the recent tokens `[F, s + T)`: the local window plus the remainder not yet in a formed block,
  always attended.

Each formed block is summarised by one representative vector per query head (`repr_topk` keys of the
block that received the most local attention, averaged, un-rotated), flattened over heads to
`[Hq * D]` and kept in `state["rep"]`. A prefill window or decode step attends the sinks, the recent
tokens and the top-k blocks by similarity of a *probe query* with the representatives; the choice is
written to `cache.attend` (the prefill window chooses before it attends, through
`before_prefill_attention`). The same blocks serve every head of a layer.

**Positions.** `position_scheme="infllm"` (default, InfLLM Sec. 3 and its official attention): a key
less than `n_local` positions behind the query is attended at its true relative distance; every other
attended key (sinks, retrieved blocks, the remainder) as if un-rotated against the query rotated to the
fixed position `global_position` (default `n_local - 1`), i.e. at that one distance. Attention then
never sees a distance beyond `max(n_local - 1, global_position)` (`max_attended_distance`), so prompts
may exceed the model window. Keys stay stored post-RoPE at their true positions: prefill attends the
compact list of attended slots with both logits (`infllm_attention`), decode re-rotates far keys to
`position - global_position` (`decode_keys`). `position_scheme="exact"`: every key at its true
position (with every block retrieved the method equals full attention). Retrieval scoring follows
InfLLM in both: keys un-rotated to 0, queries rotated to `global_position`.

**Local scores.** `state["ls"]` `[B, Hq, C]` accumulates, per query head, the attention probability
each token receives from queries less than `n_local` positions after it (the joint softmax over the
keys the step really attends): recomputed at prefill over the attended slots, read from the decode
attention weights through `observe` at decode.

The memory lives on the accelerator with the rest of the cache (a host-memory copy streaming
retrieved blocks back is future work, see docs/retrieval.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Method, Step
from kvjax.methods.capabilities import AttentionObserver, AttentionRewrite, QuestionReader, Retrieval
from kvjax.ops.blocks import representative_scores
from kvjax.ops.select import keep_mask, topk_keep
from kvjax.rope import rotate_by, rotate_by_integer
from kvjax.validation import check_int

Array = jax.Array

_NEG = -1e30
SIMILARITIES = ("dot", "cosine")
POSITION_SCHEMES = ("infllm", "exact")


# ------------------------------------------------------------------------------------------------
# Ops (pure, per layer)
# ------------------------------------------------------------------------------------------------


def global_queries(q: Array, positions: Array, inv_freq: Array, global_position: int) -> Array:
    """Post-RoPE queries `[B, T, N, H]` re-rotated to the fixed retrieval position (float32).

    A query embedded at position `p` is rotated by `global_position - p`, which equals InfLLM's
    global query `R(P_g) q_raw`; padding rows (position -1) are left as they are.
    """
    delta = jnp.where(positions >= 0, global_position - positions, 0)
    return rotate_by(q.astype(jnp.float32), delta[..., None], inv_freq)


def raw_keys(k: Array, pos: Array, inv_freq: Array) -> Array:
    """Stored post-RoPE keys `[..., C, H]` rotated back to position 0 (float32)."""
    return rotate_by(k.astype(jnp.float32), -jnp.maximum(pos, 0), inv_freq)


def blocks_due(start: Array, *, n_init: int, n_local: int, block_size: int, max_blocks: int) -> Array:
    """Formed blocks for a step starting at `start` `[B]`: `(start - n_local - n_init) // bs`, clipped."""
    return jnp.clip((start - n_local - n_init) // block_size, 0, max_blocks).astype(jnp.int32)


def local_scores(q: Array, q_pos: Array, k: Array, k_pos: Array, k_ok: Array, n_local: int,
                 block_q: int = 128) -> Array:
    """Per key and query head, the summed softmax probability from queries less than `n_local` after it.

    q `[B, T, N, H]` post-RoPE, q_pos `[B, T]` (-1 = padding); k `[B, K, W, H]` with positions and
    the mask of keys the step attends `[B, K, W]`. The softmax of each query row runs over every
    attended key at or before it (the same logits as the attention); only pairs with
    `q_pos - k_pos < n_local` are summed. Returns `[B, N, W]` float32. Runs over query blocks.
    """
    b, t, n, h = q.shape
    kv = k.shape[1]
    g = n // kv
    bq = max(1, min(block_q, t))
    pad = -(-t // bq) * bq - t
    qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0))) / math.sqrt(h)
    qp = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
    nq = qf.shape[1] // bq
    q_blocks = qf.reshape(b, nq, bq, kv, g, h).transpose(1, 0, 2, 3, 4, 5)
    p_blocks = qp.reshape(b, nq, bq).transpose(1, 0, 2)
    kf = k.astype(jnp.float32)
    kp = k_pos[:, :, None, None, :]

    def one(args: tuple[Array, Array]) -> Array:
        qb, pb = args  # [B, bq, K, G, H], [B, bq]
        s = jnp.einsum("bqkgh,bkch->bkgqc", qb, kf)
        qpos = pb[:, None, None, :, None]
        mask = k_ok[:, :, None, None, :] & (kp <= qpos) & (qpos >= 0)
        s = jnp.where(mask, s, _NEG)
        p = jnp.where(mask, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
        p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
        return jnp.sum(jnp.where(qpos - kp < n_local, p, 0.0), axis=3)  # [B, K, G, W]

    total = jnp.sum(jax.lax.map(one, (q_blocks, p_blocks)), axis=0)
    return total.reshape(b, n, k.shape[2])


def infllm_attention(q: Array, q_pos: Array, k: Array, v: Array, k_pos: Array, k_ok: Array, *, n_local: int,
                     global_position: int, inv_freq: Array, block_q: int = 128) -> tuple[Array, Array]:
    """Attention with InfLLM's positions and the local scores it yields, over a compact key list.

    q `[B, T, N, H]` post-RoPE at q_pos `[B, T]` (-1 = padding); k, v `[B, K, W, H]` post-RoPE at
    k_pos `[B, K, W]`, attended where k_ok. A pair with `q_pos - k_pos < n_local` scores `q . k` (the
    true distance); any other, the global query (`global_position`) against the un-rotated key. One
    float32 softmax over both. Returns the output `[B, T, N, H]` (q's dtype) and, per key and query
    head, the summed probability from queries less than `n_local` after it `[B, N, W]`.
    """
    b, t, n, h = q.shape
    kv, w = k.shape[1], k.shape[2]
    g = n // kv
    bq = max(1, min(block_q, t))
    pad = -(-t // bq) * bq - t
    scale = 1.0 / math.sqrt(h)
    qn = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0))) * scale
    qg = jnp.pad(global_queries(q, q_pos, inv_freq, global_position), ((0, 0), (0, pad), (0, 0), (0, 0))) * scale
    qp = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
    nq = qn.shape[1] // bq

    def blocks(x: Array) -> Array:
        return x.reshape(b, nq, bq, kv, g, h).transpose(1, 0, 2, 3, 4, 5)

    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    kr = raw_keys(k, k_pos, inv_freq)
    kp = k_pos[:, :, None, None, :]

    def one(args: tuple[Array, Array, Array]) -> tuple[Array, Array]:
        qb, gb, pb = args  # [B, bq, K, G, H] x2, [B, bq]
        qpos = pb[:, None, None, :, None]
        near = qpos - kp < n_local
        s = jnp.where(near, jnp.einsum("bqkgh,bkch->bkgqc", qb, kf), jnp.einsum("bqkgh,bkch->bkgqc", gb, kr))
        mask = k_ok[:, :, None, None, :] & (kp <= qpos) & (qpos >= 0)
        s = jnp.where(mask, s, _NEG)
        p = jnp.where(mask, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
        p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
        out = jnp.einsum("bkgqc,bkch->bqkgh", p, vf)
        return out, jnp.sum(jnp.where(near, p, 0.0), axis=3)

    out, ls = jax.lax.map(one, (blocks(qn), blocks(qg), qp.reshape(b, nq, bq).transpose(1, 0, 2)))
    out = out.transpose(1, 0, 2, 3, 4, 5).reshape(b, nq * bq, n, h)[:, :t]
    return out.astype(q.dtype), jnp.sum(ls, axis=0).reshape(b, n, w)


def attended_slots(nb: Array, selected: Array, length: Array, *, n_init: int, block_size: int,
                   recent: int, max_selected: int, capacity: int) -> tuple[Array, Array]:
    """Slots a prefill window attends, as a compact list of disjoint parts: sinks, the selected
    blocks, the recent tokens `[F, length)`.

    Returns slots `[B, W]` int32 (clipped into the cache) and `ok` `[B, W]` (a real candidate), with
    `W = n_init + max_selected * bs + recent`.
    """
    batch, nb_max = selected.shape
    sink = jnp.broadcast_to(jnp.arange(n_init, dtype=jnp.int32), (batch, n_init))
    key = jnp.where(selected, -jnp.arange(nb_max, dtype=jnp.int32), jnp.iinfo(jnp.int32).min)
    vals, ids = jax.lax.top_k(key, max_selected)  # selected blocks, lowest index first
    block_ok = vals > jnp.iinfo(jnp.int32).min
    bslots = (n_init + ids[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)).reshape(batch, -1)
    bok = jnp.repeat(block_ok, block_size, axis=-1)
    frontier = n_init + nb * block_size
    rslots = frontier[:, None] + jnp.arange(recent, dtype=jnp.int32)
    rok = rslots < length[:, None]
    slots = jnp.concatenate([sink, bslots, rslots], axis=-1)
    ok = jnp.concatenate([jnp.ones_like(sink, bool), bok, rok], axis=-1) & (slots < capacity)
    return jnp.clip(slots, 0, capacity - 1), ok


def form_blocks(k: Array, pos: Array, ls: Array, rep: Array, nb: Array, target: Array, *, n_init: int,
                block_size: int, repr_topk: int, inv_freq: Array, max_new: int,
                take: Callable[[Array], tuple[Array, Array, Array]] | None = None) -> tuple[Array, Array]:
    """Forms blocks `nb .. target - 1` (at most `max_new`): representative vectors into `rep`.

    For block `b` and query head `h`: the `repr_topk` tokens of the block with the largest local score
    `ls[h]` (ties: lower position), their un-rotated keys of KV head `h // G` averaged; flattened over
    heads `[Hq * D]`. Returns the new `rep` `[B, NB, Hq * D]` and formed count `nb` `[B]`. `take`
    (optional) reads `(k, v, pos)` at `[B, K, S]` slots instead of indexing `k` / `pos`.
    """
    batch, kv, cap, h = k.shape
    n = ls.shape[1]
    g = n // kv
    nb_max = rep.shape[1]
    ids = nb[:, None] + jnp.arange(max_new, dtype=jnp.int32)  # [B, M]
    ok = ids < target[:, None]
    slots = n_init + ids[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)  # [B, M, bs]
    flat = jnp.clip(slots, 0, cap - 1).reshape(batch, 1, -1)
    if take is None:
        kb = jnp.take_along_axis(k, flat[..., None], axis=2)  # [B, K, M*bs, H]
        pb = jnp.take_along_axis(pos, flat, axis=2)
    else:
        kb, _, pb = take(jnp.broadcast_to(flat, (batch, kv, flat.shape[-1])))
    kraw = raw_keys(kb, pb, inv_freq).reshape(batch, kv, 1, max_new, block_size, h)
    kraw = jnp.broadcast_to(kraw, (batch, kv, g, max_new, block_size, h)).reshape(batch, n, max_new, block_size, h)
    lsb = jnp.take_along_axis(ls, jnp.clip(flat, 0, ls.shape[-1] - 1), axis=2)
    lsb = lsb.reshape(batch, n, max_new, block_size)
    _, top = jax.lax.top_k(lsb, repr_topk)  # [B, N, M, r]
    chosen = jnp.take_along_axis(kraw, top[..., None], axis=3)
    new = jnp.mean(chosen, axis=3).transpose(0, 2, 1, 3).reshape(batch, max_new, n * h)
    rows = jnp.where(ok, ids, nb_max)  # out of range: dropped
    rep = jax.vmap(lambda r, i, v: r.at[i].set(v, mode="drop"))(rep, rows, new.astype(rep.dtype))
    nb = jnp.maximum(nb, jnp.minimum(target, nb + max_new)).astype(jnp.int32)
    return rep, nb


def similarity(probe: Array, rep: Array, kind: str, num_blocks: Array | None = None) -> Array:
    """`[B, d]` probe against `[B, NB, d]` representatives -> `[B, NB]` float32 (dot or cosine); blocks at
    or past `num_blocks` `[B]` score 0. The op `kvjax.ops.blocks.representative_scores`."""
    return representative_scores(probe, rep, num_blocks=num_blocks, kind=kind)


def select_blocks(scores: Array, ok: Array, budget: Array, max_blocks: int) -> tuple[Array, Array]:
    """Top-`budget` blocks per example (ties: lower block index) -> (`[B, NB]` mask, `[B]` count)."""
    idx, count = topk_keep(scores, ok, budget, capacity=max_blocks)
    return keep_mask(idx, count, scores.shape[-1]), count


def retrieval_mask(pos: Array, frontier: Array, selected: Array, *, n_init: int, block_size: int) -> Array:
    """`[B, K, C]` attend mask: sinks, positions at or after the frontier, and the selected blocks."""
    nb_max = selected.shape[-1]
    blk = jnp.clip((pos - n_init) // block_size, 0, nb_max - 1)
    in_block = jnp.take_along_axis(selected[:, None, :], blk, axis=2)
    f = frontier[:, None, None]
    return (pos >= 0) & ((pos < n_init) | (pos >= f) | in_block)


def normalized_entropy(scores: Array, ok: Array) -> tuple[Array, Array]:
    """Spec Eq. 11 over the valid blocks, divided by `log n` -> (`[B]` in [0, 1], `[B]` n); 0 when n < 2."""
    n = jnp.sum(ok, axis=-1)
    s = jnp.where(ok, scores.astype(jnp.float32), -jnp.inf)
    lse = jax.nn.logsumexp(jnp.where(n[:, None] > 0, s, 0.0), axis=-1)
    p = jnp.where(ok, jnp.exp(s - lse[:, None]), 0.0)
    ent = lse - jnp.sum(p * jnp.where(ok, scores, 0.0), axis=-1)
    theta = jnp.where(n >= 2, ent / jnp.log(jnp.maximum(n, 2).astype(jnp.float32)), 0.0)
    return jnp.maximum(theta, 0.0), n


# ------------------------------------------------------------------------------------------------
# Base method
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockRetrieval(Method, Retrieval, AttentionRewrite, AttentionObserver, QuestionReader):
    """Shared machinery of `infllm`, `qllm` and `actqkv` (see the module docstring).

    `budget` (optional): tokens attended per step; sets `topk = (budget - n_init - n_local) // block_size`.
    """

    name = "block_retrieval"
    uses_attend = True

    n_init: int = 128
    n_local: int = 4096
    block_size: int = 128
    topk: int = 16
    repr_topk: int = 4
    window: int = 512
    similarity: str = "dot"
    global_position: int | None = None
    position_scheme: str = "infllm"

    def __post_init__(self) -> None:
        super().__post_init__()
        name = self.name
        if self.compression_ratio is not None:
            raise ConfigError(f"{name}: keeps every token in its block memory; use topk= or budget= (tokens per step)")
        check_int(name, "n_init", self.n_init, 0)
        check_int(name, "n_local", self.n_local, 1)
        check_int(name, "block_size", self.block_size, 1)
        check_int(name, "topk", self.topk, 1)
        check_int(name, "repr_topk", self.repr_topk, 1)
        check_int(name, "window", self.window, 1)
        if self.repr_topk > self.block_size:
            raise ConfigError(f"{name}: repr_topk={self.repr_topk} exceeds block_size={self.block_size}")
        if self.similarity not in SIMILARITIES:
            raise ConfigError(f"{name}: similarity must be one of {list(SIMILARITIES)}, got {self.similarity!r}")
        if self.global_position is not None:
            check_int(name, "global_position", self.global_position, 0)
        if self.position_scheme not in POSITION_SCHEMES:
            raise ConfigError(
                f"{name}: position_scheme must be one of {list(POSITION_SCHEMES)}, got {self.position_scheme!r}"
            )
        if self.budget is not None and self.budget < self.n_init + self.n_local + self.block_size:
            raise ConfigError(
                f"{name}: budget={self.budget} tokens per step leaves no room for one block of {self.block_size} "
                f"after n_init={self.n_init} sinks and n_local={self.n_local} local tokens"
            )

    # ---- static sizes ----------------------------------------------------------------------------
    @property
    def retrieved_blocks(self) -> int:
        """Blocks retrieved per layer and step (`topk`, or derived from `budget`)."""
        if self.budget is not None:
            return (self.budget - self.n_init - self.n_local) // self.block_size
        return self.topk

    @property
    def retrieval_position(self) -> int:
        return self.n_local - 1 if self.global_position is None else self.global_position

    def max_attended_distance(self) -> int | None:
        """InfLLM's scheme: `max(n_local - 1, global_position)`; exact RoPE: unbounded (None)."""
        if self.position_scheme == "exact":
            return None
        return max(self.n_local - 1, self.retrieval_position)

    @property
    def rewrites_attention(self) -> bool:
        return self.position_scheme == "infllm"

    def memory_blocks(self, capacity: int) -> int:
        """Static number of block slots for a cache of `capacity` positions (at least 1)."""
        return max(1, (capacity - self.n_init) // self.block_size)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens

    def prefill_window(self) -> int | None:
        return self.window

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Any]:
        nb = self.memory_blocks(spec.capacity)
        d = spec.num_heads * spec.head_dim
        b = spec.batch
        state: dict[str, Any] = {
            "rep": jnp.zeros((b, nb, d), spec.dtype),
            "nb": jnp.zeros((b,), jnp.int32),
            "ls": jnp.zeros((b, spec.num_heads, spec.capacity), jnp.float32),
            "selected": jnp.zeros((b, nb), bool),
            "block_score": jnp.zeros((b, nb), jnp.float32),
            "probe": jnp.zeros((b, d), jnp.float32),
            "n_retrieved": jnp.zeros((b,), jnp.int32),
        }
        state.update(self.extra_state(spec))
        return state

    # ---- points subclasses override ------------------------------------------------------------------
    def extra_state(self, spec: CacheSpec) -> dict[str, Any]:
        return {}

    def prefill_probe(self, x: Array, valid: Array, state: dict, step: Step) -> tuple[Array, dict]:
        """InfLLM: the mean of the window's (global) query vectors `x` `[B, T, d]`."""
        vf = valid.astype(jnp.float32)
        probe = jnp.sum(x * vf[..., None], axis=1) / jnp.maximum(jnp.sum(vf, axis=1), 1.0)[:, None]
        return probe, state

    def question_scores(self, rep: Array, state: dict, decode: bool) -> Array | None:
        """Extra per-block score from the question (Q-LLM); None: no question term."""
        return None

    def decode_budget(self, scores: Array, ok: Array, state: dict, step: Step) -> tuple[Array, int, dict]:
        """(`[B]` blocks to retrieve, static maximum, state). InfLLM: a fixed `topk`."""
        k = min(self.retrieved_blocks, scores.shape[-1])
        return jnp.full(scores.shape[:1], k, jnp.int32), k, state

    def after_prefill_retrieval(self, scores: Array, ok: Array, has: Array, state: dict, step: Step) -> dict:
        return state

    # ---- shared pieces ------------------------------------------------------------------------------
    def _due(self, start: Array, nb_max: int) -> Array:
        return blocks_due(start, n_init=self.n_init, n_local=self.n_local, block_size=self.block_size,
                          max_blocks=nb_max)

    def _scores(self, probe: Array, state: dict, nb: Array, decode: bool) -> tuple[Array, Array]:
        rep = state["rep"]
        ok = jnp.arange(rep.shape[1], dtype=jnp.int32)[None] < nb[:, None]
        scores = similarity(probe, rep, self.similarity, num_blocks=nb)
        extra = self.question_scores(rep, state, decode)
        if extra is not None:
            scores = scores + extra
        return jnp.where(ok, scores, 0.0), ok

    def _mask(self, cache: KVCache, nb: Array, selected: Array) -> Array:
        return retrieval_mask(cache.pos, self.n_init + nb * self.block_size, selected,
                              n_init=self.n_init, block_size=self.block_size)

    # ---- hooks --------------------------------------------------------------------------------------
    def before_prefill_attention(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Chooses the window's blocks from its probe query (fixed `topk`) and writes `cache.attend`."""
        state = dict(cache.state)
        batch, t, n, h = q.shape
        valid = step.positions >= 0
        has = jnp.any(valid, axis=-1)
        x = global_queries(q, step.positions, step.inv_freq, self.retrieval_position).reshape(batch, t, n * h)
        probe, state = self.prefill_probe(x, valid, state, step)
        nb = state["nb"]
        scores, ok = self._scores(probe, state, nb, decode=False)
        k = min(self.retrieved_blocks, scores.shape[-1])
        selected, count = select_blocks(scores, ok, jnp.full((batch,), k, jnp.int32), k)
        state = self.after_prefill_retrieval(scores, ok, has, state, step)
        keep = has[:, None]
        state.update(
            selected=jnp.where(keep, selected, state["selected"]),
            block_score=jnp.where(keep, scores, state["block_score"]),
            probe=jnp.where(keep, probe, state["probe"]),
            n_retrieved=jnp.where(has, count, state["n_retrieved"]),
        )
        return cache.replace(attend=self._mask(cache, nb, selected), state=state)

    def _window_keys(self, cache: KVCache, t: int) -> tuple[Array, Array, Array, Array, Array]:
        """The window's attended slots `[B, W]`, their keys, values, positions and validity `[B, K, W]`."""
        state = cache.state
        k = min(self.retrieved_blocks, state["rep"].shape[1])
        slots, ok = attended_slots(
            state["nb"], state["selected"], cache.length[:, 0], n_init=self.n_init, block_size=self.block_size,
            recent=self.n_local + self.block_size - 1 + t, max_selected=k, capacity=cache.capacity,
        )
        kc = jnp.take_along_axis(kvc.keys(cache), slots[:, None, :, None], axis=2)
        vc = jnp.take_along_axis(kvc.values(cache), slots[:, None, :, None], axis=2)
        pc = jnp.take_along_axis(cache.pos, slots[:, None, :], axis=2)
        return slots, kc, vc, pc, ok[:, None, :] & (pc >= 0)

    @staticmethod
    def _add_local_scores(state: dict, slots: Array, ok: Array, delta: Array) -> dict:
        ls = state["ls"]
        target = jnp.where(ok[:, 0], slots, ls.shape[-1])  # padding: dropped
        ls = jax.vmap(lambda acc, i, v: acc.at[:, i].add(v, mode="drop"))(ls, target, delta)
        return {**state, "ls": ls}

    def prefill_attention(self, cache: KVCache, q: Array, step: Step) -> tuple[Array, KVCache]:
        """InfLLM's scheme: the window attends its compact slot list; the local scores come with it."""
        slots, kc, vc, pc, ok = self._window_keys(cache, q.shape[1])
        out, delta = infllm_attention(q, step.positions, kc, vc, pc, ok, n_local=self.n_local,
                                      global_position=self.retrieval_position, inv_freq=step.inv_freq)
        return out, cache.replace(state=self._add_local_scores(dict(cache.state), slots, ok, delta))

    def decode_keys(self, cache: KVCache, q: Array, step: Step) -> Array:
        """InfLLM's scheme: keys `n_local` or more behind the query re-rotated to `position - global_position`."""
        return self._far_keys(kvc.keys(cache), cache.pos, step)

    def slot_keys(self, k: Array, pos: Array, q: Array, step: Step) -> Array:
        """`decode_keys` on the compact list of `decode_slots`. Only its first `W - n_local` entries (sinks,
        blocks and the first `block_size` recent slots) can be far: the rest is at most `n_local - 1` behind."""
        if not self.rewrites_attention:
            return k
        split = k.shape[2] - self.n_local
        head = self._far_keys(k[:, :, :split], pos[:, :, :split], step)
        return jnp.concatenate([head, k[:, :, split:]], axis=2)

    def _far_keys(self, k: Array, pos: Array, step: Step) -> Array:
        if not self.rewrites_attention:
            return k
        p = step.positions[:, 0][:, None, None]
        far = (pos >= 0) & (p - pos >= self.n_local)
        delta = jnp.where(far, p - self.retrieval_position - pos, 0)  # |delta| < the capacity
        moved = rotate_by_integer(k, delta, step.inv_freq, max(step.capacity, self.retrieval_position) + 1)
        return jnp.where(far[..., None], moved, k)

    @property
    def gathers_at_decode(self) -> bool:
        """Decode attends the sinks, the retrieved blocks and the recent tokens gathered into one compact
        list (InfLLM's own decode), not a mask over the whole cache."""
        return True

    def decode_slots(self, cache: KVCache, q: Array, step: Step, take: Any) -> tuple[KVCache, Array, Array]:
        """`decode`'s retrieval, then the slots it attends: sinks, the selected blocks and `[F, length)`
        (at most `n_local + block_size` tokens: a block is formed once it is `n_local` behind)."""
        cache, k_max = self._retrieve(cache, q, step, take)
        state = cache.state
        batch, kv = cache.length.shape
        slots, ok = attended_slots(
            state["nb"], state["selected"], cache.length[:, 0], n_init=self.n_init, block_size=self.block_size,
            recent=self.n_local + self.block_size, max_selected=k_max, capacity=cache.capacity,
        )
        shape = (batch, kv, slots.shape[-1])  # the same slots for every KV head
        return cache, jnp.broadcast_to(slots[:, None], shape), jnp.broadcast_to(ok[:, None], shape)

    def observe_slots(
        self, cache: KVCache, weights: Array, slots: Array, pos: Array, ok: Array, step: Step
    ) -> KVCache:
        """`observe` on the compact attention: its weights on local keys added to the local scores at their slots."""
        position = step.positions[:, 0]
        local = ok & (pos >= 0) & (position[:, None, None] - pos < self.n_local)  # [B, K, W]
        b, kv, g, w = weights.shape
        delta = jnp.where(local[:, :, None, :], weights, 0.0).reshape(b, kv * g, w)
        return cache.replace(state=self._add_local_scores(dict(cache.state), slots[:, 0], local[:, :1], delta))

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """After the window attended: local scores of the recent tokens (exact scheme; InfLLM's attention
        already added them), then blocks formed up to its end."""
        state = dict(cache.state)
        t = q.shape[1]
        length = cache.length[:, 0]
        nb = state["nb"]
        nb_max = state["rep"].shape[1]
        if not self.rewrites_attention:
            slots, kc, _, pc, ok = self._window_keys(cache, t)
            delta = local_scores(q, step.positions, kc, pc, ok, self.n_local)  # [B, N, W]
            state = self._add_local_scores(state, slots, ok, delta)
        ls = state["ls"]
        rep, nb = form_blocks(
            kvc.keys(cache), cache.pos, ls, state["rep"], nb, self._due(length, nb_max), n_init=self.n_init,
            block_size=self.block_size, repr_topk=self.repr_topk, inv_freq=step.inv_freq,
            max_new=t // self.block_size + 2,
        )
        state.update(ls=ls, rep=rep, nb=nb)
        return kvc.truncate(cache.replace(state=state), step.capacity)

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Forms the block that became due, scores blocks with the token's query, writes `cache.attend`."""
        return self._retrieve(cache, q, step, None)[0]

    def _retrieve(self, cache: KVCache, q: Array, step: Step, take: Any) -> tuple[KVCache, int]:
        """`decode` (and the static most blocks it may select)."""
        state = dict(cache.state)
        batch, _, n, h = q.shape
        nb_max = state["rep"].shape[1]
        position = step.positions[:, 0]
        rep, nb = form_blocks(
            kvc.keys(cache), cache.pos, state["ls"], state["rep"], state["nb"], self._due(position, nb_max),
            n_init=self.n_init, block_size=self.block_size, repr_topk=self.repr_topk,
            inv_freq=step.inv_freq, max_new=1, take=take,
        )
        state.update(rep=rep, nb=nb)
        probe = global_queries(q, step.positions, step.inv_freq, self.retrieval_position).reshape(batch, n * h)
        scores, ok = self._scores(probe, state, nb, decode=True)
        budget, k_max, state = self.decode_budget(scores, ok, state, step)
        selected, count = select_blocks(scores, ok, budget, k_max)
        state.update(selected=selected, block_score=scores, probe=probe, n_retrieved=count)
        return cache.replace(attend=self._mask(cache, nb, selected), state=state), k_max

    def observe(self, cache: KVCache, weights: Array, step: Step) -> KVCache:
        """Adds the decode query's attention on its local keys to the local scores."""
        position = step.positions[:, 0]
        local = (cache.pos >= 0) & (position[:, None, None] - cache.pos < self.n_local)
        b, kv, g, c = weights.shape
        w = jnp.where(local[:, :, None, :], weights, 0.0).reshape(b, kv * g, c)
        ls = cache.state["ls"]
        return cache.replace(state={**cache.state, "ls": ls + w[..., : ls.shape[-1]]})
