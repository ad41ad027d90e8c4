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


@pytest.mark.parametrize("chunk", [None, 16])
def test_end_to_end_with_a_ratio_each_layer_at_its_own_size(chunk):
    lengths = (40, 23, 31)
    method = methods.get("pyramidkv", compression_ratio=0.6, window_size=4)
    budgets = [method.prompt_budget(n) for n in lengths]  # 16, 9, 12: each example's own
    schedule = np.asarray(pyramid_budgets(jnp.asarray(budgets), jnp.asarray(lengths), num_layers=4, window=4, beta=20))
    result = generate_and_check(method, lengths, num_layers=4, chunk_size=chunk,
                                prompt_kept=lambda layer, b: int(schedule[layer, b]))
    caps = [layer.capacity for layer in result.cache.layers]
    assert caps == list(cache_layer_capacities(method, 64, 5, 4)) and max(caps) <= method.capacity(64, 5)
    assert sum(caps) < 4 * method.capacity(64, 5)


def _most_kept(method, prompt_len: int, layers: int) -> np.ndarray:
    """`[L]` the most each layer keeps over every prompt length up to `prompt_len` and every count of tokens seen
    of it (a chunked prefill's chunk ends): `min(seen, schedule)` at the prompt's own budget, every pair enumerated
    and scheduled by the traced code in one call."""
    pairs = np.array([(n, seen) for n in range(1, prompt_len + 1) for seen in range(1, n + 1)])
    budget = np.array([method.prompt_budget(int(n)) for n in pairs[:, 0]])
    schedule = np.asarray(pyramid_budgets(jnp.asarray(budget), jnp.asarray(pairs[:, 1]), num_layers=layers,
                                          window=method.window_size, beta=method.beta))
    return np.minimum(schedule, pairs[None, :, 1]).max(axis=1)


_SIZES = [dict(budget=24, window_size=4, beta=20), dict(budget=24, window_size=4, beta=3),
          dict(budget=10, window_size=6, beta=2), dict(budget=40, window_size=32, beta=20),
          dict(budget=64, window_size=8, beta=20), dict(budget=7, window_size=2, beta=1),
          dict(budget=3, window_size=2, beta=2)]  # below the window: the bottom layer clamps under the mean
_RATIOS = [dict(compression_ratio=r, window_size=w, beta=beta) for r, w, beta in
           [(0.0, 4, 20), (0.3, 4, 20), (0.45, 2, 3), (0.49, 1, 1), (0.5, 4, 20), (0.5, 8, 2), (0.55, 2, 20),
            (0.75, 4, 3), (0.9, 2, 20), (0.95, 8, 1)]]


@pytest.mark.parametrize("layers", [1, 2, 5, 8])
@pytest.mark.parametrize("prompt_len", [1, 17, 64, 120])
@pytest.mark.parametrize("args", _SIZES + _RATIOS, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_each_layer_is_allocated_at_the_most_it_can_keep(layers, prompt_len, args):
    method = methods.get("pyramidkv", **args)
    got = np.asarray(method.layer_capacities(prompt_len, 3, layers)) - 3
    most = _most_kept(method, prompt_len, layers)
    np.testing.assert_array_equal(got, most)  # never too small, and no larger than some prompt and chunk end keeps
    assert got.max() <= method.max_layer_budget(prompt_len)  # never above the uniform allocation


@pytest.mark.parametrize("args", [dict(budget=256, window_size=32), dict(compression_ratio=0.48, window_size=32),
                                  dict(compression_ratio=0.8, window_size=32, beta=3)])
def test_the_most_kept_at_32_layers_and_a_thousand_tokens(args):
    method = methods.get("pyramidkv", **args)
    np.testing.assert_array_equal(np.asarray(method.layer_capacities(1000, 0, 32)), _most_kept(method, 1000, 32))


def test_layer_sizes_save_a_third_at_a_fixed_budget():
    method = methods.get("pyramidkv", budget=1024, window_size=32)
    sizes = method.layer_capacities(32768, 100, 32)
    assert sizes[0] == method.capacity(32768, 100) and sizes[-1] == 1024 + 100  # bottom: its pyramid step; top: b
    assert list(sizes) == sorted(sizes, reverse=True)
    assert 0.6 < sum(sizes) / (32 * method.capacity(32768, 100)) < 0.7


@pytest.mark.parametrize("ratio,lo,hi", [(0.5, 0.6, 0.7), (0.75, 0.6, 0.7), (0.9, 0.6, 0.7),
                                         (0.3, 0.69, 0.71), (0.1, 0.89, 0.91)])
def test_layer_sizes_with_a_ratio(ratio, lo, hi):
    """From half the prompt evicted the pyramid saves a third, as a fixed budget; below it a long prompt's schedule
    is uniform (`n < 2 base`, KVCache-Factory's rule), so every layer needs only the budget `b(n)`, not the bottom
    layer's step (which the prompt clamps at about `n`)."""
    method = methods.get("pyramidkv", compression_ratio=ratio, window_size=32)
    sizes = method.layer_capacities(32768, 0, 32)
    bottom = method.capacity(32768, 0)
    assert list(sizes) == sorted(sizes, reverse=True) and sizes[-1] == method.prompt_budget(32768)
    assert lo < sum(sizes) / (32 * bottom) < hi
    for shorter in (1, 100, 1000, 4096, 20000):  # no size shrinks as the prompt grows (the engine's slots)
        assert all(a <= b for a, b in zip(method.layer_capacities(shorter, 0, 32), sizes, strict=True))


def test_the_pyramid_search_is_quick_at_the_grouping_prompt():
    """`Method.layer_capacities` runs at `GROUPING_PROMPT` (2^20 tokens) every prefill plan: a few pairs, also with a
    ratio just under a half, where the longest prompt that reaches the pyramid is furthest below."""
    import time

    from kvjax.runtime.stages import GROUPING_PROMPT
    for args in (dict(budget=2048), dict(compression_ratio=0.4999), dict(compression_ratio=0.7)):
        method = methods.get("pyramidkv", window_size=64, **args)
        start = time.perf_counter()
        sizes = method.layer_capacities(GROUPING_PROMPT, 0, 32)
        assert time.perf_counter() - start < 1.0 and len(sizes) == 32
