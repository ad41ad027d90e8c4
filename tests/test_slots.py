"""`kvjax.slots.put_slots`: every lowering that `Tuning.slot_write` picks writes what a NumPy loop writes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import slots, tuning


def numpy_put(buf: np.ndarray, slot: np.ndarray, new: np.ndarray) -> np.ndarray:
    out = buf.copy()
    for b in range(buf.shape[0]):
        for k in range(buf.shape[1]):
            if 0 <= slot[b, k] < buf.shape[2]:
                out[b, k, slot[b, k]] = new[b, k]
    return out


@pytest.mark.parametrize("how", tuning.SLOT_WRITES)
@pytest.mark.parametrize("shape", [(2, 3, 7, 4), (3, 2, 5), (9, 8, 6, 2)])  # 72 heads: update_slice scatters
def test_every_slot_write_matches_a_numpy_loop(how: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(shape) + shape[0])
    buf = rng.normal(size=shape).astype(np.float32)
    slot = rng.integers(-2, shape[2] + 3, size=shape[:2]).astype(np.int32)  # some dropped on either side
    slot[0, 0], slot[-1, -1] = shape[2] - 1, shape[2]
    new = rng.normal(size=shape[:2] + shape[3:]).astype(np.float32)
    with tuning.override(slot_write=how):
        t = tuning.current()

        @jax.jit
        def put(b: jax.Array, s: jax.Array, n: jax.Array) -> jax.Array:
            with tuning.use(t):
                return slots.put_slots(b, s, n)

        got = put(jnp.asarray(buf), jnp.asarray(slot), jnp.asarray(new))
        scalar = slots.put_slots(jnp.asarray(buf), jnp.asarray(slot), 0.5)  # a scalar broadcast to every slot
    np.testing.assert_array_equal(np.asarray(got), numpy_put(buf, slot, new))
    np.testing.assert_array_equal(np.asarray(scalar), numpy_put(buf, slot, np.full(new.shape, 0.5, np.float32)))


def test_unknown_slot_write_is_refused_naming_it() -> None:
    with pytest.raises(Exception, match="slot_write.*'gather'"):
        tuning.Tuning(slot_write="gather")


def test_cache_slot_multiple_rounds_appending_caches_and_keeps_the_tokens() -> None:
    """`Tuning.cache_slot_multiple`: a cache whose decode only appends gets its slots rounded up (the extra ones
    masked), an in-place evictor keeps its exact capacity (its budget); greedy tokens are those of exact slots."""
    from tiny import random_prompts, tiny_model

    import kvjax

    model = tiny_model()
    prompts = random_prompts(1, (37, 21, 50))
    for name, args, rounded in [("full", {}, True), ("snapkv", dict(budget=24, window_size=8), True),
                                ("streaming_llm", dict(budget=16), False)]:
        exact = kvjax.generate(model, prompts, method=name, method_args=args, max_new_tokens=6, return_cache=True)
        with tuning.override(cache_slot_multiple=128):
            wide = kvjax.generate(model, prompts, method=name, method_args=args, max_new_tokens=6, return_cache=True)
        np.testing.assert_array_equal(np.asarray(wide.tokens), np.asarray(exact.tokens), err_msg=name)
        expected = 128 if rounded else exact.cache.layers[0].capacity
        assert wide.cache.layers[0].capacity == expected, name
