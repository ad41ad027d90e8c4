"""SnapKV against a NumPy transcription of the paper (votes of the observation window, pooling over
the prefix, top-k + window), invariants, batching, and end to end through `kvjax.generate`."""

import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    assert_keeps_everything,
    assert_kept_top_of_scores,
    assert_same_set,
    generate_and_check,
    kept,
    pool,
    run_prefill,
    snapkv_keep,
)

from kvjax import methods
from kvjax.errors import ConfigError


@pytest.mark.parametrize("pooling,group_reduce", [("avg", "mean"), ("max", "max")])
def test_matches_paper_reference(pooling, group_reduce):
    batch = Batch()
    method = methods.get("snapkv", budget=12, window_size=4, kernel_size=5, pooling=pooling, group_reduce=group_reduce)
    out, cache, step = run_prefill(method, batch)
    assert out.capacity == 12 + 3
    votes = batch.votes(4, group_reduce)
    for b, n in enumerate(batch.lengths):
        for k in range(batch.kv):
            want = snapkv_keep(votes[b, k], n, 12, 4, 5, pooling)
            pooled = pool(votes[b, k, : n - 4], 5, pooling)
            assert_same_set(kept(out, b, k), want, {j: pooled[j] for j in range(n - 4)})
            assert set(range(n - 4, n)) <= set(kept(out, b, k))  # the window is always kept
    assert_kept_top_of_scores(method, cache, batch.qj(), step, out)


def test_compression_ratio_per_example_and_window_above_budget():
    batch = Batch()
    out, _, _ = run_prefill(methods.get("snapkv", compression_ratio=0.5, window_size=4), batch)
    votes = batch.votes(4)
    for b, n in enumerate(batch.lengths):
        assert out.length[b].tolist() == [n // 2] * batch.kv
        for k in range(batch.kv):
            pooled = pool(votes[b, k, : n - 4], 5, "avg")
            assert_same_set(kept(out, b, k), snapkv_keep(votes[b, k], n, n // 2, 4, 5, "avg"),
                            {j: pooled[j] for j in range(n - 4)})
    # A ratio so high the budget falls below the window: keep the last `budget` tokens.
    method = methods.get("snapkv", compression_ratio=0.9, window_size=8)
    out, _, _ = run_prefill(method, batch)
    for b, n in enumerate(batch.lengths):
        budget = method.prompt_budget(int(n))
        assert budget < 8
        assert all(kept(out, b, k) == list(range(n - budget, n)) for k in range(batch.kv))


def test_budget_above_prompt_keeps_everything_and_attention_is_unchanged():
    assert_keeps_everything(methods.get("snapkv", budget=64, window_size=4), Batch())


def test_batch_equals_vmap_equals_loop():
    assert_batch_equals_loop(methods.get("snapkv", budget=10, window_size=3), Batch(lengths=(30, 17, 24)))


@pytest.mark.parametrize(
    "args,name",
    [
        (dict(budget=16, window_size=-1), "window_size"),
        (dict(budget=16, window_size=0), "window_size"),
        (dict(budget=16, window_size=16), "window_size"),
        (dict(budget=16, kernel_size=4), "kernel_size"),
        (dict(budget=16, kernel_size=0), "kernel_size"),
        (dict(budget=16, pooling="median"), "pooling"),
        (dict(budget=16, group_reduce="sum"), "group_reduce"),
        (dict(), "budget"),
        (dict(budget=-3), "budget"),
        (dict(compression_ratio=1.2), "compression_ratio"),
    ],
)
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("snapkv", **args)


def test_end_to_end_generate():
    lengths = (40, 23, 31)
    generate_and_check(
        methods.get("snapkv", budget=12, window_size=4), lengths,
        prompt_kept=lambda layer, b: min(12, lengths[b]),
    )


def test_end_to_end_chunked_prefill_compresses_every_chunk_to_the_budget():
    lengths = (40, 23, 31)
    result = generate_and_check(
        methods.get("snapkv", budget=11, window_size=4), lengths, chunk_size=16,
        prompt_kept=lambda layer, b: 11,
    )
    pos = np.asarray(result.cache.stacked().pos)
    for b, n in enumerate(lengths):  # each example's last window survives its last chunk
        assert all(set(range(n - 4, n)) <= set(pos[layer, b, k].tolist()) for layer in range(2) for k in range(2))


def test_end_to_end_budget_above_prompt_equals_full_cache():
    import jax.numpy as jnp
    from tiny import tiny_model

    import kvjax

    model = tiny_model(dtype=jnp.bfloat16, num_heads=8, num_kv_heads=2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (20, 13)]
    full = kvjax.generate(model, prompts, method="full", max_new_tokens=6)
    snap = kvjax.generate(model, prompts, method="snapkv", method_args=dict(budget=33, window_size=4), max_new_tokens=6)
    np.testing.assert_array_equal(snap.tokens, full.tokens)
