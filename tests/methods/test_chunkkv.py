"""ChunkKV against a NumPy float64 transcription of the paper (the base scorer's token scores summed over KV heads,
averaged per chunk of consecutive positions, the best whole chunks within the budget plus the base's window, the
same chunks in every head), invariants, batching, and end to end through `kvjax.generate`."""

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
from reference_scorers import chunkkv_keep

from kvjax import methods
from kvjax.errors import ConfigError


@pytest.mark.parametrize("chunk,budget", [(3, 14), (5, 20), (10, 21), (1, 12)])
def test_matches_paper_reference_over_snapkv(chunk, budget):
    batch = Batch()
    method = methods.get("chunkkv", budget=budget, chunk_size=chunk, base_args={"window_size": 4})
    out, _, _ = run_prefill(method, batch)
    votes = batch.votes(4)
    for b, n in enumerate(batch.lengths):
        w = min(4, budget)
        pooled = np.stack([pool(votes[b, k, : n - w], 5, "avg") for k in range(batch.kv)])
        want = chunkkv_keep(pooled, range(n - w), range(n - w, n), min(budget, n), chunk)
        for k in range(batch.kv):
            assert kept(out, b, k) == want, (b, k)
        assert len(want) <= budget


@pytest.mark.parametrize("base,args", [("knorm", {}), ("keydiff", {}), ("random", {}),
                                       ("pyramidkv", {"window_size": 4})])
def test_any_base_scorer_selects_whole_chunks_of_its_scores(base, args):
    batch = Batch()
    method = methods.get("chunkkv", budget=15, chunk_size=4, base=base, base_args=args)
    out, cache, step = run_prefill(method, batch)
    inner = method.inner
    budget = inner.layer_budget(cache, step)
    protect = inner.protected(cache, budget, step)
    scores = np.asarray(inner.scores(cache, batch.qj(), step, protect), np.float64)
    protect = np.zeros(scores.shape, bool) if protect is None else np.asarray(protect)
    for b, n in enumerate(batch.lengths):
        prot = [j for j in range(n) if protect[b, 0, j]]
        cand = [j for j in range(n) if not protect[b, 0, j]]
        want = chunkkv_keep(np.where(protect[b], 0.0, scores[b])[:, :n], cand, prot, min(int(budget[b]), n), 4)
        for k in range(batch.kv):
            assert kept(out, b, k) == want, (base, b, k)


def test_whole_chunks_only():
    """Every kept non-window position comes with the rest of its chunk (positions below the window)."""
    batch = Batch()
    out, _, _ = run_prefill(methods.get("chunkkv", compression_ratio=0.5, chunk_size=5,
                                        base_args={"window_size": 4}), batch)
    for b, n in enumerate(batch.lengths):
        held = set(kept(out, b, 0))
        for p in held:
            if p < n - 4:
                assert {q for q in range(p - p % 5, min(p - p % 5 + 5, n - 4))} <= held, (b, p)
        assert len(held) <= n // 2 and set(range(n - 4, n)) <= held


def test_budget_above_prompt_keeps_everything_and_attention_is_unchanged():
    assert_keeps_everything(methods.get("chunkkv", budget=64, base_args={"window_size": 4}), Batch())


def test_batch_equals_vmap_equals_loop():
    assert_batch_equals_loop(methods.get("chunkkv", budget=11, chunk_size=3, base_args={"window_size": 3}),
                             Batch(lengths=(30, 17, 24)))


@pytest.mark.parametrize(
    "args,name",
    [
        (dict(budget=64, chunk_size=0), "chunk_size"),
        (dict(budget=64, chunk_size=2.5), "chunk_size"),
        (dict(budget=64, base="quest"), "base"),
        (dict(budget=16, base_args={"budget": 3}), "budget"),
        (dict(), "budget"),
    ],
)
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("chunkkv", **args)


def test_end_to_end_generate_one_shot_and_chunked():
    lengths = (40, 23, 31)
    method = methods.get("chunkkv", budget=12, chunk_size=3, base_args={"window_size": 4})
    for chunk_size in (None, 16):
        result = generate_and_check(method, lengths, chunk_size=chunk_size, check_heads=False)
        pos = np.asarray(result.cache.stacked().pos)
        for layer in range(2):
            for b, n in enumerate(lengths):
                heads = [sorted(p for p in pos[layer, b, k].tolist() if 0 <= p < n) for k in range(2)]
                assert heads[0] == heads[1] and len(heads[0]) <= 12 and set(range(n - 4, n)) <= set(heads[0])
