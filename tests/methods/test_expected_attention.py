"""ExpectedAttention: kept positions against the NumPy float64 reference of the paper's closed form, the running
query statistics of chunked prefill, batching, end to end."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, assert_batch_equals_loop, assert_keeps_everything, assert_keeps_reference_top
from reference_scorers import expected_attention, rope_matrix

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec
from kvjax.methods.common import merge_statistics, observe_queries, query_statistics_state

INV_FREQ = (1.0 / 100.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)


def _prefill(method, batch):
    capacity = method.capacity(batch.t, 3)
    cache = batch.cache(capacity)
    step = dataclasses.replace(batch.step(method, capacity), inv_freq=jnp.asarray(INV_FREQ))
    return jax.jit(method.prefill)(cache, batch.qj(), step)


@pytest.mark.parametrize("args", [dict(n_future_positions=64), dict(n_future_positions=8, use_covariance=False,
                                                                     use_vnorm=False, n_sink=2)])
def test_keeps_the_reference_top_scores(args):
    batch = Batch()
    method = methods.get("expected_attention", budget=11, **args)
    out = _prefill(method, batch)
    ref = dict(n_future=method.n_future_positions, n_sink=method.n_sink, covariance=method.use_covariance,
               vnorm=method.use_vnorm)
    assert_keeps_reference_top(out, batch.lengths, lambda b, n: expected_attention(
        batch.q[b].astype(np.float64), batch.k[b].astype(np.float64), batch.v[b].astype(np.float64), n,
        INV_FREQ.astype(np.float64), **ref), 11)


def test_merged_statistics_equal_one_pass():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 24, 3, 4)) * 3 + 1, jnp.float32)
    rows = jnp.asarray(np.arange(24)[None] < np.array([[24], [17]]))
    zero = {"query_count": jnp.zeros(2), "query_mean": jnp.zeros((2, 3, 4)), "query_m2": jnp.zeros((2, 3, 4, 4))}
    whole = merge_statistics(zero, x, rows, True)
    parts = zero
    for lo, hi in ((0, 5), (5, 16), (16, 24)):
        parts = merge_statistics(parts, x[:, lo:hi], rows[:, lo:hi], True)
    for name in whole:
        np.testing.assert_allclose(np.asarray(parts[name]), np.asarray(whole[name]), rtol=1e-5, atol=1e-4)
    xs = np.asarray(x, np.float64)
    for b, n in enumerate((24, 17)):
        centred = xs[b, :n] - xs[b, :n].mean(0)
        np.testing.assert_allclose(np.asarray(whole["query_m2"][b]), np.einsum("tni,tnj->nij", centred, centred),
                                   rtol=1e-5, atol=1e-4)


def test_bf16_queries_are_unrotated_in_float32():
    # a bf16 query rotated back and stored in bf16 is rounded twice; the statistics must see the exact pre-RoPE rows
    rng = np.random.default_rng(2)
    t, n, h = 40, 2, 16
    inv_freq = (1.0 / 100.0 ** (np.arange(0, h, 2) / h)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((1, t, n, h)) * 4, jnp.bfloat16)
    state = query_statistics_state(CacheSpec(1, 1, t, n, h, 1, jnp.bfloat16), covariance=False)
    cache = types.SimpleNamespace(state=state, replace=lambda state: state)  # observe_queries reads and replaces
    step = types.SimpleNamespace(positions=jnp.arange(t, dtype=jnp.int32)[None], inv_freq=jnp.asarray(inv_freq))
    mean = np.asarray(observe_queries(cache, q, step, 0, covariance=False)["query_mean"][0])
    rows = np.asarray(q.astype(jnp.float32), np.float64)[0]
    want = np.mean([[rope_matrix(j, inv_freq.astype(np.float64)).T @ rows[j, i] for i in range(n)] for j in range(t)],
                   axis=0)
    np.testing.assert_allclose(mean, want, rtol=0, atol=2e-5)


def test_budget_above_prompt_and_batching():
    assert_keeps_everything(methods.get("expected_attention", budget=50), Batch())
    assert_batch_equals_loop(methods.get("expected_attention", compression_ratio=0.6), Batch(lengths=(30, 17, 24)))


@pytest.mark.parametrize("args,name", [(dict(budget=4), "n_sink"), (dict(budget=8, n_future_positions=0),
                                                                    "n_future_positions"),
                                       (dict(budget=8, epsilon=-1.0), "epsilon")])
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("expected_attention", **args)


def test_end_to_end_chunked_generate():
    from baseline_refs import generate_and_check

    generate_and_check(methods.get("expected_attention", budget=9, n_future_positions=16), chunk_size=16,
                       prompt_kept=lambda layer, b: 9)
