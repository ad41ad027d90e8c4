"""Random eviction: keyed by (seed, layer, head, position), sinks / window kept, end to end."""

import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    assert_keeps_everything,
    generate_and_check,
    kept,
    run_prefill,
    top_positions,
)

from kvjax import methods
from kvjax.errors import ConfigError


def reference_uniform(seed, layer, head, pos):
    """The documented hash, transcribed in NumPy uint32 arithmetic."""

    def mix(x):
        x = np.uint32(x)
        x ^= x >> np.uint32(16)
        x = np.uint32((int(x) * 0x85EBCA6B) & 0xFFFFFFFF)
        x ^= x >> np.uint32(13)
        x = np.uint32((int(x) * 0xC2B2AE35) & 0xFFFFFFFF)
        return x ^ (x >> np.uint32(16))

    h = mix(np.uint32(seed) ^ np.uint32(0x9E3779B9))
    for field in (layer, head, pos):
        h = mix(h ^ np.uint32(field))
    return float(h >> np.uint32(8)) * 2.0**-24


def test_keeps_the_top_of_the_seeded_draws_with_sinks_and_window():
    batch = Batch(lengths=(20, 11, 15), h=8)
    method = methods.get("random", budget=8, seed=3, sink_size=2, window_size=2)
    out, _, _ = run_prefill(method, batch, layer=1)
    for b, n in enumerate(batch.lengths):
        for k in range(batch.kv):
            protected = [0, 1, n - 2, n - 1]
            draws = {p: reference_uniform(3, 1, k, p) for p in range(2, n - 2)}
            assert kept(out, b, k) == sorted(protected + top_positions(draws, 4))


def test_deterministic_per_seed_layer_and_head():
    batch = Batch()
    a, _, _ = run_prefill(methods.get("random", budget=10, seed=0), batch)
    b, _, _ = run_prefill(methods.get("random", budget=10, seed=0), batch)
    c, _, _ = run_prefill(methods.get("random", budget=10, seed=1), batch)
    d, _, _ = run_prefill(methods.get("random", budget=10, seed=0), batch, layer=1)
    np.testing.assert_array_equal(np.asarray(a.pos), np.asarray(b.pos))
    assert (np.asarray(a.pos) != np.asarray(c.pos)).any() and (np.asarray(a.pos) != np.asarray(d.pos)).any()
    assert kept(a, 0, 0) != kept(a, 0, 1)  # heads draw independently
    assert (np.asarray(a.length) == 10).all()


def test_budget_above_prompt_and_batching():
    assert_keeps_everything(methods.get("random", budget=40), Batch())
    assert_batch_equals_loop(methods.get("random", budget=9, sink_size=1), Batch(lengths=(30, 17, 24)))


@pytest.mark.parametrize(
    "args,name",
    [
        (dict(budget=8, seed=-1), "seed"),
        (dict(budget=8, sink_size=-2), "sink_size"),
        (dict(budget=8, window_size=-1), "window_size"),
        (dict(budget=8, sink_size=4, window_size=4), "sink_size"),
    ],
)
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("random", **args)


def test_end_to_end_generate():
    lengths = (40, 23, 31)
    generate_and_check(methods.get("random", budget=9, sink_size=2, seed=5), lengths,
                       prompt_kept=lambda layer, b: 9)


def test_draws_are_uniform():
    import jax.numpy as jnp

    from kvjax.methods.random import token_uniform

    u = np.asarray(token_uniform(7, jnp.int32(2), jnp.arange(40000, dtype=jnp.int32).reshape(1, 4, 10000)))
    assert u.min() >= 0 and u.max() < 1
    counts, _ = np.histogram(u, bins=10, range=(0, 1))
    assert np.abs(counts / u.size - 0.1).max() < 0.01
    assert abs(np.corrcoef(u[0, 0], u[0, 1])[0, 1]) < 0.05  # heads independent
