"""AhaKV: the spec's testable properties (shared/specs/ahakv.md section 8), the NumPy reference of the
prefill score and selection, the reduction to SnapKV's window vote, Algorithm 1's decode updates, and
end-to-end generation."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_seed as ref
from tiny import tiny_model

import kvjax
from kvjax import cache as kvc
from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.ahakv import sg_lambda, value_prior
from kvjax.ops.scoring import accumulated_scores, window_scores
from kvjax.runtime import TRACE_COUNTS

KV, G, D = 2, 4, 8


def _batch(seed, lengths=(48, 30, 20), t=48, groups=G, d=D):
    rng = np.random.default_rng(seed)
    b = len(lengths)
    k = rng.standard_normal((b, KV, t, d)).astype(np.float32)
    v = rng.standard_normal((b, KV, t, d)).astype(np.float32)
    q = rng.standard_normal((b, t, KV * groups, d)).astype(np.float32)
    return q, k, v, list(lengths)


@functools.cache
def _prefill_fn(method):
    return jax.jit(method.prefill)


@functools.cache
def _scores_fn(method):
    return jax.jit(method.scores)


def _setup(method, q, k, v, lengths, capacity=None):
    cache, pos = ref.make_cache(method, k, v, lengths, capacity=capacity)
    step = ref.make_step(method, pos, method.capacity(k.shape[2], 1) if capacity is None else capacity)
    return cache, jnp.asarray(q), step


def test_lambda_matches_the_worked_example_and_reduces_to_softmax_at_k_sqrt_e():
    """Property 1: lambda(8000, 1000, 128) = 0.180253 (0.1803), lambda(4000) = 0.147176, 0 for i <= k.
    Property 2: at i = k sqrt(e), lambda = 1/sqrt(d) and the SG row is the standard softmax row."""
    assert abs(float(sg_lambda(8000, 1000, 128)) - 0.180253) < 1e-6
    assert abs(float(sg_lambda(4000, 1000, 128)) - 0.147176) < 1e-6
    assert round(float(sg_lambda(8000, 1000, 128)), 4) == 0.1803
    assert float(sg_lambda(1000, 1000, 128)) == 0.0 == float(sg_lambda(10, 1000, 128))
    np.testing.assert_allclose(float(sg_lambda(1000 * math.sqrt(math.e), 1000, 128)), 1 / math.sqrt(128), rtol=1e-6)
    # A real row: n = 160 keys, k = 97 -> ln(160/97) = 0.5005, lambda = 1.0005 / sqrt(d).
    q, k, v, _ = _batch(0, lengths=(160,), t=160)
    args = dict(budget=97, recent_size=1, value_prior=False)
    cache, qq, step = _setup(methods.get("ahakv", **args), q, k, v, [160])
    sg = _scores_fn(methods.get("ahakv", **args))(cache, qq, step)
    std = _scores_fn(methods.get("ahakv", sg_softmax=False, **args))(cache, qq, step)
    np.testing.assert_allclose(sg, std, rtol=2e-3, atol=1e-7)


def test_lambda_zero_gives_uniform_rows():
    """Property 3: with every row clamped (k >= n), P[p, j] = 1/(p+1): B_r = 2, n = 5 gives
    F = [0.45, 0.45, 0.45, 0.45, 0.2]."""
    q, k, v, _ = _batch(1, lengths=(5,), t=8)
    method = methods.get("ahakv", budget=8, recent_size=2, value_prior=False)
    cache, qq, step = _setup(method, q, k, v, [5])
    f = np.asarray(_scores_fn(method)(cache, qq, step))
    np.testing.assert_allclose(f[0, :, :5], [[0.45, 0.45, 0.45, 0.45, 0.2]] * KV, rtol=1e-6)


@pytest.mark.parametrize(
    "args",
    [
        dict(),
        dict(sg_scale_on="scaled_qk"),
        dict(group_reduce="max"),
        dict(sg_softmax=False, value_prior=False),
        dict(pool_kernel=3),
    ],
    ids=["default", "scaled_qk", "max", "plain", "kernel3"],
)
def test_prefill_matches_numpy_reference(args):
    """Properties 4-6: on a right-padded GQA batch the kept set is the B_r most recent tokens plus the
    top B - B_r of F_hat = value prior x RA(SG-softmax) from a float64 NumPy transcription; exactly B
    slots per head when n > B, everything when n <= B; the scores are kept for decoding. n = 17
    (= B + 1) puts clamped, uniform rows inside the window."""
    q, k, v, lengths = _batch(2, lengths=(48, 17, 12))
    method = methods.get("ahakv", budget=16, recent_size=4, **args)
    cache, qq, step = _setup(method, q, k, v, lengths)
    out = _prefill_fn(method)(cache, qq, step)
    for b, n in enumerate(lengths):
        f = ref.ahakv_scores(q[b].transpose(1, 0, 2), k[b], v[b], n, budget=16, recent=4, groups=G,
                             kernel=args.get("pool_kernel", 5), scale_on=args.get("sg_scale_on", "raw_qk"),
                             sg=args.get("sg_softmax", True), value_prior=args.get("value_prior", True),
                             group_reduce=args.get("group_reduce", "mean"))
        want = ref.ahakv_select(f, n, budget=16, recent=4)
        for g in range(KV):
            kept = ref.kept_positions(out, b, g)
            assert kept == want[g]
            assert len(kept) == min(n, 16)
            assert set(range(max(0, n - 4), n)) <= set(kept)
            np.testing.assert_allclose(np.asarray(out.score)[b, g, : len(kept)], f[g, kept], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("budget", [16, 48, 64, 128])
def test_small_budgets_sum_the_recent_budget_rows(budget):
    """Issue 23 item 5 (Alg. 1 lines 8 and 14, spec 3.1 / 3.3): at the default recent_size = 32 the recent
    budget B_r = min(32, B / 2) is both the protected window and the rows summed for F. Kept sets and
    scores at B in {16, 48, 64, 128} equal the float64 reference summing exactly those B_r rows."""
    q, k, v, lengths = _batch(31, lengths=(160, 137), t=160)
    method = methods.get("ahakv", budget=budget)
    recent = min(32, budget // 2)
    out = _prefill_fn(method)(*_setup(method, q, k, v, lengths))
    for b, n in enumerate(lengths):
        f = ref.ahakv_scores(q[b].transpose(1, 0, 2), k[b], v[b], n, budget=budget, recent=recent, groups=G)
        want = ref.ahakv_select(f, n, budget=budget, recent=recent)
        for g in range(KV):
            kept = ref.kept_positions(out, b, g)
            assert kept == want[g], (budget, b, g)
            np.testing.assert_allclose(np.asarray(out.score)[b, g, : len(kept)], f[g, kept], rtol=1e-4, atol=1e-7)


def test_bf16_cache_scores_in_float32():
    """A bf16 cache gives the float32 scores (and kept set) of the same rounded keys and values."""
    q, k, v, lengths = _batch(12)
    k16, v16 = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (k, v))
    method = methods.get("ahakv", budget=16, recent_size=4)
    cache, pos = ref.make_cache(method, k16, v16, lengths, dtype=jnp.bfloat16)
    step = ref.make_step(method, pos, method.capacity(48, 1))
    out = _prefill_fn(method)(cache, jnp.asarray(q), step)
    want = _prefill_fn(method)(*_setup(method, q, k16, v16, lengths))
    assert out.k.dtype == jnp.bfloat16 and out.score.dtype == jnp.float32
    np.testing.assert_allclose(out.score, want.score, rtol=1e-5, atol=1e-7)
    for b in range(3):
        for g in range(KV):
            assert ref.kept_positions(out, b, g) == ref.kept_positions(want, b, g)


def test_reduces_to_snapkv_window_vote_with_standard_softmax_and_no_value_prior():
    """lambda forced to 1/sqrt(d) (`sg_softmax=False`) and no value prior: the score is the shared
    `window_scores` vote over the last B_r rows, and the kept set equals SnapKV's (window B_r, no
    pooling): the pieces compose."""
    q, k, v, lengths = _batch(3)
    aha = methods.get("ahakv", budget=16, recent_size=4, sg_softmax=False, value_prior=False)
    snap = methods.get("snapkv", budget=16, window_size=4, kernel_size=1)
    cache, qq, step = _setup(aha, q, k, v, lengths)
    votes = window_scores(qq, step.positions, cache.k, cache.pos, kvc.stored_mask(cache), window=4)
    np.testing.assert_allclose(_scores_fn(aha)(cache, qq, step), votes, rtol=1e-6, atol=1e-8)
    a = _prefill_fn(aha)(cache, qq, step)
    cache_s, qq, step_s = _setup(snap, q, k, v, lengths)
    s = jax.jit(snap.prefill)(cache_s, qq, step_s)
    for b in range(3):
        for g in range(KV):
            assert ref.kept_positions(a, b, g) == ref.kept_positions(s, b, g)


def test_value_prior_properties():
    """Properties 7-8: gamma_bar in [0, 1] with max 1; equal value norms give 1 away from the pooling
    edges; scaling V changes nothing; boosting one token's V never lowers its F_hat."""
    _, _, v, _ = _batch(4)
    stored = jnp.ones(v.shape[:3], bool)
    g = np.asarray(value_prior(jnp.asarray(v), stored, 5))
    assert (g >= 0).all() and (g <= 1 + 1e-6).all() and np.allclose(g.max(-1), 1.0)
    np.testing.assert_allclose(value_prior(jnp.asarray(3.0 * v), stored, 5), g, rtol=1e-5)
    unit = v / np.linalg.norm(v, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(value_prior(jnp.asarray(unit), stored, 5))[..., 2:-2], 1.0, rtol=1e-5)
    q, k, v, lengths = _batch(5, lengths=(48,))
    method = methods.get("ahakv", budget=16, recent_size=4)
    base = np.asarray(_scores_fn(method)(*_setup(method, q, k, v, lengths)))
    v2 = v.copy()
    v2[0, :, 20] *= 3.0
    boosted = np.asarray(_scores_fn(method)(*_setup(method, q, k, v2, lengths)))
    assert (boosted[0, :, 20] >= base[0, :, 20]).all()
    far = [j for j in range(48) if abs(j - 20) > 2]
    assert (boosted[0, :, 20][:, None] / boosted[0][:, far] >= base[0, :, 20][:, None] / base[0][:, far] - 1e-6).all()


def test_identical_queries_in_a_group_select_like_one_head():
    """Property 9: when the G query heads of each group carry the same query, the selection (mean or
    max reduction) equals the G = 1 selection."""
    q, k, v, lengths = _batch(6, groups=1)
    for reduce in ("mean", "max"):
        one = methods.get("ahakv", budget=16, recent_size=4, group_reduce=reduce)
        a = _prefill_fn(one)(*_setup(one, q, k, v, lengths))
        b_ = _prefill_fn(one)(*_setup(one, np.repeat(q, G, axis=2), k, v, lengths))
        for b in range(3):
            for g in range(KV):
                assert ref.kept_positions(a, b, g) == ref.kept_positions(b_, b, g)


def test_recent_accumulation_removes_the_positional_bias_of_h2o():
    """Property 10 (statistical): iid N(0, 1) queries and keys, no RoPE, n = 1024, B = 128. The H2O
    score (all rows) falls with position (Spearman rho strongly negative); the AhaKV score over the
    candidates does not (|rho| < 0.1) over three seeds."""

    def spearman(x):
        r = np.argsort(np.argsort(x)).astype(float)
        p = np.arange(len(x), dtype=float)
        return np.corrcoef(r, p)[0, 1]

    n = 1024
    method = methods.get("ahakv", budget=128, recent_size=32, value_prior=False)
    for seed in range(3):
        rng = np.random.default_rng(100 + seed)
        k = rng.standard_normal((1, 1, n, 16)).astype(np.float32)
        q = rng.standard_normal((1, n, 1, 16)).astype(np.float32)
        cache, qq, step = _setup(method, q, k, k, [n], capacity=129)
        h2o = accumulated_scores(qq, step.positions, cache.k, cache.pos, kvc.stored_mask(cache))
        aha = _scores_fn(method)(cache, qq, step)
        assert spearman(np.asarray(h2o)[0, 0, : n - 32]) < -0.5
        assert abs(spearman(np.asarray(aha)[0, 0, : n - 32])) < 0.1


def test_decode_follows_algorithm_1():
    """Properties 4, 5, 11, 13: no eviction until the cache would exceed B; then exactly B after every
    step with one token evicted (the lowest score outside the B_r most recent); each step adds the group
    mean of the new token's SG-softmax row (lambda from the cache length) to every kept score, the new
    token's own entry included; evicted tokens never return."""
    q, k, v, _ = _batch(7, lengths=(10,), t=40)
    method = methods.get("ahakv", budget=16, recent_size=4)
    cap = method.capacity(10, 30)
    cache, qq, step = _setup(method, q[:, :10], k[:, :, :10], v[:, :, :10], [10], capacity=cap)
    cache = _prefill_fn(method)(cache, qq, step)

    @jax.jit
    def step_fn(c, kn, vn, qn, p, st):
        c = method.decode(kvc.append(c, kn, vn, p), qn, st)
        return c, method.observe(c, None, st)

    def scores(c, g):
        return {int(x): float(sc) for x, sc in zip(np.asarray(c.pos)[0, g], np.asarray(c.score)[0, g], strict=True)
                if x >= 0}

    gone = set()
    for t in range(10, 40):
        p = np.array([[t]], np.int32)
        old = [scores(cache, g) for g in range(KV)]
        scored, cache = step_fn(cache, jnp.asarray(k[:, :, t:t + 1].transpose(0, 2, 1, 3)),
                                jnp.asarray(v[:, :, t:t + 1].transpose(0, 2, 1, 3)), jnp.asarray(q[:, t:t + 1]),
                                jnp.asarray(p), ref.make_step(method, p, cap, [10]))
        positions = sorted(old[0]) + [t]
        lam = ref.sg_lambda(len(positions), 16, D)  # i = keys in the row, the new token included
        for g in range(KV):
            rows = []
            for h in range(g * G, (g + 1) * G):
                logits = np.array([lam * float(np.dot(q[0, t, h], k[0, g, j])) for j in positions])
                e = np.exp(logits - logits.max())
                rows.append(e / e.sum())
            inc = np.mean(rows, axis=0)
            got = scores(scored, g)
            for j, pj in enumerate(positions):
                assert abs(got[pj] - (old[g].get(pj, 0.0) + inc[j])) < 1e-5
            kept = set(ref.kept_positions(cache, 0, g))
            assert len(kept) == min(len(positions), 16)
            assert set(range(t - 3, t + 1)) <= kept
            if len(positions) > 16:
                (victim,) = set(positions) - kept
                others = {j: sc for j, sc in got.items() if j < t - 3}
                assert victim == min(others, key=lambda j: (others[j], j))
                gone.add((g, victim))
            assert not any((g, j) in gone for j in kept)


def test_no_nan_for_degenerate_inputs():
    """Property 12: all-zero V, constant K, n = B + 1, n = B_r + 1, mixed lengths."""
    q, k, v, _ = _batch(8, lengths=(17, 5, 9), t=24)
    method = methods.get("ahakv", budget=16, recent_size=4)
    for kk, vv in ((k, np.zeros_like(v)), (np.ones_like(k), v)):
        out = _prefill_fn(method)(*_setup(method, q, kk, vv, [17, 5, 9]))
        assert np.isfinite(np.asarray(out.score)).all()
        assert out.length[:, 0].tolist() == [16, 5, 9]


def test_config_errors_name_the_parameter():
    for kwargs, match in [
        (dict(), "budget"),
        (dict(budget=16, recent_size=0), "recent_size"),
        (dict(budget=16, pool_kernel=4), "pool_kernel"),
        (dict(budget=16, sg_scale_on="x"), "sg_scale_on"),
        (dict(budget=16, lambda_budget="x"), "lambda_budget"),
        (dict(budget=16, decode_lambda_i="x"), "decode_lambda_i"),
        (dict(budget=16, group_reduce="sum"), "group_reduce"),
        (dict(budget=16, value_prior="yes"), "value_prior"),
        (dict(budget=1), "budget"),
    ]:
        with pytest.raises(ConfigError, match=match):
            methods.get("ahakv", **kwargs)


# ---- end to end ------------------------------------------------------------------------------------


def test_generate_gqa_padded_batch_first_token_and_one_trace():
    """8 query heads on 2 KV heads, 3 right-padded prompts of different lengths: the first token equals
    `full`'s (uncompressed prefill); the cache is at B after every step; every prompt gives the same
    tokens as alone; a second generate in the same shape bucket does not retrace the decode step."""
    model, prompts = ref.e2e_model(), ref.e2e_prompts(10)
    full = kvjax.generate(model, prompts, method="full", max_new_tokens=20)
    args = dict(budget=24, recent_size=4)
    batch = kvjax.generate(model, prompts, method="ahakv", method_args=args, max_new_tokens=20, return_cache=True)
    np.testing.assert_array_equal(batch.tokens[:, 0], full.tokens[:, 0])
    assert (np.asarray(batch.cache.stacked().length) == 24).all()
    for i, p in enumerate(prompts):
        alone = kvjax.generate(model, [p], method="ahakv", method_args=args, max_new_tokens=20)
        np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0])
    before = dict(TRACE_COUNTS)
    kvjax.generate(model, ref.e2e_prompts(11), method="ahakv", method_args=args, max_new_tokens=20)
    assert TRACE_COUNTS["decode_step"] == before["decode_step"]


def test_budget_covering_everything_equals_full_attention():
    """With a budget covering prompt + generated tokens nothing is evicted: generation equals `full`."""
    model, prompts = ref.e2e_model(), ref.e2e_prompts(10)
    want = kvjax.generate(model, prompts, method="full", max_new_tokens=20)
    got = kvjax.generate(model, prompts, method="ahakv", method_args=dict(budget=80), max_new_tokens=20)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_bf16_storage_ratio_and_chunked_prefill():
    """bf16 cache with float32 scores: finite; `compression_ratio` keeps floor(n / 2) per example; the
    chunked path runs within the same capacity."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 96, n).tolist() for n in (50, 31)]
    model = tiny_model(dtype=jnp.bfloat16)
    out = kvjax.generate(model, prompts, method="ahakv", method_args=dict(compression_ratio=0.5, recent_size=4),
                         max_new_tokens=8, return_cache=True)
    assert out.cache.stacked().k.dtype == jnp.bfloat16 and out.cache.stacked().score.dtype == jnp.float32
    assert np.isfinite(np.asarray(out.cache.stacked().score)).all()
    assert np.asarray(out.cache.stacked().length)[:, :, 0].max(0).tolist() == [25, 15]
    chunked = kvjax.prefill(model, prompts, method="ahakv", method_args=dict(budget=16, recent_size=4),
                            max_new_tokens=4, chunk_size=16)
    assert chunked.cache.capacity == 17 and (np.asarray(chunked.cache.stacked().length) == 16).all()
