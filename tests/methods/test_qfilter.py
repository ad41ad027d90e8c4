"""Q-Filters: the filter loader (round trip on generated files in the published layout, float32 and bfloat16, clear
refusals, never a pickle) and kept positions against a NumPy float64 reference of the paper's score
(`-<f_{l,k}, k_i>` per layer and KV head, each head keeping its best `budget` keys), batched and end to end."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from baseline_refs import Batch, assert_batch_equals_loop, assert_keeps_everything, assert_same_set, kept, run_prefill
from learned_files import filters, qfilter_dir
from tiny import random_prompts, tiny_model

import kvjax
from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec
from kvjax.methods.qfilter import load_qfilters, write_qfilters
from kvjax.runtime import step


def ref_scores(k: np.ndarray, f: np.ndarray, n: int) -> np.ndarray:
    """`[K, n]` float64: minus each key's projection on its head's filter (loops)."""
    out = np.zeros((k.shape[1], n))
    for h in range(k.shape[1]):
        for j in range(n):
            out[h, j] = -sum(float(f[h, d]) * float(k[j, h, d]) for d in range(k.shape[2]))
    return out


def test_round_trip_float32(tmp_path):
    f = filters(3, 2, 16, seed=4)
    write_qfilters(tmp_path / "Llama-3.1-8B-Instruct_qfilt", f)
    meta = json.loads((tmp_path / "Llama-3.1-8B-Instruct_qfilt" / "config.json").read_text())
    assert meta == {"num_layers": 3, "num_kv_heads": 2, "kv_head_dim": 16}  # QFilters' constructor arguments
    got = load_qfilters(tmp_path / "Llama-3.1-8B-Instruct_qfilt")
    np.testing.assert_array_equal(got.filters, f)
    assert got.model_name == "Llama-3.1-8B-Instruct"


def test_round_trip_bfloat16(tmp_path):
    f = filters(2, 2, 16).astype(ml_dtypes.bfloat16)
    safetensors.numpy.save_file({"q_filters": f}, str(tmp_path / "model.safetensors"))
    got = load_qfilters(tmp_path)
    np.testing.assert_array_equal(got.filters, f.astype(np.float32))
    assert got.model_name is None  # not a <model>_qfilt directory: nothing to compare a model name with


@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_keeps_the_most_negative_projections(layer):
    batch, budget = Batch(kv=2), 10
    f = filters(4, 2, 16, seed=1)
    method = methods.get("qfilter", budget=budget, filters=qfilter_dir(4, 2, 16, seed=1))
    out, _, _ = run_prefill(method, batch, layer=layer)
    for b, n in enumerate(batch.lengths):
        scores = ref_scores(batch.k[b].astype(np.float64), f[layer].astype(np.float64), int(n))
        for k in range(batch.kv):
            row = {j: scores[k, j] for j in range(int(n))}
            want = sorted(sorted(row, key=lambda j: (-row[j], j))[:budget])
            assert_same_set(kept(out, b, k), want, row, tol=1e-4)
    assert_batch_equals_loop(method, batch, layer=layer)


def test_ratio_and_large_budget():
    batch = Batch(kv=2)
    assert_keeps_everything(methods.get("qfilter", budget=64, filters=qfilter_dir(4, 2, 16)), batch)
    out, _, _ = run_prefill(methods.get("qfilter", compression_ratio=0.5, filters=qfilter_dir(4, 2, 16)), batch)
    for b, n in enumerate(batch.lengths):
        assert all(len(kept(out, b, k)) == int(n) // 2 for k in range(2))


def test_generate_ragged_batch():
    method = methods.get("qfilter", budget=12, filters=qfilter_dir(2, 2, 16))
    lengths, new = (31, 12, 40), 4
    out = kvjax.generate(tiny_model(num_layers=2), random_prompts(7, lengths), method=method, max_new_tokens=new,
                         return_cache=True, stop_at_eos=False)
    for layer in out.cache.layers:
        for b, n in enumerate(lengths):
            for k in range(2):
                held = kept(layer, b, k)
                assert sum(p < n for p in held) == min(12, n)
                assert [p for p in held if p >= n] == list(range(n, n + new - 1))


# ---- refusals -------------------------------------------------------------------------------------------------


def test_missing_or_pickled_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="model.safetensors"):
        methods.get("qfilter", budget=8, filters=str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ConfigError, match="pickle"):
        methods.get("qfilter", budget=8, filters=str(tmp_path))
    with pytest.raises(ConfigError, match="needs filters="):
        methods.get("qfilter", budget=8)


def test_inconsistent_files_are_refused(tmp_path):
    write_qfilters(tmp_path, filters(2, 2, 16))
    (tmp_path / "config.json").write_text(json.dumps({"num_layers": 3, "num_kv_heads": 2, "kv_head_dim": 16}))
    with pytest.raises(ConfigError, match="config.json"):
        methods.get("qfilter", budget=8, filters=str(tmp_path))
    safetensors.numpy.save_file({"other": filters(2, 2, 16)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="q_filters"):
        methods.get("qfilter", budget=8, filters=str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(ConfigError, match="safetensors"):
        methods.get("qfilter", budget=8, filters=str(tmp_path))


@pytest.mark.parametrize("dims", [(3, 2, 16), (2, 4, 16), (2, 2, 8)])
def test_filters_for_another_model_are_refused_before_tracing(dims):
    method = methods.get("qfilter", budget=8, filters=qfilter_dir(*dims))
    with pytest.raises(ConfigError, match=r"model\.safetensors.*the model has 2 layers x 2 KV heads x head_dim 16"):
        kvjax.generate(tiny_model(num_layers=2), random_prompts(7, (12,)), method=method, max_new_tokens=2)
    spec = CacheSpec(batch=1, kv_heads=2, capacity=8, num_heads=4, head_dim=16, num_layers=2, dtype=jnp.float32)
    with pytest.raises(ConfigError, match="qfilt"):
        step.init_cache(method, spec)


def test_model_name_is_checked_against_the_directory(tmp_path):
    write_qfilters(tmp_path / "Llama-3.1-8B-Instruct_qfilt", filters(2, 2, 16))
    path = str(tmp_path / "Llama-3.1-8B-Instruct_qfilt")
    methods.get("qfilter", budget=8, filters=path, model="meta-llama/Meta-Llama-3.1-8B-Instruct")  # kvpress's naming
    with pytest.raises(ConfigError, match=r"Llama-3\.1-8B-Instruct_qfilt.*Qwen3-8B"):
        methods.get("qfilter", budget=8, filters=path, model="Qwen/Qwen3-8B")


def test_adakv_over_qfilter_checks_the_model_too():
    method = methods.get("adakv", budget=8, base="qfilter", base_args={"filters": qfilter_dir(3, 2, 16)})
    spec = CacheSpec(batch=1, kv_heads=2, capacity=8, num_heads=4, head_dim=16, num_layers=2, dtype=jnp.float32)
    with pytest.raises(ConfigError, match="qfilter"):
        step.init_cache(method, spec)


def test_one_compile_per_shape_bucket():
    """Other prompts of the same bucket (and batch) reuse the prefill and decode programs."""
    from kvjax.runtime.generate import TRACE_COUNTS

    method = methods.get("qfilter", compression_ratio=0.5, filters=qfilter_dir(2, 2, 16))
    model = tiny_model(num_layers=2)
    kvjax.generate(model, random_prompts(1, (30, 20)), method=method, max_new_tokens=3)
    before = dict(TRACE_COUNTS)
    kvjax.generate(model, random_prompts(2, (25, 31)), method=method, max_new_tokens=3)
    assert TRACE_COUNTS == before
