"""Fast KVzip (arXiv 2601.17668; kvpress's `FastKVzipPress`): the gate file, the gate's scores and the kept positions.

Oracles: a NumPy float64 gate written from kvpress's `FastKVzipGate` (`reference_scorers.fastkvzip_gate`) fed the
model's own attention inputs (`shared_prefill.record` of each prompt alone, uncompressed), kvpress's window rule in
plain Python (`fastkvzip_window`), and KVzip's cross-layer allocation (`reference_scorers.kvzip_keep`, sinks and
window scored 1 as kvpress scores them); invariants: chunked prefill equals one shot, a batch equals a loop over its
examples, a budget above the prompt keeps everything, the per-head cap sizes the cache; refusals before tracing.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from baseline_refs import Batch, assert_generate_batch_equals_loop, generate_and_check, prompt_kept
from learned_files import fastkvzip_gates, gate_tensors
from reference_scorers import fastkvzip_gate, fastkvzip_window, kvzip_keep
from tiny import random_prompts, tiny_gemma3, tiny_model

import kvjax
from kvjax import cache as kvc
from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.fastkvzip import GATES, gate_scores, load_gates, window_steps, write_gates
from kvjax.runtime import forward, shared_prefill
from kvjax.runtime.generate import bucket_length

PROMPTS = (31, 12, 40)
D, K = 64, 2


def _model(layers: int = 3):
    return tiny_model(num_layers=layers)


def _args(layers: int = 3, **extra) -> dict:
    return {**dict(budget=8, n_sink=2, gates=fastkvzip_gates(layers, D, K)), **extra}


def _reference_kept(model, prompt: list[int], a: dict, budget: int) -> list:
    """`[L][K]` kept positions of one prompt: the float64 gate on the recorded attention inputs, sinks and window at
    1, KVzip's allocation (`max_head_share` 2)."""
    n = len(prompt)
    tensors = gate_tensors(model.config.num_layers, D, K)
    rec = shared_prefill.record(model, [prompt], layer_inputs={"hidden"})
    window = fastkvzip_window(n, a.get("window_ratio", 0.02), a.get("window_size", 4096))
    scores = []
    for layer in range(model.config.num_layers):
        s = fastkvzip_gate(tensors, layer, np.asarray(rec.inputs["hidden"][layer][0], np.float64)[:n])
        s[:, : a["n_sink"]] = 1.0
        s[:, n - window :] = 1.0
        scores.append(s)
    cap = int(np.ceil(budget * a.get("max_head_share", 2.0)))
    return kvzip_keep(scores, n, budget, a["n_sink"], cap=min(cap, n), layerwise=a.get("layerwise", False),
                      total=_kvpress_total(n, a, model.config.num_layers))


def _kvpress_total(n: int, a: dict, layers: int) -> int | None:
    """kvpress's count with a ratio: `m - int(m * ratio)` of the example's (or, layerwise, each layer's) `m` pairs."""
    if a.get("compression_ratio") is None or a.get("ratio_count", "pairs") != "pairs":
        return None
    m = K * n * (1 if a.get("layerwise", False) else layers)
    return m - int(m * a["compression_ratio"])


def test_gate_scores_match_the_reference(tmp_path):
    tensors = gate_tensors(3, D, K, groups=3, seed=4)
    gates = load_gates(str(write_gates(tmp_path, tensors)))
    assert (gates.num_layers, gates.input_dim, gates.kv_heads) == (3, D, K)
    h = np.random.default_rng(0).normal(size=(2, 9, D)).astype(np.float32)
    arrays = {name: jnp.asarray(v) for name, v in gates.arrays.items()}
    for layer in range(3):
        got = np.asarray(jax.jit(gate_scores)(arrays, jnp.int32(layer), jnp.asarray(h)))  # [B, T, K]
        want = np.stack([fastkvzip_gate(tensors, layer, x).T for x in h])
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
        assert 0.02 < want.std()  # the generated gates spread their scores (a meaningful test)


def test_bfloat16_file(tmp_path):
    tensors = gate_tensors(2, D, K, seed=1)
    write_gates(tmp_path, {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()})
    got = load_gates(str(tmp_path)).arrays["b"][1]
    np.testing.assert_array_equal(got, tensors["layers.1.b"][:, 0].astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("ratio", [0.02, 0.03, 0.1, 0.013, 0.0, 1.0])
def test_window_follows_kvpress_rule_exactly(ratio):
    method = methods.get("fastkvzip", **_args(window_ratio=ratio, window_size=100))
    n = np.concatenate([np.arange(0, 4000), np.arange(31990, 32010), [50000]]).astype(np.int32)
    got = np.asarray(jax.jit(method.window)(jnp.asarray(n)))
    want = [fastkvzip_window(int(x), ratio, 100) for x in n]
    np.testing.assert_array_equal(got, want)
    assert window_steps(ratio).dtype == np.int32


@pytest.mark.parametrize("extra", [{}, {"layerwise": True}, {"window_ratio": 0.1}, {"max_head_share": 1.0}])
def test_kept_positions_match_the_reference(extra):
    model, args = _model(), _args(**extra)
    method = methods.get("fastkvzip", **args)
    prompts = random_prompts(7, PROMPTS)
    out = kvjax.generate(model, prompts, method=method, max_new_tokens=1, return_cache=True)
    for b, prompt in enumerate(prompts):
        want = _reference_kept(model, prompt, args, min(args["budget"], len(prompt)))
        assert prompt_kept(out.cache, b, len(prompt)) == want, f"example {b}"


@pytest.mark.parametrize("extra", [{}, {"layerwise": True}, {"ratio_count": "per_head"}])
def test_a_ratio_prunes_kvpress_count_of_pairs(extra):
    """`compression_ratio` 0.7 on 31 / 12 / 40 tokens: kvpress prunes `int(0.7 m)` of the `m` pairs (`m` = 6 n over
    three layers, 2 n per layer with `layerwise`), one more or fewer than the per-head budget's
    `floor(0.3 n) * 6`; `ratio_count="per_head"` keeps the latter."""
    model, args = _model(), dict(_args(), budget=None, compression_ratio=0.7, **extra)
    method = methods.get("fastkvzip", **args)
    prompts = random_prompts(7, PROMPTS)
    out = kvjax.generate(model, prompts, method=method, max_new_tokens=1, return_cache=True)
    counts = []
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        want = _reference_kept(model, prompt, args, method.prompt_budget(n))
        assert prompt_kept(out.cache, b, n) == want, f"example {b}"
        counts.append(sum(len(h) for layer in prompt_kept(out.cache, b, n) for h in layer))
    per_head = [method.prompt_budget(n) * K * 3 for n in PROMPTS]
    if extra.get("ratio_count") == "per_head":
        assert counts == per_head
    else:
        m = [K * n * (1 if extra else 3) for n in PROMPTS]
        assert counts == [(x - int(x * 0.7)) * (3 if extra else 1) for x in m] != per_head


def test_a_ratio_chunked_prefill_and_the_shared_prefill_give_the_same_cache():
    model, args = _model(), dict(_args(), budget=None, compression_ratio=0.6)
    method = methods.get("fastkvzip", **args)
    prompts = random_prompts(3, PROMPTS)
    one = kvjax.generate(model, prompts, method=method, max_new_tokens=4, return_cache=True)
    for b, prompt in enumerate(prompts):
        want = _reference_kept(model, prompt, args, method.prompt_budget(len(prompt)))
        assert prompt_kept(one.cache, b, len(prompt)) == want, f"example {b}"
    chunked = kvjax.generate(model, prompts, method=method, max_new_tokens=4, return_cache=True, chunk_size=16)
    np.testing.assert_array_equal(chunked.tokens, one.tokens)
    rec = shared_prefill.record(model, prompts, layer_inputs=shared_prefill.recorded_inputs([method]))
    state = shared_prefill.prefill_from(model, rec, method, max_new_tokens=4)
    for b, n in enumerate(PROMPTS):
        assert prompt_kept(chunked.cache, b, n) == prompt_kept(one.cache, b, n)
        assert [[sorted(int(p) for p in h if 0 <= p < n) for h in np.asarray(x.pos)[b]] for x in state.cache.layers] \
            == prompt_kept(one.cache, b, n)


def test_batch_equals_a_loop_over_examples():
    method = methods.get("fastkvzip", **dict(_args(), budget=None, compression_ratio=0.5))
    assert_generate_batch_equals_loop(_model(), method, random_prompts(9, PROMPTS))


def test_budget_above_the_prompt_keeps_everything():
    prompts = random_prompts(7, PROMPTS)
    out = kvjax.generate(_model(), prompts, method=methods.get("fastkvzip", **dict(_args(), budget=64)),
                         max_new_tokens=6, return_cache=True)
    full = kvjax.generate(_model(), prompts, method="full", max_new_tokens=6)
    np.testing.assert_array_equal(out.tokens, full.tokens)
    for b, n in enumerate(PROMPTS):
        assert all(head == list(range(n)) for layer in prompt_kept(out.cache, b, n) for head in layer)


def test_head_cap_and_memory():
    method = methods.get("fastkvzip", **_args())
    out = kvjax.generate(_model(), random_prompts(7, PROMPTS), method=method, max_new_tokens=4, return_cache=True)
    assert out.cache.layers[0].capacity == method.capacity(bucket_length(max(PROMPTS)), 4) == 16 + 4
    sizes = [len(head) for b, n in enumerate(PROMPTS) for layer in prompt_kept(out.cache, b, n) for head in layer]
    assert max(sizes) <= 16 and len(set(sizes)) > 1  # heads and layers differ (one ranking), within the cap
    for b, n in enumerate(PROMPTS):  # the example's total is its budget per head and layer
        assert sum(len(h) for layer in prompt_kept(out.cache, b, n) for h in layer) == min(8, n) * K * 3


def test_generate_end_to_end_on_a_bf16_gqa_model():
    method = methods.get("fastkvzip", budget=10, gates=fastkvzip_gates(2, D, K))
    result = generate_and_check(method, check_heads=False)
    for b, n in enumerate((40, 23, 31)):
        assert sum(len(h) for layer in prompt_kept(result.cache, b, n) for h in layer) == min(10, n) * K * 2


def test_step_api_prefill_keeps_each_layers_best():
    """Without the cross-layer stage (a model of one's own calling `prefill`), a layer keeps its own
    `budget * kv_heads` best gate scores, sinks and window at 1, capped per head."""
    batch, rng = Batch(n=4, kv=K), np.random.default_rng(3)
    hidden = rng.standard_normal((len(batch.lengths), batch.t, D)).astype(np.float32)
    args = _args(2, budget=10, window_ratio=0.1)
    method = methods.get("fastkvzip", **args)
    capacity = method.capacity(batch.t, 3)
    gates = {name: jnp.asarray(v) for name, v in load_gates(args["gates"]).arrays.items()}
    cache = batch.cache(capacity)
    cache = cache.replace(score=jnp.zeros(cache.pos.shape, jnp.float32), state={kvc.SHARED_STATE: {GATES: gates}})
    step = dataclasses.replace(batch.step(method, capacity, layer=1), hidden=jnp.asarray(hidden))
    out = jax.jit(method.prefill)(cache, batch.qj(), step)
    tensors = gate_tensors(2, D, K)
    for b, n in enumerate(batch.lengths):
        s = fastkvzip_gate(tensors, 1, hidden[b, :n])
        s[:, :2] = 1.0
        s[:, n - fastkvzip_window(int(n), 0.1) :] = 1.0
        want = kvzip_keep([s], int(n), min(10, int(n)), 2, cap=min(20, int(n)), layerwise=True)
        assert [[sorted(int(p) for p in h if 0 <= p < n) for h in np.asarray(out.pos)[b]]] == want, f"example {b}"


def test_sliding_window_model_compresses_its_global_layers():
    model = tiny_gemma3(window=8)
    prompts = random_prompts(7, PROMPTS)
    method = methods.get("fastkvzip", **_args(1))
    out = kvjax.generate(model, prompts, method=method, max_new_tokens=3, return_cache=True)
    full = kvjax.generate(model, prompts, method="full", max_new_tokens=3)
    np.testing.assert_array_equal(out.tokens[:, 0], full.tokens[:, 0])
    for b, n in enumerate(PROMPTS):
        kept = np.asarray(out.cache.layers[1].pos)[b]
        assert ((kept < n) & (kept >= 0)).sum() == K * min(8, n)  # one managed layer: the whole budget
    with pytest.raises(ConfigError, match="1 global layers of 2"):  # a gate per model layer does not fit
        kvjax.generate(model, prompts, method=methods.get("fastkvzip", **_args(2)), max_new_tokens=2)


@pytest.mark.parametrize("bad, match", [
    (dict(budget=None), "budget"), (dict(n_sink=-1), "n_sink"), (dict(window_size=0), "window_size"),
    (dict(window_ratio=1.5), "window_ratio"), (dict(layerwise="yes"), "layerwise"),
    (dict(max_head_share=0.5), "max_head_share"), (dict(gates=""), "gates"), (dict(ratio_count="all"), "ratio_count"),
])
def test_bad_hyperparameters(bad, match):
    with pytest.raises(ConfigError, match=match):
        methods.get("fastkvzip", **dict(_args(), **bad))


def test_missing_or_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no Fast KVzip gates at .*nowhere"):
        methods.get("fastkvzip", budget=8, gates=str(tmp_path / "nowhere"))
    tensors = gate_tensors(2, D, K)
    write_gates(tmp_path / "short", {k: v for k, v in tensors.items() if k != "layers.1.b"})
    with pytest.raises(ConfigError, match=r"missing \['layers.1.b'\]"):
        methods.get("fastkvzip", budget=8, gates=str(tmp_path / "short"))
    write_gates(tmp_path / "shape", {**tensors, "layers.1.k_base": tensors["layers.1.k_base"][:, :, :3]})
    with pytest.raises(ConfigError, match="'layers.1.k_base' .* has shape"):
        methods.get("fastkvzip", budget=8, gates=str(tmp_path / "shape"))


@pytest.mark.parametrize("what", ["layers", "hidden", "heads"])
def test_mismatched_model_is_one_error_before_tracing(tmp_path, what):
    sizes = dict(layers=2, hidden_size=D, kv_heads=K)
    sizes[{"layers": "layers", "hidden": "hidden_size", "heads": "kv_heads"}[what]] += 1
    write_gates(tmp_path, gate_tensors(**sizes))
    method = methods.get("fastkvzip", budget=8, gates=str(tmp_path))
    before = dict(forward.TRACE_COUNTS)
    with pytest.raises(ConfigError) as err:
        kvjax.generate(_model(2), [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], method=method, max_new_tokens=2)
    text = str(err.value)
    assert str(tmp_path) in text and "llama model with 2 layers, hidden size 64, 2 KV heads" in text, text
    assert dict(forward.TRACE_COUNTS) == before


def test_a_quantized_cache_is_refused():
    method = methods.get("fastkvzip", **_args())
    with pytest.raises(ConfigError, match="kv_dtype"):
        kvjax.generate(_model(), random_prompts(7, PROMPTS), method=method, max_new_tokens=2, kv_dtype="int8")
