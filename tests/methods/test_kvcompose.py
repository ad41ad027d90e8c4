"""KVCompose (composite tokens from a replay of the context): kept positions against a NumPy float64 reference of
kvpress's `KVComposePress` (scores, composite curves, the cross-layer allocation), on the tiny model end to end.

Oracle for the replay: the model's own full-cache forward over `prompt + prompt` (`shared_prefill.record`, one
example at a time), whose recorded post-RoPE queries / keys / values feed `reference_scorers.kvcompose_*`; the rows
are built here, independently of `KVCompose.replay_rows`. Invariants: budget above the prompt keeps everything, a
batch equals a loop over its examples, one count per layer (structured), the per-head cap and real memory savings.
"""

import math

import jax
import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    assert_generate_batch_equals_loop,
    assert_keeps_everything,
    generate_and_check,
    kept,
    prompt_kept,
)
from reference_scorers import kvcompose_keep, kvcompose_scores
from tiny import assert_caches_close, random_prompts, tiny_gemma3, tiny_model

import kvjax
from kvjax import methods
from kvjax.errors import ConfigError, KvjaxError
from kvjax.methods import kvcompose as kvcompose_module
from kvjax.runtime import shared_prefill
from kvjax.runtime.generate import bucket_length

PROMPTS = (31, 12, 40)  # ragged
SCORE_ARGS = ("agg_task", "agg_group", "add_v_norm", "add_mean_across_heads")


def _model():
    return tiny_model(num_layers=3)


def _reference_scores(model, prompt: list[int], a: dict) -> list[np.ndarray]:
    """Per layer `[K, n]` from one forward over the prompt followed by itself."""
    rec = shared_prefill.record(model, [prompt + prompt])
    return [kvcompose_scores(*(np.asarray(x[0], np.float64) for x in qkv), len(prompt),
                             **{k: a[k] for k in SCORE_ARGS if k in a}) for qkv in rec.qkv]


def _want(method, scores: list[np.ndarray], n: int) -> list:
    layers, kv = len(scores), scores[0].shape[0]
    entries = layers * (1 if method.structured else kv)
    budget = method.prompt_budget(n)
    if method.compression_ratio is not None:  # kvpress's compute_n_kept over every entry, in float64
        total = max(1, int(entries * n * (1 - method.compression_ratio)))
    else:
        total = budget * entries
    cap = min(math.ceil(budget * method.max_head_share), n)
    return kvcompose_keep(scores, n, total, cap, structured=method.structured, agg_head=method.agg_head,
                          lower_bound=method.keep_token_lower_bound)


@pytest.mark.parametrize("args, row_block", [
    (dict(budget=8), 256),
    (dict(compression_ratio=0.6), 8),  # the replay rows (64 wide) scored eight blocks at a time, as long prompts are
    (dict(budget=8, structured=False), 256),
    (dict(compression_ratio=0.55, structured=False, agg_task="mean", agg_group="max"), 256),
    (dict(budget=8, agg_task="mean", agg_head="max", add_v_norm=True, add_mean_across_heads=False,
          keep_token_lower_bound=3), 256),
    (dict(budget=5, max_head_share=1.2, keep_token_lower_bound=2, structured=False, add_v_norm=True), 256),
])
def test_kept_positions_match_the_reference(args, row_block, monkeypatch):
    monkeypatch.setattr(kvcompose_module, "REPLAY_ROW_BLOCK", row_block)
    jax.clear_caches()  # the programs are traced again with this block
    model, method = _model(), methods.get("kvcompose", **args)
    prompts = random_prompts(7, PROMPTS)
    out = kvjax.generate(model, prompts, method=method, max_new_tokens=1, return_cache=True)
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        scores = _reference_scores(model, prompt, args)
        assert prompt_kept(out.cache, b, n) == _want(method, scores, n), f"example {b}"
        for layer, s in zip(out.cache.layers, scores, strict=True):  # the scores kvjax kept, at their positions
            pos, got = np.asarray(layer.pos)[b], np.asarray(layer.score)[b]
            real = (pos >= 0) & (pos < n)
            heads = np.nonzero(real)[0]
            np.testing.assert_allclose(got[real], s[heads, pos[real]], rtol=2e-5, atol=1e-7)


def _self_read_scores(batch, b: int, a: dict) -> np.ndarray:
    """`[K, n]` scores of example `b` read by its own prompt (the step API without a replay), float64: row `t`'s
    causal softmax over `[0, t]`, aggregated over the rows (the mean over all `n` rows) and the group, enhanced."""
    n, group = int(batch.lengths[b]), batch.n // batch.kv
    q, k, v = (x[b].astype(np.float64) for x in (batch.q, batch.k, batch.v))
    per_head = np.zeros((batch.n, n, n))
    for head in range(batch.n):
        for t in range(n):
            logits = k[: t + 1, head // group] @ q[t, head] / math.sqrt(batch.h)
            p = np.exp(logits - logits.max())
            per_head[head, t, : t + 1] = p / p.sum()
    rows = per_head.max(axis=1) if a.get("agg_task", "max") == "max" else per_head.mean(axis=1)
    grouped = rows.reshape(batch.kv, group, n)
    out = grouped.max(axis=1) if a.get("agg_group") == "max" else grouped.mean(axis=1)
    if a.get("add_v_norm"):
        out = out * np.linalg.norm(v[:n], axis=-1).T
    if a.get("add_mean_across_heads", True):
        out = out + out.mean(axis=0, keepdims=True)
    return out


@pytest.mark.parametrize("args", [dict(budget=10), dict(budget=10, structured=False),
                                  dict(budget=9, agg_task="mean", agg_group="max", add_v_norm=True)])
def test_step_api_without_a_replay_matches_the_reference(args):
    """A model of the user's own calling `prefill`: the prompt reads itself, then one layer's allocation."""
    batch = Batch()
    method = methods.get("kvcompose", **args)
    capacity = method.capacity(batch.t, 3)
    out = jax.jit(method.prefill)(batch.cache(capacity), batch.qj(), batch.step(method, capacity))
    for b, n in enumerate(batch.lengths):
        n = int(n)
        budget = method.prompt_budget(n)
        want = kvcompose_keep([_self_read_scores(batch, b, args)], n, budget * (1 if method.structured else batch.kv),
                              min(math.ceil(budget * 2.0), capacity), structured=method.structured)
        assert [[kept(out, b, k) for k in range(batch.kv)]] == want, f"example {b}"


def test_budget_above_the_prompt_keeps_everything():
    prompts = random_prompts(7, PROMPTS)
    full = kvjax.generate(_model(), prompts, method="full", max_new_tokens=6)
    for structured in (True, False):
        method = methods.get("kvcompose", budget=64, structured=structured)
        out = kvjax.generate(_model(), prompts, method=method, max_new_tokens=6, return_cache=True)
        np.testing.assert_array_equal(out.tokens, full.tokens)
        for b, n in enumerate(PROMPTS):
            assert all(head == list(range(n)) for layer in prompt_kept(out.cache, b, n) for head in layer)
        assert_keeps_everything(methods.get("kvcompose", budget=50, structured=structured), Batch())


def test_batch_equals_a_loop_over_examples():
    prompts = random_prompts(9, PROMPTS)
    for structured in (True, False):
        method = methods.get("kvcompose", compression_ratio=0.6, structured=structured)
        assert_generate_batch_equals_loop(_model(), method, prompts)
        assert_batch_equals_loop(method, Batch(lengths=(30, 17, 24)))


def test_end_to_end_generate():
    """`max_head_share = 1`: no layer (head) may exceed the budget and the total is the budget per layer (head), so
    every layer and head keeps exactly its budget."""
    lengths = (40, 23, 31)
    for structured in (True, False):
        generate_and_check(methods.get("kvcompose", budget=7, max_head_share=1.0, structured=structured), lengths,
                           prompt_kept=lambda layer, b: min(7, lengths[b]))


def test_composite_tokens_per_layer_and_memory():
    """Structured: every head of a layer holds the same count, the layers' counts differ, sum to the budget per
    layer, and layer 0 holds the most; the cache is allocated at the cap (+ new tokens), not at the prompt."""
    prompts = random_prompts(7, PROMPTS)
    method = methods.get("kvcompose", budget=8)
    out = kvjax.generate(_model(), prompts, method=method, max_new_tokens=4, return_cache=True)
    bucket = bucket_length(max(PROMPTS))
    assert out.cache.layers[0].capacity == method.capacity(bucket, 4) == 16 + 4 < bucket
    differ = False
    for b, n in enumerate(PROMPTS):
        counts = []
        for layer in prompt_kept(out.cache, b, n):
            assert len({len(head) for head in layer}) == 1
            counts.append(len(layer[0]))
        assert sum(counts) == 3 * min(8, n) and counts[0] == max(counts) and max(counts) <= min(16, n)
        differ |= len(set(counts)) > 1
    assert differ
    loose = kvjax.generate(_model(), prompts, method=methods.get("kvcompose", budget=8, structured=False),
                           max_new_tokens=1, return_cache=True)
    sizes = [len(head) for b, n in enumerate(PROMPTS) for layer in prompt_kept(loose.cache, b, n) for head in layer]
    assert max(sizes) <= 16 and len(set(sizes)) > 1  # unstructured: heads of a layer differ, within the cap


def test_shared_prefill_and_sliding_window_model():
    """The eval's shared prefill (one recording, the replay from it) equals the method's own prefill; on a model with
    sliding-window layers the rings keep their window and the one global layer is compressed."""
    model, prompts = _model(), random_prompts(14, PROMPTS)
    for structured in (True, False):
        method = methods.get("kvcompose", compression_ratio=0.5, structured=structured)
        shared = shared_prefill.prefill_from(model, shared_prefill.record(model, prompts), method, max_new_tokens=4)
        own = kvjax.prefill(model, prompts, method=method, max_new_tokens=4)
        assert_caches_close(shared.cache, own.cache, tol=1e-5, name=str(method))
    gemma = tiny_gemma3(window=8)
    method = methods.get("kvcompose", budget=8)
    out = kvjax.generate(gemma, prompts, method=method, max_new_tokens=3, return_cache=True)
    full = kvjax.generate(gemma, prompts, method="full", max_new_tokens=3)
    np.testing.assert_array_equal(out.tokens[:, 0], full.tokens[:, 0])
    assert out.cache.layers[1].capacity == method.capacity(bucket_length(max(PROMPTS)), 3)
    for b, n in enumerate(PROMPTS):  # one managed layer: the whole total, every head the same count
        assert [len(h) for h in prompt_kept(out.cache, b, n)[1]] == [min(8, n)] * 2


def test_replay_rows_are_the_prompt():
    method = methods.get("kvcompose", budget=8)
    prompts = random_prompts(7, PROMPTS)
    tokens = np.zeros((3, 40), np.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    [(rows, lengths, spans)] = method.replay_rows(tokens, np.asarray(PROMPTS))
    for b, prompt in enumerate(prompts):
        assert rows[b, : lengths[b]].tolist() == prompt and spans[b].tolist() == [0, len(prompt)]
    assert method.replay_width(40) == 40


@pytest.mark.parametrize("bad, match", [
    (dict(budget=None), "budget"), (dict(agg_task="sum"), "agg_task"), (dict(agg_group="median"), "agg_group"),
    (dict(agg_head=1), "agg_head"), (dict(structured="yes"), "structured"), (dict(add_v_norm=1), "add_v_norm"),
    (dict(add_mean_across_heads=None), "add_mean_across_heads"),
    (dict(keep_token_lower_bound=-1), "keep_token_lower_bound"), (dict(max_head_share=0.5), "max_head_share"),
])
def test_bad_hyperparameters(bad, match):
    with pytest.raises(ConfigError, match=match):
        methods.get("kvcompose", **dict(dict(budget=8), **bad))


def test_refusals_name_the_reason():
    method = methods.get("kvcompose", budget=8)
    with pytest.raises(ConfigError, match="kv_dtype"):
        kvjax.generate(_model(), random_prompts(7, PROMPTS), method=method, max_new_tokens=2, kv_dtype="int8")
    short = tiny_model(num_layers=3, max_position_embeddings=64)
    with pytest.raises(KvjaxError, match="replay rows reach position"):  # 40 prompt + 40 replayed positions
        kvjax.generate(short, random_prompts(7, (40,)), method=method, max_new_tokens=2)
