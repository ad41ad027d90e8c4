"""Expected Attention with offline query statistics (kvpress's `ExpectedAttentionStatsPress`): kept positions against
the NumPy float64 reference of the closed form with the file's mean and covariance; the invariant that a file holding
the prompt's own statistics keeps what `expected_attention` keeps; the loader's contract (kvpress's saved layout; a
missing, malformed or mismatched file is one error naming it); end to end."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, assert_keeps_reference_top, generate_and_check, kept
from reference_scorers import expected_attention, rope_matrix
from safetensors.numpy import save_file

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Step
from kvjax.methods.expected_attention_stats import load_statistics, write_statistics

INV_FREQ = (1.0 / 100.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
LAYERS = 4  # run_prefill's step: layer 0 of 4


def random_stats(folder, layers=LAYERS, heads=8, size=16, seed=0):
    rng = np.random.default_rng(seed)
    mean = rng.standard_normal((layers, heads, size)).astype(np.float32)
    root = rng.standard_normal((layers, heads, size, size)) / np.sqrt(size)
    cov = np.einsum("lnij,lnkj->lnik", root, root).astype(np.float32)  # positive semi-definite
    write_statistics(folder, mean, cov, model_name="test", n_sink=4)
    return mean, cov


def _prefill(method, batch, layer=0):
    capacity = method.capacity(batch.t, 3)
    spec = CacheSpec(batch=len(batch.lengths), kv_heads=batch.kv, capacity=capacity, num_heads=batch.n,
                     head_dim=batch.h, num_layers=LAYERS, dtype=batch.dtype)
    method.check_cache_spec(spec)
    cache = batch.cache(capacity).replace(state=method.init_cache_state(spec))
    step = dataclasses.replace(batch.step(method, capacity, layer=layer), inv_freq=jnp.asarray(INV_FREQ))
    return jax.jit(method.prefill)(cache, batch.qj(), step)


@pytest.mark.parametrize("args", [dict(n_future_positions=64), dict(n_future_positions=8, use_covariance=False,
                                                                     use_vnorm=False, n_sink=2)])
@pytest.mark.parametrize("layer", [0, 2])
def test_keeps_the_reference_top_scores(tmp_path, args, layer):
    mean, cov = random_stats(tmp_path)
    batch = Batch()
    method = methods.get("expected_attention_stats", budget=11, stats=str(tmp_path), **args)
    out = _prefill(method, batch, layer)
    ref = dict(n_future=method.n_future_positions, n_sink=method.n_sink, covariance=method.use_covariance,
               vnorm=method.use_vnorm, stats=(mean[layer].astype(np.float64), cov[layer].astype(np.float64)))
    assert_keeps_reference_top(out, batch.lengths, lambda b, n: expected_attention(
        batch.q[b].astype(np.float64), batch.k[b].astype(np.float64), batch.v[b].astype(np.float64), n,
        INV_FREQ.astype(np.float64), **ref), 11)


def test_the_prompts_own_statistics_keep_what_expected_attention_keeps(tmp_path):
    """A file holding one prompt's own pre-RoPE query mean and covariance (divided by the count, as the prompt's are)
    makes the method `expected_attention` for that prompt."""
    for b, n in enumerate(Batch().lengths):
        batch = Batch(lengths=(int(n),))
        batch.q, batch.k, batch.v = (x[b : b + 1, : int(n)] for x in (Batch().q, Batch().k, Batch().v))
        pre = np.stack([rope_matrix(t, INV_FREQ.astype(np.float64)).T @ batch.q[0, t].astype(np.float64).T
                        for t in range(int(n))])[4:]  # [m, H, N], after the 4 sinks
        mean = pre.mean(0).T  # [N, H]
        centred = pre - pre.mean(0)
        cov = np.einsum("mhn,mgn->nhg", centred, centred) / len(pre)
        folder = tmp_path / str(b)
        write_statistics(folder, np.repeat(mean[None], LAYERS, 0), np.repeat(cov[None], LAYERS, 0))
        ours = _prefill(methods.get("expected_attention_stats", budget=11, n_future_positions=32,
                                    stats=str(folder)), batch)
        theirs = _prefill(methods.get("expected_attention", budget=11, n_future_positions=32), batch)
        for k in range(batch.kv):
            assert kept(ours, 0, k) == kept(theirs, 0, k), (b, k)


def test_loads_kvpress_layout_and_refuses_bad_files(tmp_path):
    mean, cov = random_stats(tmp_path / "ok", layers=2, heads=4, size=8)
    loaded = load_statistics(str(tmp_path / "ok"))
    np.testing.assert_array_equal(loaded.mean, mean)
    np.testing.assert_array_equal(loaded.cov, cov)
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert (config["num_layers"], config["num_heads"], config["head_dim"], config["model_name"]) == (2, 4, 8, "test")
    with pytest.raises(ConfigError, match="no query statistics at '/no/such'"):
        methods.get("expected_attention_stats", budget=8, stats="/no/such")
    with pytest.raises(ConfigError, match="stats= must name a local directory"):
        methods.get("expected_attention_stats", budget=8)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    save_file({"query_mean": mean, "query_cov": cov[..., :3]}, str(bad / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"query_mean \(2, 4, 8\) and query_cov \(2, 4, 8, 3\)"):
        load_statistics(str(bad))
    save_file({"query_mean": mean, "extra": mean}, str(bad / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"holds \['extra', 'query_mean'\]"):
        load_statistics(str(bad / "model.safetensors"))
    (bad / "config.json").write_text(json.dumps({"num_layers": 3}))
    save_file({"query_mean": mean, "query_cov": cov}, str(bad / "model.safetensors"))
    load_statistics.cache_clear()
    with pytest.raises(ConfigError, match="says num_layers=3, but the tensors have 2"):
        load_statistics(str(bad))


def test_refuses_another_models_statistics(tmp_path):
    from tiny import tiny_model

    import kvjax

    random_stats(tmp_path, layers=3, heads=8, size=16)
    model = tiny_model(num_layers=2, num_heads=8, num_kv_heads=2)
    with pytest.raises(ConfigError, match=r"3 layers x 8 query heads x head size 16; the llama model has 2 layers"):
        kvjax.generate(model, [[1, 2, 3, 4, 5, 6, 7, 8, 9]], method="expected_attention_stats",
                       method_args={"budget": 6, "stats": str(tmp_path)}, max_new_tokens=1)


def test_the_rotation_carries_ropes_attention_factor(tmp_path):
    """yarn's / LongRoPE's factor `s` on RoPE's cos and sin: the averaged rotation is `s R`, so the statistics are
    scored as a file of mean `s mu` and covariance `s^2 Sigma` is without it."""
    mean, cov = random_stats(tmp_path / "plain")
    write_statistics(tmp_path / "scaled", mean * 1.3, cov * 1.3 ** 2)
    batch = Batch()
    method = methods.get("expected_attention_stats", budget=11, n_future_positions=16, stats=str(tmp_path / "plain"))
    capacity = method.capacity(batch.t, 3)
    spec = CacheSpec(batch=3, kv_heads=2, capacity=capacity, num_heads=8, head_dim=16, num_layers=LAYERS,
                     dtype=batch.dtype)
    step = dataclasses.replace(batch.step(method, capacity), inv_freq=jnp.asarray(INV_FREQ))
    plain = batch.cache(capacity).replace(state=method.init_cache_state(spec))
    with_factor = method.scores(plain, batch.qj(), dataclasses.replace(step, rope_scaling=1.3), None)
    scaled = dataclasses.replace(method, stats=str(tmp_path / "scaled"))
    cache = batch.cache(capacity).replace(state=scaled.init_cache_state(spec))
    np.testing.assert_allclose(np.asarray(with_factor), np.asarray(scaled.scores(cache, batch.qj(), step, None)),
                               rtol=1e-4, atol=1e-6)
    assert not np.allclose(np.asarray(with_factor), np.asarray(method.scores(plain, batch.qj(), step, None)))


def test_a_self_contained_base_of_chunk(tmp_path):
    random_stats(tmp_path, layers=2)
    method = methods.get("chunk", compression_ratio=0.5, chunk_length=8, base="expected_attention_stats",
                         base_args={"stats": str(tmp_path), "n_future_positions": 16})
    assert method.inner.name == "expected_attention_stats"
    with pytest.raises(ConfigError, match="keeps statistics"):  # the prompt's own statistics: refused there
        methods.get("chunk", compression_ratio=0.5, chunk_length=8, base="expected_attention")


def test_end_to_end_generate(tmp_path):
    random_stats(tmp_path, layers=2, heads=8, size=16)
    generate_and_check(methods.get("expected_attention_stats", budget=7, stats=str(tmp_path)),
                       prompt_kept=lambda layer, b: 7)


def test_the_runtime_hands_the_models_rope_factor(tmp_path):
    """On a yarn model (factor 16: RoPE's cos and sin carry 1.277), `generate` keeps in layer 0 what the hook keeps on
    that layer's whole prompt with `rope_scaling` the model's factor, and not what it keeps with 1.0."""
    from tiny import random_prompts, tiny_model

    import kvjax
    from kvjax import cache as kvc
    from kvjax.models.config import RopeConfig

    yarn = RopeConfig(theta=10000.0, rope_type="yarn", factor=16.0, original_max_position_embeddings=1024)
    model = tiny_model(num_layers=2, num_heads=8, num_kv_heads=2, rope=yarn)
    assert model.rope_scaling > 1.2
    random_stats(tmp_path, layers=2, heads=8, size=16, seed=3)
    prompt = random_prompts(4, (40,))
    method = methods.get("expected_attention_stats", budget=9, n_future_positions=16, stats=str(tmp_path))
    got = kvjax.generate(model, prompt, method=method, max_new_tokens=1, return_cache=True)
    whole = kvjax.generate(model, prompt, method="full", max_new_tokens=1, return_cache=True).cache.layers[0]
    spec = CacheSpec(batch=1, kv_heads=2, capacity=whole.capacity, num_heads=8, head_dim=16, num_layers=2,
                     dtype=jnp.float32)
    layer = whole.replace(state=method.init_cache_state(spec))
    kept_with = {}
    for factor in (model.rope_scaling, 1.0):
        step = Step(positions=jnp.arange(40, dtype=jnp.int32)[None], budget=jnp.asarray([9], jnp.int32),
                    layer=jnp.int32(0), inv_freq=model.inv_freq[...], capacity=whole.capacity, num_layers=2,
                    rope_scaling=factor)
        out = method.prefill(layer, jnp.zeros((1, 40, 8, 16), jnp.float32), step)
        kept_with[factor] = [sorted(h) for h in kvc.positions_kept(out)[0]]
    ours = [sorted(p for p in h if p < 40) for h in kvc.positions_kept(got.cache.layers[0])[0]]
    assert ours == kept_with[model.rope_scaling]
    assert kept_with[1.0] != kept_with[model.rope_scaling]
