"""KeyDiff and ObservedAttention: kept positions against NumPy float64 references of their definitions,
batching, budgets, the block-wise (chunked) KeyDiff end to end."""

import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    assert_keeps_everything,
    assert_same_set,
    generate_and_check,
    kept,
    run_prefill,
)
from reference_scorers import keydiff, observed_attention

from kvjax import methods
from kvjax.errors import ConfigError


def _check_top(out, batch, reference, budget):
    for b, n in enumerate(batch.lengths):
        scores = reference(b, int(n))
        for k in range(batch.kv):
            row = {j: scores[k, j] for j in range(n)}
            want = sorted(sorted(row, key=lambda j: (-row[j], j))[:budget])
            assert_same_set(kept(out, b, k), want, row, tol=1e-4)


def test_keydiff_keeps_the_least_similar_keys():
    batch = Batch()
    out, _, _ = run_prefill(methods.get("keydiff", budget=10), batch)
    _check_top(out, batch, lambda b, n: keydiff(batch.k[b].astype(np.float64), n), 10)


def test_observed_attention_keeps_the_highest_mean_attention():
    batch = Batch()
    out, _, _ = run_prefill(methods.get("observed_attention", budget=10), batch)
    _check_top(out, batch, lambda b, n: observed_attention(batch.q[b].astype(np.float64),
                                                           batch.k[b].astype(np.float64), n), 10)


@pytest.mark.parametrize("name", ["keydiff", "observed_attention"])
def test_budget_above_prompt_and_batching(name):
    assert_keeps_everything(methods.get(name, budget=50), Batch())
    assert_batch_equals_loop(methods.get(name, compression_ratio=0.6), Batch(lengths=(30, 17, 24)))


def test_bad_hyperparameters():
    with pytest.raises(ConfigError, match="block_size"):
        methods.get("keydiff", budget=8, block_size=0)
    with pytest.raises(ConfigError, match="budget"):
        methods.get("observed_attention")


def test_keydiff_block_wise_generate():
    method = methods.get("keydiff", budget=9, block_size=16)
    assert method.prefill_window() == 16
    generate_and_check(method, prompt_kept=lambda layer, b: 9)
