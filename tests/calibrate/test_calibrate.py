"""kvjax.calibrate against NumPy float64 references written from each recipe, on the same activations of a tiny
random model; round trips through the methods' loaders into a generation; determinism; the CLI's errors."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from reference_calibration import duo_scores, kvzip_plus_log, qfilters, ridge
from tiny import random_prompts, tiny_gemma3, tiny_model

import kvjax
from kvjax import methods
from kvjax.calibrate import activations, duo_attention, expected_attention_stats, kvzap, qfilter
from kvjax.calibrate.__main__ import main
from kvjax.errors import ConfigError
from kvjax.methods.duo_attention import load_attention_pattern
from kvjax.methods.expected_attention_stats import load_statistics
from kvjax.methods.kvzap import load_weights
from kvjax.methods.qfilter import load_qfilters
from kvjax.models import block
from kvjax.rope import apply_rope

LAYOUT = ([1], [5, 6, 7])  # opening + context + middle + context, as a tokenizer would give


def _model():
    return tiny_model(num_layers=2)


def _activations(model, tokens):
    seen = []
    activations.run_layers(model, tokens, seen.append)
    return seen


def test_forward_hands_over_what_attention_reads():
    model = _model()
    tokens = random_prompts(0, (40,))[0]
    acts = _activations(model, tokens)
    weights = model.weights()
    positions = jnp.arange(40)[None]
    x = block.embed(model.config, weights, jnp.asarray([tokens]))
    q, k, v = block.attention_inputs(model.config, weights["layers"][0], x, positions, model.rope()[:2])
    np.testing.assert_allclose(acts[0].q, np.asarray(q[0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(acts[0].k, np.asarray(k[0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(acts[0].v, np.asarray(v[0]), rtol=1e-6, atol=1e-6)
    for a in acts:  # pre-RoPE rotated = what attention reads
        inv_freq, scaling = model.rope()[:2]
        np.testing.assert_allclose(np.asarray(apply_rope(jnp.asarray(a.q_pre), positions[0], inv_freq, scaling)),
                                   a.q, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(apply_rope(jnp.asarray(a.k_pre), positions[0], inv_freq, scaling)),
                                   a.k, rtol=1e-5, atol=1e-5)
    assert [a.layer for a in acts] == [0, 1]


def test_qfilters_match_reference():
    model = _model()
    prompts = random_prompts(1, (48, 40, 56))
    queries = qfilter.collect_queries(model, prompts, svd_samples=100, seed=3)
    assert all(q.shape == (100, 4, 16) for q in queries)
    for q in queries:
        got = qfilter.filters_from_queries(q, kv_heads=2)
        np.testing.assert_allclose(got, qfilters(q, 2), atol=2e-4)
    # the sampled queries are the model's queries at the drawn positions
    picks = qfilter.sample_positions([48, 40, 56], 100, 3)
    first = np.concatenate([_activations(model, p)[1].q[rows] for p, rows in zip(prompts, picks, strict=True)])
    np.testing.assert_array_equal(first, queries[1])


def test_qfilter_sign_follows_queries():
    rng = np.random.default_rng(0)
    direction = rng.normal(size=16)
    direction /= np.linalg.norm(direction)
    q = 3.0 * direction + 0.3 * rng.normal(size=(500, 4, 16))  # every query along +direction
    filters = qfilter.filters_from_queries(q.astype(np.float32), kv_heads=2)
    for f in filters:
        assert f @ direction < -0.99  # stored negated: -<f, k> ranks keys along the queries' direction first


def test_kvzip_plus_scores_match_reference():
    model = _model()
    context = random_prompts(2, (24,))[0]
    opening, middle = LAYOUT
    acts = _activations(model, opening + context + middle + context)
    c0, r0 = len(opening), len(opening) + len(context) + len(middle)
    for a in acts:
        got = np.asarray(kvzap.kvzip_plus_log_scores(a.q, a.k, a.v, a.hidden, a.o, c0, r0, len(context)))
        want = kvzip_plus_log(a.q, a.k, a.v, a.hidden, a.o, c0, r0, len(context))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_kvzap_ridge_matches_reference():
    model = _model()
    contexts = random_prompts(3, (30, 30, 30))
    pairs: dict[int, list] = {0: [], 1: []}
    sums = kvzap.collect(model, contexts, LAYOUT, seed=5, tokens_per_sample=20,
                         visit=lambda a, rows, y: pairs[a.layer].append((a.hidden[rows], y)))
    w, b = sums.solve(alpha=1.0)
    for layer, chunks in pairs.items():
        x = np.concatenate([c[0] for c in chunks])
        y = np.concatenate([c[1] for c in chunks])
        assert x.shape == (60, 64) and y.shape == (60, 2)
        rw, rb = ridge(x, y, alpha=1.0)
        np.testing.assert_allclose(w[layer], rw, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(b[layer], rb, rtol=1e-6, atol=1e-8)
        residual = y - x.astype(np.float64) @ rw - rb
        want_r2 = 1 - (residual ** 2).sum(0) / ((y - y.mean(0)) ** 2).sum(0)
        np.testing.assert_allclose(sums.r2(w)[layer], want_r2, rtol=1e-6, atol=1e-8)
    every = np.concatenate([np.concatenate([c[1] for c in chunks]).ravel() for chunks in pairs.values()])
    assert sums.quantiles((0.5,)) == {"0.5": round(float(np.quantile(every, 0.5)), 4)}


def test_forward_attends_within_each_layers_window():
    """On a sliding-window model the calibration forward is the model's: each layer's keys and values equal those the
    runtime's prefill stores (a global layer's every token, a ring's last window), for a prompt five windows long.
    Before, every layer attended the whole prompt, so past the first window the activations, and KVzap's surrogates
    fit to them, were another model's."""
    from kvjax.runtime import forward
    from kvjax.runtime.generate import init_cache

    model = tiny_gemma3(num_layers=3, window=8, layer_types=("sliding_attention", "full_attention",
                                                             "sliding_attention"))
    n = 40
    tokens = random_prompts(4, (n,))[0]
    acts = _activations(model, tokens)
    full = methods.get("full")
    cache = init_cache(full, model.config, 1, n, jnp.float32)
    _, cache = forward.prefill_chunk(model.config, model.weights(), model.rope(), full, cache, jnp.asarray([tokens]),
                                     jnp.arange(n)[None], jnp.array([n]))
    for a, layer in zip(acts, cache.layers, strict=True):
        pos = np.asarray(layer.pos[0, 0])
        held = pos >= 0
        assert held.sum() == (n if model.config.layer_window(a.layer) is None else 8)
        for got, stored in ((a.k, layer.k), (a.v, layer.v)):  # [T, K, H] against [K, C, H] at the slots' positions
            np.testing.assert_allclose(got[pos[held]], np.swapaxes(np.asarray(stored[0]), 0, 1)[held],
                                       rtol=1e-5, atol=1e-5)


def test_kvzap_on_a_sliding_window_model_fits_its_global_layers(tmp_path):
    """Gemma 3's layout: KVzap's surrogates are those of the global layers (the only ones a method acts on), each
    the ridge fit of that model layer's pairs; the file round-trips into a generation; the calibrations that do not
    cover sliding windows refuse the model in one error."""
    model = tiny_gemma3(num_layers=3, window=8)  # layers 0, 1 slide; layer 2 is global
    assert model.config.global_layers == (2,)
    contexts = random_prompts(3, (30, 30))
    pairs: dict[int, list] = {}
    sums = kvzap.collect(model, contexts, LAYOUT, seed=5, tokens_per_sample=20,
                         visit=lambda a, rows, y: pairs.setdefault(a.layer, []).append((a.hidden[rows], y)))
    assert sorted(pairs) == [2] and sums.n.tolist() == [40]
    w, b = sums.solve(alpha=1.0)
    rw, rb = ridge(np.concatenate([c[0] for c in pairs[2]]), np.concatenate([c[1] for c in pairs[2]]), alpha=1.0)
    np.testing.assert_allclose(w[0], rw, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(b[0], rb, rtol=1e-6, atol=1e-8)
    linear, _ = kvzap.calibrate(model, contexts, LAYOUT, tmp_path, seed=5, tokens_per_sample=20, hidden_dim=8,
                                epochs=1, log=lambda *_: None)
    assert load_weights(str(linear)).w1.shape == (1, 64, 2)
    assert json.loads((linear / "config.json").read_text())["kvjax_calibration"]["model_layers"] == [2]
    method = methods.get("kvzap", budget=12, weights=str(linear), model_type="linear")
    out = kvjax.generate(model, random_prompts(6, (36,)), method=method, max_new_tokens=2)
    assert np.asarray(out.tokens).shape[-1] == 2
    every_layer = tmp_path / "every-layer"  # a file with one surrogate per model layer does not fit
    kvzap.write_linear(every_layer, np.zeros((3, 64, 2)), np.zeros((3, 2)), {})
    with pytest.raises(ConfigError, match=r"1 global layers of 3, .*n_modules 3 \(model: 1\)"):
        kvjax.generate(model, random_prompts(6, (36,)),
                       method=methods.get("kvzap", budget=12, weights=str(every_layer), model_type="linear"),
                       max_new_tokens=2)


def test_qfilter_and_duo_attention_on_a_sliding_window_model_cover_its_global_layers(tmp_path):
    """Gemma 3's layout: Q-Filters and the DuoAttention estimate are the global layers' (the ones `qfilter` and
    `duo_attention` act on), each equal to the recipe on that layer's activations (the NumPy Q-Filter reference;
    the estimate's own head scores, visited); the files round-trip into a generation. Before, both calibrations
    refused the model."""
    model = tiny_gemma3(num_layers=3, window=8, layer_types=("full_attention", "sliding_attention",
                                                             "full_attention"))
    assert model.config.global_layers == (0, 2)
    prompts = random_prompts(8, (40, 36))
    queries = qfilter.collect_queries(model, prompts, svd_samples=60, seed=2)
    picks = qfilter.sample_positions([40, 36], 60, 2)
    for q, layer in zip(queries, (0, 2), strict=True):
        seen = np.concatenate([_activations(model, p)[layer].q[rows] for p, rows in zip(prompts, picks, strict=True)])
        np.testing.assert_array_equal(q, seen)
        np.testing.assert_allclose(qfilter.filters_from_queries(q, kv_heads=2), qfilters(q, 2), atol=2e-4)
    visited = []
    scores = duo_attention.estimate(model, prompts, q_len=32, visit=lambda a, s: visited.append((a.layer, s)))
    assert sorted({layer for layer, _ in visited}) == [0, 2] and scores.shape == (2, 2)
    for row, layer in enumerate((0, 2)):
        np.testing.assert_allclose(scores[row], np.mean([s for i, s in visited if i == layer], axis=0), rtol=1e-6)
    qdir = qfilter.calibrate(model, prompts, tmp_path, model_name="gemma", seed=0, svd_samples=60,
                             log=lambda *_: None)
    ddir = duo_attention.calibrate(model, prompts, tmp_path, model_name="gemma", seed=0, q_len=32,
                                   log=lambda *_: None)
    assert load_qfilters(qdir).filters.shape == (2, 2, 16) and load_attention_pattern(ddir).scores.shape == (2, 2)
    for method in (methods.get("qfilter", filters=str(qdir), model="gemma", compression_ratio=0.5),
                   methods.get("duo_attention", patterns=str(ddir), sink_size=2, recent_size=8,
                               head_compression_ratio=0.5)):
        out = kvjax.generate(model, random_prompts(6, (36,)), method=method, max_new_tokens=2)
        assert np.asarray(out.tokens).shape[-1] == 2


@pytest.mark.parametrize("gemma", [False, True])
def test_expected_attention_statistics_match_reference(gemma, tmp_path):
    """kvpress's recipe in NumPy: the pre-RoPE queries of every prompt after its first n_sink positions, pooled; mean
    and covariance (ddof 1) per layer and query head; on Gemma 3's layout, its global layers only. The file written
    loads through the method's loader and runs a generation."""
    if gemma:
        model = tiny_gemma3(num_layers=3, window=8, layer_types=("full_attention", "sliding_attention",
                                                                 "full_attention"))
    else:
        model = _model()
    prompts = random_prompts(9, (40, 33, 37))
    mean, cov, count = expected_attention_stats.query_statistics(model, prompts, n_sink=4)
    assert count == 40 + 33 + 37 - 3 * 4
    layers = model.config.global_layers
    assert mean.shape[0] == cov.shape[0] == len(layers) == (2 if gemma else 2)
    seen = [_activations(model, p) for p in prompts]
    for row, layer in enumerate(layers):
        queries = np.concatenate([acts[layer].q_pre[4:] for acts in seen]).astype(np.float64)  # [count, N, H]
        np.testing.assert_allclose(mean[row], queries.mean(0), rtol=1e-5, atol=1e-6)
        for head in range(queries.shape[1]):
            np.testing.assert_allclose(cov[row, head], np.cov(queries[:, head].T, ddof=1), rtol=1e-4, atol=1e-6)
    folder = expected_attention_stats.calibrate(model, prompts, tmp_path, model_name="tiny", seed=0,
                                                log=lambda *_: None)
    assert folder.name == "expected_attention_stats" and load_statistics(str(folder)).mean.shape == mean.shape
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_samples"], config["sample_seq_len"], config["n_sink"]) == (3, 40, 4)
    out = kvjax.generate(model, random_prompts(6, (36,)), max_new_tokens=2,
                         method=methods.get("expected_attention_stats", stats=str(folder), compression_ratio=0.5))
    assert np.asarray(out.tokens).shape[-1] == 2


def test_duo_scores_match_reference():
    model = _model()
    prompts = random_prompts(4, (32, 40))
    seen = []
    scores = duo_attention.estimate(model, prompts, q_len=64, visit=lambda a, s: seen.append((a, s)))
    for a, s in seen:
        np.testing.assert_allclose(s, duo_scores(a.q_pre, a.k_pre, 64, theta=10000.0), rtol=1e-5, atol=1e-6)
    mean = np.mean([[s for a, s in seen if a.layer == i] for i in range(2)], axis=1)
    np.testing.assert_allclose(scores, mean, rtol=1e-6)


def test_round_trips_into_generation(tmp_path):
    model = _model()
    prompts = random_prompts(5, (40, 40))
    qdir = qfilter.calibrate(model, prompts, tmp_path, model_name="tiny", seed=0, log=lambda *_: None)
    zdir, mlp_dir = kvzap.calibrate(model, prompts, LAYOUT, tmp_path, seed=0, tokens_per_sample=30, hidden_dim=16,
                                    epochs=2, log=lambda *_: None)
    ddir = duo_attention.calibrate(model, prompts, tmp_path, model_name="tiny", seed=0, q_len=32,
                                   log=lambda *_: None)
    assert qdir.name == "tiny_qfilt" and load_qfilters(qdir).filters.shape == (2, 2, 16)
    surrogate = load_weights(str(zdir))
    assert surrogate.model_type == "linear" and surrogate.w1.shape == (2, 64, 2)
    assert load_weights(str(mlp_dir)).w2.shape == (2, 16, 2)
    pattern = load_attention_pattern(ddir)
    assert pattern.scores.shape == (2, 2) and (pattern.sink_size, pattern.recent_size) == (128, 256)
    assert json.loads((ddir / "config.json").read_text())["model_name"] == "tiny"
    # the loaded linear surrogate predicts what the fit says (float32 file)
    sums = kvzap.collect(model, prompts, LAYOUT, seed=0, tokens_per_sample=30)
    w, b = sums.solve()
    np.testing.assert_allclose(surrogate.w1, w.astype(np.float32), rtol=1e-6)
    np.testing.assert_allclose(surrogate.b1, b.astype(np.float32), rtol=1e-6)
    prompt = random_prompts(6, (36,))
    for method in (methods.get("qfilter", filters=str(qdir), model="tiny", compression_ratio=0.5),
                   methods.get("dms", threshold=-4.0, sliding_window_size=8,
                               base_args={"weights": str(zdir), "model_type": "linear"}),
                   methods.get("duo_attention", patterns=str(ddir), sink_size=2, recent_size=8,
                               head_compression_ratio=0.5)):
        out = kvjax.generate(model, prompt, method=method, max_new_tokens=2)
        assert np.asarray(out.tokens).shape[-1] == 2


def test_calibration_is_deterministic(tmp_path):
    model = _model()
    prompts = random_prompts(7, (32, 32))
    for run in ("a", "b"):
        out = tmp_path / run
        qfilter.calibrate(model, prompts, out, model_name="tiny", seed=1, svd_samples=40, log=lambda *_: None)
        kvzap.calibrate(model, prompts, LAYOUT, out, seed=1, tokens_per_sample=10, log=lambda *_: None)
        duo_attention.calibrate(model, prompts, out, model_name="tiny", seed=1, q_len=16, log=lambda *_: None)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) == 8  # kvzap: linear and MLP
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


@pytest.mark.parametrize("argv, message", [
    (["--method=snapkv", "--model=kvjax-tiny"], "--method='snapkv': unknown snapkv"),
    (["--method=qfilter", "--model=/no/such/model"], "model directory '/no/such/model' does not exist"),
    (["--method=qfilter", "--model=/no/such/model.gguf"], "GGUF file '/no/such/model.gguf' does not exist"),
    (["--method=qfilter", "--model=kvjax-tiny", "--samples=0"], "--samples must be > 0"),
    (["--method=qfilter", "--model=kvjax-tiny", "--seed=-1"], "--seed must be >= 0, got -1"),  # was a traceback
    (["--model=kvjax-tiny", "--out=x"], "the following arguments are required: --method"),
    # issue 60: 100,000 tokens ran 10 minutes without a word; refused before the first prompt is drawn
    (["--method=qfilter", "--model=kvjax-tiny", "--context_length=100000"],
     "--context_length=100000 exceeds the model's maximum context of 16384 tokens (qfilter); give --context_length "
     "<= 16384"),
    (["--method=duo_attention,kvzap", "--model=kvjax-tiny", "--context_length=9000"],
     "--context_length=9000: kvzap reads each context twice in KVzip's repeat prompt, 2 x 9000 + "),
])
def test_cli_errors_are_one_line(argv, message, tmp_path, capsys):
    argv = argv if any(a.startswith("--out") for a in argv) else [*argv, f"--out={tmp_path / 'o'}"]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_cli_out_is_a_file(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["--method=qfilter", "--model=kvjax-tiny", f"--out={target}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a folder" in err and str(target) in err


def test_cli_writes_every_layout_for_kvjax_tiny(tmp_path, capsys):
    out = tmp_path / "calib"
    assert main(["--method=qfilter,kvzap,duo_attention,expected_attention_stats", "--model=kvjax-tiny",
                 f"--out={out}", "--samples=1", "--context_length=160"]) == 0
    assert load_qfilters(out / "kvjax-tiny_qfilt").filters.shape == (6, 2, 32)
    assert load_weights(str(out / "kvzap-linear")).w1.shape == (6, 128, 2)
    assert load_weights(str(out / "kvzap-mlp")).w2.shape == (6, 512, 2)
    assert load_attention_pattern(out / "duo_attention").scores.shape == (6, 2)
    assert load_statistics(str(out / "expected_attention_stats")).cov.shape == (6, 4, 32, 32)
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 5  # one line per directory written
    # progress on stderr: what is drawn, then each forward
    for method in ("qfilter", "kvzap", "duo_attention", "expected_attention_stats"):
        assert f"{method}: drawing 1 calibration prompts of 160 tokens" in captured.err
        assert f"{method}: forward: 100%" in captured.err, captured.err


def test_committed_kvjax_tiny_files_fit_the_model():
    """The files `make calibrate` commits load through each method's loader and fit kvjax-tiny."""
    import pathlib

    from kvjax.methods.base import CacheSpec
    from kvjax.models.model import load_model

    root = pathlib.Path(kvjax.__file__).parent / "assets" / "calibration" / "kvjax-tiny"
    config = load_model("kvjax-tiny").config
    spec = CacheSpec(batch=1, kv_heads=config.num_kv_heads, capacity=64, num_heads=config.num_heads,
                     head_dim=config.head_dim, num_layers=config.num_layers, dtype=jnp.float32)
    methods.get("qfilter", filters=str(root / "kvjax-tiny_qfilt"), model="kvjax-tiny",
                compression_ratio=0.5).check_cache_spec(spec)
    methods.get("duo_attention", patterns=str(root / "duo_attention"), model="kvjax-tiny").check_cache_spec(spec)
    methods.get("dms", threshold=-5.0, base_args={"weights": str(root / "kvzap-linear"),
                                                  "model_type": "linear"}).check_model(config)
    meta = json.loads((root / "kvzap-linear" / "config.json").read_text())["kvjax_calibration"]
    assert meta["pairs"] == 16 * 500 and meta["seed"] == 1234
