"""CriticalKV / CriticalAdaKV: kept positions against a NumPy float64 reference of the two-stage selection with
`||v W_o||_1` (base: ExpectedAttention without its value norm, whose own reference gives the base scores, and the
default SnapKV, whose window votes enter as attention weights); the step API refuses to run them without the output
projection."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, assert_batch_equals_loop, generate_and_check, kept, pool, ref_adaptive
from reference_scorers import criticalkv_keep, expected_attention, value_output_norms

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.runtime import step as step_api

BASE = dict(base="expected_attention", base_args={"use_vnorm": False, "n_future_positions": 16, "n_sink": 2})
W_O = np.asarray(jnp.asarray(np.random.default_rng(3).standard_normal((8, 16, 24)), jnp.bfloat16).astype(jnp.float32))


def _prefill(method, batch):
    capacity = method.capacity(batch.t, 3)
    step = dataclasses.replace(batch.step(method, capacity), inv_freq=jnp.ones(8, jnp.float32),
                               out_proj=jnp.asarray(W_O))
    return jax.jit(method.prefill)(batch.cache(capacity), batch.qj(), step)


def _base_and_norms(batch, b, n):
    base = expected_attention(batch.q[b].astype(np.float64), batch.k[b].astype(np.float64),
                              batch.v[b].astype(np.float64), n, np.ones(8), n_future=16, n_sink=2, vnorm=False)
    return base, value_output_norms(batch.v[b].astype(np.float64), W_O.astype(np.float64), n)


def test_criticalkv_two_stages():
    batch = Batch()
    out = _prefill(methods.get("criticalkv", budget=12, **BASE), batch)
    for b, n in enumerate(batch.lengths):
        base, norms = _base_and_norms(batch, b, int(n))
        for k in range(batch.kv):
            assert kept(out, b, k) == criticalkv_keep(base[k], norms[k], 12), (b, k)


def test_criticalkv_over_snapkv_reads_the_window_mean():
    """Stage two adds `epsilon` to SnapKV's score, so the score's scale matters: it is the window rows' mean
    attention weight (the CriticalKV authors' Ada-KV code and kvpress), not the paper's summed votes. An epsilon
    near the weights' size tells the two apart."""
    batch = Batch()
    window, budget, eps = 4, 12, 0.05
    out = _prefill(methods.get("criticalkv", budget=budget, epsilon=eps, base_args={"window_size": window}), batch)
    votes = batch.votes(window, row_reduce="mean")
    for b, n in enumerate(batch.lengths):
        n = int(n)
        norms = value_output_norms(batch.v[b].astype(np.float64), W_O.astype(np.float64), n)
        for k in range(batch.kv):
            base = np.full(n, np.inf)
            base[: n - window] = pool(votes[b, k, : n - window], 5, "avg")
            assert kept(out, b, k) == criticalkv_keep(base, norms[k], budget, eps=eps), (b, k)


def test_criticaladakv_head_budgets_then_two_stages():
    batch = Batch()
    out = _prefill(methods.get("criticaladakv", budget=10, max_head_share=4.0, **BASE), batch)
    for b, n in enumerate(batch.lengths):
        n = int(n)
        base, norms = _base_and_norms(batch, b, n)
        protect = np.isinf(base)
        finite = np.where(protect, 0.0, base)
        per_head = ref_adaptive(finite, np.ones_like(protect), protect, np.tile(np.arange(n), (batch.kv, 1)),
                                min(10, n), min(40, n), 0.2)
        budget = min(10, n)
        for k in range(batch.kv):
            guard = int(protect[k].sum()) + max(int(np.floor(np.float32(0.2) * np.float32(budget - 2))), 1)
            assert kept(out, b, k) == criticalkv_keep(base[k], norms[k], per_head[k], at_least_one=False,
                                                      floor=guard), (b, k)


def test_batching():
    batch = Batch(lengths=(30, 17, 24))
    method = methods.get("criticalkv", compression_ratio=0.6, **BASE)
    capacity = method.capacity(batch.t, 3)
    # assert_batch_equals_loop builds its own step: give the method the output projection through it
    original = batch.step

    def step_with_w_o(m, c, layer=0, num_layers=4):
        return dataclasses.replace(original(m, c, layer, num_layers), out_proj=jnp.asarray(W_O))

    batch.step = step_with_w_o
    assert capacity == method.capacity(batch.t, 3)
    assert_batch_equals_loop(method, batch)


def test_needs_the_output_projection():
    batch = Batch()
    method = methods.get("criticalkv", budget=40)
    assert "out_proj" in method.layer_inputs
    cache = batch.cache(method.capacity(batch.t, 3))
    k, v = jnp.swapaxes(cache.k, 1, 2)[:, : batch.t], jnp.swapaxes(cache.v, 1, 2)[:, : batch.t]
    with pytest.raises(ConfigError, match="out_proj"):
        step_api.prefill_layer(method, cache, batch.qj(), k, v, jnp.asarray(batch.pos), jnp.full(3, 40), layer=0,
                               inv_freq=jnp.ones(8), num_layers=1)


@pytest.mark.parametrize("args,name", [(dict(first_stage_ratio=1.5), "first_stage_ratio"),
                                       (dict(epsilon=-1.0), "epsilon"), (dict(base="full"), "base"),
                                       (dict(base_args={"budget": 3}), "budget")])
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("criticalkv", budget=40, **args)


def test_end_to_end_generate():
    generate_and_check(methods.get("criticalkv", budget=9, base_args={"window_size": 4}),
                       prompt_kept=lambda layer, b: 9)
