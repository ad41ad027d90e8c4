"""Quest against a NumPy transcription of the paper (per-page key min / max, the query's upper bound
per page, the current page + the top pages within the token budget, first layers dense), the page
summaries kept in the cache state, invariants, batching, and end to end through `kvjax.generate`."""

import numpy as np
import pytest
from baseline_refs import Batch
from baseline_refs_decode import DecodeRun, assert_full_attention, generate_rolling, quest_reference

from kvjax import cache as kvc
from kvjax import methods
from kvjax.errors import ConfigError

STEPS = 26  # crosses page boundaries for every example


@pytest.mark.parametrize(
    "args",
    [
        dict(budget=32),
        dict(compression_ratio=0.5, page_size=4, group_reduce="max", always_last_page=False),
    ],
)
def test_matches_paper_reference_over_a_long_decode(args):
    method = methods.get("quest", **args)
    batch = Batch()
    run = DecodeRun(method, batch, STEPS, layer=2)
    page, g = method.page_size, batch.n // batch.kv
    assert run.capacity == batch.t + STEPS + 1  # the whole cache is kept
    sparse_steps = 0
    for b, n in enumerate(batch.lengths):
        limit = args.get("budget") or method.prompt_budget(int(n))
        assert all(run.kept_after(-1, b, k) == list(range(n)) for k in range(batch.kv))
        for t in range(STEPS):
            cache = run.caches[t]
            attend = np.asarray(kvc.valid_mask(cache))
            for k in range(batch.kv):
                assert run.kept_after(t, b, k) == list(range(n + t + 1))  # nothing evicted
                keys = np.stack([run.key(b, k, p) for p in range(n + t + 1)])
                values = np.stack([run.value(b, k, p) for p in range(n + t + 1)])
                want, out = quest_reference(
                    keys, values, run.q[t, b, k * g : (k + 1) * g], limit, page=page, dense=False,
                    always_last_page=method.always_last_page, group_reduce=method.group_reduce,
                )
                assert np.flatnonzero(attend[b, k]).tolist() == want, (b, k, t)
                assert len(want) <= max(limit // page, 1) * page or len(want) == n + t + 1
                # the model's attention output is stored in bf16
                np.testing.assert_allclose(run.outs[t][b, k * g : (k + 1) * g], out, rtol=1e-2, atol=4e-3)
                # the page summaries in the state are the pages' exact min / max
                lo = np.asarray(cache.state["page_min"], np.float64)
                hi = np.asarray(cache.state["page_max"], np.float64)
                for p in range(-(-(n + t + 1) // page)):
                    np.testing.assert_array_equal(lo[b, k, p], keys[p * page : (p + 1) * page].min(0))
                    np.testing.assert_array_equal(hi[b, k, p], keys[p * page : (p + 1) * page].max(0))
            sparse_steps += int(n + t + 1 > limit)
    assert sparse_steps > 0
    if "compression_ratio" in args:  # per-example budgets: batched step == vmap of one example
        run.assert_vmap_equals_batch(STEPS - 1)


def test_first_layers_are_dense_and_budget_above_length_is_full_attention():
    assert_full_attention(DecodeRun(methods.get("quest", budget=16), Batch(), 5, layer=1))  # layers 0, 1 dense
    assert_full_attention(DecodeRun(methods.get("quest", budget=64), Batch(), 5, layer=3))


@pytest.mark.parametrize(
    "args,name",
    [
        (dict(budget=32, page_size=0), "page_size"),
        (dict(budget=32, page_size=-16), "page_size"),
        (dict(budget=8), "budget"),
        (dict(budget=32, dense_layers=-1), "dense_layers"),
        (dict(budget=32, always_last_page=1), "always_last_page"),
        (dict(budget=32, group_reduce="sum"), "group_reduce"),
        (dict(), "budget"),
    ],
)
def test_bad_hyperparameters(args, name):
    with pytest.raises(ConfigError, match=name):
        methods.get("quest", **args)


def test_end_to_end_generate():
    lengths, max_new = (40, 9, 31), 6
    result, _, _ = generate_rolling(
        methods.get("quest", budget=16), lengths, max_new=max_new, num_layers=3,
        held=lambda b: lengths[b] + max_new - 1,  # nothing is evicted
    )
    stacked = result.cache.stacked()
    attend = np.asarray(kvc.valid_mask(stacked))  # [L, B, K, C]: the last step's mask
    stored = np.asarray(kvc.stored_mask(stacked))
    for b, n in enumerate(lengths):
        assert (attend[:2, b] == stored[:2, b]).all()  # layers 0 and 1 are dense
        total = n + max_new - 1
        want = total if total <= 16 else total - (total - 1) // 16 * 16  # one page: the current one
        assert (attend[2, b].sum(-1) == want).all(), (b, attend[2, b].sum(-1), want)
