"""Ada-KV over SnapKV: head-adaptive budgets against a NumPy transcription of the algorithm, the
per-head cap, the bytes the budget-sized cache saves, and end to end through `kvjax.generate`."""

import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    assert_keeps_everything,
    generate_and_check,
    kept,
    pool,
    ref_adaptive,
    run_prefill,
    top_positions,
)

from kvjax import methods
from kvjax.errors import ConfigError


def reference_adakv(batch, budget, window, floor, share, kv_scale=None):
    """Per example: SnapKV's pooled votes per head, Ada-KV's allocation, top-h per head + window."""
    votes = batch.votes(window)
    if kv_scale is not None:
        votes = votes * kv_scale
    out = []
    for b, n in enumerate(batch.lengths):
        bud = min(budget, int(n))
        scores = np.zeros((batch.kv, batch.t))
        for k in range(batch.kv):
            scores[k, : n - window] = pool(votes[b, k, : n - window], 5, "avg")
        valid = np.broadcast_to(np.arange(batch.t) < n, (batch.kv, batch.t))
        protect = valid & (np.arange(batch.t) >= n - window)
        positions = np.broadcast_to(np.arange(batch.t), (batch.kv, batch.t))
        cap = int(np.ceil(np.float32(bud) * np.float32(share)))
        per_head = ref_adaptive(scores, valid, protect, positions, bud, cap, floor)
        out.append([
            sorted(top_positions({j: scores[k, j] for j in range(n - window)}, per_head[k] - window)
                   + list(range(n - window, n)))
            for k in range(batch.kv)
        ])
    return out


@pytest.mark.parametrize("floor,share", [(0.2, 2.0), (0.0, 1.25)])
def test_matches_reference_algorithm(floor, share):
    batch = Batch(kv=4, n=8, lengths=(40, 23, 31))
    method = methods.get("adakv", budget=12, floor=floor, max_head_share=share, base_args={"window_size": 4})
    out, _, _ = run_prefill(method, batch)
    want = reference_adakv(batch, 12, 4, floor, share)
    cap = int(np.ceil(12 * share))
    assert out.capacity == min(cap, batch.t) + 3
    for b in range(3):
        got = [kept(out, b, k) for k in range(batch.kv)]
        assert got == want[b], (b, [len(g) for g in got], [len(w) for w in want[b]])
        assert sum(len(g) for g in got) == batch.kv * 12  # the layer's total budget, exactly
        assert all(set(range(batch.lengths[b] - 4, batch.lengths[b])) <= set(g) for g in got)
        assert max(len(g) for g in got) <= cap
    assert len({len(g) for g in [kept(out, 0, k) for k in range(batch.kv)]}) > 1  # really adaptive


def kvpress_adakv_keep(scores, budget, alpha):
    """Kept positions per head by kvpress's AdaKVPress, transcribed: `scores` `[K, n]` with the protected tokens at
    +inf; each head's best `max(1, floor(alpha * budget))` are raised above every score, then the layer keeps its
    best `K * budget` scores across heads (ties: lower position, then lower head)."""
    kv, n = scores.shape
    raised = scores.copy()
    n_safe = max(1, int(np.floor(np.float32(alpha) * np.float32(budget))))
    for k in range(kv):
        for j in sorted(range(n), key=lambda j: (-scores[k, j], j))[:n_safe]:
            raised[k, j] = np.inf
    ranked = sorted(((-raised[k, j], j, k) for k in range(kv) for j in range(n)), key=lambda e: (e[0], e[1], e[2]))
    kept_heads = [[] for _ in range(kv)]
    for _, j, k in ranked[: kv * budget]:
        kept_heads[k].append(j)
    return [sorted(h) for h in kept_heads]


def test_kvpress_safeguard_matches_adakvpress():
    """`safeguard="kvpress"` keeps what kvpress's AdaKVPress keeps (its safeguard counts the window in); the default
    keeps more of each head's own best (after the window), so the two differ here."""
    batch = Batch(kv=4, n=8, lengths=(40, 23, 31))
    batch.k = batch.k * np.array([8.0, 8.0, 0.125, 0.125])[None, None, :, None]  # two peaked heads, two flat
    window, budget = 8, 14
    args = dict(budget=budget, max_head_share=8.0, base_args={"window_size": window})
    out, _, _ = run_prefill(methods.get("adakv", safeguard="kvpress", **args), batch)
    default, _, _ = run_prefill(methods.get("adakv", **args), batch)
    votes = batch.votes(window)
    differs = False
    for b, n in enumerate(batch.lengths):
        n = int(n)
        scores = np.full((batch.kv, n), np.inf)
        for k in range(batch.kv):
            scores[k, : n - window] = pool(votes[b, k, : n - window], 5, "avg")
        want = kvpress_adakv_keep(scores, budget, 0.2)
        assert [kept(out, b, k) for k in range(batch.kv)] == want, b
        differs |= [kept(default, b, k) for k in range(batch.kv)] != want
    assert differs


def test_floor_one_is_the_base_method():
    batch = Batch()
    ada, _, _ = run_prefill(methods.get("adakv", budget=12, floor=1.0, base_args={"window_size": 4}), batch)
    snap, _, _ = run_prefill(methods.get("snapkv", budget=12, window_size=4), batch)
    for b in range(3):
        assert [kept(ada, b, k) for k in range(2)] == [kept(snap, b, k) for k in range(2)]


def test_other_bases_and_budget_above_prompt():
    batch = Batch()
    out, _, _ = run_prefill(methods.get("adakv", budget=10, base="knorm"), batch)
    assert (np.asarray(out.length).sum(-1) == 20).all()
    pyramid = methods.get("adakv", budget=12, base="pyramidkv", base_args={"window_size": 4})
    out, _, _ = run_prefill(pyramid, batch, layer=3)
    assert (np.asarray(out.length) == 4).all()  # the pyramid's top layer of 4 keeps the window only
    assert_keeps_everything(methods.get("adakv", budget=64, base_args={"window_size": 4}), batch)
    assert_batch_equals_loop(methods.get("adakv", budget=10, base_args={"window_size": 3}), Batch(lengths=(30, 17, 24)))


def test_cache_is_budget_sized_and_saves_bytes():
    """Bytes of the bf16 cache (all layers) for a Llama-3-8B-shaped model (32 layers, 8 KV heads,
    head_dim 128) at a 32K prompt, budget 1024, 128 new tokens."""
    per_slot = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x heads x head_dim x bf16 bytes
    full = methods.get("full").capacity(32768, 128) * per_slot
    ada = methods.get("adakv", budget=1024).capacity(32768, 128) * per_slot
    uniform = methods.get("snapkv", budget=1024).capacity(32768, 128) * per_slot
    assert full == 4_311_744_512 and ada == 285_212_672 and uniform == 150_994_944
    assert full - ada == 4_026_531_840  # 3.75 GiB saved (kvpress's masked AdaKV saves nothing)
    assert 15.1 < full / ada < 15.2 and 1.88 < ada / uniform < 1.89
    # max_head_share = 1: uniform SnapKV's memory.
    assert methods.get("adakv", budget=1024, max_head_share=1.0).capacity(32768, 128) * per_slot == uniform


def test_bad_hyperparameters():
    for args, name in [
        (dict(budget=16, floor=1.5), "floor"),
        (dict(budget=16, floor=-0.1), "floor"),
        (dict(budget=16, max_head_share=0.5), "max_head_share"),
        (dict(budget=16, safeguard="paper"), "safeguard"),
        (dict(budget=16, base="streaming_llm"), "base"),
        (dict(budget=16, base="adakv"), "base"),
        (dict(budget=64, base_args={"budget": 8}), "budget"),
        (dict(budget=64, base_args={"window_size": -1}), "window_size"),
        (dict(budget=16, base_args={"kernel_size": 2, "window_size": 4}), "kernel_size"),
        (dict(budget=16, base_args=[1, 2]), "base_args"),
        (dict(), "budget"),
    ]:
        with pytest.raises(ConfigError, match=name):
            methods.get("adakv", **args)
    with pytest.raises(ConfigError, match="snapkv"):
        methods.get("adakv", budget=16, base="snapvk")  # unknown name, with a suggestion


def test_hashable_static_argument():
    a = methods.get("adakv", budget=16, base_args={"window_size": 4, "kernel_size": 3})
    b = methods.get("adakv", budget=16, base_args={"kernel_size": 3, "window_size": 4})
    assert a == b and hash(a) == hash(b) and a.inner.window_size == 4
    assert {a: 1}[b] == 1


@pytest.mark.parametrize("chunk_size,budget", [(None, 12), (16, 13)])
def test_end_to_end_generate_per_head_lengths(chunk_size, budget):
    lengths = (40, 23, 31)
    method = methods.get("adakv", budget=budget, base_args={"window_size": 4})
    result = generate_and_check(method, lengths, check_heads=False, chunk_size=chunk_size)
    pos = np.asarray(result.cache.stacked().pos)
    prompt = np.stack([(pos[:, b] >= 0) & (pos[:, b] < n) for b, n in enumerate(lengths)], 1).sum(-1)  # [L, B, K]
    assert (prompt.sum(-1) == 2 * budget).all()  # per layer and example: K x budget slots in all
    assert result.cache.capacity == method.capacity(64, 5) == 2 * budget + 5
    assert (prompt <= 2 * budget).all() and (prompt >= 4).all()
    np.testing.assert_array_equal(np.asarray(result.cache.stacked().length), prompt + 4)  # per-head lengths
