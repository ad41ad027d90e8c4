"""Compactor: kept positions against a NumPy float64 reference (exact leverage, which a square sketch without
ridge reproduces, or the sketched leverage with its ridge; non-causal chunked attention with each treatment of a
partial last chunk), the chunk votes against the authors' zero-padding construction, the Cholesky jitter
escalation, Ada-KV over it, and the refusal of chunked prefill."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, assert_batch_equals_loop, assert_same_set, generate_and_check, kept, run_prefill
from reference_scorers import compactor, compactor_chunk_votes

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.common import PARTIAL_CHUNK, chunk_attention, gaussian_sketch, jitters, sketched_leverage

INV_FREQ = (1.0 / 100.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
ARGS = dict(sink_size_start=2, sink_size_end=3, chunk_size=8, sketch_dimension=16, ridge=0.0, blending=0.7)


def check_against_reference(args: dict, **reference_args) -> None:
    batch = Batch()  # middles of 35, 18 and 26 tokens: every example ends in a partial chunk of 8
    method = methods.get("compactor", budget=12, **args)
    capacity = method.capacity(batch.t, 3)
    step = dataclasses.replace(batch.step(method, capacity), inv_freq=jnp.asarray(INV_FREQ))
    out = jax.jit(method.prefill)(batch.cache(capacity), batch.qj(), step)
    for b, n in enumerate(batch.lengths):
        scores = compactor(batch.q[b].astype(np.float64), batch.k[b].astype(np.float64),
                           batch.v[b].astype(np.float64), int(n), INV_FREQ.astype(np.float64),
                           start=args["sink_size_start"], end=args["sink_size_end"], chunk=args["chunk_size"],
                           blending=args["blending"], **reference_args)
        for k in range(batch.kv):
            row = {j: scores[k, j] for j in range(n)}
            want = sorted(sorted(row, key=lambda j: (-row[j], j))[:12])
            assert_same_set(kept(out, b, k), want, {j: x for j, x in row.items() if np.isfinite(x)}, tol=1e-3)


@pytest.mark.parametrize("partial", [None, *PARTIAL_CHUNK])
def test_keeps_the_reference_scores(partial):
    # None: the default, "fill" (issue 44: kvjax once dropped the filled mass of a partial chunk)
    args = ARGS if partial is None else {**ARGS, "partial_chunk": partial}
    check_against_reference(args, partial=partial or "fill")


def test_keeps_the_reference_scores_with_a_sketch_and_ridge():
    # a narrow sketch and kvpress's ridge: the leverage depends on the draws, here kvjax's own of layer 0
    args = {**ARGS, "sketch_dimension": 6, "ridge": 1e-2, "seed": 3}
    sketch = np.asarray(gaussian_sketch(3, 0, 2, 16, 6), np.float64)
    check_against_reference(args, sketch=sketch, ridge=1e-2)


@pytest.mark.parametrize("partial", PARTIAL_CHUNK)
@pytest.mark.parametrize("far", [False, True])
def test_chunk_votes_match_the_zero_padding_construction(partial, far):
    rng = np.random.default_rng(1)
    b, t, kv, g, h, start, end, chunk = 2, 29, 2, 3, 8, 3, 2, 8
    q = rng.standard_normal((b, t, kv * g, h)).astype(np.float32)
    k = rng.standard_normal((b, kv, t, h)).astype(np.float32)
    if far:  # unscaled logits far below 0 for one query head: exp(logit) underflows in float32 without the row max
        k = np.abs(k) + 1.0
        q[:, :, 1] = -30.0 * np.abs(q[:, :, 1])
    lengths = (29, 20)
    pos = np.arange(t)
    middle = np.stack([np.broadcast_to((pos >= start) & (pos < n - end), (kv, t)) for n in lengths])
    got = np.asarray(chunk_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(middle), start, chunk, partial))
    for e, n in enumerate(lengths):
        mid = list(range(start, n - end))
        for kh in range(kv):
            want = compactor_chunk_votes(q[e, mid, kh * g : (kh + 1) * g].astype(np.float64),
                                         k[e, kh, mid].astype(np.float64), chunk, partial)
            np.testing.assert_allclose(got[e, kh, mid], want, rtol=1e-5, atol=1e-6)
            assert (got[e, kh, ~middle[e, kh]] == 0).all()


def test_cholesky_jitter_grows_until_the_factor_exists():
    assert jitters(0.0) == pytest.approx([0.0, 1e-2, 0.1, 1.0, 10.0])
    assert jitters(1e-2) == pytest.approx([1e-2, 0.1, 1.0, 10.0, 100.0])
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((1, 2, 20, 8)).astype(np.float32)
    sketch = rng.standard_normal((2, 8, 5)).astype(np.float32)
    sketch[:, :, 0] = 0.0  # a zero sketched column: the Gram matrix is singular, its first Cholesky pivot 0
    valid = np.ones((1, 2, 20), bool)
    got = np.asarray(sketched_leverage(jnp.asarray(keys), jnp.asarray(valid), jnp.asarray(sketch), 0.0))
    assert np.isfinite(got).all()
    for kh in range(2):  # the second try's ridge, 1e-2
        x = keys[0, kh].astype(np.float64)
        y = (x - x.mean(0)) @ sketch[kh]
        want = np.diag(y @ np.linalg.inv(y.T @ y + 1e-2 * np.eye(5)) @ y.T)
        np.testing.assert_allclose(got[0, kh], want, rtol=1e-4, atol=1e-5)


def test_batching_and_adakv_over_it():
    batch = Batch()
    assert_batch_equals_loop(methods.get("compactor", compression_ratio=0.6, chunk_size=8), batch)
    # the leaderboard's adakv_compactor: heads get different counts, the layer keeps K * budget per example
    args = {"chunk_size": 8, "sink_size_start": 2, "sink_size_end": 2}
    for extra in ({}, {"partial_chunk": "kvpress"}):
        out, _, _ = run_prefill(methods.get("adakv", budget=12, base="compactor", base_args={**args, **extra}), batch)
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
    with pytest.raises(ConfigError, match="partial_chunk"):
        methods.get("compactor", budget=12, partial_chunk="pad")
