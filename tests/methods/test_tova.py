"""TOVA against a NumPy transcription of the paper's policy (drop the token the current query attends
least, averaged over heads, after that query attended), invariants, batching, and end to end
through `kvjax.generate`."""

import numpy as np
import pytest
from baseline_refs import Batch
from baseline_refs_decode import DecodeRun, assert_full_attention, generate_rolling, tova_reference

from kvjax import methods
from kvjax.errors import ConfigError

STEPS = 20


@pytest.mark.parametrize(
    "args,lengths",
    [
        (dict(budget=10), (40, 7, 31)),  # the paper: mean over every head, one token set per layer
        (dict(compression_ratio=0.7, head_reduce="group", protect_last=True), (40, 23, 31)),
    ],
)
def test_matches_paper_reference_over_a_long_decode(args, lengths):
    method = methods.get("tova", **args)
    batch = Batch(lengths=lengths)
    run = DecodeRun(method, batch, STEPS)
    if "budget" in args:
        assert run.capacity == args["budget"] + 1
    dropped_new = 0  # steps whose own token was dropped (the paper lets the current token compete)
    for b, n in enumerate(lengths):
        limit = args.get("budget") or method.prompt_budget(n)
        want = tova_reference(run, b, limit, args.get("head_reduce", "all"), args.get("protect_last", False))
        for t in range(-1, STEPS):
            got = [run.kept_after(t, b, k) for k in range(batch.kv)]  # distinct positions per head
            assert got == want[t + 1], (b, t)
            assert all(len(x) == min(limit, n + t + 1) for x in got)
            dropped_new += int(t >= 0 and n + t not in got[0])
        if method.head_reduce == "all":  # every KV head holds the same tokens in the same slots
            pos = np.asarray(run.caches[-1].pos[b])
            assert (pos == pos[0]).all()
    assert (dropped_new == 0) if method.protect_last else (dropped_new > 0)
    if "compression_ratio" in args:  # per-example budgets: batched step == vmap of one example
        run.assert_vmap_equals_batch(STEPS - 1)


def test_budget_above_length_keeps_everything_and_attention_is_full():
    assert_full_attention(DecodeRun(methods.get("tova", budget=64), Batch(), 5))


@pytest.mark.parametrize(
    "args,name",
    [
        (dict(budget=16, head_reduce="max"), "head_reduce"),
        (dict(budget=16, protect_last="yes"), "protect_last"),
        (dict(), "budget"),
        (dict(budget=-2), "budget"),
        (dict(compression_ratio=-0.1), "compression_ratio"),
    ],
)
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("tova", **args)


def test_end_to_end_generate():
    lengths, max_new = (40, 9, 31), 8
    result, _, _ = generate_rolling(
        methods.get("tova", budget=12), lengths, max_new=max_new, held=lambda b: min(12, lengths[b] + max_new - 1)
    )
    assert result.cache.capacity == 13
    pos = np.asarray(result.cache.stacked().pos)
    assert all((pos[layer, b] == pos[layer, b, 0]).all() for layer in range(2) for b in range(3))
