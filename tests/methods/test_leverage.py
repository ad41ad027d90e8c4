"""LeverageScore: kept positions against a NumPy float64 reference of the sketched leverage of the pre-RoPE keys;
the z-scores compare across heads (Ada-KV over it); batching; chunked prefill end to end; refusals."""

import dataclasses

import jax
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
from reference_scorers import leverage

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.common import gaussian_sketch

INV_FREQ = (1.0 / 100.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)


@pytest.mark.parametrize("args", [dict(sketch_dimension=6, seed=3), dict(sketch_dimension=16, ridge=0.5),
                                  dict(sketch_dimension=24, seed=1)])
def test_keeps_the_reference_leverage(args):
    batch = Batch()
    method = methods.get("leverage", budget=11, **args)
    capacity = method.capacity(batch.t, 3)
    step = dataclasses.replace(batch.step(method, capacity), inv_freq=jnp.asarray(INV_FREQ))
    out = jax.jit(method.prefill)(batch.cache(capacity), batch.qj(), step)
    sketch = np.asarray(gaussian_sketch(method.seed, 0, batch.kv, batch.k.shape[-1], method.sketch_dimension),
                        np.float64)
    stored = np.asarray(jnp.asarray(batch.k, out.k.dtype).astype(jnp.float32), np.float64)  # the cache's rounding
    for b, n in enumerate(batch.lengths):
        scores = leverage(stored[b], int(n), INV_FREQ.astype(np.float64), sketch, method.ridge)
        for k in range(batch.kv):
            row = {j: scores[k, j] for j in range(n)}
            want = sorted(sorted(row, key=lambda j: (-row[j], j))[:11])
            assert_same_set(kept(out, b, k), want, row, tol=1e-3)


def test_budget_above_prompt_batching_and_adakv():
    assert_keeps_everything(methods.get("leverage", budget=50), Batch())
    batch = Batch(lengths=(30, 17, 24))
    assert_batch_equals_loop(methods.get("leverage", compression_ratio=0.6), batch)
    # z-scores span the example's heads, so Ada-KV's head budgets differ between heads
    out, _, _ = run_prefill(methods.get("adakv", budget=10, base="leverage"), Batch())
    lengths = np.asarray(out.length)
    assert (lengths.sum(axis=1) == Batch().kv * 10).all() and (lengths[:, 0] != lengths[:, 1]).any()


def test_bad_hyperparameters():
    with pytest.raises(ConfigError, match="sketch_dimension"):
        methods.get("leverage", budget=8, sketch_dimension=0)
    with pytest.raises(ConfigError, match="ridge"):
        methods.get("leverage", budget=8, ridge=-1.0)


def test_end_to_end_chunked_generate():
    generate_and_check(methods.get("leverage", budget=9), chunk_size=16, prompt_kept=lambda layer, b: 9)
