"""KVzap (arXiv 2601.07891): the checkpoint loader and the surrogate scorer.

Oracles: a NumPy float64 surrogate written from the paper's equations (tests/methods/reference_kvzap.py), torch's
own `nn.Linear` / `nn.GELU` modules reading the same safetensors file (the published layout's key names), and the
loader's contract (round trip; a missing or mismatched file is one error naming the file and the model, raised
before anything is traced).
"""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kvzap_weights import FIXTURE, kvzap_tensors, write_kvzap
from reference_kvzap import kvzap_scores, top
from safetensors.numpy import save_file
from tiny import tiny_model

import kvjax
from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, per_example_budget
from kvjax.methods.kvzap import load_weights, surrogate_scores
from kvjax.runtime import forward, step

B, N, K, H, D = 3, 4, 2, 16, 64
LENGTHS = np.array([30, 12, 40])
T = 40


def test_round_trip(tmp_path):
    for hidden_dim in (8, None):
        folder = tmp_path / f"w{hidden_dim}"
        tensors = write_kvzap(folder, layers=3, input_dim=D, output_dim=K, hidden_dim=hidden_dim, seed=1)
        w = load_weights(str(folder))
        assert (w.num_layers, w.input_dim, w.output_dim) == (3, D, K)
        assert w.model_type == ("linear" if hidden_dim is None else "mlp")
        first = "layers.1.weight" if hidden_dim is None else "layers.1.0.weight"
        np.testing.assert_array_equal(w.w1[1], tensors[first].T)
        h = np.random.default_rng(0).normal(size=(2, 5, D)).astype(np.float32)
        for layer in range(3):
            got = np.asarray(surrogate_scores({k: jnp.asarray(v) for k, v in _leaves(w).items()}, layer, h))
            want = np.stack([kvzap_scores(tensors, layer, x) for x in h])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _leaves(w):
    return {"w1": w.w1, "b1": w.b1} if w.w2 is None else {"w1": w.w1, "b1": w.b1, "w2": w.w2, "b2": w.b2}


def test_torch_modules_read_the_same_file(tmp_path):
    """The published layout is torch's `ModuleList` of `Sequential(Linear, GELU, Linear)`: torch's modules loaded from
    the file compute what kvjax computes."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    write_kvzap(tmp_path, layers=2, input_dim=D, output_dim=K, hidden_dim=8, seed=2)
    net = torch.nn.Module()
    net.layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.GELU(), torch.nn.Linear(8, K)) for _ in range(2))
    net.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    h = np.random.default_rng(1).normal(size=(1, 7, D)).astype(np.float32)
    w = load_weights(str(tmp_path))
    for layer in range(2):
        want = net.layers[layer](torch.from_numpy(h)).detach().numpy()
        got = np.asarray(surrogate_scores({k: jnp.asarray(v) for k, v in _leaves(w).items()}, layer, h))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_file(tmp_path):
    tensors = kvzap_tensors(2, D, K, 8, seed=3)
    write_kvzap(tmp_path, layers=2, input_dim=D, output_dim=K, hidden_dim=8, seed=3)
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    w = load_weights(str(tmp_path))
    np.testing.assert_array_equal(w.b1[0], tensors["layers.0.0.bias"].astype(ml_dtypes.bfloat16).astype(np.float32))


def test_missing_or_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no KVzap checkpoint at .*nowhere"):
        methods.get("kvzap", budget=8, weights=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="weights= must name a local KVzap checkpoint"):
        methods.get("kvzap", budget=8)
    folder = tmp_path / "bad"
    write_kvzap(folder, layers=2, input_dim=D, output_dim=K, hidden_dim=8)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_modules": 3}))
    with pytest.raises(ConfigError, match="does not match its config.json"):
        methods.get("kvzap", budget=8, weights=str(folder))
    with pytest.raises(ConfigError, match="holds a mlp surrogate"):
        methods.get("kvzap", budget=8, weights=str(FIXTURE), model_type="linear")


@pytest.mark.parametrize("what", ["layers", "hidden", "heads"])
def test_mismatched_model_is_one_error_before_tracing(tmp_path, what):
    sizes = dict(layers=2, input_dim=64, output_dim=2)
    sizes[{"layers": "layers", "hidden": "input_dim", "heads": "output_dim"}[what]] += 1
    write_kvzap(tmp_path, **sizes)
    model = tiny_model(num_layers=2)
    method = methods.get("kvzap", budget=8, weights=str(tmp_path))
    before = dict(forward.TRACE_COUNTS)
    with pytest.raises(ConfigError) as err:
        kvjax.generate(model, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], method=method, max_new_tokens=2)
    text = str(err.value)
    assert str(tmp_path) in text and "llama model with 2 layers, hidden size 64, 2 KV heads" in text, text
    assert dict(forward.TRACE_COUNTS) == before


def _run_prefill(method, rng, t=T):
    capacity = method.capacity(t, 4)
    spec = CacheSpec(batch=B, kv_heads=K, capacity=capacity, num_heads=N, head_dim=H, num_layers=2, dtype=jnp.float32)
    cache = step.init_cache(method, spec).layer(1)
    q = jnp.asarray(rng.normal(size=(B, t, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, t, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, t, K, H)), jnp.float32)
    hidden = rng.normal(size=(B, t, D)).astype(np.float32)
    positions = np.arange(t)[None].repeat(B, 0)
    positions = jnp.asarray(np.where(positions < LENGTHS[:, None], positions, -1), jnp.int32)
    budget = jnp.asarray(per_example_budget(method, LENGTHS))
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    _, out = step.prefill_layer(method, cache, q, k, v, positions, budget, layer=1, inv_freq=inv_freq,
                                num_layers=2, hidden=jnp.asarray(hidden))
    return out, hidden, (k, v, inv_freq, budget)


def test_prefill_keeps_the_top_predicted_scores():
    method = methods.get("kvzap", budget=10, weights=str(FIXTURE))
    tensors = kvzap_tensors(2, 64, 2, 8, seed=0)
    out, hidden, _ = _run_prefill(method, np.random.default_rng(0))
    pos, score, length = np.asarray(out.pos), np.asarray(out.score), np.asarray(out.length)
    for b in range(B):
        n = int(LENGTHS[b])
        ref = kvzap_scores(tensors, 1, hidden[b, :n])
        for h in range(K):
            kept = sorted(pos[b, h][: length[b, h]].tolist())
            assert kept == top(ref[:, h], list(range(n)), min(10, n)), (b, h)
            for slot in range(length[b, h]):  # each kept pair carries its entry score
                assert abs(score[b, h, slot] - ref[pos[b, h, slot], h]) < 1e-4


def test_decode_scores_the_new_token():
    """Under a wrapper that reads decode scores (`decoding`), each generated token gets its predicted score."""
    method = methods.get("decoding", base="kvzap", base_args={"weights": str(FIXTURE)}, budget=10)
    tensors = kvzap_tensors(2, 64, 2, 8, seed=0)
    rng = np.random.default_rng(1)
    assert methods.get("kvzap", budget=10, weights=str(FIXTURE)).decode_appends_only  # alone: decode only appends
    out, _, (_, _, inv_freq, budget) = _run_prefill(method, rng)
    h1 = rng.normal(size=(B, 1, D)).astype(np.float32)
    q1 = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32)
    kv1 = jnp.asarray(rng.normal(size=(B, 1, K, H)), jnp.float32)
    positions = jnp.asarray(LENGTHS[:, None], jnp.int32)
    _, out = step.decode_layer(method, out, q1, kv1, kv1, positions, budget, layer=1, inv_freq=inv_freq,
                               num_layers=2, hidden=jnp.asarray(h1))
    pos, score = np.asarray(out.pos), np.asarray(out.score)
    for b in range(B):
        ref = kvzap_scores(tensors, 1, h1[b])[0]
        for h in range(K):
            slot = int(np.flatnonzero(pos[b, h] == LENGTHS[b])[0])
            assert abs(score[b, h, slot] - ref[h]) < 1e-4


def test_step_api_requires_hidden_states():
    method = methods.get("kvzap", budget=10, weights=str(FIXTURE))
    spec = CacheSpec(batch=1, kv_heads=K, capacity=12, num_heads=N, head_dim=H, num_layers=2, dtype=jnp.float32)
    cache = step.init_cache(method, spec).layer(0)
    x = jnp.zeros((1, 4, N, H))
    kv = jnp.zeros((1, 4, K, H))
    with pytest.raises(ConfigError, match="pass hidden="):
        step.prefill_layer(method, cache, x, kv, kv, jnp.arange(4)[None], jnp.asarray([4]), layer=0,
                           inv_freq=jnp.ones(H // 2), num_layers=2)
