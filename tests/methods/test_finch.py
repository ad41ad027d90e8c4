"""Finch against a NumPy float64 transcription of the paper (the question's causal attention, each row weighted by
the keys it sees, averaged over rows and the GQA group; the question kept; top-k over the whole prompt or per
segment quota; RoPE re-rotation of the kept keys), invariants, batching, and end to end through `kvjax.generate`."""

import jax
import jax.numpy as jnp
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
    run_prefill,
)
from reference_scorers import finch_keep, finch_scores, rope_matrix

from kvjax import methods
from kvjax.errors import ConfigError


def _reference(batch: Batch, b: int, window: int, normalize: bool = True) -> np.ndarray:
    n = int(batch.lengths[b])
    return finch_scores(batch.q[b, :n], batch.k[b, :n], n, window, normalize)


@pytest.mark.parametrize("normalize", [True, False])
def test_matches_paper_reference(normalize):
    batch = Batch()
    method = methods.get("finch", budget=12, window_size=4, normalize=normalize, rerotate=False)
    out, cache, step = run_prefill(method, batch)
    got_scores = np.asarray(method.scores(cache, batch.qj(), step, None))
    for b, n in enumerate(batch.lengths):
        want = _reference(batch, b, 4, normalize)
        np.testing.assert_allclose(got_scores[b, :, :n], want, rtol=2e-4, atol=1e-6)
        for k in range(batch.kv):
            assert_same_set(kept(out, b, k), finch_keep(want[k], n, 12, 4), {j: want[k, j] for j in range(n - 4)})
    assert_kept_top_of_scores(method, cache, batch.qj(), step, out)


def test_normalisation_changes_the_ranking():
    """The row weights are not a constant factor: some head keeps other tokens with and without them."""
    batch = Batch()
    a, _, _ = run_prefill(methods.get("finch", budget=12, window_size=4, rerotate=False), batch)
    c, _, _ = run_prefill(methods.get("finch", budget=12, window_size=4, normalize=False, rerotate=False), batch)
    assert any(kept(a, b, k) != kept(c, b, k) for b in range(3) for k in range(batch.kv))


@pytest.mark.parametrize("chunk_length,ratio", [(8, 0.5), (16, 0.7), (10, 0.25), (3, 0.6)])
def test_per_segment_quotas_match_reference(chunk_length, ratio):
    batch = Batch()
    method = methods.get("finch", compression_ratio=ratio, window_size=4, chunk_length=chunk_length, rerotate=False)
    out, _, _ = run_prefill(method, batch)
    for b, n in enumerate(batch.lengths):
        budget = method.prompt_budget(int(n))
        want = _reference(batch, b, 4)
        for k in range(batch.kv):
            ref = finch_keep(want[k], n, budget, 4, chunk_length)
            assert_same_set(kept(out, b, k), ref, {j: want[k, j] for j in range(n - 4)})
            assert len(ref) <= budget


def test_rerotation_moves_kept_keys_to_contiguous_positions():
    batch = Batch(dtype=jnp.float32)
    method = methods.get("finch", budget=12, window_size=4)
    capacity = method.capacity(batch.t, 3)
    cache = batch.cache(capacity)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, batch.h, 2) / batch.h))
    step = batch.step(method, capacity)
    step = type(step)(positions=step.positions, budget=step.budget, layer=step.layer,
                      inv_freq=jnp.asarray(inv_freq, jnp.float32), capacity=capacity, num_layers=4)
    out = jax.jit(method.prefill)(cache, batch.qj(), step)
    plain = jax.jit(methods.get("finch", budget=12, window_size=4, rerotate=False).prefill)(cache, batch.qj(), step)
    for b, n in enumerate(batch.lengths):
        for k in range(batch.kv):
            m = int(out.length[b, k])
            assert kept(out, b, k) == kept(plain, b, k)
            for r in range(m):
                p = int(out.pos[b, k, r])
                want = rope_matrix(n - m + r - p, inv_freq) @ batch.k[b, p, k]
                np.testing.assert_allclose(np.asarray(out.k[b, k, r]), want, atol=2e-5)


def test_compression_ratio_per_example_and_window_above_budget():
    batch = Batch()
    out, _, _ = run_prefill(methods.get("finch", compression_ratio=0.5, window_size=4, rerotate=False), batch)
    for b, n in enumerate(batch.lengths):
        assert out.length[b].tolist() == [n // 2] * batch.kv
        want = _reference(batch, b, 4)
        for k in range(batch.kv):
            assert_same_set(kept(out, b, k), finch_keep(want[k], n, n // 2, 4), {j: want[k, j] for j in range(n - 4)})
    method = methods.get("finch", compression_ratio=0.9, window_size=8)
    out, _, _ = run_prefill(method, batch)
    for b, n in enumerate(batch.lengths):
        budget = method.prompt_budget(int(n))
        assert all(kept(out, b, k) == list(range(n - budget, n)) for k in range(batch.kv))


def test_budget_above_prompt_keeps_everything_and_attention_is_unchanged():
    assert_keeps_everything(methods.get("finch", budget=64, window_size=4), Batch())


@pytest.mark.parametrize("chunk_length", [None, 8])
def test_batch_equals_vmap_equals_loop(chunk_length):
    method = methods.get("finch", budget=10, window_size=3, chunk_length=chunk_length)
    assert_batch_equals_loop(method, Batch(lengths=(30, 17, 24)))


@pytest.mark.parametrize(
    "args,name",
    [
        (dict(budget=16, window_size=0), "window_size"),
        (dict(budget=16, window_size=16), "window_size"),
        (dict(budget=16, chunk_length=0), "chunk_length"),
        (dict(budget=16, normalize=1), "normalize"),
        (dict(budget=16, rerotate="yes"), "rerotate"),
        (dict(budget=16, group_reduce="sum"), "group_reduce"),
        (dict(), "budget"),
    ],
)
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("finch", **args)


def test_end_to_end_generate_one_shot_and_chunked():
    lengths = (40, 23, 31)
    for chunk_size in (None, 16):
        result = generate_and_check(methods.get("finch", budget=12, window_size=4), lengths, chunk_size=chunk_size,
                                    prompt_kept=lambda layer, b: min(12, lengths[b]))
        pos = np.asarray(result.cache.stacked().pos)
        for b, n in enumerate(lengths):  # the question (the prompt's last tokens) survives
            assert all(set(range(n - 4, n)) <= set(pos[layer, b, k].tolist()) for layer in range(2) for k in range(2))
