"""KVgrad (kvpress's KVgradPress): kept positions against a float64 reference whose gradients come from Hugging Face
transformers' own autograd (torch), on a tiny Llama checkpoint that both libraries load.

Oracle: for each replay chunk, torch runs the rows over the prompt's cache with a hook on every attention module's
output, differentiates `sum ||h||^2` of the last decoder layer's output and reads each row's gradient norm per layer;
the reconstruction attention and `||v W_O||` come from the recorded forward as in KVzip's test. Invariants: a ragged
batch equals a loop over its examples (padding rows add nothing to the objective), one trace per shape, refusals.
"""

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, assert_generate_batch_equals_loop, prompt_kept
from reference_scorers import kvzip_chunk_scores, kvzip_keep, kvzip_replay_rows, written_norms
from tiny import random_prompts

import kvjax
from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.runtime import forward, shared_prefill
from kvjax.runtime import step as step_api

pytest.importorskip("torch")  # the models and the oracle come from Hugging Face (hf_tiny), as in the other HF files

import hf_tiny  # noqa: E402

ARGS = dict(budget=6, chunk_size=16, n_sink=2, context_start=2, repeat_ids=[5, 6, 7], continue_ids=[8, 9],
            suffix_ids=[10], tail=4)
PROMPTS = (37, 14, 29)  # ragged; 3, 1 and 2 replay chunks


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def models(request, tmp_path_factory):
    """Llama; Gemma 3 (two sliding-window layers around one global one, the gradient through its post-attention
    norms, which kvpress's hook on the attention module reads before)."""
    make = hf_tiny.make_llama if request.param == "llama" else hf_tiny.make_gemma3
    path, hf_model = make(tmp_path_factory.mktemp("kvgrad"), return_model=True)
    return kvjax.load_model(path, dtype="float32"), hf_model


def _prompts():
    return [[int(t) % 100 + 20 for t in p] for p in random_prompts(11, PROMPTS)]


def _torch_gradient_norms(hf_model, prompt: list[int], row: list[int]) -> list[np.ndarray]:
    """Per layer `[R]`: each replay row's `||d sum_p ||h_p||^2 / d a||`, `a` the attention module's output, `h` the last
    decoder layer's output, the rows run over the prompt's cache (torch autograd)."""
    import torch

    with torch.no_grad():
        cache = hf_model(torch.tensor([prompt]), use_cache=True).past_key_values
    given = "cache" if "cache" in inspect.signature(hf_model.model.forward).parameters else "past_key_values"
    captured: dict = {}

    def keep(name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if name != "last":
                out.retain_grad()
            captured[name] = out
        return hook

    layers = hf_model.model.layers
    hooks = [layer.self_attn.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    hooks.append(layers[-1].register_forward_hook(keep("last")))
    try:
        n = len(prompt)
        hf_model.model(torch.tensor([row]), use_cache=True, position_ids=torch.arange(n, n + len(row))[None],
                       **{given: cache})
        captured["last"].double().square().sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
    return [captured[i].grad[0].double().norm(dim=-1).numpy() for i in range(len(layers))]


def _managed(model) -> list[int]:
    """The layers KVgrad compresses (those without a sliding window)."""
    return [i for i in range(model.config.num_layers) if model.config.layer_window(i) is None]


def _reference_kept(model, hf_model, prompt: list[int]) -> tuple[list, list]:
    n = len(prompt)
    kv, managed = model.config.num_kv_heads, _managed(model)
    scores = [np.zeros((kv, n)) for _ in managed]
    for row, start, end in kvzip_replay_rows(prompt, ARGS):
        gradients = _torch_gradient_norms(hf_model, prompt, row)
        rec = shared_prefill.record(model, [prompt + row])
        rows = slice(n, n + len(row))
        for at, layer in enumerate(managed):
            q, k, v = rec.qkv[layer]
            q, k, v = (np.asarray(x[0], np.float64) for x in (q, k, v))
            w_o = np.asarray(model.weights()["layers"][layer]["o"], np.float64)
            scores[at][:, start:end] = kvzip_chunk_scores(q[rows], k[:n], k[rows], start, end, ARGS["n_sink"],
                                                             row_weight=gradients[layer],
                                                             written=written_norms(v[:n], w_o))
    budget = min(ARGS["budget"], n)
    return kvzip_keep(scores, n, budget, ARGS["n_sink"], cap=math.ceil(budget * 2.0)), scores


def test_kept_positions_match_torch_gradients(models):
    model, hf_model = models
    prompts = _prompts()
    out = kvjax.generate(model, prompts, method=methods.get("kvgrad", **ARGS), max_new_tokens=1, return_cache=True)
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        want, scores = _reference_kept(model, hf_model, prompt)
        assert prompt_kept(out.cache, b, n, _managed(model)) == want, f"example {b}"
        for layer, s in zip([out.cache.layers[i] for i in _managed(model)], scores, strict=True):  # kept scores
            pos, got = np.asarray(layer.pos)[b], np.asarray(layer.score)[b]
            real = (pos >= ARGS["n_sink"]) & (pos < n)
            heads = np.nonzero(real)[0]
            np.testing.assert_allclose(got[real], s[heads, pos[real]], rtol=1e-4, atol=1e-9)


def test_batch_equals_a_loop_and_one_trace_per_shape(models):
    model, _ = models
    method = methods.get("kvgrad", **dict(ARGS, budget=None, compression_ratio=0.6))
    prompts = _prompts()
    assert_generate_batch_equals_loop(model, method, prompts, max_new_tokens=4, layers=_managed(model))
    passes = ("replay_forward", "replay_backward", "replay")
    traced = [forward.TRACE_COUNTS[k] for k in passes]
    kvjax.generate(model, prompts[::-1], method=method, max_new_tokens=4)  # same shapes: no new program
    assert [forward.TRACE_COUNTS[k] for k in passes] == traced


def test_step_api_scores_as_kvzip_plus_with_unit_rows():
    """Without a replay (the plain step API) there is no gradient: each row weighs 1, each pair `||v W_O||`, which
    is KVzip+'s self-reading when every row's attention input has norm 1."""
    batch, rng = Batch(), np.random.default_rng(2)
    hidden = rng.standard_normal((len(batch.lengths), batch.t, 24))
    hidden /= np.linalg.norm(hidden, axis=-1, keepdims=True)
    w_o = jnp.asarray(rng.standard_normal((batch.n, batch.h, 24)), jnp.float32)
    args = dict(budget=10, n_sink=2)
    grad, plus = methods.get("kvgrad", **args), methods.get("kvzip", kvzip_plus_normalization=True, **args)
    capacity = grad.capacity(batch.t, 3)
    cache = batch.cache(capacity)
    cache = cache.replace(score=jnp.zeros(cache.pos.shape, jnp.float32))
    step = dataclasses.replace(batch.step(grad, capacity), out_proj=w_o)
    ours = jax.jit(grad.prefill)(cache, batch.qj(), step)
    unit_rows = dataclasses.replace(step, hidden=jnp.asarray(hidden, jnp.float32))
    theirs = jax.jit(plus.prefill)(cache, batch.qj(), unit_rows)
    np.testing.assert_array_equal(np.asarray(ours.pos), np.asarray(theirs.pos))
    np.testing.assert_allclose(np.asarray(ours.score), np.asarray(theirs.score), rtol=1e-6)


def test_refusals_name_the_reason(models):
    model, _ = models
    with pytest.raises(ConfigError, match="kvzip_plus_normalization"):
        methods.get("kvgrad", budget=8, kvzip_plus_normalization=True)
    method = methods.get("kvgrad", budget=8)
    assert method.chunk_size == 512 and method.layer_inputs == {"out_proj"}
    with pytest.raises(ConfigError, match="kv_dtype"):
        kvjax.generate(model, _prompts(), method=method, max_new_tokens=2, kv_dtype="int8")
    cache = kvjax.cache.init(1, 2, 8, 16, jnp.float32, score=True)
    q, k = jnp.zeros((1, 4, 4, 16)), jnp.zeros((1, 4, 2, 16))
    with pytest.raises(ConfigError, match="replay_gradient"):
        step_api.replay_layer(method, cache, q, k, k, jnp.arange(4)[None], jnp.asarray([[0, 4]]), layer=0,
                              inv_freq=jnp.ones(8), num_layers=1, out_proj=jnp.zeros((4, 16, 64)))
