"""KVzip (context reconstruction): kept positions against a NumPy float64 reference of the paper's scoring and
kvpress's budget allocation, on the tiny model end to end (`kvjax.generate`, ragged batch, chunked replay).

Oracle for the replay: the model's own full-cache forward over `prompt + repeat row` (`shared_prefill.record`,
one example and one chunk at a time), whose recorded post-RoPE queries / keys feed `reference_scorers.kvzip_*`;
the rows are built here from the paper's template, independently of `KVzip.replay_rows`. Invariants: budget above
the prompt keeps everything, a batch equals a loop over its examples, per-head caps, real memory savings.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, assert_generate_batch_equals_loop, prompt_kept
from reference_scorers import kvzip_chunk_scores, kvzip_keep, kvzip_replay_rows, written_norms
from tiny import random_prompts, tiny_gemma3, tiny_model

import kvjax
from kvjax import methods
from kvjax.errors import ConfigError, KvjaxError
from kvjax.methods import kvzip as kvzip_module
from kvjax.methods.kvzip import prompt_ids
from kvjax.runtime import shared_prefill
from kvjax.runtime.generate import bucket_length

PROMPTS = (31, 12, 40)  # ragged; chunks of 16 after a 3-token opening: 2, 1 and 3 replay chunks
ARGS = dict(budget=8, chunk_size=16, n_sink=2, context_start=3, repeat_ids=[5, 6, 7], continue_ids=[8, 9],
            suffix_ids=[10], tail=4)


def _model():
    return tiny_model(num_layers=3)


def _reference_scores(model, prompt: list[int], a: dict) -> list[np.ndarray]:
    """Per layer `[K, n]`; KVzip+ (`kvzip_plus_normalization`) from the recorded attention inputs of the rows, the
    context's values and the layer's W_O."""
    n, kv = len(prompt), model.config.num_kv_heads
    plus = a.get("kvzip_plus_normalization", False)
    scores = [np.zeros((kv, n)) for _ in range(model.config.num_layers)]
    for row, start, end in kvzip_replay_rows(prompt, a):
        rec = shared_prefill.record(model, [prompt + row], layer_inputs={"hidden"} if plus else ())
        for layer, (q, k, v) in enumerate(rec.qkv):
            q, k = np.asarray(q[0], np.float64), np.asarray(k[0], np.float64)
            rows = slice(n, n + len(row))
            weights = {}
            if plus:  # KVzip+: rows over ||h||, pairs times ||v W_O||
                hidden = np.asarray(rec.inputs["hidden"][layer][0], np.float64)[rows]
                w_o = np.asarray(model.weights()["layers"][layer]["o"], np.float64)
                weights = dict(row_weight=1.0 / np.linalg.norm(hidden, axis=-1),
                               written=written_norms(np.asarray(v[0], np.float64)[:n], w_o))
            scores[layer][:, start:end] = kvzip_chunk_scores(q[rows], k[:n], k[rows], start, end, a["n_sink"],
                                                             **weights)
    return scores


@pytest.mark.parametrize("layerwise, row_block, plus", [
    (False, 256, False), (True, 256, False), (False, 8, False), (False, 256, True), (True, 8, True)])
def test_kept_positions_match_the_reference(layerwise, row_block, plus, monkeypatch):
    # row_block 8: the replay rows (32 wide here) scored four blocks at a time, as long prompts are; plus: KVzip+
    monkeypatch.setattr(kvzip_module, "REPLAY_ROW_BLOCK", row_block)
    jax.clear_caches()  # the programs are traced again with this block
    model, args = _model(), dict(ARGS, layerwise=layerwise, kvzip_plus_normalization=plus)
    method = methods.get("kvzip", **args)
    prompts = random_prompts(7, PROMPTS)
    out = kvjax.generate(model, prompts, method=method, max_new_tokens=1, return_cache=True)
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        scores = _reference_scores(model, prompt, args)
        budget = min(args["budget"], n)
        want = kvzip_keep(scores, n, budget, args["n_sink"], cap=int(np.ceil(budget * 2.0)), layerwise=layerwise)
        assert prompt_kept(out.cache, b, n) == want, f"example {b}"
        for layer, s in zip(out.cache.layers, scores, strict=True):  # the scores kvjax kept, at their positions
            pos, got = np.asarray(layer.pos)[b], np.asarray(layer.score)[b]
            real = (pos >= args["n_sink"]) & (pos < n)
            heads = np.nonzero(real)[0]
            np.testing.assert_allclose(got[real], s[heads, pos[real]], rtol=2e-5, atol=1e-7)


def _self_read_scores(batch, b: int, hidden: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    """`[K, n]` KVzip+ scores of example `b` read by its own prompt (the step API without a replay), float64: row
    `t`'s causal softmax over `[0, t]` divided by `||h_t||`, times `||v_c W_O[head]||`, max over rows and group."""
    n, group = int(batch.lengths[b]), batch.n // batch.kv
    q, k, v = (x[b].astype(np.float64) for x in (batch.q, batch.k, batch.v))
    out = np.zeros((batch.kv, n))
    for head in range(batch.n):
        kh = head // group
        written = np.linalg.norm(v[:n, kh] @ w_o[head], axis=-1)
        for t in range(n):
            logits = k[: t + 1, kh] @ q[t, head] / math.sqrt(batch.h)
            p = np.exp(logits - logits.max())
            p = p / p.sum() / np.linalg.norm(hidden[b, t]) * written[: t + 1]
            out[kh, : t + 1] = np.maximum(out[kh, : t + 1], p)
    return out


def test_kvzip_plus_through_the_step_api_matches_the_reference():
    """Without the replay (a model of the user's own calling `prefill`), KVzip+ normalises the prompt's own reading."""
    batch, rng = Batch(), np.random.default_rng(5)
    hidden = rng.standard_normal((len(batch.lengths), batch.t, 24)) * rng.uniform(0.5, 3.0, (1, batch.t, 1))
    w_o = rng.standard_normal((batch.n, batch.h, 24))
    method = methods.get("kvzip", budget=10, n_sink=2, kvzip_plus_normalization=True)
    assert method.layer_inputs == {"hidden", "out_proj"}
    capacity = method.capacity(batch.t, 3)
    step = dataclasses.replace(batch.step(method, capacity), hidden=jnp.asarray(hidden, jnp.float32),
                               out_proj=jnp.asarray(w_o, jnp.float32))
    cache = batch.cache(capacity)
    cache = cache.replace(score=jnp.zeros(cache.pos.shape, jnp.float32))  # the runtime's `uses_score` accumulator
    out = jax.jit(method.prefill)(cache, batch.qj(), step)
    for b, n in enumerate(batch.lengths):
        want = kvzip_keep([_self_read_scores(batch, b, hidden, w_o)], int(n), min(10, int(n)), 2,
                          cap=min(20, int(n)), layerwise=True)
        got = [[sorted(int(p) for p in head if 0 <= p < n) for head in np.asarray(out.pos)[b]]]
        assert got == want, f"example {b}"
    plain = jax.jit(methods.get("kvzip", budget=10, n_sink=2).prefill)(cache, batch.qj(), step)
    assert not np.array_equal(np.asarray(plain.pos), np.asarray(out.pos))  # the normalisation changes the choice


def test_first_token_comes_from_the_uncompressed_prompt():
    prompts = random_prompts(7, PROMPTS)
    ours = kvjax.generate(_model(), prompts, method=methods.get("kvzip", **ARGS), max_new_tokens=3)
    full = kvjax.generate(_model(), prompts, method="full", max_new_tokens=3)
    np.testing.assert_array_equal(ours.tokens[:, 0], full.tokens[:, 0])


def test_batch_equals_a_loop_over_examples():
    method = methods.get("kvzip", **dict(ARGS, budget=None, compression_ratio=0.6))
    assert_generate_batch_equals_loop(_model(), method, random_prompts(9, PROMPTS))


def test_budget_above_the_prompt_keeps_everything():
    prompts = random_prompts(7, PROMPTS)
    out = kvjax.generate(_model(), prompts, method=methods.get("kvzip", **dict(ARGS, budget=64)), max_new_tokens=6,
                         return_cache=True)
    full = kvjax.generate(_model(), prompts, method="full", max_new_tokens=6)
    np.testing.assert_array_equal(out.tokens, full.tokens)
    for b, n in enumerate(PROMPTS):
        assert all(head == list(range(n)) for layer in prompt_kept(out.cache, b, n) for head in layer)


def test_head_cap_and_memory():
    """`max_head_share = 1`: no head may exceed the budget and the total is `budget` per head, so every head keeps
    exactly its budget; the cache is allocated at the cap (+ new tokens), not at the prompt."""
    prompts = random_prompts(7, PROMPTS)
    uniform = methods.get("kvzip", **dict(ARGS, max_head_share=1.0))
    out = kvjax.generate(_model(), prompts, method=uniform, max_new_tokens=1, return_cache=True)
    for b, n in enumerate(PROMPTS):
        assert all(len(head) == min(8, n) for layer in prompt_kept(out.cache, b, n) for head in layer)
    adaptive = methods.get("kvzip", **ARGS)
    out = kvjax.generate(_model(), prompts, method=adaptive, max_new_tokens=4, return_cache=True)
    bucket = bucket_length(max(PROMPTS))
    assert out.cache.layers[0].capacity == adaptive.capacity(bucket, 4) == 16 + 4 < bucket
    sizes = [len(head) for b, n in enumerate(PROMPTS) for layer in prompt_kept(out.cache, b, n) for head in layer]
    assert max(sizes) <= 16 and len(set(sizes)) > 1  # heads differ (non-uniform), within the cap


def test_replay_rows_follow_the_template():
    method = methods.get("kvzip", **ARGS)
    prompts = random_prompts(7, PROMPTS)
    tokens = np.zeros((3, 40), np.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    chunks = method.replay_rows(tokens, np.asarray(PROMPTS))
    assert len(chunks) == 3
    for b, prompt in enumerate(prompts):
        want = list(kvzip_replay_rows(prompt, ARGS))
        for i, (rows, lengths, spans) in enumerate(chunks):
            if i < len(want):
                row, start, end = want[i]
                assert rows[b, : lengths[b]].tolist() == row and spans[b].tolist() == [start, end]
            else:
                assert lengths[b] == 0 and spans[b, 0] == spans[b, 1]


def test_sliding_window_model_compresses_its_global_layers():
    model = tiny_gemma3(window=8)
    prompts = random_prompts(7, PROMPTS)
    method = methods.get("kvzip", **ARGS)
    out = kvjax.generate(model, prompts, method=method, max_new_tokens=3, return_cache=True)
    full = kvjax.generate(model, prompts, method="full", max_new_tokens=3)
    np.testing.assert_array_equal(out.tokens[:, 0], full.tokens[:, 0])
    global_layer = out.cache.layers[1]
    assert global_layer.capacity == method.capacity(bucket_length(max(PROMPTS)), 3)
    for b, n in enumerate(PROMPTS):
        kept = np.asarray(global_layer.pos)[b]
        assert ((kept < n) & (kept >= 0)).sum() == 2 * min(8, n)  # one managed layer: the whole budget, both heads


def test_prompt_ids_from_a_chat_template():
    class Tokenizer:
        chat_template = "yes"

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, **_):
            return "<u>" + messages[0]["content"] + "</u><a>"

    ids = prompt_ids(Tokenizer())
    assert ids["context_start"] == 3 and ids["suffix_ids"] == [ord(c) for c in "</u><a>"]
    assert "".join(map(chr, ids["repeat_ids"])) == "\n\nRepeat the previous context exactly."
    plain = prompt_ids(Tokenizer(), chat_template=False)  # prompts built without the template
    assert plain["suffix_ids"] == [ord("\n")] and plain["context_start"] == 0
    bare = methods.get("kvzip", budget=8)
    assert bare.with_tokenizer(Tokenizer(), True) == methods.get("kvzip", budget=8, **ids)
    assert methods.get("kvzip", **ARGS).with_tokenizer(Tokenizer(), True) == methods.get("kvzip", **ARGS)
    Tokenizer.chat_template = None
    assert prompt_ids(Tokenizer()) == plain


@pytest.mark.parametrize("bad, match", [
    (dict(budget=None), "budget"), (dict(chunk_size=0), "chunk_size"), (dict(repeat_ids=[1, -2]), "repeat_ids"),
    (dict(max_head_share=0.5), "max_head_share"), (dict(layerwise="yes"), "layerwise"), (dict(n_sink=-1), "n_sink"),
    (dict(kvzip_plus_normalization=1), "kvzip_plus_normalization"),
])
def test_bad_hyperparameters(bad, match):
    with pytest.raises(ConfigError, match=match):
        methods.get("kvzip", **dict(ARGS, **bad))


def test_refusals_name_the_reason():
    method = methods.get("kvzip", **ARGS)
    with pytest.raises(ConfigError, match="kv_dtype"):
        kvjax.generate(_model(), random_prompts(7, PROMPTS), method=method, max_new_tokens=2, kv_dtype="int8")
    short = tiny_model(num_layers=3, max_position_embeddings=64)
    with pytest.raises(KvjaxError, match="replay rows reach position"):
        kvjax.generate(short, random_prompts(7, (50,)), method=method, max_new_tokens=2)
    rec = shared_prefill.record(_model(), random_prompts(7, PROMPTS))
    with pytest.raises(ConfigError, match="kv_dtype"):  # the shared-prefill path refuses it the same way
        shared_prefill.prefill_from(_model(), rec, method, max_new_tokens=2, kv_dtype="int8")
