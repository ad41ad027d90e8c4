"""Budgets at their small edge: a method never keeps more than an example's budget (its cache was sized for it, so
decoding would overflow), and what it keeps then is what kvpress's top-k keeps: the protected tokens in position
order (ties: the lower position) before any other."""

import numpy as np
import pytest
from baseline_refs import Batch, kept, run_prefill
from baseline_refs_decode import DecodeRun, rope_inv_freq

from kvjax import methods


def assert_at_most_budget(method, out, step) -> None:
    """Every head holds at most its example's budget."""
    length, budget = np.asarray(out.length), np.asarray(step.budget)
    assert (length <= budget[:, None]).all(), (length.tolist(), budget.tolist(), method.name)


@pytest.mark.parametrize("args", [
    dict(name="capkv", compression_ratio=0.9),
    dict(name="expected_attention", compression_ratio=0.9),
    dict(name="cur", compression_ratio=0.9),
    dict(name="cur", budget=3),
])
def test_budget_below_the_sinks_keeps_the_first_tokens(args):
    args = dict(args)
    method = methods.get(args.pop("name"), **args)
    batch = Batch(lengths=(40, 23, 31))  # ratio 0.9: budgets 4, 2, 3 against 4 sinks
    out, _, step = run_prefill(method, batch)
    assert_at_most_budget(method, out, step)
    for b, n in enumerate(batch.lengths):
        budget = method.prompt_budget(int(n))
        assert budget <= 4
        assert all(kept(out, b, k) == list(range(budget)) for k in range(batch.kv)), b


@pytest.mark.parametrize("budget", [5, 10])
def test_compactor_budget_below_its_sinks_keeps_the_first_then_the_last(budget):
    method = methods.get("compactor", budget=budget, chunk_size=8)  # 8 first and 4 last tokens protected
    batch = Batch(lengths=(20, 13), n=4)
    out, _, step = run_prefill(method, batch)
    assert_at_most_budget(method, out, step)
    first = min(budget, 8)
    for b, n in enumerate(batch.lengths):
        want = list(range(first)) + list(range(n - (budget - first), n))
        assert all(kept(out, b, k) == want for k in range(batch.kv)), b


@pytest.mark.parametrize("args", [dict(compression_ratio=0.95), dict(compression_ratio=0.5, sink_size=24),
                                  dict(compression_ratio=0.95, rerotate=True)])
def test_streaming_llm_ratio_budget_at_most_the_sinks_keeps_the_newest_token(args):
    """A ratio budget `L <= sink_size` keeps `L - 1` sinks and the newest token, after prefill and every step."""
    method = methods.get("streaming_llm", **args)
    batch = Batch(lengths=(40, 23, 31))
    run = DecodeRun(method, batch, 4, inv_freq=rope_inv_freq(batch.h))
    for b, n in enumerate(batch.lengths):
        limit = method.prompt_budget(int(n))
        assert limit <= method.sink_size
        for t in range(-1, 4):
            seen = int(n) + t + 1
            want = list(range(limit - 1)) + [seen - 1]
            assert all(run.kept_after(t, b, k) == want for k in range(batch.kv)), (b, t)


def test_random_ratio_budget_below_its_protected_tokens_keeps_the_window_then_the_sinks():
    """At ratio 0.8 (budgets 8, 4, 6) against 3 sinks and a window of 5: the window first, then the sinks that fit,
    as nacl."""
    method = methods.get("random", compression_ratio=0.8, sink_size=3, window_size=5)
    batch = Batch(lengths=(40, 23, 31))
    out, _, step = run_prefill(method, batch)
    assert_at_most_budget(method, out, step)
    for b, n in enumerate(batch.lengths):
        budget = method.prompt_budget(int(n))
        window = min(5, budget)
        want = list(range(min(3, budget - window))) + list(range(n - window, n))
        assert all(kept(out, b, k) == want for k in range(batch.kv)), b
