"""CapKV: kept positions against the NumPy float64 reference of the weighted leverage (one shot and two chunks),
the solve against float64, batching, budgets, hyperparameter checks, end to end."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, assert_batch_equals_loop, assert_keeps_everything, assert_same_set, kept
from reference_scorers import capkv

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, per_example_budget
from kvjax.methods.capkv import weighted_leverage
from kvjax.runtime import step as step_api

INV_FREQ = (1.0 / 100.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
BUDGET = 11


def _prefill(method, batch):
    capacity = method.capacity(batch.t, 3)
    step = dataclasses.replace(batch.step(method, capacity), inv_freq=jnp.asarray(INV_FREQ))
    return jax.jit(method.prefill)(batch.cache(capacity), batch.qj(), step)


def _reference(method, batch, b, n, held=None):
    return capkv(batch.q[b].astype(np.float64), batch.k[b].astype(np.float64), batch.v[b].astype(np.float64), n,
                 INV_FREQ.astype(np.float64), held=held, n_future=method.n_future_positions, n_sink=method.n_sink,
                 tau=method.tau, eps=method.epsilon, normalize=method.normalize_alignment)


def _assert_top(got, row, budget):
    want = sorted(sorted(row, key=lambda j: (-row[j], j))[:budget])
    assert_same_set(got, want, {j: x for j, x in row.items() if np.isfinite(x)}, tol=1e-4)


@pytest.mark.parametrize("args", [{}, dict(n_future_positions=64, tau=2.0, n_sink=2),
                                  dict(n_future_positions=8, tau=0.5, epsilon=0.1, n_sink=0),
                                  dict(normalize_alignment=False, tau=0.2)])
def test_keeps_the_reference_top_scores(args):
    batch = Batch()
    method = methods.get("capkv", budget=BUDGET, **args)
    out = _prefill(method, batch)
    for b, n in enumerate(batch.lengths):
        scores = _reference(method, batch, b, int(n))
        for k in range(batch.kv):
            _assert_top(kept(out, b, k), scores[k], BUDGET)


def test_two_chunks_score_the_held_slots_with_every_query_seen():
    """Chunk 1 (positions 0..19) compresses to the budget with its own queries; chunk 2 scores what is held plus
    its tokens with the anchor of all the queries so far and the capacity matrix of the slots then held."""
    batch, chunk = Batch(), 20
    method = methods.get("capkv", budget=BUDGET, n_future_positions=32, n_sink=2)
    spec = CacheSpec(batch=len(batch.lengths), kv_heads=batch.kv, capacity=method.capacity(batch.t, 3),
                     num_heads=batch.n, head_dim=batch.h, num_layers=1, dtype=jnp.float32)
    cache = step_api.init_cache(method, spec).layer(0)
    budget = jnp.asarray(per_example_budget(method, batch.lengths))
    held = []
    for start in (0, chunk):
        rows = slice(start, start + chunk)
        _, cache = step_api.prefill_layer(
            method, cache, jnp.asarray(batch.q[:, rows]), jnp.asarray(batch.k[:, rows]),
            jnp.asarray(batch.v[:, rows]), jnp.asarray(batch.pos[:, rows]), budget, layer=0,
            inv_freq=jnp.asarray(INV_FREQ), num_layers=1, final_chunk=start > 0)
        for b, n in enumerate(batch.lengths):
            seen = min(int(n), start + chunk)
            before = held[b] if start else [list(range(seen))] * batch.kv
            now = [sorted(h + list(range(start, seen))) for h in before] if start else before
            scores = _reference(method, batch, b, seen, held=now)
            for k in range(batch.kv):
                _assert_top(kept(cache, b, k), scores[k], min(BUDGET, seen))
            if not start:
                held.append([kept(cache, b, k) for k in range(batch.kv)])


@pytest.mark.parametrize("block", [512, 16])  # one block; blocks of 16 over 50 slots (a padded last block)
def test_the_leverage_solve_matches_float64(block):
    rng = np.random.default_rng(2)
    b, kv, g, c, h = 2, 2, 3, 50, 16
    u = rng.standard_normal((b, kv, c, h)) * 2
    w = np.exp(rng.uniform(-6, 0, (b, kv, g, c)))
    ok = rng.uniform(size=(b, kv, c)) > 0.2
    got = np.asarray(weighted_leverage(jnp.asarray(w * ok[:, :, None], jnp.float32), jnp.asarray(u, jnp.float32),
                                       jnp.asarray(ok), 1e-6, block=block))
    for idx in np.ndindex(b, kv, g):
        bi, ki, _ = idx
        keep = ok[bi, ki]
        a = np.eye(h) + np.einsum("c,ci,cj->ij", (w[idx] + 1e-6) * keep, u[bi, ki], u[bi, ki])
        want = w[idx] * np.einsum("ci,ij,cj->c", u[bi, ki], np.linalg.inv(a), u[bi, ki])
        np.testing.assert_allclose(got[idx][keep], want[keep], rtol=2e-5, atol=1e-7)


def test_budget_above_prompt_and_batching():
    assert_keeps_everything(methods.get("capkv", budget=50), Batch())
    assert_batch_equals_loop(methods.get("capkv", compression_ratio=0.6), Batch(lengths=(30, 17, 24)))


@pytest.mark.parametrize("args,name", [(dict(budget=4), "n_sink"), (dict(budget=8, n_future_positions=0),
                                                                    "n_future_positions"),
                                       (dict(budget=8, tau=-1.0), "tau"), (dict(budget=8, tau=float("inf")), "tau"),
                                       (dict(budget=8, epsilon=-1e-6), "epsilon"),
                                       (dict(budget=8, normalize_alignment=1), "normalize_alignment")])
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("capkv", **args)


def test_end_to_end_chunked_generate():
    from baseline_refs import generate_and_check

    generate_and_check(methods.get("capkv", budget=9, n_future_positions=16), chunk_size=16,
                       prompt_kept=lambda layer, b: 9)
