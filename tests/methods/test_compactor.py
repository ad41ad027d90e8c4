"""Compactor: kept positions against a NumPy float64 reference (exact leverage, which a square sketch without
ridge reproduces; non-causal chunked attention), Ada-KV over it, and the refusal of chunked prefill."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, assert_batch_equals_loop, assert_same_set, generate_and_check, kept, run_prefill
from reference_scorers import compactor

from kvjax import methods
from kvjax.errors import ConfigError

INV_FREQ = (1.0 / 100.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
ARGS = dict(sink_size_start=2, sink_size_end=3, chunk_size=8, sketch_dimension=16, ridge=0.0, blending=0.7)


def test_keeps_the_reference_scores():
    batch = Batch()
    method = methods.get("compactor", budget=12, **ARGS)
    capacity = method.capacity(batch.t, 3)
    step = dataclasses.replace(batch.step(method, capacity), inv_freq=jnp.asarray(INV_FREQ))
    out = jax.jit(method.prefill)(batch.cache(capacity), batch.qj(), step)
    for b, n in enumerate(batch.lengths):
        scores = compactor(batch.q[b].astype(np.float64), batch.k[b].astype(np.float64),
                           batch.v[b].astype(np.float64), int(n), INV_FREQ.astype(np.float64), start=2, end=3,
                           chunk=8, blending=0.7)
        for k in range(batch.kv):
            row = {j: scores[k, j] for j in range(n)}
            want = sorted(sorted(row, key=lambda j: (-row[j], j))[:12])
            assert_same_set(kept(out, b, k), want, {j: x for j, x in row.items() if np.isfinite(x)}, tol=1e-3)


def test_batching_and_adakv_over_it():
    batch = Batch()
    assert_batch_equals_loop(methods.get("compactor", compression_ratio=0.6, chunk_size=8), batch)
    # the leaderboard's adakv_compactor: heads get different counts, the layer keeps K * budget per example
    args = {"chunk_size": 8, "sink_size_start": 2, "sink_size_end": 2}
    out, _, _ = run_prefill(methods.get("adakv", budget=12, base="compactor", base_args=args), batch)
    lengths = np.asarray(out.length)
    assert (lengths.sum(axis=1) == batch.kv * 12).all() and (lengths[:, 0] != lengths[:, 1]).any()


def test_chunked_prefill_is_refused():
    with pytest.raises(ConfigError, match="chunked prefill"):
        generate_and_check(methods.get("compactor", budget=12, chunk_size=8), chunk_size=16)


def test_bad_hyperparameters():
    with pytest.raises(ConfigError, match="ridge"):
        methods.get("compactor", budget=12, ridge=-1.0)
    with pytest.raises(ConfigError, match="sketch_dimension"):
        methods.get("compactor", budget=12, sketch_dimension=0)
