"""Cache ops: append, compact, keep_where, evict, truncate, rerotate, against plain NumPy."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.rope import apply_rope


def filled(rng, b=2, kv=2, c=10, h=4, t=6, lengths=(6, 4)):
    cache = kvc.init(b, kv, c, h, jnp.float32, score=True)
    k = rng.standard_normal((b, t, kv, h)).astype(np.float32)
    v = rng.standard_normal((b, t, kv, h)).astype(np.float32)
    pos = np.where(np.arange(t)[None] < np.array(lengths)[:, None], np.arange(t)[None], -1).astype(np.int32)
    return kvc.append(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos)), k, v, pos


def test_init_shapes_and_model_cache_of_layers():
    one = kvc.init(3, 2, 16, 8, jnp.bfloat16)
    assert one.k.shape == (3, 2, 16, 8) and one.k.dtype == jnp.bfloat16
    assert one.pos.shape == (3, 2, 16) and int(one.pos.max()) == -1
    assert one.length.shape == (3, 2) and one.capacity == 16
    c = kvc.ModelCache(tuple(kvc.init(3, 2, 16, 8, jnp.bfloat16) for _ in range(4)))
    assert c.num_layers == 4 and c.capacity == 16 and c.batch_size == 3
    assert c.layer(1).k.shape == (3, 2, 16, 8) and kvc.SHARED_STATE not in c.layer(1).state
    assert c.nbytes == 2 * 4 * 3 * 2 * 16 * 8 * 2 + 4 * 3 * 2 * 16 * 4 + 4 * 3 * 2 * 4
    stacked = c.stacked()
    assert stacked.k.shape == (4, 3, 2, 16, 8) and stacked.length.shape == (4, 3, 2)


def test_model_cache_hands_the_shared_state_to_each_layer_and_takes_it_back():
    shared = {"left": jnp.asarray([5], jnp.int32)}
    c = kvc.ModelCache(tuple(kvc.init(1, 1, 4, 2, jnp.float32) for _ in range(2)), shared)
    layer = c.layer(0)
    assert layer.state[kvc.SHARED_STATE] is shared
    k = jnp.ones((1, 1, 1, 2))
    written = kvc.append(layer, k, k, jnp.asarray([[0]], jnp.int32))
    written = written.replace(state={**written.state, kvc.SHARED_STATE: {"left": jnp.asarray([4], jnp.int32)}})
    out = c.with_layer(0, written)
    assert int(out.shared["left"][0]) == 4 and kvc.SHARED_STATE not in out.layers[0].state
    np.testing.assert_array_equal(out.layers[0].length, [[1]])
    np.testing.assert_array_equal(out.layers[1].length, [[0]])  # the other layer is untouched
    assert int(out.layer(1).state[kvc.SHARED_STATE]["left"][0]) == 4  # the next layer sees the new version
    # A layer returned without shared state leaves the model's shared state as it was.
    assert int(c.with_layer(1, kvc.init(1, 1, 4, 2, jnp.float32)).shared["left"][0]) == 5


def test_append_writes_after_each_heads_length_and_skips_padding():
    rng = np.random.default_rng(0)
    cache, k, v, pos = filled(rng)
    np.testing.assert_array_equal(cache.length, [[6, 6], [4, 4]])
    np.testing.assert_array_equal(cache.pos[1, 0], [0, 1, 2, 3, -1, -1, -1, -1, -1, -1])
    np.testing.assert_allclose(cache.k[0, 1, :6], k[0, :, 1])
    # A second append (one token) lands right after the valid slots of each example.
    k2 = jnp.ones((2, 1, 2, 4))
    cache = kvc.append(cache, k2, k2, jnp.asarray([[6], [4]], jnp.int32))
    np.testing.assert_array_equal(cache.length, [[7, 7], [5, 5]])
    np.testing.assert_array_equal(cache.pos[1, 1, :6], [0, 1, 2, 3, 4, -1])
    np.testing.assert_allclose(cache.k[1, 1, 4], 1.0)
    assert bool(jnp.all(kvc.valid_mask(cache) == (cache.pos >= 0)))


def test_compact_gathers_the_given_slots():
    rng = np.random.default_rng(1)
    cache, k, _, _ = filled(rng)
    idx = jnp.asarray(np.tile(np.array([5, 0, 2, 9]), (2, 2, 1)))
    out = kvc.compact(cache, idx, jnp.asarray([[3, 3], [2, 2]]))
    assert out.capacity == 4
    np.testing.assert_array_equal(out.pos[0, 0], [5, 0, 2, -1])
    # Example 1 has 4 valid slots, so the requested slot 5 comes back as an empty slot's data.
    np.testing.assert_array_equal(out.pos[1, 0], [-1, 0, -1, -1])
    np.testing.assert_array_equal(out.length, [[3, 3], [2, 2]])
    np.testing.assert_allclose(out.k[0, 1, 0], k[0, 5, 1])


def test_keep_where_keeps_marked_slots_in_order():
    rng = np.random.default_rng(2)
    cache, _, _, _ = filled(rng)
    keep = jnp.zeros((2, 2, 10), bool).at[:, :, jnp.array([1, 3, 5, 7])].set(True)
    out = kvc.keep_where(cache, keep, 3)
    np.testing.assert_array_equal(out.pos[0, 0], [1, 3, 5])
    np.testing.assert_array_equal(out.pos[1, 1], [1, 3, -1])  # slots 5, 7 are empty in example 1
    np.testing.assert_array_equal(out.length, [[3, 3], [2, 2]])


def test_evict_moves_last_slot_into_victim():
    rng = np.random.default_rng(3)
    cache, k, _, _ = filled(rng)
    out = kvc.evict(cache, jnp.asarray([[1, 5], [0, 0]]), where=jnp.asarray([[True, True], [False, True]]))
    np.testing.assert_array_equal(out.length, [[5, 5], [4, 3]])
    np.testing.assert_array_equal(out.pos[0, 0, :6], [0, 5, 2, 3, 4, -1])
    np.testing.assert_array_equal(out.pos[0, 1, :6], [0, 1, 2, 3, 4, -1])  # victim was the last
    np.testing.assert_array_equal(out.pos[1, 0, :4], [0, 1, 2, 3])  # untouched
    for before, after in ((cache.k, out.k), (cache.v, out.v), (cache.pos, out.pos)):
        np.testing.assert_array_equal(after[1, 0], before[1, 0])  # every slot of the head left alone
    np.testing.assert_array_equal(out.pos[1, 1, :4], [3, 1, 2, -1])
    np.testing.assert_allclose(out.k[0, 0, 1], k[0, 5, 0])


def test_truncate_and_extend_round_trip():
    rng = np.random.default_rng(4)
    cache, _, _, _ = filled(rng)
    big = kvc.extend(cache, 5)
    assert big.capacity == 15 and int(big.pos[0, 0, 14]) == -1
    back = kvc.truncate(big, 10)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(a, b)
    small = kvc.truncate(cache, 5)
    np.testing.assert_array_equal(small.length, [[5, 5], [4, 4]])


def test_rerotate_equals_embedding_at_the_new_position():
    rng = np.random.default_rng(5)
    inv_freq = jnp.asarray(1.0 / (10000 ** (np.arange(0, 8, 2) / 8)), jnp.float32)
    raw = jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32)
    old = jnp.arange(6, dtype=jnp.int32)[None]
    new = old + 100
    cache = kvc.init(1, 2, 6, 8, jnp.float32)
    cache = kvc.append(cache, apply_rope(raw, old, inv_freq), raw, old)
    moved = kvc.rerotate(cache, jnp.int32(100), inv_freq)
    expect = jnp.swapaxes(apply_rope(raw, new, inv_freq), 1, 2)
    np.testing.assert_allclose(moved.k, expect, atol=1e-4)
    np.testing.assert_array_equal(moved.pos, cache.pos)  # original positions are kept


def test_positions_kept_nests_like_the_heads():
    rng = np.random.default_rng(6)
    cache, _, _, _ = filled(rng, lengths=(6, 6))
    assert kvc.positions_kept(cache) == [[list(range(6))] * 2] * 2
    model_cache = kvc.ModelCache(tuple(kvc.init(2, 1, 4, 2, jnp.float32) for _ in range(3)))
    assert kvc.positions_kept(model_cache) == [[[[]], [[]]]] * 3
    assert kvc.positions_kept(model_cache.stacked()) == kvc.positions_kept(model_cache)


def test_append_token_equals_append_of_one_token():
    """The in-place one-slot scatter of decode against `append` (padding rows stored but not counted; a full
    head's write clamps to the last slot as `append`'s dynamic_update_slice does)."""
    rng = np.random.default_rng(7)
    cache, _, _, _ = filled(rng, c=7, lengths=(6, 4))
    cache = cache.replace(attend=jnp.zeros(cache.pos.shape, bool))
    cache = cache.replace(length=cache.length.at[0, 1].set(7))  # head (0, 1) is full
    k = jnp.asarray(rng.standard_normal((2, 1, 2, 4)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 1, 2, 4)), jnp.float32)
    for positions in ([[6], [4]], [[6], [-1]]):
        positions = jnp.asarray(positions, jnp.int32)
        got = jax.jit(kvc.append_token)(cache, k, v, positions)
        want = kvc.append(cache, k, v, positions)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


def test_take_slots_reads_each_heads_slots():
    rng = np.random.default_rng(8)
    cache, _, _, _ = filled(rng)
    slots = jnp.asarray(rng.integers(0, 10, (2, 2, 3)), jnp.int32)
    k = np.asarray(cache.k)
    want = np.stack([np.stack([k[b, h, np.asarray(slots)[b, h]] for h in range(2)]) for b in range(2)])
    np.testing.assert_array_equal(kvc.take_slots(cache.k, slots), want)
    np.testing.assert_array_equal(kvc.take_slots(cache.pos, slots),
                                  np.take_along_axis(np.asarray(cache.pos), np.asarray(slots), axis=-1))
