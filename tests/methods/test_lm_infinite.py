"""LM-Infinite against a NumPy transcription of the paper's Lambda-shaped attention (global + local
branches, relative distance capped) computed from raw pre-RoPE keys, no rounding drift of the
re-rotated global keys over a long bf16 decode, invariants, batching, and end to end through
`kvjax.generate`."""

import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch
from baseline_refs_decode import (
    DecodeRun,
    assert_full_attention,
    generate_rolling,
    lm_infinite_reference,
    rope_inv_freq,
    rope_np,
)

from kvjax import methods
from kvjax.errors import ConfigError

STEPS = 24
INV_FREQ = rope_inv_freq(16)


@pytest.mark.parametrize(
    "args,lengths",
    [
        (dict(budget=14, n_global=4), (40, 9, 31)),  # InfLLM's ceiling: n_local - 1; a short prompt grows
        # per-example windows; a ceiling above the window for the shorter prompts
        (dict(compression_ratio=0.6, n_global=3, max_distance=20), (40, 23, 31)),
    ],
)
def test_matches_lambda_attention_reference(args, lengths):
    method = methods.get("lm_infinite", **args)
    batch = Batch(lengths=lengths, dtype=jnp.float32)
    run = DecodeRun(method, batch, STEPS, inv_freq=INV_FREQ)
    g = batch.n // batch.kv
    if "budget" in args:
        assert run.capacity == args["budget"] + 1
    for b, n in enumerate(lengths):
        limit = args.get("budget") or method.prompt_budget(n)
        n_local = limit - method.n_global
        ceiling = max(args.get("max_distance", 0), n_local - 1)
        assert run.kept_after(-1, b, 0) == [p for p in range(n) if p < method.n_global or p > n - 1 - n_local]
        for t in range(STEPS):
            for k in range(batch.kv):
                held, out = lm_infinite_reference(
                    run, t, b, k, n_global=method.n_global, n_local=n_local, max_distance=ceiling, inv_freq=INV_FREQ
                )
                assert run.kept_after(t, b, k) == held, (b, k, t)
                np.testing.assert_allclose(run.outs[t][b, k * g : (k + 1) * g], out, rtol=1e-4, atol=1e-4)
    if "compression_ratio" in args:  # per-example budgets: batched step == vmap of one example
        run.assert_vmap_equals_batch(STEPS - 1)


def test_ratio_budget_at_most_n_global_keeps_a_local_window_of_one():
    """A ratio budget `L <= n_global` (a short prompt's) keeps `L - 1` global tokens and the newest one: the reference
    with those sizes, at every step, and never more than `L` tokens."""
    method = methods.get("lm_infinite", compression_ratio=0.5, n_global=24)
    batch = Batch(lengths=(40, 23, 31), dtype=jnp.float32)
    run = DecodeRun(method, batch, 4, inv_freq=INV_FREQ)
    g = batch.n // batch.kv
    for b, n in enumerate(batch.lengths):
        limit = method.prompt_budget(int(n))
        assert limit <= method.n_global
        assert run.kept_after(-1, b, 0) == list(range(limit - 1)) + [n - 1]
        for t in range(4):
            for k in range(batch.kv):
                held, out = lm_infinite_reference(run, t, b, k, n_global=limit - 1, n_local=1, max_distance=0,
                                                  inv_freq=INV_FREQ)
                assert run.kept_after(t, b, k) == held, (b, k, t)
                np.testing.assert_allclose(run.outs[t][b, k * g : (k + 1) * g], out, rtol=1e-4, atol=1e-4)


def test_global_keys_do_not_drift_over_a_long_bf16_decode():
    """Each step rotates the global keys again; taking the rotation from the clean copy keeps them
    within one bf16 rounding of the exact key, however long the generation."""
    steps, n_global, budget = 160, 3, 8
    batch = Batch(lengths=(12, 5, 9))
    run = DecodeRun(methods.get("lm_infinite", budget=budget, n_global=n_global), batch, steps, inv_freq=INV_FREQ)
    cache = run.caches[-1]
    k_stored = np.asarray(cache.k, np.float64)
    pos = np.asarray(cache.pos)
    for b in range(3):
        r = int(run.positions[-1, b])
        for k in range(batch.kv):
            for slot in range(n_global):
                p = int(pos[b, k, slot])
                assert p == slot
                exact = rope_np(run.key(b, k, p), r - (budget - n_global - 1), INV_FREQ)
                err = np.linalg.norm(k_stored[b, k, slot] - exact) / np.linalg.norm(exact)
                assert err < 2.0**-7, (b, k, slot, err)


def test_budget_above_length_keeps_everything_and_attention_is_full():
    assert_full_attention(DecodeRun(methods.get("lm_infinite", budget=64, n_global=4), Batch(), 5))


@pytest.mark.parametrize(
    "args,name",
    [
        (dict(budget=16, n_global=-1), "n_global"),
        (dict(budget=16, n_global=16), "n_global"),
        (dict(budget=16, n_global=4, max_distance=0), "max_distance"),
        (dict(budget=16, n_global=4, max_distance=10), "max_distance"),
        (dict(n_global=4), "budget"),
        (dict(budget=16, compression_ratio=0.5), "budget"),
    ],
)
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("lm_infinite", **args)


def test_end_to_end_generate():
    lengths, max_new = (40, 9, 31), 8
    result, _, _ = generate_rolling(
        methods.get("lm_infinite", budget=12, n_global=4), lengths, max_new=max_new,
        held=lambda b: min(12, lengths[b] + max_new - 1),
    )
    pos = np.asarray(result.cache.stacked().pos)
    for b, n in enumerate(lengths):
        newest = n + max_new - 2
        want = sorted({p for p in range(newest + 1) if p < 4 or p > newest - 8})
        assert all(sorted(pos[layer, b, k][pos[layer, b, k] >= 0].tolist()) == want
                   for layer in range(2) for k in range(2))


def test_question_after_compression_below_n_global_decodes():
    """A ratio whose budget is under `n_global` (16:1 on a leaderboard prompt) with question tokens appended after
    compression: the appended tokens widen the cache past the clean global copies' width (a leaderboard run
    crashed there); the recorded (shared) prefill and the method's own prefill decode the same tokens."""
    from tiny import random_prompts, tiny_model

    import kvjax
    from kvjax.runtime import shared_prefill

    model = tiny_model()
    prompts, questions = random_prompts(21, (300, 280)), random_prompts(22, (5, 3))
    method = methods.get("lm_infinite", compression_ratio=0.9375)
    own = kvjax.prefill(model, prompts, method=method, max_new_tokens=4, question_ids=questions)
    layer = own.cache.layers[0]
    assert layer.state["sink_k"].shape[2] < layer.capacity < method.n_global  # the case that crashed
    shared = shared_prefill.prefill_from(model, shared_prefill.record(model, prompts, question_ids=questions),
                                         method, max_new_tokens=4)
    own_tokens = kvjax.decode(model, own, max_new_tokens=4)[0]
    np.testing.assert_array_equal(kvjax.decode(model, shared, max_new_tokens=4)[0], own_tokens)
