"""LU-KV: per-head keep counts against kvpress's arithmetic (a plain-loop reference), kept positions against NumPy
references of the base's scores (Knorm exactly, Expected Attention in float64), batching, the ratio-0 switch, the
curve file's refusals, and the real per-layer allocation end to end."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, assert_batch_equals_loop, assert_keeps_everything, assert_same_set, kept, run_prefill
from learned_files import budget_curve, lukv_curve
from reference_scorers import expected_attention, lukv_counts, lukv_keep

import kvjax
from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec
from kvjax.methods.lukv import curve_row, head_keep_counts, write_budget_curve

CURVE = lukv_curve(2, 2)
INV_FREQ = (1.0 / 100.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)


def test_head_counts_follow_kvpress_arithmetic():
    rng = np.random.default_rng(3)
    rows = [rng.uniform(0, 1, size=3) for _ in range(40)]
    rows += [np.array([0.5, 0.5, 0.5]), np.array([1.0, 1.0, 0.0]), np.array([1.0, 1.0, 1.0]),
             np.array([0.0, 0.0, 0.0]), np.array([0.25, 0.75, 0.5]), np.array([0.9, 0.95, 0.99])]
    lengths = np.array([1, 2, 3, 5, 7, 16, 23, 40, 101, 1000, 4097], np.int32)
    count = jax.jit(head_keep_counts)
    extras = 0
    for prune in rows:
        prune = prune.astype(np.float32)
        got = np.asarray(count(jnp.asarray(prune), jnp.asarray(lengths)))
        for b, n in enumerate(lengths):
            want = lukv_counts(prune, int(n))
            assert got[b].tolist() == want, (prune, n)
            extras += sum(want) > sum(int(np.floor(np.float32(1 - p) * np.float32(n))) for p in prune)
    assert extras > 0  # the largest-remainder step was exercised


def test_curve_row():
    assert [curve_row(r) for r in (0.0, 0.005, 0.01, 0.125, 0.5, 0.994, 0.999)] == [0, 0, 0, 11, 49, 98, 98]


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("args", [dict(compression_ratio=0.5), dict(compression_ratio=0.8, sink=2, window=3),
                                  dict(compression_ratio=0.97, window=0)])
def test_keeps_each_heads_count_of_the_knorm_best(layer, args):
    batch = Batch()
    method = methods.get("lukv", base="knorm", curve=CURVE, **args)
    out, _, _ = run_prefill(method, batch, layer=layer, num_layers=2)
    prune = budget_curve(2, 2)[curve_row(args["compression_ratio"]), layer].astype(np.float32)
    for b, n in enumerate(batch.lengths):
        counts = lukv_counts(prune, int(n))
        for k in range(batch.kv):
            norms = np.linalg.norm(batch.k[b, :n, k].astype(np.float64), axis=-1)
            want = lukv_keep(-norms, int(n), counts[k], sink=args.get("sink", 4), window=args.get("window", 1))
            assert kept(out, b, k) == want, (b, k)
    assert out.capacity == method.capacity(batch.t, 3)


def test_default_base_is_expected_attention_with_its_sinks_ranked_next():
    batch = Batch()
    method = methods.get("lukv", compression_ratio=0.7, curve=CURVE, sink=2, window=2)
    assert method.inner.name == "expected_attention" and method.inner.epsilon == 0.02
    capacity = method.capacity(batch.t, 3)
    step = dataclasses.replace(batch.step(method, capacity, layer=1, num_layers=2), inv_freq=jnp.asarray(INV_FREQ))
    out = jax.jit(method.prefill)(batch.cache(capacity), batch.qj(), step)
    prune = budget_curve(2, 2)[curve_row(0.7), 1].astype(np.float32)
    for b, n in enumerate(batch.lengths):
        scores = expected_attention(batch.q[b].astype(np.float64), batch.k[b].astype(np.float64),
                                    batch.v[b].astype(np.float64), int(n), INV_FREQ.astype(np.float64), eps=0.02)
        counts = lukv_counts(prune, int(n))
        for k in range(batch.kv):
            want = lukv_keep(scores[k], int(n), counts[k], sink=2, window=2, base_protected=range(4))
            assert set(range(4)) | {int(n) - 2, int(n) - 1} <= set(want)
            row = {j: scores[k, j] for j in range(4, int(n) - 2)}
            assert_same_set(kept(out, b, k), want, row, tol=1e-4)


def test_ratio_zero_or_a_curve_of_zeros_keeps_everything(tmp_path):
    assert_keeps_everything(methods.get("lukv", compression_ratio=0.0, curve=CURVE), Batch())
    zeros = write_budget_curve(tmp_path / "zeros.npy", np.zeros((99, 4, 2), np.float32))
    assert_keeps_everything(methods.get("lukv", compression_ratio=0.9, curve=str(zeros), base="knorm"), Batch())


def test_batch_equals_loop():
    assert_batch_equals_loop(methods.get("lukv", compression_ratio=0.6, curve=CURVE), Batch(lengths=(30, 17, 24)))


def _write(tmp_path, name, array, **kw):
    path = tmp_path / name
    np.save(path, array, **kw)
    return str(path)


def test_bad_hyperparameters_and_curves(tmp_path):
    good = dict(compression_ratio=0.5, curve=CURVE)
    pickled = _write(tmp_path, "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    cases = [
        (dict(curve=CURVE, budget=12), "give compression_ratio= instead of budget=12"),
        (dict(curve=CURVE), "needs compression_ratio="),
        (dict(good, sink=-1), "sink"), (dict(good, window=1.5), "window"),
        (dict(compression_ratio=0.5), "needs curve="),
        (dict(good, curve=str(tmp_path / "none.npy")), "no budget curve at .*none.npy"),
        (dict(good, curve=pickled), "cannot read .*obj.npy"),
        (dict(good, curve=_write(tmp_path, "int.npy", np.zeros((99, 2, 2), np.int32))), "int.npy.*float"),
        (dict(good, curve=_write(tmp_path, "shape.npy", np.zeros((98, 2, 2)))), r"shape.npy.*\[99, layers, kv_heads"),
        (dict(good, curve=_write(tmp_path, "range.npy", np.full((99, 2, 2), 1.5))), "range.npy.*in \\[0, 1\\]"),
        (dict(good, curve=_write(tmp_path, "nan.npy", np.full((99, 2, 2), np.nan))), "nan.npy.*finite"),
        (dict(good, base="adakv"), "base must name a scoring method"),
        (dict(good, base_args={"n_sink": -1}), "n_sink"),
    ]
    for args, match in cases:
        with pytest.raises(ConfigError, match=match):
            methods.get("lukv", **args)
    method = methods.get("lukv", **good)
    spec = CacheSpec(batch=1, kv_heads=2, capacity=20, num_heads=8, head_dim=16, num_layers=3, dtype=jnp.float32)
    with pytest.raises(ConfigError, match=r"curve\.npy' has shape \[99, 2, 2\] but the model needs \[99, 3, 2\]"):
        method.check_cache_spec(spec)
    with pytest.raises(ConfigError, match=r"needs \[99, 2, 4\]"):
        method.check_cache_spec(dataclasses.replace(spec, num_layers=2, kv_heads=4))
    with pytest.raises(ConfigError, match=r"needs \[99, 3, 2\]"):
        method.layer_capacities(40, 4, 3)
    method.check_cache_spec(dataclasses.replace(spec, num_layers=2))


def test_end_to_end_each_layer_allocated_at_its_largest_head():
    from tiny import tiny_model

    lengths, new = (40, 23, 31), 5
    method = methods.get("lukv", compression_ratio=0.75, curve=CURVE)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in lengths]
    model = tiny_model(dtype=jnp.bfloat16, num_heads=8, num_kv_heads=2, num_layers=2)
    result = kvjax.generate(model, prompts, method=method, max_new_tokens=new, return_cache=True)
    prune = budget_curve(2, 2)[curve_row(0.75)].astype(np.float32)
    caps = [layer.capacity for layer in result.cache.layers]
    assert caps == list(method.layer_capacities(64, new, 2)) and caps[0] != caps[1]
    for layer, cap in enumerate(caps):  # the bound: the largest head count at the 64-token bucket, plus one at most
        assert max(lukv_counts(prune[layer], 64)) + new <= cap <= max(lukv_counts(prune[layer], 64)) + new + 1
    for layer, cache in enumerate(result.cache.layers):
        for b, n in enumerate(lengths):
            counts = lukv_counts(prune[layer], n)
            for k in range(2):
                held = kept(cache, b, k)
                assert sum(p < n for p in held) == counts[k], (layer, b, k)
                assert set([0, 1, 2, 3, n - 1][: counts[k]]) <= set(held)  # protected, the lower positions first
                assert [p for p in held if p >= n] == list(range(n, n + new - 1))
