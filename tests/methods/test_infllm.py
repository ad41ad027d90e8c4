"""InfLLM / Q-LLM block retrieval: window-by-window prefill, equivalence with full attention when
every block is retrieved, the NumPy oracle of the whole scheme (spec 2.1, 2.3) including the question
path of the runtime and the attend-mask partition, defaults and hyperparameter errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_actqkv as ref
from tiny import tiny_model

from kvjax import methods, tuning
from kvjax.errors import ConfigError
from kvjax.runtime import forward, prefill

#: Small retrieval geometry for a tiny model: 4 sinks, 16 local, blocks of 4, windows of 16.
SMALL = dict(n_init=4, n_local=16, block_size=4, window=16, repr_topk=2)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _step(config, method, tune, weights, rope, cache, tokens, positions, budget):
    with tuning.use(tune):  # as the decode loop traces it
        return forward.decode_step(config, weights, rope, method, cache, tokens, positions, budget)


def manual_decode(model, state, rest):
    """Teacher-forces `rest` `[B, n]` after prefill; returns per-step logits `[n + 1, B, V]` and the cache."""
    cache, logits = state.cache, [np.asarray(state.logits)]
    lengths = jnp.asarray(state.prompt_lengths)
    for i in range(rest.shape[1]):
        out, cache = _step(
            model.config, state.method, tuning.current(), model.weights(), model.rope(), cache,
            jnp.asarray(rest[:, i], jnp.int32), lengths + i, state.budget,
        )
        logits.append(np.asarray(out))
    return np.stack(logits), cache


def test_window_prefill_with_full_attention_equals_one_shot():
    model = tiny_model()
    prompt = np.random.default_rng(0).integers(0, 96, 75)[None]
    one = prefill(model, prompt, method="full", max_new_tokens=4)
    windows = prefill(model, prompt, method="full", max_new_tokens=4, chunk_size=16)
    np.testing.assert_allclose(np.asarray(windows.logits), np.asarray(one.logits), atol=1e-5, rtol=1e-5)
    n = 75
    windows, one = windows.cache.stacked(), one.cache.stacked()
    for a, b in ((windows.k, one.k), (windows.v, one.v)):
        np.testing.assert_allclose(np.asarray(a)[..., :n, :], np.asarray(b)[..., :n, :], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["infllm", "actqkv"])
def test_retrieving_every_block_equals_full_attention(name):
    """topk >= the number of blocks with exact RoPE: every window and decode step sees the whole causal prefix
    at the true positions (InfLLM's own scheme moves far keys to one distance: not full attention)."""
    model = tiny_model()
    rng = np.random.default_rng(1)
    lengths = [90, 71]
    seqs = [rng.integers(0, 96, n + 10) for n in lengths]
    method = methods.get(name, topk=1000, position_scheme="exact", **SMALL)
    state = prefill(model, [s[:n].tolist() for s, n in zip(seqs, lengths, strict=True)], method=method,
                    max_new_tokens=10)
    rest = np.stack([s[n : n + 9] for s, n in zip(seqs, lengths, strict=True)])
    logits, cache = manual_decode(model, state, rest)
    for b, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        full, _ = model(s[None])
        np.testing.assert_allclose(logits[:, b], np.asarray(full[0, n - 1 : n + 9]), atol=1e-4, rtol=1e-4)
    # Blocks were formed and all retrieved: the equality is not vacuous.
    last = np.array(lengths) + 8
    state = cache.stacked().state  # [L, ...]
    nb = np.asarray(state["nb"])
    np.testing.assert_array_equal(nb[0], (last - 16 - 4) // 4)
    np.testing.assert_array_equal(np.asarray(state["n_retrieved"])[0], nb[0])


def check_partition(cache, *, p, n_init, n_local, block_size, topk):
    """Spec 7.3 / 7.4: the mask of decode position `p` is exactly sinks + [F, p] + the selected blocks
    (one layer's cache, example 0, every KV head)."""
    pos = np.asarray(cache.pos)[0]
    attend = np.asarray(cache.attend)[0]
    nb = int(np.asarray(cache.state["nb"])[0])
    assert nb == (p - n_local - n_init) // block_size
    frontier = n_init + nb * block_size
    chosen = set(np.flatnonzero(np.asarray(cache.state["selected"])[0]).tolist())
    assert len(chosen) == min(topk, nb)
    for head in range(pos.shape[0]):
        for slot, j in enumerate(pos[head]):
            expect = 0 <= j <= p and (j < n_init or j >= frontier or (j - n_init) // block_size in chosen)
            assert bool(attend[head, slot]) == expect, (head, slot, j)


def _simulate(model, prompt, rest, question=None, **kw):
    return ref.simulate(model.weights(), model.config, np.asarray(model.rope()[0]), prompt, rest,
                        question=question, **kw)


@pytest.mark.parametrize("scheme", ["infllm", "exact"])
@pytest.mark.parametrize(
    "name, question, extra",
    [
        ("infllm", False, dict(similarity="dot")),
        ("qllm", True, dict(similarity="cosine", question_weight=4.0)),
    ],
)
def test_matches_numpy_oracle_on_one_layer_model(name, question, extra, scheme):
    """Logits, local scores, representative keys and the last selection equal the spec's oracle."""
    model = tiny_model(num_layers=1)
    rng = np.random.default_rng(2)
    ctx, q_ids, rest = (rng.integers(0, 96, n).tolist() for n in (100, 7, 12))
    method = methods.get(name, topk=3, position_scheme=scheme, **SMALL)
    extra = {**extra, "position_scheme": scheme}
    state = prefill(model, [ctx], method=method, max_new_tokens=len(rest), question_ids=[q_ids] if question else None)
    prompt = q_ids + ctx + q_ids if question else ctx  # Q-LLM's layout: the question opens the prompt too
    assert int(state.prompt_lengths[0]) == len(prompt)
    logits, cache = manual_decode(model, state, np.array(rest[:-1])[None])
    oracle = _simulate(model, prompt, rest, q_ids if question else None, topk=3, **SMALL, **extra)
    np.testing.assert_allclose(logits[:, 0], np.stack(oracle["logits"]), atol=1e-4, rtol=1e-4)
    seen = len(prompt) + len(rest) - 1
    state = cache.layers[0].state  # the one layer
    np.testing.assert_allclose(np.asarray(state["ls"])[0, :, :seen], oracle["ls"][:, :seen], atol=1e-5)
    nb = int(np.asarray(state["nb"])[0])
    assert nb == len(oracle["reps"]) > 10
    np.testing.assert_allclose(np.asarray(state["rep"])[0, :nb], np.stack(oracle["reps"]), atol=1e-5)
    assert np.flatnonzero(np.asarray(state["selected"])[0]).tolist() == oracle["selected"]
    if question:
        assert bool(np.asarray(state["qv_set"])[0])
        np.testing.assert_allclose(np.asarray(state["qv"])[0], oracle["qv"], atol=1e-5)
    check_partition(cache.layer(0), p=seen - 1, n_init=4, n_local=16, block_size=4, topk=3)
    # Retrieval really restricts attention: not the full-attention logits.
    full, _ = model(np.array(prompt + rest)[None])
    assert np.abs(logits[:, 0] - np.asarray(full[0, len(prompt) - 1 : -1])).max() > 1e-2


def test_defaults_reproduce_official_configs():
    inf = methods.get("infllm")
    geometry = (inf.n_init, inf.n_local, inf.block_size, inf.topk, inf.repr_topk, inf.window)
    assert geometry == (128, 4096, 128, 16, 4, 512)
    assert inf.similarity == "dot" and inf.retrieval_position == 4095
    q = methods.get("qllm")
    assert (q.n_init, q.n_local, q.block_size, q.topk, q.window, q.similarity, q.question_weight) == (
        64, 512, 64, 23, 256, "cosine", 4.0)
    # budget= (tokens attended per step) sets topk: 2048 = 64 sinks + 512 local + 23 x 64.
    assert methods.get("qllm", budget=2048).retrieved_blocks == 23
    assert inf.prefill_window() == 512


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=0), dict(topk=0), dict(repr_topk=9, block_size=8), dict(similarity="l2"),
        dict(n_local=0), dict(compression_ratio=0.5), dict(budget=100), dict(window=-1), dict(n_init=True),
    ],
)
def test_bad_hyperparameters_raise(kwargs):
    with pytest.raises(ConfigError):
        methods.get("infllm", **kwargs)


def test_bad_question_weight_raises():
    with pytest.raises(ConfigError):
        methods.get("qllm", question_weight=-1.0)
