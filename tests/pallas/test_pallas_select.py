"""Selection + compaction kernels (interpret mode): the threshold-search top-k keeps exactly the set
`topk_keep` keeps (ties by position, protected slots, NaN / -0.0 / inf scores, per-head budgets,
budget above the valid count or the capacity), and the DMA gather builds the same compressed cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import TPU_SIM, make_cache

from kvjax import cache as kvc
from kvjax import tuning
from kvjax.errors import ConfigError
from kvjax.ops import gather, select
from kvjax.pallas import select as kernels
from kvjax.quant import KVQuant
from kvjax.quant import storage as st

B, K, C = 3, 4, 50


def rows(rng, dtype=np.float32):
    scores = rng.integers(0, 6, (B, K, C)).astype(dtype)  # six distinct values: many ties
    scores[0, 0, :5] = np.nan
    scores[0, 1, :3] = [-np.inf, np.inf, -0.0]
    scores[1, 1, 2:6] = [-0.0, 0.0, -0.0, 0.0]
    valid = rng.random((B, K, C)) > 0.2
    valid[2, 3] = False  # an empty head
    protect = rng.random((B, K, C)) > 0.9
    positions = np.stack([np.stack([rng.permutation(C) for _ in range(K)]) for _ in range(B)]).astype(np.int32)
    budget = np.array([[3, 10, 0, 60], [1, 2, 3, 4], [7, 45, 7, 5]], np.int32)
    return scores, valid, protect, positions, budget


def assert_same_selection(ref, got, num_slots):
    (r_idx, r_cnt), (g_idx, g_cnt) = ref, got
    np.testing.assert_array_equal(np.asarray(g_cnt), np.asarray(r_cnt))
    np.testing.assert_array_equal(np.asarray(select.keep_mask(g_idx, g_cnt, num_slots)),
                                  np.asarray(select.keep_mask(r_idx, r_cnt, num_slots)))
    live = np.arange(r_idx.shape[-1]) < np.asarray(r_cnt)[..., None]  # same order (by position) too
    np.testing.assert_array_equal(np.where(live, g_idx, 0), np.where(live, r_idx, 0))


@pytest.mark.parametrize("capacity,use_protect,use_positions,dtype", [
    (8, False, False, np.float32),
    (20, True, True, np.float32),
    (64, True, False, jnp.bfloat16),
])
def test_threshold_topk_keeps_the_reference_set(capacity, use_protect, use_positions, dtype):
    scores, valid, protect, positions, budget = rows(np.random.default_rng(0), np.float32)
    args = (jnp.asarray(scores, dtype), jnp.asarray(valid), jnp.asarray(budget))
    kw = dict(capacity=capacity, protect=jnp.asarray(protect) if use_protect else None,
              positions=jnp.asarray(positions) if use_positions else None)
    ref = select.topk_keep(*args, **kw)
    got = select.topk_keep(*args, **kw, implementation="pallas")
    assert_same_selection(ref, got, C)


def test_threshold_topk_random_scores_per_query_head_layout_several_chunks():
    rng = np.random.default_rng(1)
    scores = rng.standard_normal((2, 7, 300)).astype(np.float32)  # [B, N, C'], 7 rows per example
    scores[0, 0, 100:300] = 0.5  # ties across lane chunks
    valid = jnp.asarray(rng.random((2, 7, 300)) > 0.3)
    budget = jnp.asarray([5, 120])
    ref = select.topk_keep(jnp.asarray(scores), valid, budget, capacity=160)
    key = select.order_key(jnp.asarray(scores), valid).reshape(14, 300)
    keep, count = kernels.threshold_topk(key, jnp.repeat(budget, 7), jnp.broadcast_to(jnp.arange(300), (14, 300)),
                                         capacity=160, chunk=128, interpret=TPU_SIM)  # 3 chunks of 128 lanes
    np.testing.assert_array_equal(np.asarray(count).reshape(2, 7), np.asarray(ref[1]))
    np.testing.assert_array_equal(np.asarray(keep).reshape(2, 7, 300), np.asarray(select.keep_mask(*ref, 300)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_kernel_builds_the_reference_cache(dtype):
    rng = np.random.default_rng(2)
    scores, _, _, _, budget = rows(rng)
    lengths = np.array([[50, 30, 20, 1], [0, 5, 49, 12], [33, 33, 33, 33]])
    c = make_cache(rng, lengths, C, 16)
    cache = kvc.init(B, K, C, 16, dtype, score=True, attend=True)
    cache = cache.replace(k=jnp.asarray(c.k_nan, dtype), v=jnp.asarray(c.v_nan, dtype), pos=jnp.asarray(c.pos),
                          length=jnp.asarray(lengths, jnp.int32), score=jnp.asarray(scores))
    ref = gather.keep_top(cache, jnp.asarray(scores), jnp.asarray(budget), capacity=20)
    if dtype == jnp.float32:  # through the ops' dispatch
        got = gather.keep_top(cache, jnp.asarray(scores), jnp.asarray(budget), capacity=20, implementation="pallas")
    else:  # the TPU simulator checks the DMAs' bounds
        idx, cnt = select.topk_keep(jnp.asarray(scores), kvc.stored_mask(cache), jnp.asarray(budget), capacity=20,
                                    positions=cache.pos)
        got = kernels.gather_kept(cache, idx, cnt, interpret=TPU_SIM)
    stored = np.asarray(kvc.stored_mask(ref))
    for name in ("k", "v", "pos", "length", "score", "attend"):
        r, g = np.asarray(getattr(ref, name), np.float32), np.asarray(getattr(got, name), np.float32)
        assert r.shape == g.shape, name
        if name in ("k", "v"):  # kept rows are bit-identical; rows past the count are unspecified
            r, g = r[stored], g[stored]
            assert np.isfinite(g).all()
        np.testing.assert_array_equal(g, r, err_msg=name)


@pytest.mark.parametrize("spec", [KVQuant("int8"), KVQuant("kivi2", group_size=4, residual=4)], ids=["int8", "kivi2"])
def test_a_quantized_cache_is_compacted_by_xla_where_the_gather_kernel_is_listed(spec):
    """The DMA gather reads model-dtype K / V: with the kernel listed in the tuning (as every method's keep_top
    reaches it under "auto"), a quantized cache died in an AttributeError (a QuantizedKV has no reshape). "auto"
    now compacts it with XLA (the same cache as implementation="xla"); "pallas" refuses it by name."""
    rng = np.random.default_rng(3)
    lengths = np.array([[16, 10], [5, 16]])
    c = make_cache(rng, lengths, 16, 16, shuffle=False)
    length = jnp.asarray(lengths, jnp.int32)
    cache = kvc.init(2, 2, 16, 16, jnp.float32, quant=spec).replace(
        k=st.quantize(spec, "k", jnp.asarray(c.k), length, jnp.float32),
        v=st.quantize(spec, "v", jnp.asarray(c.v), length, jnp.float32), pos=jnp.asarray(c.pos), length=length)
    scores = jnp.asarray(rng.standard_normal((2, 2, 16)), jnp.float32)
    want = gather.keep_top(cache, scores, 6, capacity=8, implementation="xla")
    with tuning.override(auto_pallas={"topk_keep", "gather_kept"}):
        got = gather.keep_top(cache, scores, 6, capacity=8)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    with pytest.raises(ConfigError, match=f"gather_kept: .* not a quantized one \\({spec.name}\\)"):
        gather.keep_top(cache, scores, 6, capacity=8, implementation="pallas")
