"""NACL against a NumPy transcription of the paper / official code (protected proxy window and sinks,
top proxy-token scores, seeded sampling without replacement from softmax(score / T)), the sampling
law, invariants, batching, and end to end through `kvjax.generate`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    generate_and_check,
    kept,
    run_prefill,
)
from baseline_refs_decode import nacl_reference

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.nacl import SEED_SALT, gumbel_keys
from kvjax.methods.random import token_uniform


@pytest.mark.parametrize(
    "args",
    [
        dict(budget=14, window_size=4),
        dict(budget=14, window_size=3, sink_size=2, random_ratio=0.5, temperature=0.5, seed=7, group_reduce="max"),
        dict(compression_ratio=0.5, window_size=4, random_ratio=1.0),
    ],
)
def test_matches_reference(args):
    method = methods.get("nacl", **args)
    batch = Batch()
    out, cache, step = run_prefill(method, batch, layer=1)
    votes = batch.votes(method.window_size, method.group_reduce)
    uniforms = np.asarray(token_uniform(method.seed ^ SEED_SALT, jnp.int32(1), cache.pos))
    for b, n in enumerate(batch.lengths):
        budget = method.prompt_budget(int(n))
        for k in range(batch.kv):
            want = nacl_reference(votes[b, k], uniforms[b, k], int(n), budget, window=method.window_size,
                                  sink=method.sink_size, random_ratio=method.random_ratio,
                                  temperature=method.temperature)
            got = kept(out, b, k)
            assert got == want, (b, k)
            w = min(method.window_size, budget)
            assert set(range(method.sink_size)) | set(range(n - w, n)) <= set(got)  # protected kept


def test_gumbel_top_k_samples_from_the_softmax():
    """The first pick of the Gumbel keys follows softmax(score / T) (the law of the official
    `np.random.choice(p=softmax(score))`)."""
    scores = jnp.asarray([0.0, 1.0, 2.0, 0.5, -1.0], jnp.float32)
    u = jax.random.uniform(jax.random.key(0), (20000, 5))
    for temperature in (1.0, 0.5):
        picks = jnp.argmax(gumbel_keys(scores[None], u, temperature), axis=-1)
        freq = np.bincount(np.asarray(picks), minlength=5) / 20000
        want = np.exp(np.asarray(scores) / temperature)
        np.testing.assert_allclose(freq, want / want.sum(), atol=0.015)


def test_budget_above_prompt_keeps_everything():
    """budget >= prompt: the hook is the identity (same keys, values, positions: same attention)."""
    batch = Batch()
    out, cache, _ = run_prefill(methods.get("nacl", budget=64, window_size=4), batch)
    for b, n in enumerate(batch.lengths):
        for k in range(batch.kv):
            assert kept(out, b, k) == list(range(n))
            for name in ("k", "v", "pos"):
                got, want = np.asarray(getattr(out, name)[b, k, :n]), np.asarray(getattr(cache, name)[b, k, :n])
                np.testing.assert_array_equal(got, want)


def test_batch_equals_vmap_equals_loop():
    assert_batch_equals_loop(methods.get("nacl", budget=10, window_size=3), Batch(lengths=(30, 17, 24)))


@pytest.mark.parametrize(
    "args,name",
    [
        (dict(budget=16, window_size=0), "window_size"),
        (dict(budget=16, window_size=-4), "window_size"),
        (dict(budget=16, window_size=12, sink_size=4), "window_size"),
        (dict(budget=16, sink_size=-1), "sink_size"),
        (dict(budget=16, window_size=4, random_ratio=1.5), "random_ratio"),
        (dict(budget=16, window_size=4, random_ratio=-0.1), "random_ratio"),
        (dict(budget=16, window_size=4, temperature=0.0), "temperature"),
        (dict(budget=16, window_size=4, seed=-1), "seed"),
        (dict(budget=16, window_size=4, group_reduce="sum"), "group_reduce"),
        (dict(window_size=4), "budget"),
    ],
)
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("nacl", **args)


def test_end_to_end_generate():
    lengths = (40, 23, 31)
    generate_and_check(
        methods.get("nacl", budget=12, window_size=4), lengths, prompt_kept=lambda layer, b: min(12, lengths[b])
    )
