"""Knorm: the lowest key L2 norms per KV head (NumPy reference), skipped layers, end to end."""

import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    assert_keeps_everything,
    assert_kept_top_of_scores,
    generate_and_check,
    kept,
    run_prefill,
    top_positions,
)

from kvjax import methods
from kvjax.errors import ConfigError


def test_keeps_the_lowest_key_norms():
    batch = Batch()
    method = methods.get("knorm", budget=9)
    out, cache, step = run_prefill(method, batch)
    assert out.capacity == 9 + 3
    for b, n in enumerate(batch.lengths):
        for k in range(batch.kv):
            norms = np.linalg.norm(batch.k[b, :n, k].astype(np.float64), axis=-1)
            assert kept(out, b, k) == top_positions({j: -norms[j] for j in range(n)}, 9)
    assert_kept_top_of_scores(method, cache, batch.qj(), step, out)


def test_skipped_layers_keep_everything_and_size_the_cache():
    batch = Batch()
    method = methods.get("knorm", budget=9, skip_layers=2)
    assert method.capacity(40, 3) == 43  # the largest layer: a skipped one holds the whole prompt
    assert method.layer_capacities(40, 3, 4) == (43, 43, 12, 12)  # the others hold the budget
    for layer, want in ((0, None), (1, None), (2, 9)):
        out, _, _ = run_prefill(method, batch, layer=layer)
        for b, n in enumerate(batch.lengths):
            assert out.length[b].tolist() == [n if want is None else want] * batch.kv


def test_budget_above_prompt_and_batching():
    assert_keeps_everything(methods.get("knorm", budget=50), Batch())
    assert_batch_equals_loop(methods.get("knorm", compression_ratio=0.6), Batch(lengths=(30, 17, 24)))


@pytest.mark.parametrize("args,name", [(dict(budget=8, skip_layers=-1), "skip_layers"), (dict(), "budget")])
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("knorm", **args)


def test_end_to_end_generate():
    lengths = (40, 23, 31)
    generate_and_check(methods.get("knorm", budget=7, skip_layers=1), lengths,
                       prompt_kept=lambda layer, b: lengths[b] if layer == 0 else 7)
