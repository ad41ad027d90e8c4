"""Shared-forward sweeps: one recorded prefill replayed per method equals each method's own prefill.

Oracle: `kvjax.prefill` + `kvjax.decode` run cell by cell (the path every method is tested on); the replay must
keep exactly the same positions, generate the same tokens and match keys / values / logits up to float rounding
(the two are different XLA programs). Replaying one cell alone or inside a sweep is bit for bit the same.
"""

import numpy as np
import pytest
from tiny import assert_caches_close, assert_trees_equal, random_prompts, tiny_gemma3, tiny_model

import kvjax
from kvjax import methods
from kvjax.errors import KvjaxError
from kvjax.runtime import TRACE_COUNTS, shared_prefill

# Every qualifying method, with small settings that make it evict in a 30-token prompt.
CELLS = [
    ("full", {}),
    ("snapkv", {"budget": 12, "window_size": 4}),
    ("snapkv", {"compression_ratio": 0.5, "window_size": 4}),
    ("pyramidkv", {"budget": 12, "window_size": 4}),
    ("adakv", {"budget": 12, "base_args": {"window_size": 4}}),
    ("streaming_llm", {"budget": 10}),
    ("streaming_llm", {"budget": 10, "rerotate": True}),
    ("h2o", {"budget": 12}),
    ("tova", {"budget": 12}),
    ("knorm", {"compression_ratio": 0.5}),
    ("lagkv", {"budget": 12, "sink_size": 2, "lag_size": 4}),
    ("lagkv", {"retention": 0.5, "sink_size": 2, "lag_size": 4}),
    ("random", {"budget": 12}),
    ("nacl", {"budget": 12, "window_size": 4}),
    ("sagekv", {"budget": 12}),
    ("ahakv", {"budget": 12, "recent_size": 4}),
    ("lm_infinite", {"budget": 12, "n_global": 4}),
]
# Methods that read the question as the end of the prompt replay a recording with the question appended.
QUESTION_IN_PROMPT_CELLS = [
    ("quest", {"budget": 16, "page_size": 4, "dense_layers": 0}),
    ("quest", {"compression_ratio": 0.5, "page_size": 4, "dense_layers": 1}),
]


def _method(name, args):
    try:
        return methods.get(name, **args)
    except Exception as e:  # a method whose defaults need other settings: fail loudly, not skip
        raise AssertionError(f"{name}({args}): {e}") from e


def test_which_methods_share():
    for name, args in CELLS + QUESTION_IN_PROMPT_CELLS:
        assert shared_prefill.shares_prefill(_method(name, args)), name
    for name in ("infllm", "qllm", "actqkv"):  # chunked / question first / retrieval hooks
        assert not shared_prefill.shares_prefill(methods.get(name)), name
    assert not shared_prefill.shares_prefill(methods.get("snapkv", budget=40), chunk_size=8)
    with pytest.raises(KvjaxError, match="cannot be replayed"):
        rec = shared_prefill.record(tiny_model(), random_prompts(0, (9,)))
        shared_prefill.prefill_from(tiny_model(), rec, methods.get("infllm"), max_new_tokens=2)


@pytest.mark.slow
def test_replay_equals_each_methods_own_prefill_and_decode():
    model = tiny_model()
    prompts = random_prompts(1, (30, 9, 23))  # ragged, one prompt shorter than the budgets
    questions = random_prompts(2, (3, 0, 5))  # appended uncompressed after compression (query-agnostic)
    rec = shared_prefill.record(model, prompts, question_ids=questions)
    for name, args in CELLS:
        method = _method(name, args)
        own = kvjax.prefill(model, prompts, method=method, max_new_tokens=6, question_ids=questions)
        shared = shared_prefill.prefill_from(model, rec, method, max_new_tokens=6)
        np.testing.assert_allclose(
            np.asarray(shared.logits), np.asarray(own.logits), rtol=1e-5, atol=1e-5, err_msg=name
        )
        np.testing.assert_array_equal(shared.prompt_lengths, own.prompt_lengths)
        assert_caches_close(shared.cache, own.cache, tol=1e-5, name=name)
        own_tokens, own_count, _ = kvjax.decode(model, own, max_new_tokens=6)
        tokens, count, _ = kvjax.decode(model, shared, max_new_tokens=6)
        np.testing.assert_array_equal(tokens, own_tokens, err_msg=name)
        np.testing.assert_array_equal(count, own_count)


def test_a_recorded_log_sum_exp_serves_h2o_and_changes_no_other_method():
    model = tiny_model()
    prompts, questions = random_prompts(12, (30, 9, 23)), random_prompts(13, (3, 0, 5))
    rec = shared_prefill.record(model, prompts, question_ids=questions, attention_lse=True)
    layers, batch = model.config.num_layers, len(prompts)
    assert rec.lse is not None and len(rec.lse) == layers
    assert all(lse.shape[:2] == (batch, model.config.num_kv_heads) for lse in rec.lse)
    cells = (("h2o", {"budget": 12}), ("h2o", {"budget": 12, "window_size": 2}),
             ("snapkv", {"budget": 12, "window_size": 4}))
    for name, args in cells:
        method = _method(name, args)
        own = kvjax.prefill(model, prompts, method=method, max_new_tokens=6, question_ids=questions)
        shared = shared_prefill.prefill_from(model, rec, method, max_new_tokens=6)
        assert_caches_close(shared.cache, own.cache, tol=1e-5, name=name)
        np.testing.assert_allclose(np.asarray(shared.logits), np.asarray(own.logits), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(
            kvjax.decode(model, shared, max_new_tokens=6)[0], kvjax.decode(model, own, max_new_tokens=6)[0]
        )


def test_question_in_prompt_replay_equals_its_own_prefill_and_decode():
    model = tiny_model()
    prompts, questions = random_prompts(8, (30, 9, 23)), random_prompts(9, (3, 0, 5))
    rec = shared_prefill.record(model, prompts, question_ids=questions, question_in_prompt=True)
    assert rec.q_tokens is None and list(rec.lengths) == [33, 9, 28]
    for name, args in QUESTION_IN_PROMPT_CELLS:
        method = _method(name, args)
        own = kvjax.prefill(model, prompts, method=method, max_new_tokens=6, question_ids=questions)
        shared = shared_prefill.prefill_from(model, rec, method, max_new_tokens=6)
        np.testing.assert_allclose(np.asarray(shared.logits), np.asarray(own.logits), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(shared.prompt_lengths, own.prompt_lengths)
        assert_caches_close(shared.cache, own.cache, tol=1e-5, name=name)
        np.testing.assert_array_equal(
            kvjax.decode(model, shared, max_new_tokens=6)[0], kvjax.decode(model, own, max_new_tokens=6)[0]
        )


def test_a_recording_replays_only_methods_that_put_the_question_where_it_was_recorded():
    model = tiny_model()
    prompts, questions = random_prompts(10, (20, 12)), random_prompts(11, (4, 2))
    quest = _method(*QUESTION_IN_PROMPT_CELLS[0])
    with pytest.raises(KvjaxError, match="record with question_in_prompt=True"):
        shared_prefill.prefill_from(model, shared_prefill.record(model, prompts, question_ids=questions), quest,
                                    max_new_tokens=2)
    inside = shared_prefill.record(model, prompts, question_ids=questions, question_in_prompt=True)
    with pytest.raises(KvjaxError, match="would compress it with the context"):
        shared_prefill.prefill_from(model, inside, methods.get("snapkv", budget=12, window_size=4), max_new_tokens=2)
    shared_prefill.prefill_from(model, shared_prefill.record(model, prompts), quest, max_new_tokens=2)  # no question


def test_a_replayed_cell_is_bit_identical_alone_and_in_a_sweep():
    model = tiny_model()
    prompts, questions = random_prompts(6, (28, 13)), random_prompts(7, (4, 2))
    sweep = [methods.get("snapkv", budget=12, window_size=4), methods.get("knorm", budget=10), methods.get("full")]
    rec = shared_prefill.record(model, prompts, question_ids=questions)
    together = [shared_prefill.prefill_from(model, rec, m, max_new_tokens=5) for m in sweep]
    for method, state in zip(sweep, together, strict=True):
        alone = shared_prefill.prefill_from(
            model, shared_prefill.record(model, prompts, question_ids=questions), method, max_new_tokens=5
        )
        assert_trees_equal(alone.cache, state.cache)
        np.testing.assert_array_equal(np.asarray(alone.logits), np.asarray(state.logits))
        np.testing.assert_array_equal(
            kvjax.decode(model, alone, max_new_tokens=5)[0], kvjax.decode(model, state, max_new_tokens=5)[0]
        )


def test_kvzip_scores_once_per_recording_and_equals_its_own_prefill(monkeypatch):
    """A context replay (KVzip) runs from the recording once, whatever the budgets: each amount's cell equals
    `kvjax.prefill` with that amount (kept positions, logits, tokens), and alone equals in a sweep bit for bit."""
    model = tiny_model(num_layers=3)
    prompts, questions = random_prompts(14, (31, 12, 40)), random_prompts(15, (3, 0, 5))
    base = dict(chunk_size=16, n_sink=2, context_start=3, repeat_ids=[5, 6, 7], continue_ids=[8, 9], suffix_ids=[10],
                tail=4)
    amounts = (dict(budget=8), dict(compression_ratio=0.5), dict(budget=8, layerwise=True))
    cells = [methods.get("kvzip", **base, **a) for a in amounts]
    assert all(shared_prefill.shares_prefill(m) for m in cells)
    scored = []
    real_score = shared_prefill.replay.score
    monkeypatch.setattr(shared_prefill.replay, "score", lambda *a, **k: scored.append(1) or real_score(*a, **k))
    rec = shared_prefill.record(model, prompts, question_ids=questions)
    together = [shared_prefill.prefill_from(model, rec, m, max_new_tokens=6) for m in cells]
    assert len(scored) == 2  # one replay for both amounts; layerwise is another setting, so another replay
    assert all(shared_prefill.replay_seconds(rec, m, max_new_tokens=6) > 0 for m in cells)
    assert shared_prefill.replay_seconds(rec, methods.get("knorm", budget=8), max_new_tokens=6) == 0.0
    kept = [{int(p) for p in np.asarray(s.cache.layers[0].pos)[0].ravel() if p >= 0} for s in together[:2]]
    assert kept[0] != kept[1]  # the amounts differ, so a reused scored cache compacted wrongly would show
    for method, shared in zip(cells, together, strict=True):
        alone = shared_prefill.prefill_from(
            model, shared_prefill.record(model, prompts, question_ids=questions), method, max_new_tokens=6)
        assert_trees_equal(alone.cache, shared.cache)
        np.testing.assert_array_equal(np.asarray(alone.logits), np.asarray(shared.logits))
        own = kvjax.prefill(model, prompts, method=method, max_new_tokens=6, question_ids=questions)
        assert_caches_close(shared.cache, own.cache, tol=1e-5, name=str(method))
        np.testing.assert_allclose(np.asarray(shared.logits), np.asarray(own.logits), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(kvjax.decode(model, shared, max_new_tokens=6)[0],  # decode donates the caches
                                      kvjax.decode(model, own, max_new_tokens=6)[0])


def test_kvzip_replays_from_the_recording_on_a_sliding_window_model():
    """Local layers keep their rings (filled from the recording, attended by the replay rows), KVzip compresses the
    global ones: as its own prefill does."""
    model = tiny_gemma3(window=8)
    prompts = random_prompts(18, (31, 12, 40))
    method = methods.get("kvzip", budget=8, chunk_size=16, n_sink=2, repeat_ids=[5, 6, 7], continue_ids=[8, 9],
                         suffix_ids=[10], tail=4)
    shared = shared_prefill.prefill_from(model, shared_prefill.record(model, prompts), method, max_new_tokens=5)
    own = kvjax.prefill(model, prompts, method=method, max_new_tokens=5)
    assert_caches_close(shared.cache, own.cache, tol=1e-5, name="kvzip")
    np.testing.assert_array_equal(kvjax.decode(model, shared, max_new_tokens=5)[0],
                                  kvjax.decode(model, own, max_new_tokens=5)[0])


def test_hidden_state_methods_replay_a_recording_that_kept_them():
    """KVzap and DMS over it read each layer's normed attention input: a recording made with hidden_states=True
    replays them as their own prefill keeps them (decode, which reads its own hidden states, included)."""
    from kvzap_weights import FIXTURE  # 2 layers of the tiny model

    model = tiny_model(num_layers=2)
    prompts, questions = random_prompts(16, (30, 9, 23)), random_prompts(17, (3, 0, 5))
    kvzap = {"weights": str(FIXTURE)}
    cells = [methods.get("dms", threshold=t, sliding_window_size=4, base_args=kvzap) for t in (0.0, 0.3)]
    cells.append(methods.get("dms", threshold=0.0, sliding_window_size=4, decoding=True, base_args=kvzap))
    cells.append(methods.get("kvzap", budget=12, **kvzap))
    assert all(shared_prefill.shares_prefill(m) for m in cells)
    with pytest.raises(KvjaxError, match="hidden_states=True"):
        shared_prefill.prefill_from(model, shared_prefill.record(model, prompts), cells[0], max_new_tokens=2)
    rec = shared_prefill.record(model, prompts, question_ids=questions, hidden_states=True)
    assert [h.shape for h in rec.hidden] == [(3, rec.bucket, model.config.hidden_size)] * 2
    kept = []
    for method in cells:
        own = kvjax.prefill(model, prompts, method=method, max_new_tokens=6, question_ids=questions)
        shared = shared_prefill.prefill_from(model, rec, method, max_new_tokens=6)
        assert_caches_close(shared.cache, own.cache, tol=1e-5, name=str(method))
        np.testing.assert_allclose(np.asarray(shared.logits), np.asarray(own.logits), rtol=1e-5, atol=1e-5)
        kept.append(np.asarray(shared.cache.layers[1].length).tolist())
        own_tokens, own_count, own_cache = kvjax.decode(model, own, max_new_tokens=6)
        tokens, count, cache = kvjax.decode(model, shared, max_new_tokens=6)
        np.testing.assert_array_equal(tokens, own_tokens)
        np.testing.assert_array_equal(np.asarray(cache.layers[1].length), np.asarray(own_cache.layers[1].length))
    assert kept[0] != kept[1]  # the thresholds keep different amounts: the comparison can fail


def test_methods_differ_so_the_comparison_can_fail():
    model = tiny_model()
    prompts = random_prompts(3, (30, 27))
    rec = shared_prefill.record(model, prompts)
    outs = {}
    for name, args in (("full", {}), ("streaming_llm", {"budget": 6}), ("knorm", {"budget": 6})):
        state = shared_prefill.prefill_from(model, rec, methods.get(name, **args), max_new_tokens=8)
        outs[name] = kvjax.decode(model, state, max_new_tokens=8)[0]
    assert not np.array_equal(outs["full"], outs["streaming_llm"]) or not np.array_equal(outs["full"], outs["knorm"])


def test_one_trace_per_bucket():
    model = tiny_model()
    method = methods.get("snapkv", budget=12, window_size=4)
    rec = shared_prefill.record(model, random_prompts(4, (20, 25)))
    shared_prefill.prefill_from(model, rec, method, max_new_tokens=3)
    before = dict(TRACE_COUNTS)
    rec = shared_prefill.record(model, random_prompts(5, (27, 18)))  # same bucket (32), same batch
    shared_prefill.prefill_from(model, rec, method, max_new_tokens=3)
    for key in ("shared_prefill", "shared_compress"):
        assert TRACE_COUNTS[key] == before[key], key


def test_a_recording_keeps_the_layer_inputs_its_cells_read_and_no_other():
    """`recorded_inputs` asks a recording for the inputs of the tokens its methods read: hidden states only for a
    method that reads them, none for CriticalKV, whose `W_o` the replay takes from the weights (and replays as its own
    prefill keeps it)."""
    from kvzap_weights import FIXTURE  # 2 layers of the tiny model

    model = tiny_model(num_layers=2)
    prompts, questions = random_prompts(19, (30, 9, 23)), random_prompts(20, (3, 0, 5))
    crit = methods.get("criticalkv", budget=12, base_args={"window_size": 4})
    kvzap = methods.get("kvzap", budget=12, weights=str(FIXTURE))
    h2o = methods.get("h2o", budget=12)
    assert shared_prefill.recorded_inputs([crit]) == frozenset()
    assert shared_prefill.recorded_inputs([crit, h2o]) == {"attention_lse"}
    assert shared_prefill.recorded_inputs([crit, kvzap]) == {"hidden"}
    rec = shared_prefill.record(model, prompts, question_ids=questions,
                                layer_inputs=shared_prefill.recorded_inputs([crit]))
    assert rec.inputs == {} and rec.hidden is None and rec.lse is None
    with pytest.raises(KvjaxError, match=r"kvzap reads each layer's hidden.*layer_inputs=\{'hidden'\}"):
        shared_prefill.prefill_from(model, rec, kvzap, max_new_tokens=2)
    own = kvjax.prefill(model, prompts, method=crit, max_new_tokens=6, question_ids=questions)
    shared = shared_prefill.prefill_from(model, rec, crit, max_new_tokens=6)
    assert_caches_close(shared.cache, own.cache, tol=1e-5, name="criticalkv")
    assert (np.asarray(own.cache.layers[1].length) < np.asarray(rec.lengths)[:, None]).any()  # it evicted
    np.testing.assert_array_equal(kvjax.decode(model, shared, max_new_tokens=6)[0],
                                  kvjax.decode(model, own, max_new_tokens=6)[0])
    rec = shared_prefill.record(model, prompts, layer_inputs=shared_prefill.recorded_inputs([crit, kvzap, h2o]))
    assert set(rec.inputs) == {"hidden", "attention_lse"}
    assert [h.shape for h in rec.hidden] == [(3, rec.bucket, model.config.hidden_size)] * 2
