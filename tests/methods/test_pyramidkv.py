"""PyramidKV: the per-layer schedule against the paper's arithmetic sequence, per-layer selection
against the SnapKV reference, memory accounting, and end to end through `kvjax.generate`."""

import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    assert_keeps_everything,
    assert_same_set,
    generate_and_check,
    kept,
    pool,
    run_prefill,
    snapkv_keep,
)

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.pyramidkv import pyramid_budgets


def reference_schedule(budget, n, layers, window, beta):
    """Paper / KVCache-Factory rules in real numbers: top = base // beta, bottom = 2 base - top,
    clamped to the prompt, uniform when n < 2 base; returns (real per-layer budgets, uniform?)."""
    w = min(window, budget)
    base = budget - w
    top, bottom = base // beta, 2 * base - base // beta
    if bottom >= n - w:
        bottom, top = n - w, 2 * base - (n - w)
    if n < 2 * base or layers == 1:
        return np.full(layers, float(budget)), True
    return np.array([bottom - (bottom - top) * i / (layers - 1) for i in range(layers)]) + w, False


@pytest.mark.parametrize("layers", [1, 2, 5, 32, 80])
@pytest.mark.parametrize("budget,n", [(128, 4096), (2048, 4096), (300, 500), (96, 100), (40, 40), (4, 100)])
def test_schedule_is_the_papers_arithmetic_sequence_with_exact_mean(layers, budget, n):
    got = pyramid_budgets(jnp.asarray([budget]), jnp.asarray([n]), num_layers=layers, window=32, beta=20)
    got = np.asarray(got)[:, 0]
    real, uniform = reference_schedule(budget, n, layers, 32, 20)
    assert got.sum() == layers * budget  # mean budget == global budget, exactly
    assert (np.diff(got) <= 0).all()  # shrinks from the bottom layer to the top
    assert np.abs(got - real).max() < 1.0
    assert got.max() <= n and got.min() >= min(32, budget)
    if not uniform:
        assert got[0] == round(real[0]) and got[-1] == round(real[-1])


def test_schedule_is_per_example():
    budgets = jnp.asarray([64, 64, 20])
    seen = jnp.asarray([1000, 100, 1000])
    got = np.asarray(pyramid_budgets(budgets, seen, num_layers=4, window=8, beta=20))
    assert got[:, 0].tolist() == [118, 82, 46, 10]  # base 56: bottom 112 - 2, top 2, + window 8
    assert got[:, 2].tolist() == [32, 24, 16, 8]
    assert got[:, 1].tolist() == [64, 64, 64, 64]  # 100 < 2 * base: uniform
    assert got.sum(0).tolist() == [256, 256, 80]


@pytest.mark.parametrize("layer", [0, 1, 3])
def test_each_layer_is_snapkv_at_its_budget(layer):
    batch = Batch()
    method = methods.get("pyramidkv", budget=12, window_size=4)
    out, _, step = run_prefill(method, batch, layer=layer, num_layers=4)
    schedule = np.asarray(pyramid_budgets(step.budget, jnp.asarray(batch.lengths), num_layers=4, window=4, beta=20))
    votes = batch.votes(4)
    for b, n in enumerate(batch.lengths):
        layer_budget = int(schedule[layer, b])
        assert out.length[b].tolist() == [layer_budget] * batch.kv
        for k in range(batch.kv):
            pooled = pool(votes[b, k, : n - 4], 5, "avg")
            assert_same_set(kept(out, b, k), snapkv_keep(votes[b, k], n, layer_budget, 4, 5, "avg"),
                            {j: pooled[j] for j in range(n - 4)})


def test_capacity_is_the_largest_layer_budget_and_memory_is_reported():
    method = methods.get("pyramidkv", budget=1024, window_size=32)
    snap = methods.get("snapkv", budget=1024, window_size=32)
    # base 992: bottom layer 2 * 992 - 49 = 1935 non-window tokens.
    assert method.capacity(32768, 100) == 1935 + 32 + 100
    per_slot = 2 * 8 * 128 * 2  # K and V, 8 KV heads, head_dim 128, bf16
    pyramid_bytes = 32 * method.capacity(32768, 100) * per_slot
    snap_bytes = 32 * snap.capacity(32768, 100) * per_slot
    full_bytes = 32 * (32768 + 100) * per_slot
    # Every layer's buffers have one capacity, the bottom layer's: ~1.84x SnapKV at the same mean budget
    # (and 100 new tokens), still 15x below the full cache.
    assert 1.8 < pyramid_bytes / snap_bytes < 1.9 and full_bytes / pyramid_bytes > 15
    # Short prompts: never more than the prompt.
    assert method.capacity(500, 1) <= 501


def test_budget_above_prompt_and_batching():
    assert_keeps_everything(methods.get("pyramidkv", budget=64, window_size=4), Batch())
    assert_batch_equals_loop(methods.get("pyramidkv", budget=10, window_size=3), Batch(lengths=(30, 17, 24)), layer=1)


@pytest.mark.parametrize(
    "args,name", [(dict(budget=64, beta=0), "beta"), (dict(budget=8, window_size=8), "window_size")]
)
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("pyramidkv", **args)


def test_end_to_end_generate_layers_follow_the_pyramid():
    lengths = (40, 23, 31)
    method = methods.get("pyramidkv", budget=12, window_size=4)
    schedule = pyramid_budgets(jnp.asarray([12, 12, 12]), jnp.asarray(lengths), num_layers=4, window=4, beta=20)
    schedule = np.asarray(schedule)
    result = generate_and_check(method, lengths, num_layers=4, prompt_kept=lambda layer, b: int(schedule[layer, b]))
    prompt_part = (np.asarray(result.cache.stacked().pos) >= 0).sum(-1) - 4  # minus the 4 fed-back tokens
    assert (prompt_part.mean(0) == 12).all()  # the mean over layers is the budget
    assert result.cache.capacity == method.capacity(64, 5)
