"""CUR (CurDKV): kept positions against a NumPy float64 reference of the approximate leverage scores; windows by
position after chunked compression; batching."""

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
    run_prefill,
)
from reference_scorers import cur

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.cur import window_normalised


@pytest.mark.parametrize("args", [{}, dict(leverage_type="kv_avg", local_window_size=5, num_sinks=1),
                                  dict(leverage_type="value", use_local_approximation=False)])
def test_keeps_the_reference_leverage(args):
    batch = Batch()
    method = methods.get("cur", budget=11, **args)
    out, _, _ = run_prefill(method, batch)
    for b, n in enumerate(batch.lengths):
        scores = cur(batch.k[b].astype(np.float64), batch.v[b].astype(np.float64), int(n),
                     num_sinks=method.num_sinks, leverage_type=method.leverage_type,
                     local=method.use_local_approximation, window=method.local_window_size)
        for k in range(batch.kv):
            row = {j: scores[k, j] for j in range(n)}
            want = sorted(sorted(row, key=lambda j: (-row[j], j))[:11])
            assert_same_set(kept(out, b, k), want, {j: x for j, x in row.items() if np.isfinite(x)}, tol=1e-4)


def test_windows_follow_positions_not_slots():
    pos = jnp.asarray([[[0, 3, 4, 9, 10, 17, -1]]])
    x = jnp.asarray([[[1.0, 3.0, 2.0, 5.0, 5.0, 7.0, 9.0]]])
    got = np.asarray(window_normalised(x, pos, pos >= 0, 4))[0, 0]
    np.testing.assert_allclose(got, [0.25, 0.75, 1.0, 0.5, 0.5, 1.0, 0.0])


def test_budget_above_prompt_batching_and_sketch():
    assert_keeps_everything(methods.get("cur", budget=50), Batch())
    assert_batch_equals_loop(methods.get("cur", compression_ratio=0.6), Batch(lengths=(30, 17, 24)))
    assert_batch_equals_loop(methods.get("cur", compression_ratio=0.6, use_random_leverage=True), Batch())


def test_bad_hyperparameters():
    with pytest.raises(ConfigError, match="leverage_type"):
        methods.get("cur", budget=8, leverage_type="svd")
    with pytest.raises(ConfigError, match="local_window_size"):
        methods.get("cur", budget=8, local_window_size=0)


def test_end_to_end_chunked_generate():
    generate_and_check(methods.get("cur", budget=9), chunk_size=16, prompt_kept=lambda layer, b: 9)
