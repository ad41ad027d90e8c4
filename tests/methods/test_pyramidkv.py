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
from kvjax.runtime.stages import cache_layer_capacities


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


def test_capacity_is_the_bottom_layer_budget_and_memory_is_reported():
    method = methods.get("pyramidkv", budget=1024, window_size=32)
    snap = methods.get("snapkv", budget=1024, window_size=32)
    # base 992: bottom layer 2 * 992 - 49 = 1935 non-window tokens.
    assert method.capacity(32768, 100) == 1935 + 32 + 100
    per_slot = 2 * 8 * 128 * 2  # K and V, 8 KV heads, head_dim 128, bf16
    bottom_bytes = 32 * method.capacity(32768, 100) * per_slot
    pyramid_bytes = sum(cache_layer_capacities(method, 32768, 100, 32)) * per_slot
    snap_bytes = 32 * snap.capacity(32768, 100) * per_slot
    full_bytes = 32 * (32768 + 100) * per_slot
    # Every layer at the bottom layer's capacity would be ~1.84x SnapKV at the same mean budget (and 100 new tokens);
    # each layer at the most it keeps, grouped into a few sizes, is ~1.26x, 23x below the full cache.
    assert 1.8 < bottom_bytes / snap_bytes < 1.9
    assert 1.2 < pyramid_bytes / snap_bytes < 1.3 and full_bytes / pyramid_bytes > 20
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
    prompt_part = np.stack([(np.asarray(layer.pos) >= 0).sum(-1) for layer in result.cache.layers]) - 4  # minus the
    assert (prompt_part.mean(0) == 12).all()  # the mean over layers is the budget             4 fed-back tokens
    caps = [layer.capacity for layer in result.cache.layers]  # each layer at its own size, the bottom one's the most
    assert caps == list(method.layer_capacities(64, 5, 4)) and max(caps) == method.capacity(64, 5) > min(caps)


def _most_kept(method, prompt_len: int, layers: int) -> np.ndarray:
    """`[L]` the most each layer keeps over every prompt length up to `prompt_len` and every count of tokens seen
    of it (a chunked prefill's chunk ends): `min(seen, schedule)` at the prompt's own budget, every pair enumerated
    and scheduled by the traced code in one call."""
    pairs = np.array([(n, seen) for n in range(1, prompt_len + 1) for seen in range(1, n + 1)])
    budget = np.array([method.prompt_budget(int(n)) for n in pairs[:, 0]])
    schedule = np.asarray(pyramid_budgets(jnp.asarray(budget), jnp.asarray(pairs[:, 1]), num_layers=layers,
                                          window=method.window_size, beta=method.beta))
    return np.minimum(schedule, pairs[None, :, 1]).max(axis=1)


@pytest.mark.parametrize("layers", [1, 2, 5, 8])
@pytest.mark.parametrize("budget,window,beta,prompt_len", [(24, 4, 20, 90), (24, 4, 3, 40), (10, 6, 2, 64),
                                                           (40, 32, 20, 100), (64, 8, 20, 50), (7, 2, 1, 30)])
def test_each_layer_is_allocated_at_the_most_it_can_keep(layers, budget, window, beta, prompt_len):
    method = methods.get("pyramidkv", budget=budget, window_size=window, beta=beta)
    got = np.asarray(method.layer_capacities(prompt_len, 3, layers)) - 3
    most = _most_kept(method, prompt_len, layers)
    assert (got >= most).all(), (got, most)  # never too small ...
    assert (got <= np.maximum(most, min(budget, prompt_len) - 1)).all()  # ... and no larger than a shorter prompt needs
    assert got.max() <= method.max_layer_budget(prompt_len)  # never above the uniform allocation


def test_layer_sizes_save_a_third_at_a_fixed_budget_and_none_with_a_ratio():
    method = methods.get("pyramidkv", budget=1024, window_size=32)
    sizes = method.layer_capacities(32768, 100, 32)
    assert sizes[0] == method.capacity(32768, 100) and sizes[-1] == 1024 + 100  # bottom: its pyramid step; top: b
    assert list(sizes) == sorted(sizes, reverse=True)
    assert 0.6 < sum(sizes) / (32 * method.capacity(32768, 100)) < 0.7
    assert methods.get("pyramidkv", compression_ratio=0.5).layer_capacities(32768, 100, 32) is None
