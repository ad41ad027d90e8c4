"""Selection ops against a naive NumPy reference: top-k with protected slots, exact ties by
position, per-example / per-head budgets, and Ada-KV's head-adaptive budgets."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, kept, ref_adaptive

from kvjax import cache as kvc
from kvjax import tuning
from kvjax.errors import ConfigError
from kvjax.ops import gather, select


def ref_topk(scores, valid, budget, capacity, protect, positions):
    """Per row: protected first, then higher score, then lower position; sorted by position."""
    lead = scores.shape[:-1]
    budget = np.broadcast_to(np.asarray(budget).reshape(np.shape(budget) + (1,) * (len(lead) - np.ndim(budget))), lead)
    out = np.empty(lead, dtype=object)
    for idx in np.ndindex(*lead):
        slots = [j for j in range(scores.shape[-1]) if valid[idx][j]]
        n_prot = sum(bool(protect[idx][j]) for j in slots)
        count = min(max(int(budget[idx]), n_prot), len(slots), capacity)
        order = sorted(slots, key=lambda j: (not protect[idx][j], -scores[idx][j], positions[idx][j]))
        out[idx] = sorted(order[:count], key=lambda j: positions[idx][j])
    return out


def random_rows(rng, lead=(3, 2), c=23, ties=False):
    scores = rng.standard_normal(lead + (c,)).astype(np.float32)
    if ties:
        scores = np.round(scores, 0)  # a handful of distinct values: many ties
    valid = rng.random(lead + (c,)) > 0.25
    protect = (rng.random(lead + (c,)) > 0.85) & valid
    positions = np.stack([rng.permutation(c) for _ in range(int(np.prod(lead)))]).reshape(lead + (c,)).astype(np.int32)
    return scores, valid, protect, positions


def check_against_ref(scores, valid, budget, capacity, protect, positions):
    idx, cnt = select.topk_keep(
        jnp.asarray(scores), jnp.asarray(valid), jnp.asarray(budget), capacity=capacity,
        protect=jnp.asarray(protect), positions=jnp.asarray(positions),
    )
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    assert idx.shape == scores.shape[:-1] + (capacity,) and idx.dtype == np.int32
    want = ref_topk(scores, valid, budget, capacity, protect, positions)
    for row in np.ndindex(*scores.shape[:-1]):
        got = idx[row][: cnt[row]].tolist()
        assert got == want[row], (row, got, want[row])  # same slots, in position order
        assert len(set(got)) == len(got) and cnt[row] <= capacity
        assert all(j in got for j in np.flatnonzero(protect[row] & valid[row])[:capacity])


@pytest.mark.parametrize("ties", [False, True])
def test_topk_keep_matches_reference_per_example_budget(ties):
    rng = np.random.default_rng(0 + ties)
    scores, valid, protect, positions = random_rows(rng, ties=ties)
    check_against_ref(scores, valid, np.array([5, 9, 0], np.int32), 12, protect, positions)


def test_topk_keep_per_head_budget_and_query_heads():
    rng = np.random.default_rng(2)
    scores, valid, protect, positions = random_rows(rng, lead=(3, 8), ties=True)
    budget = rng.integers(0, 15, size=(3, 8)).astype(np.int32)
    check_against_ref(scores, valid, budget, 10, protect, positions)
    # Per query head: KV-head masks expanded over each group of 4.
    kv_valid = valid[:, ::4]
    q_valid = np.asarray(select.to_query_heads(jnp.asarray(kv_valid), 4))
    assert (q_valid[:, 5] == kv_valid[:, 1]).all()
    check_against_ref(scores, q_valid, np.array([4, 6, 8]), 10, protect & q_valid, positions)


def test_ties_break_by_position_not_slot():
    scores = np.zeros((1, 6), np.float32)
    positions = np.array([[50, 10, 40, 20, 30, 60]], np.int32)
    idx, cnt = select.topk_keep(jnp.asarray(scores), jnp.ones((1, 6), bool), 3, capacity=4,
                                positions=jnp.asarray(positions))
    assert positions[0, np.asarray(idx)[0, : int(cnt[0])]].tolist() == [10, 20, 30]


def test_special_values_and_edge_budgets():
    scores = np.array([[np.nan, -np.inf, -0.0, 0.0, np.inf, -1.0, 2.0]], np.float32)
    valid = np.array([[True, True, True, True, True, True, False]])
    idx, cnt = select.topk_keep(jnp.asarray(scores), jnp.asarray(valid), 4, capacity=7)
    # inf, then the two zeros (equal: lower position first), then -1; invalid 2.0 never.
    assert np.asarray(idx)[0, : int(cnt[0])].tolist() == [2, 3, 4, 5]
    idx, cnt = select.topk_keep(jnp.asarray(scores), jnp.asarray(valid), 100, capacity=7)
    assert int(cnt[0]) == 6 and np.asarray(idx)[0, :6].tolist() == [0, 1, 2, 3, 4, 5]
    _, cnt = select.topk_keep(jnp.asarray(scores), jnp.asarray(valid), 0, capacity=3)
    assert int(cnt[0]) == 0
    # More protected slots than the budget: all protected are kept (capacity permitting).
    protect = np.array([[True, True, True, False, False, False, False]])
    idx, cnt = select.topk_keep(jnp.asarray(scores), jnp.asarray(valid), 1, capacity=7, protect=jnp.asarray(protect))
    assert np.asarray(idx)[0, : int(cnt[0])].tolist() == [0, 1, 2]


def test_vmap_over_batch_equals_loop_and_jit():
    scores, valid, protect, positions = random_rows(np.random.default_rng(3), lead=(3, 2))
    budget = np.array([3, 7, 11], np.int32)

    def one(s, v, b, p, pos):
        return select.topk_keep(s, v, b, capacity=9, protect=p, positions=pos)

    args = [jnp.asarray(x) for x in (scores, valid, budget, protect, positions)]
    batched = jax.jit(one)(*args)
    vmapped = jax.vmap(one)(*args)
    for i in range(3):
        loop = one(*(a[i] for a in args))
        for got in (batched, vmapped):
            np.testing.assert_array_equal(np.asarray(got[1][i]), np.asarray(loop[1]))
            for k in range(2):
                n = int(loop[1][k])
                np.testing.assert_array_equal(np.asarray(got[0][i, k, :n]), np.asarray(loop[0][k, :n]))


def test_protect_regions_per_example():
    batch = Batch(lengths=(12, 7, 9), h=8)
    cache = batch.cache(4)
    mask = np.asarray(select.protect_regions(cache, sink=2, recent=jnp.asarray([3, 1, 0]), last=True))
    held = [sorted(np.asarray(cache.pos)[b, 0][mask[b, 0]].tolist()) for b in range(3)]
    assert held == [[0, 1, 9, 10, 11], [0, 1, 6], [0, 1, 8]]
    assert not mask[np.asarray(cache.pos) < 0].any()


def test_keep_top_builds_the_budget_sized_cache():
    batch = Batch(lengths=(12, 7, 9), h=8)
    cache = batch.cache(4)
    scores = jnp.asarray(-np.asarray(cache.pos, np.float32))  # prefer early tokens
    out = gather.keep_top(cache, scores, jnp.asarray([5, 5, 3]), capacity=6)
    assert out.capacity == 6
    assert [kept(out, b, 1) for b in range(3)] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2]]
    # Keys travel with their positions.
    np.testing.assert_array_equal(np.asarray(out.k[2, 1, :3], np.float32), batch.k[2, :3, 1])
    idx, cnt = select.topk_keep(scores, kvc.stored_mask(cache), 4, capacity=6, positions=cache.pos)
    direct = gather.gather_kept(cache, idx, cnt)
    mask = np.asarray(select.keep_mask(idx, cnt, cache.capacity))
    assert (mask.sum(-1) == np.asarray(cnt)).all() and (np.asarray(cache.pos)[mask] < 4).all()
    np.testing.assert_array_equal(np.asarray(direct.pos), np.asarray(kvc.compact(cache, idx, cnt).pos))
    with pytest.raises(ValueError, match="pallas"):  # no kernel for Ada-KV's head budgets
        select.adaptive_head_budgets(scores, kvc.stored_mask(cache), 4, head_cap=6, floor=0.2,
                                     implementation="pallas")
    with pytest.raises(ConfigError, match="capacity"):
        select.topk_keep(scores, kvc.stored_mask(cache), 4, capacity=0)


@pytest.mark.parametrize("counts_protected", [False, True])
@pytest.mark.parametrize("floor,share", [(0.2, 2.0), (0.0, 1.5), (1.0, 2.0), (0.5, 100.0)])
def test_adaptive_head_budgets_match_reference(floor, share, counts_protected):
    rng = np.random.default_rng(4)
    b, kv, c = 3, 4, 30
    # Heads with very different score spreads, so the allocation is far from uniform.
    scores = (rng.random((b, kv, c)) ** np.array([1, 4, 8, 16])[None, :, None]).astype(np.float32)
    valid = np.arange(c)[None, None] < np.array([30, 22, 26])[:, None, None]
    valid = np.broadcast_to(valid, (b, kv, c))
    positions = np.broadcast_to(np.arange(c, dtype=np.int32), (b, kv, c))
    protect = valid & (positions >= np.array([26, 18, 22])[:, None, None])  # window of 4
    budget = np.array([12, 10, 26], np.int32)
    cap = np.ceil(budget.astype(np.float32) * np.float32(share)).astype(np.int32)
    got = np.asarray(select.adaptive_head_budgets(
        jnp.asarray(scores), jnp.asarray(valid), jnp.asarray(budget), head_cap=jnp.asarray(cap), floor=floor,
        protect=jnp.asarray(protect), positions=jnp.asarray(positions), max_head_cap=40,
        guard_counts_protected=counts_protected,
    ))
    for i in range(b):
        want = ref_adaptive(scores[i], valid[i], protect[i], positions[i], int(budget[i]), int(cap[i]), floor,
                            counts_protected)
        assert got[i].tolist() == want, (i, got[i], want)
        assert got[i].sum() == kv * budget[i]  # the layer's total is exact
        assert (got[i] <= cap[i]).all() and (got[i] >= 4).all()
    if floor == 1.0:
        assert (got == budget[:, None]).all()  # both safeguards: every head its uniform share
    if floor == 0.0:
        assert len(set(got[0].tolist())) > 1  # adaptive: heads differ
    with pytest.raises(ConfigError, match="floor"):
        select.adaptive_head_budgets(jnp.asarray(scores), jnp.asarray(valid), 3, head_cap=6, floor=1.5)


@pytest.mark.parametrize("seed", range(6))
def test_bisection_selection_equals_the_top_k_one(seed):
    """On CPU, long slot axes select by bisection instead of three `top_k` sorts: the same indices (entries
    past the count included) and counts, with ties, protected slots, custom positions and any capacity."""
    rng = np.random.default_rng(seed)
    c = int(rng.choice([256, 300, 513]))
    lead = (2, 3)
    scores = rng.integers(-3, 4, size=lead + (c,)) if seed % 2 else rng.normal(size=lead + (c,))
    args = (jnp.asarray(scores, jnp.float32), jnp.asarray(rng.random(lead + (c,)) < 0.9),
            jnp.asarray(rng.integers(0, c + 5, size=lead[:1]), jnp.int32))
    kw = dict(capacity=int(rng.choice([1, 64, c, c + 10])),
              protect=jnp.asarray(rng.random(lead + (c,)) < 0.05) if seed % 3 == 0 else None,
              positions=None if seed % 4 else jnp.asarray(rng.permutation(2 * c)[:c], jnp.int32))
    with tuning.override(topk_bisect_min_slots=None):
        sorted_idx, sorted_count = select.topk_keep(*args, implementation="xla", **kw)
    with tuning.override(topk_bisect_min_slots=1):
        idx, count = select.topk_keep(*args, implementation="xla", **kw)
    np.testing.assert_array_equal(np.asarray(count), np.asarray(sorted_count))
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(sorted_idx))


def _argmin_cases() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    floats = rng.choice(np.array([0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan], np.float32), size=(6, 3, 33))
    floats[0] = np.nan  # a row all NaN, one with none
    floats[1] = rng.standard_normal((3, 33)).astype(np.float32)
    return [rng.integers(-3, 4, size=(5, 4, 37)).astype(np.int32),  # many ties
            np.full((2, 3, 9), np.iinfo(np.int32).max, np.int32),   # nothing but the sentinel
            floats, floats.astype(jnp.bfloat16), rng.random((4, 50)) < 0.1]


@pytest.mark.parametrize("inside", [False, True], ids=["variadic", "two_reductions"])
@pytest.mark.parametrize("case", range(5))
def test_argmin_argmax_equal_jnp_on_ties_nan_and_signed_zero(case, inside, monkeypatch):
    # Oracle: jnp.argmin / argmax (the first index of the extreme, the first NaN if any), on every axis. Inside
    # two_reduction_argmin an axis up to TWO_REDUCTION_MAX_LENGTH (here 5) lowers to two reductions, a longer one
    # to one (value, index) reduction, as does every axis outside it.
    monkeypatch.setattr(select, "TWO_REDUCTION_MAX_LENGTH", 5)
    x = jnp.asarray(_argmin_cases()[case])
    for axis in range(-x.ndim, x.ndim):
        for ours, theirs in ((select.argmin, jnp.argmin), (select.argmax, jnp.argmax)):
            with select.two_reduction_argmin() if inside else contextlib.nullcontext():
                lowered = jax.jit(lambda v, ours=ours, axis=axis: ours(v, axis)).lower(x)
            two = inside and x.shape[axis] <= 5
            assert lowered.as_text().count("stablehlo.reduce(") == (2 if two else 1), (axis, two)
            got = lowered.compile()(x)
            assert got.dtype == jnp.int32
            np.testing.assert_array_equal(np.asarray(got), np.asarray(theirs(x, axis=axis)), err_msg=f"axis {axis}")


def test_oldest_slot_is_the_lowest_position_among_the_mask():
    # Oracle: a loop over heads picking the lowest position; slot 0 where the mask is empty (jnp.argmin's).
    from kvjax.methods.common import oldest_slot

    rng = np.random.default_rng(1)
    pos = np.stack([rng.permutation(40)[:24] for _ in range(6)]).reshape(2, 3, 24).astype(np.int32)
    among = rng.random(pos.shape) < 0.4
    among[1, 2] = False
    cache = kvc.KVCache(k=jnp.zeros((2, 3, 24, 4)), v=jnp.zeros((2, 3, 24, 4)), pos=jnp.asarray(pos),
                        length=jnp.full((2, 3), 24, jnp.int32))
    want = [[int(np.flatnonzero(m)[np.argmin(p[m])]) if m.any() else 0 for p, m in zip(pr, mr, strict=True)]
            for pr, mr in zip(pos, among, strict=True)]
    np.testing.assert_array_equal(np.asarray(oldest_slot(cache, jnp.asarray(among))), want)
