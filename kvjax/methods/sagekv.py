"""`sagekv`: SAGE-KV, "LLMs Know What to Drop: Self-Attention Guided KV Cache Eviction for Efficient
Long-Context Inference" (Wang et al., 2025, arXiv 2503.08879).

One-shot, after prefill (paper Steps 1-4), per layer: the prompt's cache is split into sink tokens
`[0, S)`, eviction candidates `[S, N-1-R)`, the recent window `[N-1-R, N-1)` and the last token `N-1`.
For every **query head** `h` the last prompt token's query scores the candidates (`q_h . k`, post-RoPE,
float32; softmax and the `1/sqrt(d)` scale do not change a row's ranking) and its top `k` are kept
(Step 2). The reduced cache `Concat(S, E_topk, R, P_N)` (Step 3) is used for the whole generation:
each new token joins the recent window and the window's oldest token is evicted (Step 4); the sink
and the selections never change.

Budget split (Appendix A.2) from the per-KV-head token budget `B` and the group size `G = Hq / Hkv`:
`S = B // 4`, `k = pow2floor(B / 2G)` (the rounding that reproduces both published configurations,
k = 1024 for G = 4 and 512 for G = 7 at B = 8192), `R = B - S - G k`. `sink_size`, `topk` and
`window_size` override the split.

GQA layouts (spec 3.3). The cache is stored per KV head. The paper's budget `S + G k + R` stores the
`G` query heads' selections of a group side by side; here they are stored **once each**: the KV head
keeps the deduplicated union of its query heads' selections (at most `G k` slots, so the memory is
the paper's), and `cache.state["sel"]` records per slot which query heads of the group selected it
(a bitmask, bit `g` = query head `g` of the group). Storing a token chosen by two heads twice would
make a head that attends both copies count its attention mass twice.

* `gqa="per_head"` (default, `sagekv`): paper-faithful; query head `h` attends the shared sink and
  window plus **its own** selection: `query_mask(cache, G)` gives the `[B, K, G, C]` visibility, which
  the model's decode attention ANDs into its per-KV-head mask (`kvjax/models/transformer.py`).
* `gqa="union"` (`sagekv_union`): every head of a group attends the union of the group's selections
  (a superset of its own; the same memory), a standard per-KV-head cache.

Decisions where the paper is silent (spec section 9): the last prompt token is the first member of
an `R + 1` FIFO (`pin_last_token=True` keeps it pinned instead); positions are absolute.

Short prompts (Step 3): the reduced cache is `Concat(S, E_topk, R, P_N)` whatever `N` is, so a prompt
of `N <= B` tokens is reduced too and every query head attends `min(N, S + k + R + 1)` tokens, the
window rolling at `R + 1` from the first decode step. `identity_within_budget=True` restores the
DESIGN invariant "budget >= length is identity" instead: such a prompt is kept whole and its FIFO
grows into the unused budget before it rolls (at most `B + 1` tokens).

`compression_ratio` gives each example the budget `floor(n (1 - ratio))`, split by the same rules.
Chunked prefill (`chunk_size`) re-runs the selection after every chunk that takes the prompt past
the budget, and after the chunk holding the prompt's end, with that chunk's last query (bounded
memory; with one chunk this is exactly the paper's method). A prompt of `N <= B` tokens ending exactly
on a chunk boundary before the batch's last chunk cannot be told from one that goes on, so it stays
whole (as `identity_within_budget`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Method, Step, last_position
from kvjax.methods.capabilities import QueryHeadMask
from kvjax.methods.common import oldest_slot
from kvjax.methods.registry import register
from kvjax.ops.scoring import window_scores
from kvjax.ops.select import keep_mask, to_query_heads, topk_keep
from kvjax.validation import check_choice, check_int

Array = jax.Array

#: Bit of `state["sel"]` marking a slot that never leaves the cache (sink, selection, pinned token).
STATIC = 1 << 30
#: Query-head visibility bits; 0 = visible to every head of the group.
VISIBLE = STATIC - 1
GQA_LAYOUTS = ("per_head", "union")


def pow2floor(x: Array) -> Array:
    """Largest power of two <= x (0 for x < 1), int32."""
    x = jnp.asarray(x, jnp.int32)
    safe = jnp.maximum(x, 1)
    return jnp.where(x >= 1, jnp.left_shift(jnp.int32(1), 31 - jax.lax.clz(safe)), 0).astype(jnp.int32)


def _pow2floor_int(x: int) -> int:
    return 1 << (x.bit_length() - 1) if x >= 1 else 0


def budget_split(budget: int, groups: int) -> tuple[int, int, int]:
    """(S, k, R) of the paper's rules for a token budget `budget` per KV head and group size `groups`."""
    sink = budget // 4
    k = _pow2floor_int(budget // (2 * groups))
    return sink, k, budget - sink - groups * k


def selections(cache: KVCache) -> Array:
    """`state["sel"]` over every slot: slots past the state's width (room added after compression for a
    prefill chunk or the question) hold no selection bits, so they are shared FIFO tokens."""
    sel = cache.state["sel"]
    return jnp.pad(sel, ((0, 0), (0, 0), (0, cache.capacity - sel.shape[-1])))


def query_mask(cache: KVCache, groups: int) -> Array:
    """`[B, K, G, C]` bool: slot visible to query head `g` of the group (stored and, for a selected
    slot, selected by that head). What the attention must apply for `gqa="per_head"`."""
    bits = selections(cache) & VISIBLE
    own = (bits[:, :, None, :] >> jnp.arange(groups, dtype=jnp.int32)[None, None, :, None]) & 1
    visible = (bits[:, :, None, :] == 0) | (own == 1)
    return visible & kvc.valid_mask(cache)[:, :, None, :]


@register
@dataclasses.dataclass(frozen=True)
class SageKV(Method, QueryHeadMask):
    """SAGE-KV: sink + per-query-head top-k of the last token's attention + recent window + last token;
    `budget` (tokens per KV head) or `compression_ratio`; paper split S = B/4, k = pow2floor(B/2G)."""

    name = "sagekv"

    gqa: str = "per_head"
    sink_size: int | None = None
    topk: int | None = None
    window_size: int | None = None
    pin_last_token: bool = False
    identity_within_budget: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.compresses:
            raise ConfigError(f"{self.name}: needs budget= (tokens per KV head) or compression_ratio=")
        check_choice(self.name, "gqa", self.gqa, GQA_LAYOUTS)
        check_int(self.name, "sink_size", self.sink_size, 0, optional=True)
        check_int(self.name, "topk", self.topk, 0, optional=True)
        check_int(self.name, "window_size", self.window_size, 1 if self.pin_last_token else 0, optional=True)
        for flag in ("pin_last_token", "identity_within_budget"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{self.name}: {flag} must be a bool, got {getattr(self, flag)!r}")
        if self.budget is not None:
            fixed = (self.sink_size or 0) + (self.window_size or 0)
            if fixed > self.budget:
                raise ConfigError(
                    f"{self.name}: sink_size + window_size = {fixed} exceed budget={self.budget}"
                )

    # ---- budgets -----------------------------------------------------------------------------------
    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        # At most B + 1 tokens stay (S + G k + R + last); one more slot for the token that arrives
        # before the FIFO drops its oldest.
        budget = self.budget if self.budget is not None else self.prompt_budget(prompt_len)
        return min(prompt_len + max_new_tokens, budget + 2)

    def _budget(self, step: Step) -> Array:
        """`[B]` configured tokens per KV head (the budget itself, not clipped to the prompt)."""
        if self.budget is not None:
            return jnp.full(step.budget.shape, self.budget, jnp.int32)
        return step.budget

    def split(self, budget: Array, groups: int) -> tuple[Array, Array, Array]:
        """`(S, k, R)` `[B]` for per-example budgets (the rules of `resolved_split`)."""
        sink = budget // 4 if self.sink_size is None else jnp.full_like(budget, self.sink_size)
        if self.topk is not None:
            k = jnp.full_like(budget, self.topk)
        elif self.window_size is not None:
            k = jnp.maximum(budget - sink - self.window_size, 0) // groups
        else:
            k = pow2floor(budget // (2 * groups))
        window = budget - sink - groups * k if self.window_size is None else jnp.full_like(budget, self.window_size)
        return sink, k, jnp.maximum(window, 0)

    def resolved_split(self, groups: int, budget: int | None = None) -> tuple[int, int, int]:
        """Static `(S, k, R)` for a token budget (default: `budget`) and group size `groups`: the paper's
        rules, where an explicit `sink_size` / `topk` / `window_size` wins; with a window given and no
        `topk`, the selections get what is left: `k = (B - S - R) // G`."""
        budget = self.budget if budget is None else budget
        sink = budget // 4 if self.sink_size is None else self.sink_size
        if self.topk is not None:
            k = self.topk
        elif self.window_size is not None:
            k = max(budget - sink - self.window_size, 0) // groups
        else:
            k = _pow2floor_int(budget // (2 * groups))
        window = budget - sink - groups * k if self.window_size is None else self.window_size
        return sink, k, window

    def _check_split(self, groups: int) -> None:
        if self.budget is None:
            return
        sink, k, window = self.resolved_split(groups)
        if k < 1 or window < 0 or sink + groups * k + window > self.budget:
            raise ConfigError(
                f"{self.name}: budget={self.budget} cannot hold sink {sink} + {groups} query heads x topk {k} "
                f"+ window {window} (needs topk >= 1 and sink + G * topk + window <= budget)"
            )

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Array]:
        return {
            "sel": jnp.zeros((spec.batch, spec.kv_heads, spec.capacity), jnp.int32),
            "window": jnp.zeros((spec.batch, spec.kv_heads), jnp.int32),
        }

    # ---- hooks -------------------------------------------------------------------------------------
    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        kv, c = cache.num_kv_heads, cache.capacity
        groups = q.shape[2] // kv
        if groups > 30:
            raise ConfigError(f"{self.name}: at most 30 query heads per KV head are supported, got {groups}")
        self._check_split(groups)
        budget = self._budget(step)
        sink, k, window = (x[:, None] for x in self.split(budget, groups))  # [B, 1]
        stored = kvc.stored_mask(cache)
        n = last_position(cache) + 1  # [B, K] prompt tokens so far
        # Step 3 reduces every prompt, once its last token is in: in the final chunk, or in a chunk
        # that ends in padding (the prompt ended inside it). `identity_within_budget` keeps N <= B whole.
        compress = n > budget[:, None]
        if not self.identity_within_budget:
            ends = step.positions[:, -1] < 0 if not step.final_chunk else jnp.ones(n.shape[:1], bool)
            compress = compress | ends[:, None]
        pos = cache.pos
        is_sink = stored & (pos < sink[..., None])
        is_last = stored & (pos == (n - 1)[..., None])
        recent = stored & (pos >= (n - 1 - window)[..., None]) & ~is_sink
        candidate = stored & ~is_sink & ~recent

        # Step 2: per query head, the last prompt token's attention over the candidates.
        probs = window_scores(q, step.positions, kvc.keys(cache), pos, stored, window=1, group_reduce=None)
        cand_q = to_query_heads(candidate, groups)
        kcap = max(1, min(c, self.resolved_split(groups, step.capacity)[1]))
        idx, cnt = topk_keep(probs, cand_q, jnp.broadcast_to(k, (k.shape[0], q.shape[2])), capacity=kcap,
                             positions=to_query_heads(pos, groups))
        chosen = keep_mask(idx, cnt, c).reshape(cache.batch_size, kv, groups, c)
        selected = jnp.any(chosen, axis=2) & compress[..., None]
        bits = jnp.sum(chosen.astype(jnp.int32) << jnp.arange(groups, dtype=jnp.int32)[:, None], axis=2)
        if self.gqa == "union":
            bits = jnp.zeros_like(bits)
        # A prompt kept whole (`identity_within_budget`) keeps every candidate, visible to all heads.
        kept_cand = candidate & ~compress[..., None]
        static = is_sink | selected | kept_cand | (is_last if self.pin_last_token else False)
        sel = jnp.where(static, STATIC, 0) | jnp.where(selected, bits, 0)
        keep = is_sink | recent | selected | kept_cand

        # Examples without queries in this chunk (their prompt ended earlier) are left as they are.
        active = jnp.any(step.positions >= 0, axis=-1)[:, None]
        old_sel = jnp.pad(cache.state["sel"], ((0, 0), (0, 0), (0, c - cache.state["sel"].shape[-1])))
        keep = jnp.where(active[..., None], keep, stored)
        sel = jnp.where(active[..., None], sel, old_sel)

        slots = jnp.arange(c, dtype=jnp.int32)
        order = jnp.argsort(jnp.where(keep, slots, slots + c), axis=-1)[..., : step.capacity]
        count = jnp.minimum(jnp.sum(keep, axis=-1), step.capacity).astype(jnp.int32)
        out = kvc.compact(cache, order, count)
        live = jnp.arange(step.capacity) < count[..., None]
        sel = jnp.where(live, jnp.take_along_axis(sel, order, axis=-1), 0)
        n_static = jnp.sum((sel & STATIC) != 0, axis=-1)
        fifo = jnp.where(compress, window + 1 - int(self.pin_last_token), budget[:, None] + 1 - n_static)
        fifo = jnp.where(active, fifo, cache.state["window"])
        return out.replace(state={**cache.state, "sel": sel, "window": fifo.astype(jnp.int32)})

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Step 4: the new token joins the FIFO window; the oldest one leaves when it is full."""
        fifo = kvc.stored_mask(cache) & ((selections(cache) & STATIC) == 0)
        over = jnp.sum(fifo, axis=-1) > cache.state["window"]
        oldest = oldest_slot(cache, fifo)
        # `evict` moves the newest slot (a FIFO token, sel 0) into the victim's (sel 0): `sel` holds.
        return kvc.evict(cache, oldest, where=over)

    def query_mask(self, cache: KVCache, num_query_heads: int) -> Array | None:
        """`[B, K, G, C]` per-query-head visibility for `gqa="per_head"`, None for the union layout."""
        if self.gqa == "union":
            return None
        return query_mask(cache, num_query_heads // cache.num_kv_heads)


@register
@dataclasses.dataclass(frozen=True)
class SageKVUnion(SageKV):
    """SAGE-KV with the group-union GQA layout (spec 3.3 (B)): each KV head keeps the union of its
    query heads' selections and every head of the group attends all of it."""

    name = "sagekv_union"

    gqa: str = "union"
