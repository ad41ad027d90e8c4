"""ActQKV: the activation-aware probe against a NumPy transcription of Eq. 7-9, the dynamic cut-off
(Eq. 11-12) as a pure function and through the decode hook layer by layer, the one-layer oracle of
the whole scheme, end-to-end generation (budgets, top-by-score retrieval, one decode compile,
padding invariance) and the bounded cache of a 32K-token prompt."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_actqkv as ref
from test_infllm import SMALL, check_partition, manual_decode
from tiny import tiny_model

import kvjax
from kvjax import cache as kvc
from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.actqkv import (
    ActQKV,
    activation_weights,
    chan_merge,
    dcm_layer_budget,
    ema_merge,
    weighted_probe,
)
from kvjax.methods.base import CacheSpec, Step
from kvjax.runtime import TRACE_COUNTS, forward, prefill
from kvjax.runtime.generate import bucket_length, init_cache

# ---------------------------------------------------------------------------------------------------
# Stage 1: probe query
# ---------------------------------------------------------------------------------------------------


def _run_windows(windows, valid, rel_eps=0.01):
    b, _, d = windows[0].shape
    n, mean, m2 = jnp.zeros(b), jnp.zeros((b, d)), jnp.zeros((b, d))
    out = []
    for x, ok in zip(windows, valid, strict=True):
        n, mean, m2 = chan_merge(n, mean, m2, jnp.asarray(x), jnp.asarray(ok))
        var = m2 / jnp.maximum(n - 1.0, 1.0)[:, None]
        w = activation_weights(jnp.asarray(x), jnp.asarray(ok), mean, var, rel_eps)
        out.append((np.asarray(n), np.asarray(mean), np.asarray(var), np.asarray(w),
                    np.asarray(weighted_probe(jnp.asarray(x), w))))
    return out


def test_probe_equals_numpy_eq_7_to_9_over_running_windows():
    rng = np.random.default_rng(0)
    b, t, d = 2, 9, 12
    windows = [rng.standard_normal((b, t, d)).astype(np.float32) * rng.uniform(0.5, 3, d) for _ in range(3)]
    windows[1][0, 4] += 6.0  # an anchor token
    valid = [np.ones((b, t), bool) for _ in range(3)]
    valid[2][1, 6:] = False  # a ragged last window
    windows[2][1, 6:] = 1e3  # padding garbage must not leak
    got = _run_windows(windows, valid)
    for i in range(b):
        seen = []
        for w_idx, (x, ok) in enumerate(zip(windows, valid, strict=True)):
            rows = x[i][ok[i]]
            seen.extend(rows)
            mean, var = ref.running_stats(np.stack(seen))  # Eq. 8
            probe, w = ref.activation_probe(rows, mean, var)  # Eq. 7, 9
            n, jm, jv, jw, jp = (a[i] for a in got[w_idx])
            assert n == len(seen)
            np.testing.assert_allclose(jm, mean, atol=1e-5)
            np.testing.assert_allclose(jv, var, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(jw[ok[i]], w, rtol=1e-4, atol=1e-6)
            assert np.all(jw[~ok[i]] == 0)
            np.testing.assert_allclose(jp, probe, rtol=1e-4, atol=1e-5)
    # The anchor dominates its window.
    assert np.argmax(got[1][3][0]) == 4


def test_probe_degenerate_windows():
    """Spec 7.5: identical queries -> probe = q (uniform fallback); one query -> w = [1]; no NaN."""
    q = np.tile(np.arange(1.0, 7.0, dtype=np.float32), (1, 5, 1))
    (_, _, _, w, probe), = _run_windows([q], [np.ones((1, 5), bool)])
    np.testing.assert_allclose(w[0], np.full(5, 0.2), atol=1e-6)
    np.testing.assert_allclose(probe[0], q[0, 0], atol=1e-5)
    one = np.zeros((1, 5), bool)
    one[0, 0] = True
    (_, _, _, w, probe), = _run_windows([q + 1.0], [one])
    np.testing.assert_allclose(w[0], [1, 0, 0, 0, 0])
    np.testing.assert_allclose(probe[0], q[0, 0] + 1.0, atol=1e-5)
    # Equal ||phi||_1 for every token -> the mean (InfLLM's probe): +-1 around a zero mean.
    sym = np.array([[[1.0, -1.0], [-1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]]], np.float32)
    (_, _, _, w, probe), = _run_windows([sym], [np.ones((1, 4), bool)])
    np.testing.assert_allclose(w[0], np.full(4, 0.25), atol=1e-6)
    np.testing.assert_allclose(probe[0], sym[0].mean(0), atol=1e-6)


def test_shared_statistics_ema():
    """[CODE] variant: the first window sets the statistics; later windows count once, capped."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 6, 4)).astype(np.float32)
    ok = np.ones((1, 6), bool)
    n, mean, var = ema_merge(jnp.zeros(1), jnp.zeros((1, 4)), jnp.zeros((1, 4)), x, ok, cap=2)
    np.testing.assert_allclose(mean[0], x[0].mean(0), atol=1e-6)
    np.testing.assert_allclose(var[0], x[0].var(0, ddof=1), atol=1e-5)
    for _ in range(5):
        n, mean2, _ = ema_merge(n, mean, var, x + 3.0, ok, cap=2)
        assert float(n[0]) <= 3.0
    assert float(n[0]) == 3.0
    np.testing.assert_allclose(mean2[0], (2 * mean[0] + x[0].mean(0) + 3.0) / 3, atol=1e-5)
    n2, _, _ = ema_merge(n, mean, var, x, np.zeros((1, 6), bool), cap=2)  # no valid rows: unchanged
    assert float(n2[0]) == float(n[0])


# ---------------------------------------------------------------------------------------------------
# Stage 2: dynamic cut-off
# ---------------------------------------------------------------------------------------------------


def _jax_budgets(thetas, means, total, n, k_min, k_max, cold=False):
    num_layers = len(thetas)
    remaining = jnp.asarray([total], jnp.int32)
    out = []
    for layer in range(num_layers):
        later_sum = jnp.asarray([sum(means[layer + 1 :])], jnp.float32)
        b = dcm_layer_budget(jnp.asarray([thetas[layer]], jnp.float32), later_sum, jnp.asarray([cold]), remaining,
                             jnp.asarray([n]), jnp.int32(layer), num_layers, k_min, k_max)
        out.append(int(b[0]))
        remaining = remaining - b
    return out


def test_dcm_budgets_match_eq_12_and_sum_to_total():
    rng = np.random.default_rng(2)
    num_layers, k = 8, 10
    for _ in range(20):
        thetas = rng.uniform(0.5, 1.0, num_layers).tolist()
        means = rng.uniform(0.5, 1.0, num_layers).tolist()
        got = _jax_budgets(thetas, means, num_layers * k, 1000, 0, None)
        assert got == ref.dcm_budgets(thetas, means, num_layers * k, 1000, 0, None)
        assert sum(got) == num_layers * k  # the last layer takes the remainder
    # Steady state (history mean = current entropy): B_l is proportional to Theta_l.
    thetas = [0.6, 0.95, 0.7, 0.8]
    got = _jax_budgets(thetas, thetas, 4 * 25, 1000, 0, None)
    assert sum(got) == 100 and int(np.argmax(got)) == int(np.argmax(thetas))
    np.testing.assert_allclose(got, np.array(thetas) / sum(thetas) * 100, atol=1.0)
    # Equal entropies -> k per layer; empty history -> uniform split; clamps respected.
    assert _jax_budgets([0.9] * 4, [0.9] * 4, 40, 1000, 0, None) == [10] * 4
    assert _jax_budgets([0.1, 0.9, 0.9, 0.9], [0.9] * 4, 40, 1000, 0, None, cold=True) == [10] * 4
    clamped = _jax_budgets([0.99, 0.1, 0.1, 0.1], [0.1] * 4, 40, 1000, 8, 20)
    assert clamped == ref.dcm_budgets([0.99, 0.1, 0.1, 0.1], [0.1] * 4, 40, 1000, 8, 20)
    # The floor of 8 yields only to the budget left (here for the last layer): the sum stays within 40.
    assert all(b <= 20 for b in clamped) and all(b >= 8 for b in clamped[:-1]) and sum(clamped) <= 40
    # Fewer blocks than the floor: every layer gets all n of them.
    assert _jax_budgets([0.5] * 3, [0.5] * 3, 30, 4, 8, 20) == [4, 4, 4]


@functools.cache
def _decode_hook(method):
    return jax.jit(method.decode)


def test_decode_hook_allocates_eq_12_across_layers_and_retrieves_top_blocks():
    """The hook of each layer in turn (as the decode step calls it) with cross-layer `shared` state."""
    num_layers, k, n_blocks = 4, 3, 10
    method = ActQKV(n_init=2, n_local=4, block_size=2, window=4, repr_topk=1, topk=k, similarity="dot",
                    dcm_min=1, question_weight=0.0)
    cap = 32
    p = 2 + 4 + 2 * n_blocks  # blocks_due(p) == n_blocks: no block forms in this step
    spec = CacheSpec(batch=1, kv_heads=1, capacity=cap, num_heads=2, head_dim=4, num_layers=num_layers,
                     dtype=jnp.float32)
    rng = np.random.default_rng(3)
    inv_freq = jnp.asarray(1.0 / 100.0 ** (np.arange(2) / 2), jnp.float32)
    scales = [0.3, 4.0, 1.0, 2.0]  # flat scores -> high entropy for small scales
    reps, queries, thetas = [], [], []
    for layer in range(num_layers):
        rep = np.zeros((1, method.memory_blocks(cap), 8), np.float32)
        rep[0, :n_blocks] = rng.standard_normal((n_blocks, 8)) * scales[layer]
        q = rng.standard_normal((1, 1, 2, 4)).astype(np.float32)
        probe = ref.rope(q[0, 0].astype(np.float64), method.retrieval_position - p, np.asarray(inv_freq)).reshape(-1)
        scores = ref.block_scores(probe, rep[0, :n_blocks], "dot")
        reps.append(rep)
        queries.append(q)
        thetas.append(ref.normalized_entropy(scores))
    assert int(np.argmax(thetas)) == 0
    state = method.init_cache_state(spec)
    hist = np.zeros((1, num_layers, method.dcm_history), np.float32)
    hist[0, :, :3] = np.array(thetas)[:, None]  # steady state: history mean = current entropy
    shared = {**state["shared"], "ent_hist": jnp.asarray(hist), "ent_count": jnp.full((1, num_layers), 3, jnp.int32)}
    kk = rng.standard_normal((1, p + 1, 1, 4)).astype(np.float32)
    base = kvc.append(kvc.init(1, 1, cap, 4, jnp.float32, attend=True), kk, kk, jnp.arange(p + 1)[None])
    budgets = []
    for layer in range(num_layers):
        st = {**state, "rep": jnp.asarray(reps[layer]), "nb": jnp.asarray([n_blocks], jnp.int32), "shared": shared}
        step = Step(positions=jnp.asarray([[p]], jnp.int32), budget=jnp.asarray([0], jnp.int32),
                    layer=jnp.int32(layer), inv_freq=inv_freq, capacity=cap, num_layers=num_layers)
        out = _decode_hook(method)(base.replace(state=st), jnp.asarray(queries[layer]), step)
        shared = out.state["shared"]
        got = np.asarray(out.state["probe"])[0]
        want_probe = ref.rope(queries[layer][0, 0].astype(np.float64), method.retrieval_position - p,
                              np.asarray(inv_freq)).reshape(-1)
        np.testing.assert_allclose(got, want_probe, atol=1e-5)
        scores = ref.block_scores(want_probe, reps[layer][0, :n_blocks], "dot")
        np.testing.assert_allclose(np.asarray(out.state["block_score"])[0, :n_blocks], scores, rtol=1e-5, atol=1e-5)
        b = int(np.asarray(out.state["n_retrieved"])[0])
        budgets.append(b)
        chosen = np.flatnonzero(np.asarray(out.state["selected"])[0]).tolist()
        assert chosen == ref.top_blocks(scores, b)  # the top blocks by the spec's score
        check_partition(out, p=p, n_init=2, n_local=4, block_size=2, topk=b)
    assert budgets == ref.dcm_budgets(thetas, thetas, num_layers * k, n_blocks, 1, 2 * k)
    assert sum(budgets) == num_layers * k
    assert int(np.argmax(budgets)) == int(np.argmax(thetas))  # the flattest layer gets the most
    # The history got this step's entropies.
    np.testing.assert_array_equal(np.asarray(shared["ent_count"]), [[4] * num_layers])
    np.testing.assert_allclose(np.asarray(shared["ent_hist"])[0, :, 3], thetas, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------------


def test_matches_numpy_oracle_on_one_layer_model():
    """The whole scheme with the activation-aware probe, against the spec's oracle."""
    model = tiny_model(num_layers=1)
    rng = np.random.default_rng(2)
    ctx, rest = rng.integers(0, 96, 100).tolist(), rng.integers(0, 96, 12).tolist()
    method = methods.get("actqkv", topk=3, **SMALL)
    state = prefill(model, [ctx], method=method, max_new_tokens=len(rest))
    logits, cache = manual_decode(model, state, np.array(rest[:-1])[None])
    oracle = ref.simulate(model.weights(), model.config, np.asarray(model.rope()[0]), ctx, rest, topk=3,
                          similarity="cosine", probe="activation", position_scheme="infllm", **SMALL)
    np.testing.assert_allclose(logits[:, 0], np.stack(oracle["logits"]), atol=1e-4, rtol=1e-4)
    seen = len(ctx) + len(rest) - 1
    state = cache.layers[0].state  # the one layer
    np.testing.assert_allclose(np.asarray(state["ls"])[0, :, :seen], oracle["ls"][:, :seen], atol=1e-5)
    nb = int(np.asarray(state["nb"])[0])
    np.testing.assert_allclose(np.asarray(state["rep"])[0, :nb], np.stack(oracle["reps"]), atol=1e-5)
    # Running statistics cover every prompt query (7 windows of 16 = 100 tokens + padding).
    assert float(np.asarray(state["st_n"])[0]) == len(ctx)


def test_generate_dcm_budgets_top_blocks_and_one_decode_compile():
    model = tiny_model(num_layers=4)
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 96, 150).tolist()
    # The history holds decode steps only (prefill entropies carry the question term); budgets that
    # really differ across layers: tests/methods/test_retrieval_fidelity.py.
    method = methods.get("actqkv", topk=3, dcm_min=1, similarity="cosine", **SMALL)
    before = TRACE_COUNTS["decode_step"]
    out = kvjax.generate(model, [prompt], method=method, max_new_tokens=6, return_cache=True, stop_at_eos=False)
    assert TRACE_COUNTS["decode_step"] - before == 1
    kvjax.generate(model, [prompt[::-1]], method=method, max_new_tokens=6, stop_at_eos=False)
    assert TRACE_COUNTS["decode_step"] - before == 1  # same shapes: no new compile
    cache = out.cache
    state = cache.stacked().state  # [L, ...]
    p = 150 + 6 - 2  # position of the last decode step's token
    nb = int(np.asarray(state["nb"])[0, 0])
    assert nb == (p - 16 - 4) // 4
    retrieved = np.asarray(state["n_retrieved"])[:, 0]
    shared = cache.shared
    count = np.asarray(shared["ent_count"])[0]
    hist = np.asarray(shared["ent_hist"])[0]
    thetas, prior_means = [], []
    for layer in range(4):
        probe = np.asarray(state["probe"])[layer, 0]
        reps = np.asarray(state["rep"])[layer, 0, :nb]
        scores = ref.block_scores(probe, reps, "cosine")  # no question term for generated tokens
        np.testing.assert_allclose(np.asarray(state["block_score"])[layer, 0, :nb], scores, rtol=1e-5,
                                   atol=1e-4)
        chosen = np.flatnonzero(np.asarray(state["selected"])[layer, 0]).tolist()
        assert chosen == ref.top_blocks(scores, int(retrieved[layer]))
        thetas.append(ref.normalized_entropy(scores))
        np.testing.assert_allclose(hist[layer, count[layer] - 1], thetas[-1], atol=1e-4)
        prior_means.append(float(hist[layer, : count[layer] - 1].mean()))
        # The attend mask holds exactly the chosen blocks of the memory.
        layer_cache = cache.layer(layer)
        pos = np.asarray(layer_cache.pos)[0, 0]
        mem = (pos >= 4) & (pos < 4 + 4 * nb)
        assert np.asarray(layer_cache.attend)[0, 0][mem].sum() == 4 * retrieved[layer]
    assert retrieved.tolist() == ref.dcm_budgets(thetas, prior_means, 4 * 3, nb, 1, 6)
    assert retrieved.sum() == 4 * 3
    assert retrieved[int(np.argmax(thetas))] == retrieved.max()


def test_padded_batch_equals_example_alone():
    """Spec 7.13: a short prompt padded into a longer batch (bucket 256, ragged question) = alone (128)."""
    model = tiny_model()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 96, n).tolist() for n in (150, 77)]
    questions = [rng.integers(0, 96, n).tolist() for n in (6, 3)]
    method = methods.get("actqkv", topk=2, **SMALL)
    both = prefill(model, prompts, question_ids=questions, method=method, max_new_tokens=4)
    assert both.prompt_lengths.tolist() == [162, 83]  # question + prompt + question and both.cache.capacity == 256 + 4
    one = prefill(model, [prompts[1]], question_ids=[questions[1]], method=method, max_new_tokens=4)
    assert one.cache.capacity == 128 + 4
    rest = rng.integers(0, 96, (2, 3))
    got, cache_b = manual_decode(model, both, rest)
    want, cache_1 = manual_decode(model, one, rest[1:])
    np.testing.assert_allclose(got[:, 1], want[:, 0], atol=1e-4, rtol=1e-4)
    state_b, state_1 = cache_b.stacked().state, cache_1.stacked().state  # [L, ...]
    for key in ("nb", "n_retrieved", "selected", "qv_set"):
        a, b = np.asarray(state_b[key])[:, 1], np.asarray(state_1[key])[:, 0]
        np.testing.assert_array_equal(a[..., : b.shape[-1]] if a.ndim > 1 else a, b)  # fewer block slots alone
    assert np.asarray(state_b["nb"])[0, 0] > np.asarray(state_b["nb"])[0, 1] > 10


def test_32k_prompt_cache_is_bounded_by_sinks_local_and_memory():
    """Array sizes of a 32K-token prompt (shapes only): capacity = the context, memory in blocks,
    method state a few percent of the KV; a prefill window and a decode step keep every shape."""
    model = tiny_model()
    config = model.config
    method = methods.get("actqkv")
    bucket = bucket_length(32768, multiple=method.prefill_window())
    assert bucket == 32768
    cap = method.capacity(bucket, 16)
    cache = jax.eval_shape(lambda: init_cache(method, config, 1, cap, jnp.float32))
    nb = method.memory_blocks(cap)
    assert cap <= method.n_init + method.n_local + nb * method.block_size
    assert cache.num_layers == config.num_layers
    for layer in cache.layers:
        assert layer.k.shape == (1, config.num_kv_heads, cap, config.head_dim)
        assert layer.state["rep"].shape == (1, nb, config.num_heads * config.head_dim)
    kv_bytes = sum(2 * layer.k.size * layer.k.dtype.itemsize for layer in cache.layers)
    leaves = jax.tree.leaves(([layer.state for layer in cache.layers], cache.shared))
    state_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    assert state_bytes < 0.25 * kv_bytes, (state_bytes, kv_bytes)
    window = method.prefill_window()
    tok = jax.ShapeDtypeStruct((1, window), jnp.int32)
    _, out = jax.eval_shape(
        functools.partial(forward.prefill_chunk, config, method=method, final_chunk=False), model.weights(),
        model.rope(), cache=cache, tokens=tok, positions=tok, budget=jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    assert jax.tree.map(lambda a: (a.shape, a.dtype), out) == jax.tree.map(lambda a: (a.shape, a.dtype), cache)
    one = jax.ShapeDtypeStruct((1,), jnp.int32)
    _, out = jax.eval_shape(
        functools.partial(forward.decode_step, config, method=method), model.weights(), model.rope(),
        cache=cache, tokens=one, positions=one, budget=one,
    )
    assert jax.tree.map(lambda a: (a.shape, a.dtype), out) == jax.tree.map(lambda a: (a.shape, a.dtype), cache)


def test_preset_and_errors():
    llama = ActQKV.preset("llama-3-8b")
    assert (llama.block_size, llama.topk, llama.block_floor, llama.block_cap) == (32, 46, 0, 92)
    qwen = methods.get("actqkv")
    assert (qwen.block_size, qwen.topk, qwen.block_floor, qwen.block_cap) == (64, 23, 0, 46)
    assert methods.get("actqkv", dcm_max_factor=None).block_cap is None
    with pytest.raises(ConfigError):
        ActQKV.preset("gpt-5")
    for bad in (dict(probe="max"), dict(stats="global"), dict(dcm_history=0), dict(dcm_max_factor=0.5),
                dict(dcm_numerator="x"), dict(stats_eps=-1.0)):
        with pytest.raises(ConfigError):
            methods.get("actqkv", **bad)
