"""H2O against a NumPy transcription of the paper's Algorithm 1 (accumulated attention, heavy hitters +
recent window, one eviction per decode step after the token attended), invariants, batching, and
end to end through `kvjax.generate`."""

import numpy as np
import pytest
from baseline_refs import Batch
from baseline_refs_decode import (
    DecodeRun,
    accumulated_reference,
    assert_full_attention,
    generate_rolling,
    h2o_reference,
)

from kvjax import methods
from kvjax.errors import ConfigError

STEPS = 24


@pytest.mark.parametrize(
    "args,lengths",
    [
        (dict(budget=12), (40, 9, 31)),  # the paper's equal split; a short prompt grows to the budget
        (dict(compression_ratio=0.6, window_size=3), (40, 23, 31)),  # per-example budgets
    ],
)
def test_matches_paper_reference_over_a_long_decode(args, lengths):
    method = methods.get("h2o", **args)
    batch = Batch(lengths=lengths)
    run = DecodeRun(method, batch, STEPS)
    if "budget" in args:
        assert run.capacity == args["budget"] + 1  # budget kept + the token that attends before eviction
    for b, n in enumerate(lengths):
        limit = args.get("budget") or method.prompt_budget(n)
        window = args.get("window_size", limit - limit // 2)
        for k in range(batch.kv):
            want = h2o_reference(run, b, k, limit, min(window, limit))
            for t in range(-1, STEPS):
                got = run.kept_after(t, b, k)  # also checks the slots hold distinct positions
                assert got == want[t + 1], (b, k, t)
                newest = n + t
                assert set(range(max(0, newest - min(window, limit) + 1), newest + 1)) <= set(got)  # window kept
                length = int((run.prefilled if t < 0 else run.caches[t]).length[b, k])
                assert length == len(want[t + 1]) <= min(limit, run.capacity)
    if "compression_ratio" in args:  # per-example budgets: batched step == vmap of one example
        run.assert_vmap_equals_batch(STEPS - 1)
    # The scores carried after prefill are the accumulated attention of every prompt row.
    for b in range(len(lengths)):
        for k in range(batch.kv):
            pos, score = np.asarray(run.prefilled.pos[b, k]), np.asarray(run.prefilled.score[b, k])
            held = pos >= 0
            np.testing.assert_allclose(score[held], accumulated_reference(batch, b, k)[pos[held]], rtol=1e-5, atol=1e-6)


def test_budget_above_length_keeps_everything_and_attention_is_full():
    assert_full_attention(DecodeRun(methods.get("h2o", budget=64), Batch(), 5))


@pytest.mark.parametrize(
    "args,name",
    [
        (dict(budget=16, window_size=-1), "window_size"),
        (dict(budget=16, window_size=0), "window_size"),
        (dict(budget=16, window_size=16), "window_size"),
        (dict(budget=16, window_size=2.5), "window_size"),
        (dict(), "budget"),
        (dict(budget=0), "budget"),
        (dict(compression_ratio=1.0), "compression_ratio"),
    ],
)
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("h2o", **args)


def test_end_to_end_generate():
    lengths, max_new = (40, 9, 31), 8
    method = methods.get("h2o", budget=12, window_size=4)
    result, _, _ = generate_rolling(method, lengths, max_new=max_new, held=lambda b: min(12, lengths[b] + max_new - 1))
    assert result.cache.capacity == 13
    pos = np.asarray(result.cache.stacked().pos)
    for b, n in enumerate(lengths):  # the recent window is the last 4 tokens fed back
        newest = n + max_new - 2
        assert all(set(range(newest - 3, newest + 1)) <= set(pos[layer, b, k].tolist())
                   for layer in range(2) for k in range(2))


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_prefill_reusing_attention_lse_keeps_the_same_tokens(chunk_size):
    """H2O's one-pass prefill scores (the attention's row log-sum-exp) against its own two-pass
    fallback, one-shot and chunked: the same kept positions in every layer / head and the same tokens."""
    import dataclasses

    import jax.numpy as jnp
    from tiny import tiny_model

    import kvjax
    from kvjax.methods.h2o import H2O

    @dataclasses.dataclass(frozen=True)
    class TwoPassH2O(H2O):
        layer_inputs = frozenset()

    model = tiny_model(dtype=jnp.float32, num_heads=8, num_kv_heads=2, num_layers=2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (40, 9, 31)]
    runs = [kvjax.generate(model, prompts, method=m, max_new_tokens=6, return_cache=True, stop_at_eos=False,
                           chunk_size=chunk_size) for m in (H2O(budget=12), TwoPassH2O(budget=12))]
    np.testing.assert_array_equal(np.asarray(runs[0].tokens), np.asarray(runs[1].tokens))
    pos = [np.sort(np.asarray(r.cache.stacked().pos), axis=-1) for r in runs]
    np.testing.assert_array_equal(pos[0], pos[1])
    scores = [np.asarray(r.cache.stacked().score) for r in runs]
    np.testing.assert_allclose(scores[0], scores[1], rtol=1e-4, atol=1e-6)
