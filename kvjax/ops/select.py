"""Top-k selection of cache slots with protected regions and exact tie-breaking (XLA reference).

`topk_keep` picks, per head, the `budget` best slots by score, protected slots first, ties broken
by the lower position. It is exact without sorting the whole slot axis: scores become an int32
key that orders like the floats (protected = INT_MAX, invalid = INT_MIN), one `lax.top_k` finds the
key of the last kept slot, a second one resolves the slots tied at that key by position, a third
lists the kept slots in position order. Slot axes of the current tuning's `topk_bisect_min_slots` or more
(`kvjax.tuning`; CPU: 256, elsewhere never) take the threshold-search formulation instead (bisection on the
key, then on the position, as the Pallas kernel does): XLA:CPU's `top_k` is a full comparator sort, which
made Quest's page choice cost more per decode step at 32K than attending the whole layer. Both give
identical outputs (tested).

Scores are `[..., C]` with any leading axes: `[B, K, C]` per KV head (the default), `[B, N, C]` per
query head (expand the KV-head masks with `to_query_heads`), `[B, C']` for a flattened layout.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax import tuning
from kvjax._kernel_common import INT_MAX, INT_MIN, order_key
from kvjax._kernel_common import broadcast_lead as _broadcast_lead
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.ops._impl import resolve
from kvjax.ops._shard import per_shard, rows_role

Array = jax.Array


#: Axes up to this long take the two-reduction form of `argmin` / `argmax` inside `two_reduction_argmin()`: XLA:GPU
#: (jaxlib 0.10) emits each such row as one kernel, fused with the reductions' producer and the index's consumer. A
#: longer row is split into partial reductions, and two reductions then cost more kernels than one (value, index)
#: reduction (5-6 against 3, compiled for an H200).
TWO_REDUCTION_MAX_LENGTH = 16384

_TWO_REDUCTIONS: contextvars.ContextVar[bool] = contextvars.ContextVar("kvjax_two_reduction_argmin", default=False)


@contextlib.contextmanager
def two_reduction_argmin() -> Iterator[None]:
    """Inside the block, `argmin` / `argmax` along an axis of at most `TWO_REDUCTION_MAX_LENGTH` are two
    single-operand reductions (the extreme, then the lowest index holding it): the same index as one (value, index)
    reduction. Compiled for an H200, the fused decode step's in-place eviction (StreamingLLM) is 1 kernel per layer
    this way, 3 the other. On the XLA decode path the (value, index) form is the better one: XLA batches those
    reductions of all layers into a few kernels (4 per step), which it does not do with the two-reduction kernels
    (BENCHMARKS.md, "StreamingLLM's eviction")."""
    token = _TWO_REDUCTIONS.set(True)
    try:
        yield
    finally:
        _TWO_REDUCTIONS.reset(token)


def argmin(x: Array, axis: int = -1) -> Array:
    """`jnp.argmin(x, axis)` as int32: the first index of the minimum (of the first NaN, if any); its lowering is
    `two_reduction_argmin`'s choice."""
    return _first_extreme(x, axis, jnp.min, jnp.argmin)


def argmax(x: Array, axis: int = -1) -> Array:
    """`jnp.argmax(x, axis)` as int32, as `argmin` lowers it: the first index of the maximum (of the first NaN)."""
    return _first_extreme(x, axis, jnp.max, jnp.argmax)


def _first_extreme(x: Array, axis: int, extreme: Any, variadic: Any) -> Array:
    axis = axis % x.ndim
    length = x.shape[axis]
    if not _TWO_REDUCTIONS.get() or length > TWO_REDUCTION_MAX_LENGTH:
        return variadic(x, axis=axis).astype(jnp.int32)
    hit = x == extreme(x, axis=axis, keepdims=True)
    if jnp.issubdtype(x.dtype, jnp.floating):  # the extreme of a row holding a NaN is NaN, equal to nothing
        hit |= jnp.isnan(x)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.min(jnp.where(hit, index, length), axis=axis)


def _kth(values: Array, k: Array) -> Array:
    """`values[..., k - 1]` (clipped)."""
    idx = jnp.clip(k - 1, 0, values.shape[-1] - 1)
    return jnp.take_along_axis(values, idx[..., None], axis=-1)[..., 0]


def topk_keep(
    scores: Array,
    valid: Array,
    budget: Array | int,
    *,
    capacity: int,
    protect: Array | None = None,
    positions: Array | None = None,
    implementation: str = "auto",
) -> tuple[Array, Array]:
    """Kept slot indices `[..., capacity]` (sorted by position) and counts `[...]` int32.

    Per row: the kept count is `min(max(budget, #protected), #valid, capacity)`; protected slots
    come first (they count against the budget; if there are more than `budget` they are all kept,
    capacity permitting), then the highest scores, ties broken by the lower position. `budget`
    broadcasts over the leading axes (`[B]` per example, `[B, K]` per head). `positions` (default:
    the slot index) must be distinct among a row's valid slots. Entries past the count are
    unspecified slot indices (`kvjax.cache.compact` ignores them).
    """
    if resolve("topk_keep", implementation) == "pallas":
        from kvjax.pallas import select as kernels

        role = rows_role(scores.ndim)
        operands = (
            scores,
            jnp.broadcast_to(valid, scores.shape),
            _broadcast_lead(jnp.asarray(budget, jnp.int32), scores.shape[:-1]),
            None if protect is None else jnp.broadcast_to(protect, scores.shape),
            None if positions is None else jnp.broadcast_to(positions, scores.shape),
        )

        def call(scores: Array, valid: Array, budget: Array, protect: Array | None, positions: Array | None):
            return kernels.topk_keep(scores, valid, budget, capacity=capacity, protect=protect, positions=positions)

        return per_shard(call, operands, (role, role, role[:-1], role, role), (role, role[:-1]),
                         batch=scores.shape[0] if scores.ndim > 1 else 1,
                         heads=scores.shape[1] if scores.ndim > 2 else 1)
    if not isinstance(capacity, int) or capacity < 1:
        raise ConfigError(f"topk_keep: capacity must be a positive integer, got {capacity!r}")
    lead, c = scores.shape[:-1], scores.shape[-1]
    valid = jnp.broadcast_to(valid, scores.shape)
    by_slot = positions is None
    if positions is None:
        positions = jnp.arange(c, dtype=jnp.int32)
    positions = jnp.broadcast_to(positions, scores.shape).astype(jnp.int32)
    key = order_key(scores, valid, protect)
    kc = min(capacity, c)

    n_valid = jnp.sum(valid, axis=-1, dtype=jnp.int32)
    n_prot = jnp.zeros(lead, jnp.int32) if protect is None else jnp.sum(protect & valid, axis=-1, dtype=jnp.int32)
    budget = _broadcast_lead(jnp.asarray(budget, jnp.int32), lead)
    count = jnp.clip(jnp.maximum(budget, n_prot), 0, jnp.minimum(n_valid, kc))

    if _bisect(c):
        return _topk_keep_bisect(key, valid, positions, count, kc, capacity, by_slot)
    top_keys, _ = jax.lax.top_k(key, kc)
    threshold = _kth(top_keys, count)  # key of the last kept slot
    above = key > threshold[..., None]
    need = count - jnp.sum(above, axis=-1, dtype=jnp.int32)  # slots to take among the tied ones
    tie = (key == threshold[..., None]) & valid
    tie_neg_pos, _ = jax.lax.top_k(jnp.where(tie, -positions, INT_MIN), kc)
    last_pos = -_kth(tie_neg_pos, need)
    keep = (above | (tie & (positions <= last_pos[..., None]) & (need > 0)[..., None])) & (count > 0)[..., None]

    _, order = jax.lax.top_k(jnp.where(keep, -positions, INT_MIN), kc)  # kept first, by position
    if kc < capacity:
        order = jnp.concatenate([order, jnp.zeros((*lead, capacity - kc), order.dtype)], axis=-1)
    return order.astype(jnp.int32), count.astype(jnp.int32)


def _bisect(slots: int) -> bool:
    """Select by bisection: the slot axis reaches the current tuning's `topk_bisect_min_slots`."""
    least = tuning.current().topk_bisect_min_slots
    return least is not None and slots >= least


def _as_unsigned(x: Array) -> Array:
    """int32 -> uint32 with the same order (INT_MIN -> 0)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint32) ^ jnp.uint32(0x80000000)


def _kth_largest(u: Array, mask: Array, k: Array) -> Array:
    """Per row, the largest `t` with `#(mask & u >= t) >= k` (uint32 `u`, 32 halvings): the `k`-th largest
    masked value when `k` >= 1."""
    t = jnp.zeros(u.shape[:-1], jnp.uint32)
    for bit in range(31, -1, -1):
        t = _set_bit_if_enough(t, jnp.uint32(1 << bit), u, mask, k)
    return t


def _set_bit_if_enough(t: Array, bit: Array, u: Array, mask: Array | None, k: Array) -> Array:
    """One halving of `_kth_largest`: `t | bit` where at least `k` masked values of `u` reach it, else `t`."""
    cand = t | bit
    reach = u >= cand[..., None]
    enough = jnp.sum(reach if mask is None else mask & reach, axis=-1, dtype=jnp.int32) >= k
    return jnp.where(enough, cand, t)


def _above_and_tied(u: Array, valid: Array, count: Array) -> tuple[Array, Array]:
    """The slots whose key `u` is above the `count`-th largest, and the valid ones equal to it.

    A loop, so that every comparison reads one materialized `u`: written as straight-line code, XLA may fuse the
    float arithmetic that makes the scores into each comparison, and those copies can round differently (XLA:CPU at
    `--xla_backend_optimization_level=0` did, one ulp apart), so the threshold, `above` and `tie` disagreed and
    a kept slot was lost. Each step is one of `_kth_largest`'s halvings, then compares with the threshold so far."""

    def step(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        t = _set_bit_if_enough(carry[0], jnp.left_shift(jnp.uint32(1), (31 - i).astype(jnp.uint32)), u, None, count)
        return t, u > t[..., None], (u == t[..., None]) & valid

    none = jnp.zeros(u.shape, bool)
    _, above, tie = jax.lax.fori_loop(0, 32, step, (jnp.zeros(u.shape[:-1], jnp.uint32), none, none))
    return above, tie


def _topk_keep_bisect(key: Array, valid: Array, positions: Array, count: Array, kc: int, capacity: int,
                      by_slot: bool) -> tuple[Array, Array]:
    """`topk_keep` without sorting: bisection finds the key of the last kept slot, then the position of the
    last kept slot among those tied at it (the formulation of the Pallas kernel). The same output as the
    `top_k` path, entries past the count included (the rest of the slots in order)."""
    above, tie = _above_and_tied(_as_unsigned(key), valid, count)
    need = count - jnp.sum(above, axis=-1, dtype=jnp.int32)
    n_tie = jnp.sum(tie, axis=-1, dtype=jnp.int32)
    pu = _as_unsigned(positions)
    last = _kth_largest(pu, tie, n_tie - need + 1)  # the need-th smallest tied position
    keep = (above | (tie & (pu <= last[..., None]) & (need > 0)[..., None])) & (count > 0)[..., None]
    if not by_slot:  # kept slots ordered by their (arbitrary) positions: one top_k
        _, order = jax.lax.top_k(jnp.where(keep, -positions, INT_MIN), kc)
    else:  # by slot index: a stable partition, kept slots then the others
        n_keep = jnp.sum(keep, axis=-1, dtype=jnp.int32)
        rank = jnp.where(keep, jnp.cumsum(keep, axis=-1) - 1, n_keep[..., None] + jnp.cumsum(~keep, axis=-1) - 1)
        lead, c = key.shape[:-1], key.shape[-1]
        rows = rank.reshape(-1, c)
        slots = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), rows.shape)
        order = jnp.zeros((rows.shape[0], kc), jnp.int32)
        order = jax.vmap(lambda o, r, v: o.at[r].set(v, mode="drop"))(order, rows, slots).reshape(*lead, kc)
    if kc < capacity:
        order = jnp.concatenate([order, jnp.zeros((*key.shape[:-1], capacity - kc), order.dtype)], axis=-1)
    return order.astype(jnp.int32), count.astype(jnp.int32)


def keep_mask(indices: Array, counts: Array, num_slots: int) -> Array:
    """`[..., num_slots]` bool: the slots named by the first `counts` entries of `indices`."""
    lead, cap = indices.shape[:-1], indices.shape[-1]
    live = jnp.arange(cap) < counts[..., None]
    idx = jnp.where(live, indices, num_slots).reshape(-1, cap)
    rows = jnp.arange(idx.shape[0])[:, None]
    out = jnp.zeros((idx.shape[0], num_slots + 1), bool).at[rows, idx].set(True)
    return out[:, :num_slots].reshape(*lead, num_slots)


def protect_regions(
    cache: KVCache,
    *,
    sink: int | Array = 0,
    recent: int | Array = 0,
    last: bool = True,
) -> Array:
    """`[B, K, C]` bool: stored slots with `pos < sink`, among the `recent` most recent positions
    of their head (`pos > newest - recent`), or (with `last`) the newest token itself.

    `sink` / `recent` are ints or per-example `[B]` (or per-head `[B, K]`) arrays. Per layer.
    """
    stored = kvc.stored_mask(cache)
    newest = jnp.max(jnp.where(stored, cache.pos, -1), axis=-1)  # [B, K]
    lead = newest.shape
    sink = _broadcast_lead(jnp.asarray(sink, jnp.int32), lead)[..., None]
    recent = _broadcast_lead(jnp.asarray(recent, jnp.int32), lead)[..., None]
    mask = (cache.pos < sink) | (cache.pos > newest[..., None] - recent)
    if last:
        mask |= cache.pos == newest[..., None]
    return mask & stored


def to_query_heads(x: Array, groups: int) -> Array:
    """Repeats a per-KV-head `[B, K, ...]` array over each GQA group -> `[B, K * groups, ...]`
    (query head `n` reads KV head `n // groups`), for per-query-head selection."""
    return jnp.repeat(x, groups, axis=1)


def safeguard_candidates(budget: Array, n_prot: Array, floor: float, *, counts_protected: bool = False) -> Array:
    """Ada-KV's safeguard: the candidates (unprotected slots) each head keeps by its own scores, `[B, K]` int32 from
    `budget` `[B, 1]` (protected included) and `n_prot` `[B, K]`. By default `floor(floor * (budget - n_prot))`,
    the Ada-KV authors' count; `counts_protected`: `floor(floor * budget)` slots with the protected ones among them,
    kvpress's (so `n_prot` of them are spent already). At least one slot when `floor > 0`, as both have it."""
    share = jnp.maximum(budget - n_prot, 0) if not counts_protected else jnp.broadcast_to(budget, n_prot.shape)
    guard = jnp.floor(jnp.float32(floor) * share.astype(jnp.float32)).astype(jnp.int32)
    if floor > 0:
        guard = jnp.maximum(guard, jnp.minimum(share, 1))
    return jnp.maximum(guard - n_prot, 0) if counts_protected else guard


def adaptive_head_budgets(
    scores: Array,
    valid: Array,
    budget: Array | int,
    *,
    head_cap: Array | int,
    floor: float,
    protect: Array | None = None,
    positions: Array | None = None,
    max_head_cap: int | None = None,
    guard_counts_protected: bool = False,
    implementation: str = "auto",
) -> Array:
    """Ada-KV's head-adaptive split of a layer's budget: `[B, K]` int32 slots per head.

    Inputs `[B, K, C]`; `budget` `[B]` is the uniform per-head budget (protected slots included),
    so an example keeps `K * budget` slots in the layer. Per head the `P` protected slots are kept
    and `base = budget - P` candidates would be kept under uniform allocation. Ada-KV's safeguard:
    every head first keeps its best `floor(floor * base)` candidates (at least one when `floor > 0`);
    the rest of the layer's `sum(base)` goes to the best remaining candidates across all heads
    (ties: lower position, then lower head). `head_cap` `[B]` caps any head's slots (protected
    included), so overflow goes to the next-best heads. The total is exact (`sum(base)`, or every
    candidate there is when fewer), and re-running on an already compressed cache keeps it.
    `max_head_cap` (static, >= every `head_cap`) truncates the per-head lists before the
    cross-head sort. `guard_counts_protected`: the safeguard is `floor(floor * budget)` slots counting the
    protected ones in (kvpress's AdaKVPress) instead of `floor(floor * base)` candidates after them
    (`safeguard_candidates`).
    """
    resolve("adaptive_head_budgets", implementation)
    if not 0.0 <= floor <= 1.0:
        raise ConfigError(f"adaptive_head_budgets: floor must be in [0, 1], got {floor!r}")
    b, kv, c = scores.shape
    valid = jnp.broadcast_to(valid, scores.shape)
    prot = jnp.zeros(scores.shape, bool) if protect is None else protect & valid
    if positions is None:
        positions = jnp.arange(c, dtype=jnp.int32)
    positions = jnp.broadcast_to(positions, scores.shape).astype(jnp.int32)
    cand = valid & ~prot
    n_prot = jnp.sum(prot, axis=-1, dtype=jnp.int32)
    budget = _broadcast_lead(jnp.asarray(budget, jnp.int32), (b,))[:, None]
    head_cap = _broadcast_lead(jnp.asarray(head_cap, jnp.int32), (b,))[:, None]
    base = jnp.maximum(budget - n_prot, 0)  # [B, K] uniform share of candidates
    avail = jnp.minimum(jnp.sum(cand, axis=-1, dtype=jnp.int32), jnp.maximum(head_cap - n_prot, 0))
    total = jnp.minimum(jnp.sum(base, axis=-1), jnp.sum(avail, axis=-1))  # [B]
    guard = jnp.minimum(safeguard_candidates(budget, n_prot, floor, counts_protected=guard_counts_protected), avail)

    # Each head's candidates, best first (~key turns "largest key" into "smallest", no overflow).
    neg_key = ~order_key(scores, cand)
    neg_key, pos_sorted = jax.lax.sort((neg_key, positions), dimension=-1, num_keys=2)
    width = c if max_head_cap is None else min(c, max_head_cap)
    neg_key, pos_sorted = neg_key[..., :width], pos_sorted[..., :width]
    rank = jnp.arange(width)
    rest = (rank >= guard[..., None]) & (rank < avail[..., None])  # beyond the safeguard, within the cap
    # Across heads: a stable sort of the flattened lists keeps the lower head first among ties.
    flat_key = jnp.where(rest, neg_key, INT_MAX).reshape(b, kv * width)
    flat_pos = pos_sorted.reshape(b, kv * width)
    flat_head = jnp.broadcast_to(jnp.repeat(jnp.arange(kv, dtype=jnp.int32), width), (b, kv * width))
    sorted_key, _, sorted_head = jax.lax.sort((flat_key, flat_pos, flat_head), dimension=-1, num_keys=2)
    left = total - jnp.sum(guard, axis=-1)
    chosen = (jnp.arange(kv * width) < left[:, None]) & (sorted_key != INT_MAX)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], sorted_head.shape)
    extra = jnp.zeros((b, kv), jnp.int32).at[rows, sorted_head].add(chosen.astype(jnp.int32))
    return n_prot + guard + extra
