"""The engine's per-slot sampler (`kvjax.engine.decode.sample`) against a NumPy nucleus written from its definition.

Oracles: the nucleus mask equals a NumPy reference (the most likely tokens whose probability reaches `top_p`, ties
at its edge included); draws over many seeds follow the renormalised nucleus distribution (within 4.5 standard
errors per token) and never leave it; a slot's draw does not depend on whether another slot makes the step sort the
vocabulary; greedy slots take the argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine.decode import nucleus, sample
from kvjax.engine.slots import empty_slots


def reference_nucleus(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Which tokens of one row are in its nucleus."""
    if top_p >= 1.0:
        return np.ones(logits.shape, bool)
    ranked = np.sort(logits)[::-1].astype(np.float64)
    probs = np.exp(ranked - ranked.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    kept = int(np.sum(before < top_p))
    return logits >= ranked[kept - 1]


def _slots(logits, temperature, top_p, seed, active=None):
    n, vocab = logits.shape
    base = empty_slots(n, vocab, 1)
    return base.replace(logits=jnp.asarray(logits, jnp.float32), temperature=jnp.asarray(temperature, jnp.float32),
                        top_p=jnp.asarray(top_p, jnp.float32), seed=jnp.asarray(seed, jnp.uint32),
                        active=jnp.ones(n, bool) if active is None else jnp.asarray(active))


def test_nucleus_matches_the_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 50)).astype(np.float32) * 3
    logits[0, :5] = logits[0].max() + 1.0  # five tokens tie for the top: a nucleus of one token keeps all five
    top_p = rng.uniform(0.05, 1.0, 64).astype(np.float32)
    top_p[:3] = (0.0001, 1.0, 0.9999)
    got = np.isfinite(np.asarray(nucleus(jnp.asarray(logits), jnp.asarray(top_p))))
    assert got[0].sum() == 5 and got[0, :5].all()
    for row, p in enumerate(top_p):
        np.testing.assert_array_equal(got[row], reference_nucleus(logits[row], float(p)), err_msg=f"row {row}")


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_draws_follow_the_nucleus_distribution(top_p):
    draws, temperature = 20000, 0.7
    row = np.asarray([2.0, 1.5, 1.2, 0.3, -0.5, -1.0], np.float32)
    slots = _slots(np.tile(row, (draws, 1)), [temperature] * draws, [top_p] * draws, np.arange(draws))
    tokens = np.asarray(jax.jit(sample, static_argnums=1)(slots, True))
    keep = reference_nucleus(row / temperature, top_p)
    want = np.where(keep, np.exp((row - row.max()) / temperature), 0.0)
    want /= want.sum()
    got = np.bincount(tokens, minlength=row.size) / draws
    assert np.all(got[~keep] == 0)
    error = np.sqrt(want * (1 - want) / draws)
    assert np.all(np.abs(got - want) <= 4.5 * error + 1e-12), (got, want)


def test_a_draw_does_not_depend_on_whether_another_slot_sorts():
    """Slot 0 (top_p = 1) draws the same token whether slot 1 samples with top_p < 1 (the step sorts), is greedy,
    or is not active."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 300)).astype(np.float32)
    run = jax.jit(sample, static_argnums=1)
    for seed in range(20):
        alone = run(_slots(logits, [1.0, 0.0], [1.0, 0.5], [seed, 3]), True)[0]
        sorting = run(_slots(logits, [1.0, 0.9], [1.0, 0.5], [seed, 3]), True)
        idle = run(_slots(logits, [1.0, 0.9], [1.0, 0.5], [seed, 3], active=[True, False]), True)[0]
        assert int(alone) == int(sorting[0]) == int(idle), seed
        assert np.isfinite(np.asarray(nucleus(jnp.asarray(logits[1:]), jnp.asarray([0.5]))))[0, int(sorting[1])]


def test_greedy_slots_take_the_argmax():
    logits = np.random.default_rng(2).normal(size=(4, 40)).astype(np.float32)
    for sampling in (False, True):
        tokens = sample(_slots(logits, [0.0] * 4, [0.3] * 4, np.arange(4)), sampling)
        np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
