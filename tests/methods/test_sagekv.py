"""SAGE-KV: the spec's testable properties (shared/specs/sagekv.md section 8), the NumPy reference of
the per-query-head selection, both GQA layouts, the planted needle, and end-to-end generation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_seed as ref
from tiny import tiny_model

import kvjax
from kvjax import cache as kvc
from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.sagekv import STATIC, VISIBLE, budget_split, query_mask
from kvjax.runtime import TRACE_COUNTS

KV, G, D = 2, 4, 8  # 8 query heads on 2 KV heads


def _batch(seed, lengths=(64, 41, 20), t=64, d=D, groups=G):
    rng = np.random.default_rng(seed)
    b = len(lengths)
    k = rng.standard_normal((b, KV, t, d)).astype(np.float32)
    v = rng.standard_normal((b, KV, t, d)).astype(np.float32)
    q = rng.standard_normal((b, t, KV * groups, d)).astype(np.float32)
    return q, k, v, list(lengths)


@functools.cache
def _prefill_fn(method):
    return jax.jit(method.prefill)


def _compress(method, q, k, v, lengths):
    cache, pos = ref.make_cache(method, k, v, lengths)
    step = ref.make_step(method, pos, method.capacity(k.shape[2], 1))
    return _prefill_fn(method)(cache, jnp.asarray(q), step)


def _visible(out, b, h, groups=G):
    """Positions query head h of example b attends (the per-query-head mask, NumPy)."""
    g, j = divmod(h, groups)
    sel = np.asarray(out.state["sel"])[b, g]
    pos = np.asarray(out.pos)[b, g]
    n = int(np.asarray(out.length)[b, g])
    bits = sel & VISIBLE
    ok = ((bits == 0) | ((bits >> j) & 1 == 1)) & (np.arange(len(pos)) < n) & (pos >= 0)
    return sorted(int(p) for p in pos[ok])


def test_budget_split_reproduces_the_paper_configs():
    """Property 9 and Appendix A.2: Llama (G=4) 2048/1024/2048, Qwen2.5 (G=7) 2048/512/2560 at B=8192."""
    assert budget_split(8192, 4) == (2048, 1024, 2048)
    assert budget_split(8192, 7) == (2048, 512, 2560)
    assert ref.sagekv_split(8192, 7) == (2048, 512, 2560)
    for budget in (512, 1024, 2048, 4096):
        assert budget_split(budget, 4) == ref.sagekv_split(budget, 4)
    method = methods.get("sagekv", budget=64, sink_size=4, window_size=8)
    assert method.resolved_split(4) == (4, 13, 8)  # what is left goes to the selections


def test_per_query_head_selection_matches_numpy_reference():
    """Properties 1-3 and 7 on a right-padded GQA batch: each query head attends sink + its own top-k
    of the last query's logits over the candidates + recent window + last token (NumPy, float64); the
    KV head stores the deduplicated union (<= S + G k + R + 1 slots), bitwise."""
    q, k, v, lengths = _batch(0)
    method = methods.get("sagekv", budget=32)
    sink, topk, recent = method.resolved_split(G)
    assert (sink, topk, recent) == (8, 4, 8)
    out = _compress(method, q, k, v, lengths)
    union = _compress(methods.get("sagekv_union", budget=32), q, k, v, lengths)
    for b, n in enumerate(lengths):
        want = ref.sagekv_select(q[b, n - 1], k[b], n, sink=sink, topk=topk, recent=recent, groups=G)
        for g in range(KV):
            stored = ref.kept_positions(out, b, g)
            assert ref.kept_positions(union, b, g) == stored
            own = [want[h][0] if n > 32 else list(range(n)) for h in range(g * G, (g + 1) * G)]
            assert sorted(set().union(*own)) == stored
            assert len(stored) <= sink + G * topk + recent + 1
            for h in range(g * G, (g + 1) * G):
                assert _visible(out, b, h) == own[h - g * G]
                assert set(own[h - g * G]) <= set(_visible(union, b, h)) == set(stored)
                if n > 32:
                    assert len(_visible(out, b, h)) == sink + topk + recent + 1
            assert set(range(sink)) | set(range(n - 1 - recent, n)) <= set(stored)
            for slot, p in enumerate(np.asarray(out.pos)[b, g, : len(stored)]):
                np.testing.assert_array_equal(np.asarray(out.k)[b, g, slot], k[b, g, p])


def test_per_head_layout_attends_each_heads_own_set_exactly_once():
    """The union is stored once: attention with `query_mask` equals, per query head, attention over
    that head's own kept set (no double-counted duplicates); the union layout attends the union."""
    q, k, v, lengths = _batch(1)
    method = methods.get("sagekv", budget=32)
    out = _compress(method, q, k, v, lengths)
    sink, topk, recent = method.resolved_split(G)
    new_q = np.random.default_rng(5).standard_normal((len(lengths), KV * G, D)).astype(np.float32)
    mask = np.asarray(query_mask(out, G))
    kk, vv, pp = np.asarray(out.k), np.asarray(out.v), np.asarray(out.pos)
    for b, n in enumerate(lengths):
        want = ref.sagekv_select(q[b, n - 1], k[b], n, sink=sink, topk=topk, recent=recent, groups=G)
        for h in range(KV * G):
            g, j = divmod(h, G)
            got = ref.attention_np(new_q[b, h], kk[b, g][mask[b, g, j]], vv[b, g][mask[b, g, j]])
            own = want[h][0] if n > 32 else list(range(n))
            np.testing.assert_allclose(got, ref.attention_np(new_q[b, h], k[b, g, own], v[b, g, own]), atol=1e-5)
            assert sorted(pp[b, g][mask[b, g, j]].tolist()) == own
    assert methods.get("sagekv_union", budget=32).query_mask(out, KV * G) is None


def test_bf16_cache_selects_like_float32():
    """A bf16 cache (logits in float32) selects what a float32 cache of the same rounded keys selects."""
    q, k, v, lengths = _batch(11)
    k16 = np.asarray(jnp.asarray(k, jnp.bfloat16).astype(jnp.float32))
    method = methods.get("sagekv", budget=32)
    cache, pos = ref.make_cache(method, k16, v, lengths, dtype=jnp.bfloat16)
    out = _prefill_fn(method)(cache, jnp.asarray(q), ref.make_step(method, pos, method.capacity(64, 1)))
    want = _compress(method, q, k16, v, lengths)
    for b in range(3):
        for h in range(KV * G):
            assert _visible(out, b, h) == _visible(want, b, h)


def test_group_size_one_layouts_coincide_and_selection_is_scale_invariant():
    """Properties 7-8: with G = 1 both layouts keep the same set; scaling the last query by c > 0
    changes nothing."""
    q, k, v, lengths = _batch(2, groups=1)
    a = _compress(methods.get("sagekv", budget=24), q, k, v, lengths)
    b_ = _compress(methods.get("sagekv_union", budget=24), q, k, v, lengths)
    c = _compress(methods.get("sagekv", budget=24), q * 3.7, k, v, lengths)
    for b in range(3):
        for g in range(KV):
            assert ref.kept_positions(a, b, g) == ref.kept_positions(b_, b, g) == ref.kept_positions(c, b, g)
            assert _visible(a, b, g, 1) == _visible(b_, b, g, 1)


def test_planted_needle_is_kept_at_every_budget_above_sink_and_window():
    """A key the last query attends to strongly, in the middle of the prompt, is kept (and visible to
    every query head) at every budget that leaves room for one selection per head: with the paper's
    split (B >= 2G) and with a fixed sink 4 + window 8 (B >= 4 + 8 + G). Budgets are per example
    (the ratio path), so one compile covers them all."""
    q, k, v, _ = _batch(3, lengths=(64,))
    rng = np.random.default_rng(33)
    needle = 29
    for g in range(KV):
        base = rng.standard_normal(D).astype(np.float32)
        q[0, 63, g * G:(g + 1) * G] = base + 0.1 * rng.standard_normal((G, D))
        k[0, g, needle] = 3.0 * base
    for args, lowest in ((dict(), 2 * G), (dict(sink_size=4, window_size=8), 4 + 8 + G)):
        budgets = np.arange(lowest, 64)
        reps = len(budgets)
        method = methods.get("sagekv", compression_ratio=0.5, **args)
        cache, pos = ref.make_cache(method, np.repeat(k, reps, 0), np.repeat(v, reps, 0), [64] * reps, capacity=66)
        step = ref.make_step(method, pos, 66)
        step = step.__class__(**{**step.__dict__, "budget": jnp.asarray(budgets, jnp.int32)})
        out = _prefill_fn(method)(cache, jnp.asarray(np.repeat(q, reps, 0)), step)
        for i, budget in enumerate(budgets):
            sink, topk, recent = method.resolved_split(G, int(budget))
            assert topk >= 1 and sink + G * topk + recent <= budget
            for h in range(KV * G):
                assert needle in _visible(out, i, h), (args, budget, h)
            assert len(ref.kept_positions(out, i, 0)) <= budget + 1


def test_short_prompts_are_reduced_like_long_ones_per_query_head():
    """Issue 23 item 4: the paper's reduced cache is S + k + R + 1 per query head whatever N is. For
    N < B, N = B and N > B (one padded batch), after prefill and each of 12 decode steps every query head
    attends exactly the float64 reference's positions (`reference_seed.sagekv_paper_visible`, written from
    Steps 1-4), S + k + R + 1 of them. `identity_within_budget` keeps N <= B whole instead."""
    lengths, steps, t = [24, 32, 48], 12, 48
    q, k, v, _ = _batch(21, lengths=lengths, t=t + steps)
    method = methods.get("sagekv", budget=32)
    sink, topk, recent = method.resolved_split(G)
    assert (sink, topk, recent) == ref.sagekv_split(32, G) == (8, 4, 8)
    cap = method.capacity(t, steps)
    cache, pos = ref.make_cache(method, k[:, :, :t], v[:, :, :t], lengths, capacity=cap)
    out = _prefill_fn(method)(cache, jnp.asarray(q[:, :t]), ref.make_step(method, pos, cap))
    decode = jax.jit(lambda c, kn, vn, p, step, m=method: m.decode(kvc.append(c, kn, vn, p), None, step))
    for step_i in range(steps + 1):
        if step_i:
            p = np.array([[n + step_i - 1] for n in lengths], np.int32)
            kn = np.stack([k[b, :, n + step_i - 1] for b, n in enumerate(lengths)])[:, None]
            vn = np.stack([v[b, :, n + step_i - 1] for b, n in enumerate(lengths)])[:, None]
            out = decode(out, jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(p), ref.make_step(method, p, cap, lengths))
        for b, n in enumerate(lengths):
            want = ref.sagekv_paper_visible(q[b, n - 1], k[b], n, step_i, sink=sink, topk=topk, recent=recent,
                                            groups=G)
            for h in range(KV * G):
                assert _visible(out, b, h) == want[h], (n, step_i, h)
                assert len(want[h]) == sink + topk + recent + 1
    whole = methods.get("sagekv", budget=32, identity_within_budget=True)
    cache, pos = ref.make_cache(whole, k[:, :, :t], v[:, :, :t], lengths, capacity=cap)
    out = _prefill_fn(whole)(cache, jnp.asarray(q[:, :t]), ref.make_step(whole, pos, cap))
    for b, n in enumerate(lengths[:2]):
        assert all(_visible(out, b, h) == list(range(n)) for h in range(KV * G))


def test_issue_example_each_head_attends_81_tokens_at_n_100_budget_128():
    """The issue's case end to end: a 100-token prompt at B = 128 on 8 query heads / 2 KV heads
    (S = 32, k = 16, R = 32): after 40 generated tokens every query head of every layer attends
    S + k + R + 1 = 81 tokens (kvjax kept the prompt whole and attended up to 129 before)."""
    model = ref.e2e_model()
    prompt = np.random.default_rng(5).integers(0, 96, 100).tolist()
    out = kvjax.generate(model, [prompt], method="sagekv", method_args=dict(budget=128), max_new_tokens=40,
                         stop_at_eos=False, return_cache=True)
    assert methods.get("sagekv", budget=128).resolved_split(G) == (32, 16, 32)
    for layer in range(out.cache.num_layers):
        visible = np.asarray(query_mask(out.cache.layer(layer), G))
        assert (visible.sum(-1) == 81).all(), visible.sum(-1)


def test_decode_rolls_the_window_and_never_changes_the_selection():
    """Properties 3 and 6: after t decode steps the FIFO holds exactly positions [N-R+t-1, N+t-1]; the
    sink and selected slots (and their visibility) never change; the cache never exceeds B + 1.
    With `pin_last_token` the last prompt token stays and the FIFO holds R tokens."""
    q, k, v, lengths = _batch(4, lengths=(64, 50), t=80)
    for pin in (False, True):
        method = methods.get("sagekv", budget=32, pin_last_token=pin)
        sink, topk, recent = method.resolved_split(G)
        cap = method.capacity(64, 17)
        cache, pos = ref.make_cache(method, k[:, :, :64], v[:, :, :64], lengths, capacity=cap)
        out = _prefill_fn(method)(cache, jnp.asarray(q[:, :64]), ref.make_step(method, pos, cap))
        static = [{int(p) for p, s in zip(np.asarray(out.pos)[b, 0], np.asarray(out.state["sel"])[b, 0],
                                          strict=True) if s & STATIC} for b in range(2)]
        decode = jax.jit(lambda c, kn, vn, p, step, m=method: m.decode(kvc.append(c, kn, vn, p), None, step))
        for t in range(16):
            p = np.array([[n + t] for n in lengths], np.int32)
            out = decode(out, jnp.asarray(k[:, :, 64:65].transpose(0, 2, 1, 3)),
                         jnp.asarray(v[:, :, 64:65].transpose(0, 2, 1, 3)), jnp.asarray(p),
                         ref.make_step(method, p, cap, lengths))
            for b, n in enumerate(lengths):
                kept = set(ref.kept_positions(out, b, 0))
                newest_first = [j for j in range(n + t, -1, -1) if not (pin and j == n - 1)]
                fifo = set(newest_first[: recent + 1 - int(pin)])  # a pinned N-1 takes one FIFO slot
                assert kept == static[b] | fifo, (pin, t, b)
                assert len(kept) <= 33
                for h in range(G):
                    assert _visible(out, b, h) == sorted(
                        (set(_visible(out, b, h)) & static[b]) | fifo
                    )
                assert not pin or n - 1 in kept


def test_first_decode_step_without_eviction_equals_full_attention_minus_oldest_window_token():
    """Property 4 (G = 1, so a compressed prompt can have E <= k): every candidate is kept, and the first
    decode step attends the whole prefix + the new token minus position N-1-R, the FIFO's oldest."""
    q, k, v, _ = _batch(5, lengths=(40,), t=48, groups=1)
    method = methods.get("sagekv", budget=24)
    sink, topk, recent = method.resolved_split(1)
    n = sink + topk + recent + 1  # E = k, and n = B + 1 > B: compressed
    cap = method.capacity(48, 2)
    cache, pos = ref.make_cache(method, k[:, :, :n], v[:, :, :n], [n], capacity=cap)
    out = _prefill_fn(method)(cache, jnp.asarray(q[:, :n]), ref.make_step(method, pos, cap))
    assert [ref.kept_positions(out, 0, g) for g in range(KV)] == [list(range(n))] * KV
    p = np.array([[n]], np.int32)
    out = method.decode(kvc.append(out, jnp.asarray(k[:, :, n:n + 1].transpose(0, 2, 1, 3)),
                                   jnp.asarray(v[:, :, n:n + 1].transpose(0, 2, 1, 3)), jnp.asarray(p)),
                        None, ref.make_step(method, p, cap, [n]))
    for h in range(KV):
        assert _visible(out, 0, h, 1) == [j for j in range(n + 1) if j != n - 1 - recent]


def test_generate_gqa_padded_batch_first_token_and_one_trace():
    """8 query heads on 2 KV heads, 3 right-padded prompts of different lengths: the first token comes
    from the uncompressed prefill (property 5: equal to `full`'s); every prompt gives the same tokens
    as alone; the cache stays within B + 1; a second generate in the same shape bucket does not
    retrace the decode step."""
    model, prompts = ref.e2e_model(), ref.e2e_prompts(7)
    full = kvjax.generate(model, prompts, method="full", max_new_tokens=20)
    args = dict(budget=24)
    batch = kvjax.generate(model, prompts, method="sagekv", method_args=args, max_new_tokens=20, return_cache=True)
    np.testing.assert_array_equal(batch.tokens[:, 0], full.tokens[:, 0])
    assert int(np.asarray(batch.cache.stacked().length).max()) <= 25
    for i, p in enumerate(prompts):
        alone = kvjax.generate(model, [p], method="sagekv", method_args=args, max_new_tokens=20)
        np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0])
    before = dict(TRACE_COUNTS)
    kvjax.generate(model, ref.e2e_prompts(8), method="sagekv", method_args=args, max_new_tokens=20)
    assert TRACE_COUNTS["decode_step"] == before["decode_step"]


def test_budget_covering_everything_equals_full_attention():
    """With `identity_within_budget` and a budget covering prompt + generated tokens nothing is evicted:
    generation equals `full`. By default (the paper's Step 3) the same prompts are reduced and differ."""
    model, prompts = ref.e2e_model(), ref.e2e_prompts(7)
    want = kvjax.generate(model, prompts, method="full", max_new_tokens=20)
    got = kvjax.generate(model, prompts, method="sagekv", method_args=dict(budget=80, identity_within_budget=True),
                         max_new_tokens=20)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    paper = kvjax.generate(model, prompts, method="sagekv", method_args=dict(budget=80), max_new_tokens=20,
                           return_cache=True)
    sink, topk, recent = methods.get("sagekv", budget=80).resolved_split(G)
    assert int(np.asarray(paper.cache.stacked().length).max()) <= sink + G * topk + recent + 2
    assert not np.array_equal(paper.tokens, want.tokens)


def test_chunked_prefill_reduces_prompts_within_the_budget_where_they_end():
    """Prompts of 45, 36 and 60 tokens under budget 80, prefilled in chunks of 16: none exceeds the
    budget, so each is reduced once, after the chunk holding its last token (45 and 36: a chunk ending in
    padding; 60: the final chunk), with its last query: the same tokens as the one-shot prefill."""
    model, prompts = ref.e2e_model(), ref.e2e_prompts(7)
    args = dict(budget=80)
    one = kvjax.generate(model, prompts, method="sagekv", method_args=args, max_new_tokens=12)
    chunked = kvjax.generate(model, prompts, method="sagekv", method_args=args, max_new_tokens=12, chunk_size=16)
    np.testing.assert_array_equal(chunked.tokens, one.tokens)


def test_bf16_storage_and_compression_ratio():
    """bf16 cache (scores in float32): finite, sizes as in float32; a ratio gives per-example budgets."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 96, n).tolist() for n in (50, 31)]
    out = kvjax.generate(tiny_model(dtype=jnp.bfloat16), prompts, method="sagekv",
                         method_args=dict(compression_ratio=0.5), max_new_tokens=8, return_cache=True)
    assert out.cache.stacked().k.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out.cache.stacked().k, np.float32)).all()
    length = np.asarray(out.cache.stacked().length)
    assert (length[:, 0] <= 25 + 1).all() and (length[:, 1] <= 15 + 1).all()


def test_no_nan_for_short_prompts_and_ties():
    """Property 10: N < S, N < S + R + 1, mixed lengths and all-equal logits (ties: lower position)."""
    q, k, v, _ = _batch(9, t=32)
    k[:] = 1.0
    out = _compress(methods.get("sagekv", budget=24), q, k, v, [32, 5, 2])
    assert np.isfinite(np.asarray(out.k)).all()
    assert out.length[1:, 0].tolist() == [5, 2]
    sink, topk, recent = methods.get("sagekv", budget=24).resolved_split(G)
    cands = list(range(sink, 32 - 1 - recent))
    for h in range(KV * G):
        assert _visible(out, 0, h) == sorted(set(range(sink)) | set(cands[:topk]) | set(range(32 - 1 - recent, 32)))


def test_config_errors_name_the_parameter():
    for kwargs, match in [
        (dict(), "budget"),
        (dict(budget=16, gqa="x"), "gqa"),
        (dict(budget=16, sink_size=-1), "sink_size"),
        (dict(budget=16, topk=1.5), "topk"),
        (dict(budget=16, sink_size=10, window_size=10), "exceed budget"),
        (dict(budget=16, pin_last_token=1), "pin_last_token"),
        (dict(budget=16, identity_within_budget=1), "identity_within_budget"),
    ]:
        with pytest.raises(ConfigError, match=match):
            methods.get("sagekv", **kwargs)
    q, k, v, lengths = _batch(10)
    with pytest.raises(ConfigError, match="cannot hold"):
        _compress(methods.get("sagekv", budget=6), q, k, v, lengths)  # k = pow2floor(6 / 8) = 0


@pytest.mark.parametrize("name", ["sagekv", "sagekv_union"])
def test_question_after_compression(name):
    """The question is appended after the context is compressed (the eval's default): the slots added for
    it carry no selection bits. With a budget covering everything and `identity_within_budget` this equals
    `full`; with a small one the cache stays within budget + question + 1 and decoding runs."""
    model, prompts = ref.e2e_model(), ref.e2e_prompts(7)
    rng = np.random.default_rng(3)
    questions = [rng.integers(0, 96, n).tolist() for n in (5, 9, 3)][: len(prompts)]
    want = kvjax.generate(model, prompts, method="full", max_new_tokens=12, question_ids=questions)
    got = kvjax.generate(model, prompts, method=name, method_args=dict(budget=200, identity_within_budget=True),
                         max_new_tokens=12,
                         question_ids=questions)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    small = kvjax.generate(model, prompts, method=name, method_args=dict(budget=16), max_new_tokens=12,
                           question_ids=questions, return_cache=True)
    assert small.tokens.shape == want.tokens.shape
    assert int(np.asarray(small.cache.stacked().length).max()) <= 16 + 9 + 1
