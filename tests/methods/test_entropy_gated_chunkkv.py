"""EntropyGatedChunkKV against a NumPy float64 transcription of kvpress's EntropyGatedChunkKVPress (chunk means and
normalised entropies of the head-summed base scores, lower medians, spiky chunks cut to their best tokens, a greedy
pass by chunk mean, a top-up to exactly the budget), over SnapKV and other bases, on hand-made rows (negative
scores, partial and cut chunks, empty slots), invariants, batching, and end to end through `kvjax.generate`."""

import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    assert_keeps_everything,
    generate_and_check,
    kept,
    pool,
    run_prefill,
)
from reference_scorers import entropy_gated_chunkkv_keep

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.entropy_gated_chunkkv import gated_chunk_keep_row


@pytest.mark.parametrize("protected", ["kept", "kvpress"])
@pytest.mark.parametrize("chunk,low,budget", [(10, 4, 20), (5, 2, 14), (3, 1, 12), (4, 3, 25), (6, 2, 9)])
def test_matches_reference_over_snapkv(chunk, low, budget, protected):
    batch = Batch()
    method = methods.get("entropy_gated_chunkkv", budget=budget, chunk_size=chunk, low_entropy_chunk_length=low,
                         protected_tokens=protected, base_args={"window_size": 4})
    out, _, _ = run_prefill(method, batch)
    votes = batch.votes(4)
    for b, n in enumerate(batch.lengths):
        pooled = np.zeros((batch.kv, n))
        pooled[:, : n - 4] = np.stack([pool(votes[b, k, : n - 4], 5, "avg") for k in range(batch.kv)])
        want = entropy_gated_chunkkv_keep(pooled, range(n - 4), range(n - 4, n), min(budget, n), chunk, low,
                                          keep_protected=protected == "kept")
        assert len(want) == min(budget, n)
        for k in range(batch.kv):
            assert kept(out, b, k) == want, (b, k)


def test_the_gate_changes_the_selection():
    """The gate is not a no-op on this data: some example keeps another set than the same passes without the gate
    (every chunk allowed its size, `low = chunk`)."""
    batch = Batch()
    method = methods.get("entropy_gated_chunkkv", budget=20, chunk_size=5, low_entropy_chunk_length=2,
                         base_args={"window_size": 4})
    out, _, _ = run_prefill(method, batch)
    votes = batch.votes(4)
    differs = 0
    for b, n in enumerate(batch.lengths):
        pooled = np.zeros((batch.kv, n))
        pooled[:, : n - 4] = np.stack([pool(votes[b, k, : n - 4], 5, "avg") for k in range(batch.kv)])
        ungated = entropy_gated_chunkkv_keep(pooled, range(n - 4), range(n - 4, n), min(20, n), 5, 5)
        differs += kept(out, b, 0) != ungated
    assert differs


@pytest.mark.parametrize("base,args", [("knorm", {}), ("keydiff", {}), ("random", {}),
                                       ("pyramidkv", {"window_size": 4}), ("cur", {"num_sinks": 2})])
def test_any_base_scorer(base, args):
    """Signed scores (Knorm's negative norms, KeyDiff's negative cosines) rebase in the entropy; sinks (CUR) and
    windows (PyramidKV) are protected."""
    batch = Batch()
    method = methods.get("entropy_gated_chunkkv", budget=15, chunk_size=4, low_entropy_chunk_length=2, base=base,
                         base_args=args)
    out, cache, step = run_prefill(method, batch)
    inner = method.inner
    budget = inner.layer_budget(cache, step)
    protect = inner.protected(cache, budget, step)
    scores = np.asarray(inner.scores(cache, batch.qj(), step, protect), np.float64)
    protect = np.zeros(scores.shape, bool) if protect is None else np.asarray(protect)
    for b, n in enumerate(batch.lengths):
        prot = [j for j in range(n) if protect[b, 0, j]]
        cand = [j for j in range(n) if not protect[b, 0, j]]
        want = entropy_gated_chunkkv_keep(scores[b, :, :n], cand, prot, min(int(budget[b]), n), 4, 2)
        for k in range(batch.kv):
            assert kept(out, b, k) == want, (base, b, k)


@pytest.mark.parametrize("seed", range(6))
def test_row_matches_reference_on_cut_chunks_and_negative_scores(seed):
    """Slots not in position order, positions with gaps (chunks cut by an earlier compression), empty slots,
    negative scores, an odd and an even number of chunks."""
    rng = np.random.default_rng(seed)
    c, heads, chunk, low = 48, 3, 5, 2
    n_stored = 41 + seed % 2 * 5
    pos = np.full(c, -1)
    pos[rng.permutation(c)[:n_stored]] = np.sort(rng.choice(80, n_stored, replace=False))
    scores = rng.normal(size=(heads, c)) * (0.3 if seed % 3 else 1.0) + (0.0 if seed % 2 else 0.5)
    stored = pos >= 0
    protect = stored & (pos >= np.sort(pos[stored])[-3])  # the last three positions
    cand = stored & ~protect
    budget = 17 + seed if seed < 3 else n_stored - 2 - seed  # the larger ones run out of allowances: top-up
    got = gated_chunk_keep_row(jnp.asarray(scores, jnp.float32), jnp.asarray(cand), jnp.asarray(protect),
                               jnp.asarray(pos, jnp.int32), jnp.asarray(budget - 3, jnp.int32), chunk, low)
    got = sorted(pos[np.asarray(got)].tolist() + pos[protect].tolist())
    by_pos = np.zeros((heads, 80))
    by_pos[:, pos[stored]] = scores[:, stored]
    want = entropy_gated_chunkkv_keep(by_pos, pos[cand].tolist(), pos[protect].tolist(), budget, chunk, low)
    assert got == want and len(got) == budget


def test_spiky_chunks_keep_their_best_tokens():
    """Two chunks of equal mean: the flat one is kept whole, the spiky one (below the median entropy) keeps its best
    `low_entropy_chunk_length` token, and the budget freed goes to the next chunks (the last one takes its best
    token, ties to the lower position); exactly the budget is kept."""
    flat = [1.0] * 4
    spiky = [3.7, 0.1, 0.1, 0.1]
    mid = [0.6, 0.5, 0.5, 0.4]
    rest = [0.01, 0.02, 0.01, 0.02] * 3
    scores = np.asarray([flat + spiky + mid + rest], np.float32)
    c = scores.shape[1]
    pos = np.arange(c)
    cand = np.ones(c, bool)
    got = gated_chunk_keep_row(jnp.asarray(scores), jnp.asarray(cand), jnp.zeros(c, bool), jnp.asarray(pos),
                               jnp.asarray(10), 4, 1)
    assert np.flatnonzero(np.asarray(got)).tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 13]
    assert np.flatnonzero(np.asarray(got)).tolist() == entropy_gated_chunkkv_keep(scores, pos, [], 10, 4, 1)


def test_kvpress_can_drop_window_tokens_of_a_gated_chunk():
    """A chunk holding one prefix token and three window tokens (which score the largest prefix score + 1) ranks
    high and is spiky: kvpress's selection (the default, `protected_tokens="kvpress"`) keeps one of its tokens, the
    window's first (ties to the lower position); `"kept"` keeps the whole window and gives the rest of the budget
    out."""
    rng = np.random.default_rng(3)
    c, chunk, low, budget = 16, 4, 1, 8
    scores = (0.5 + 0.1 * rng.random((2, c))).astype(np.float32)
    protect = np.arange(c) >= 13
    pos = np.arange(c)
    kept_sets = {}
    for mode, avail in (("kept", budget - 3), ("kvpress", budget)):
        got = gated_chunk_keep_row(jnp.asarray(scores), jnp.asarray(~protect), jnp.asarray(protect), jnp.asarray(pos),
                                   jnp.asarray(avail), chunk, low, mode == "kept")
        got = set(np.flatnonzero(np.asarray(got)).tolist()) | (set(range(13, 16)) if mode == "kept" else set())
        want = entropy_gated_chunkkv_keep(scores.astype(np.float64), range(13), range(13, 16), budget, chunk, low,
                                          keep_protected=mode == "kept")
        assert sorted(got) == want and len(got) == budget, mode
        kept_sets[mode] = got
    assert {13, 14, 15} <= kept_sets["kept"] and 12 not in kept_sets["kept"]
    assert kept_sets["kvpress"] & {12, 13, 14, 15} == {13}


def test_the_default_is_kvpress_selection():
    # the press has no paper: kvpress's code is its official form, so its window handling is the default
    batch = Batch()
    args = dict(budget=14, chunk_size=5, low_entropy_chunk_length=2, base_args={"window_size": 4})
    default, _, _ = run_prefill(methods.get("entropy_gated_chunkkv", **args), batch)
    named, _, _ = run_prefill(methods.get("entropy_gated_chunkkv", protected_tokens="kvpress", **args), batch)
    apart, _, _ = run_prefill(methods.get("entropy_gated_chunkkv", protected_tokens="kept", **args), batch)
    heads = [(b, k) for b in range(len(batch.lengths)) for k in range(batch.kv)]
    assert all(kept(default, b, k) == kept(named, b, k) for b, k in heads)
    assert any(kept(default, b, k) != kept(apart, b, k) for b, k in heads)  # the two modes differ here


def test_budget_above_prompt_keeps_everything_and_attention_is_unchanged():
    assert_keeps_everything(methods.get("entropy_gated_chunkkv", budget=64, base_args={"window_size": 4}), Batch())


def test_batch_equals_vmap_equals_loop():
    assert_batch_equals_loop(methods.get("entropy_gated_chunkkv", compression_ratio=0.6, chunk_size=4,
                                         low_entropy_chunk_length=2, base_args={"window_size": 3}),
                             Batch(lengths=(30, 17, 24)))


@pytest.mark.parametrize(
    "args,name",
    [
        (dict(budget=64, low_entropy_chunk_length=0), "low_entropy_chunk_length"),
        (dict(budget=64, low_entropy_chunk_length=1.5), "low_entropy_chunk_length"),
        (dict(budget=64, low_entropy_chunk_length=10), "low_entropy_chunk_length"),
        (dict(budget=64, chunk_size=3), "low_entropy_chunk_length"),
        (dict(budget=64, chunk_size=0), "chunk_size"),
        (dict(budget=64, protected_tokens="drop"), "protected_tokens"),
        (dict(budget=64, base="quest"), "base"),
        (dict(budget=16, base_args={"budget": 3}), "budget"),
        (dict(), "budget"),
    ],
)
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("entropy_gated_chunkkv", **args)


def test_end_to_end_generate_one_shot_and_chunked():
    lengths = (40, 23, 31)
    method = methods.get("entropy_gated_chunkkv", budget=12, chunk_size=4, low_entropy_chunk_length=2,
                         base_args={"window_size": 4})
    for chunk_size in (None, 16):
        result = generate_and_check(method, lengths, chunk_size=chunk_size,
                                    prompt_kept=lambda layer, b: min(12, lengths[b]))
        pos = np.asarray(result.cache.stacked().pos)
        for layer in range(2):
            for b, n in enumerate(lengths):
                heads = [sorted(p for p in pos[layer, b, k].tolist() if 0 <= p < n) for k in range(2)]
                assert heads[0] == heads[1] and set(range(n - 4, n)) <= set(heads[0])
