"""LagKV: the spec's testable properties (shared/specs/lagkv.md section 8), the NumPy transcription
of the reference semantics, the three stages (one-shot, recursive decode, chunked prefill) and
end-to-end generation (GQA, padded batch, bf16, one decode trace)."""

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
from kvjax import methods, tuning
from kvjax.errors import ConfigError
from kvjax.methods.lagkv import partition_scores
from kvjax.runtime import TRACE_COUNTS, forward

S, L = 4, 8


def _kv(seed, b=3, kv=2, t=64, d=8):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((b, kv, t, d)).astype(np.float32), rng.standard_normal((b, kv, t, d)).astype(np.float32)


@functools.cache
def _prefill_fn(method):
    return jax.jit(method.prefill)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _append_prefill(method, size, cache, k, v, pos, step):
    return method.prefill(kvc.append(kvc.extend(cache, size), k, v, pos), jnp.zeros((1, size, 4, 8)), step)


@functools.partial(jax.jit, static_argnums=0)
def _append_decode(method, cache, k, v, pos, step):
    cache = kvc.append(cache, k, v, pos)
    return cache, method.decode(cache, jnp.zeros((1, 1, 4, 8)), step)


def _oneshot(method, k, v, lengths, capacity=None):
    cache, pos = ref.make_cache(method, k, v, lengths, capacity=capacity)
    cap = method.capacity(k.shape[2], 1) if capacity is None else capacity
    return _prefill_fn(method)(cache, jnp.zeros((k.shape[0], k.shape[2], 2 * k.shape[1], 2)),
                               ref.make_step(method, pos, cap)), cache


def _kept(cache):
    return [[ref.kept_positions(cache, b, h) for h in range(cache.num_kv_heads)] for b in range(cache.batch_size)]


# ---- section 8 properties on the compressor ---------------------------------------------------------


def test_hand_case():
    """Property 9: S=0, L=2, d=2, m=1, n=4: Xbar = [[0,0],[.5,1.5]], s_K = [0.33024, 0.66976]."""
    k = np.array([[0, 0], [1, 3], [0, 0], [2, 2]], np.float32)[None, None]
    z = jnp.asarray(k[0, 0]).reshape(2, 2, 2)
    np.testing.assert_allclose(partition_scores(z)[0], [0.33024, 0.66976], atol=1e-5)
    method = methods.get("lagkv", sink_size=0, lag_size=2, retention=0.5)
    out, _ = _oneshot(method, k, k, [4], capacity=4)
    assert _kept(out) == [[[1, 2, 3]]]
    assert out.length.tolist() == [[3]]


@pytest.mark.parametrize("variant", ["lag", "local", "l2"])
def test_oneshot_matches_numpy_reference_on_a_padded_batch(variant):
    """Kept indices equal the NumPy transcription, per example (right padding) and KV head; the
    length follows Eq. 12; sink and window are present bitwise; every partition gives m tokens."""
    k, v = _kv(0)
    lengths = [61, 19, 45]
    method = methods.get("lagkv", sink_size=S, lag_size=L, retention=0.25, variant=variant,
                         value_weight=0.5 if variant == "l2" else None, skip_layers=())
    out, cache = _oneshot(method, k, v, lengths)
    got = _kept(out)
    for b, n in enumerate(lengths):
        want = ref.lagkv_oneshot(k[b], v[b], n, sink=S, lag=L, keep=2, variant=variant,
                                 value_weight=method.resolved_value_weight)
        assert got[b] == want, (b, variant)
        assert out.length[b].tolist() == [ref.lagkv_length(n, S, L, 2)] * 2
        complete = (n - S) // L
        window = set(range(S + (complete - 1) * L, n))
        for h in range(2):
            kept = got[b][h]
            assert set(range(S)) | window <= set(kept)
            for p in range(complete - 1):
                assert sum(S + p * L <= x < S + (p + 1) * L for x in kept) == 2
            slots = np.asarray(out.pos)[b, h]
            for slot, p in enumerate(slots[: len(kept)]):
                np.testing.assert_array_equal(np.asarray(out.k)[b, h, slot], k[b, h, p])
                np.testing.assert_array_equal(np.asarray(out.v)[b, h, slot], v[b, h, p])


def test_eq12_examples_and_noop_below_threshold():
    """Properties 1-2: n=300, S=16, L=128, r=1/2 keeps 236; n < S + 2L is returned bitwise."""
    assert ref.lagkv_length(16384, 16, 128, 64) == 8320
    assert ref.lagkv_length(16384, 16, 1024, 512) == 9216
    assert ref.lagkv_length(16384, 16, 1024, 128) == 3840
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 1, 300, 2)).astype(np.float32)
    method = methods.get("lagkv", sink_size=16, lag_size=128, retention=0.5)
    out, _ = _oneshot(method, k, k, [300])
    assert out.length.tolist() == [[236]]
    small = methods.get("lagkv", sink_size=S, lag_size=L, retention=0.25)
    k, v = _kv(2, t=32)
    out, cache = _oneshot(small, k, v, [19, 12, 5], capacity=32)
    valid = np.asarray(kvc.stored_mask(cache))[:, :, :32, None]
    np.testing.assert_array_equal(np.asarray(out.k) * valid, np.asarray(cache.k)[:, :, :32] * valid)
    np.testing.assert_array_equal(np.asarray(out.v) * valid, np.asarray(cache.v)[:, :, :32] * valid)
    np.testing.assert_array_equal(np.asarray(out.pos), np.asarray(cache.pos)[:, :, :32])
    np.testing.assert_array_equal(np.asarray(out.length), np.asarray(cache.length))


def test_per_channel_affine_and_permutation_invariance_and_softmax_mass():
    """Properties 5-7: positive (or all-negative) per-channel affine maps and channel permutations
    leave the scores unchanged; each scored partition's K and V scores sum to 1 each."""
    rng = np.random.default_rng(3)
    z = rng.standard_normal((2, 5, L, 8)).astype(np.float32)
    base = np.asarray(partition_scores(jnp.asarray(z)))
    a = rng.uniform(0.5, 2.0, 8).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    for scale in (a, -a):
        np.testing.assert_allclose(partition_scores(jnp.asarray(z * scale + b)), base, atol=1e-5)
    perm = rng.permutation(8)
    np.testing.assert_allclose(partition_scores(jnp.asarray(z[..., perm])), base, atol=1e-6)
    np.testing.assert_allclose(base.sum(-1), 1.0, atol=1e-5)
    k, v = _kv(4)
    method = methods.get("lagkv", sink_size=S, lag_size=L, retention=0.5)
    flipped = np.array([1.0, -1.0] * 4, np.float32)  # mixed signs are *not* an invariance
    out_a, _ = _oneshot(method, k * a, v, [64, 64, 64])
    out_b, _ = _oneshot(method, k, v, [64, 64, 64])
    assert _kept(out_a) == _kept(out_b)
    assert not np.allclose(partition_scores(jnp.asarray(z * flipped)), base, atol=1e-3)


def test_head_independence_and_no_nan_for_constant_or_zero_kv():
    """Properties 8 and 12: editing head 1 leaves head 0's selection; constant / zero K,V give no NaN
    (the max - min clamp), and the literal reference behaviour (minmax_eps=0) would."""
    k, v = _kv(5)
    method = methods.get("lagkv", sink_size=S, lag_size=L, retention=0.25)
    base, _ = _oneshot(method, k, v, [64, 50, 33])
    k2, v2 = k.copy(), v.copy()
    k2[:, 1] = np.random.default_rng(9).standard_normal(k2[:, 1].shape)
    other, _ = _oneshot(method, k2, v2, [64, 50, 33])
    assert [row[0] for row in _kept(base)] == [row[0] for row in _kept(other)]
    const = np.ones_like(k)
    out, _ = _oneshot(method, const, np.zeros_like(v), [64, 50, 33])
    assert np.isfinite(np.asarray(out.k)).all()
    z = jnp.ones((1, 3, L, 8))
    assert np.isfinite(np.asarray(partition_scores(z))).all()
    assert np.isnan(np.asarray(partition_scores(z, eps=0.0))).all()


@pytest.mark.parametrize("chunks", [[1] * 64, [7] * 9 + [1], [L] * 8, [3 * L + 5, 3 * L + 5, 64 - 6 * L - 10]])
def test_incremental_prefill_equals_oneshot(chunks):
    """Property 4: chunked calls of the prefill hook (any chunk sizes) end with the one-shot cache,
    never holding more than the capacity bound between calls."""
    k, v = _kv(6, b=1, t=64)
    method = methods.get("lagkv", sink_size=S, lag_size=L, retention=0.25)
    cap = method.capacity(0, 64)
    cache = kvc.init(1, 2, cap, 8, jnp.float32, state=method.init_state(1, 2, cap))
    start = 0
    for size in chunks:
        pos = np.arange(start, start + size, dtype=np.int32)[None]
        step = ref.make_step(method, pos, cap, lengths=[start + size], final_chunk=False)
        cache = _append_prefill(method, size, cache, jnp.asarray(k[:, :, start:start + size].transpose(0, 2, 1, 3)),
                                jnp.asarray(v[:, :, start:start + size].transpose(0, 2, 1, 3)), jnp.asarray(pos), step)
        assert cache.capacity == cap
        start += size
    want = ref.lagkv_oneshot(k[0], v[0], 64, sink=S, lag=L, keep=2)
    assert _kept(cache)[0] == want
    streamed, peak = ref.lagkv_stream(k[0], v[0], chunks, sink=S, lag=L, keep=2)
    assert streamed == want
    assert peak <= cap + max(chunks)


def test_recursive_decode_hook_matches_reference_and_never_rescores():
    """Properties 10-11: one-shot prefill, then the decode hook token by token. Compressions come
    after exactly L - rem tokens, then every L; the compressed prefix is never touched; the cache
    never exceeds the capacity bound and equals the NumPy stream (deferred decode calls)."""
    k, v = _kv(7, b=1, t=96)
    method = methods.get("lagkv", sink_size=S, lag_size=L, retention=0.25)
    prompt = 31  # rem = (31 - 4) % 8 = 3: next compression after 5 tokens
    cap = method.capacity(prompt, 96 - prompt)
    out, _ = _oneshot(method, k[:, :, :prompt], v[:, :, :prompt], [prompt], capacity=cap)
    cache, lengths, compress_at = out, [int(out.length[0, 0])], []
    for t in range(prompt, 96):
        before = np.asarray(cache.pos)[0, 0].copy()
        prefix = int(np.sum((before >= 0) & (before < S + int(cache.state["parts"][0, 0]) * L)))
        appended, cache = _append_decode(method, cache, jnp.asarray(k[:, :, t:t + 1].transpose(0, 2, 1, 3)),
                                         jnp.asarray(v[:, :, t:t + 1].transpose(0, 2, 1, 3)),
                                         jnp.asarray([[t]], jnp.int32), ref.make_step(method, [[t]], cap, [prompt]))
        n_before = int(appended.length[0, 0])
        if int(cache.length[0, 0]) < n_before:
            compress_at.append(t)
        np.testing.assert_array_equal(np.asarray(cache.pos)[0, 0, :prefix], before[:prefix])
        assert int(cache.length[0, 0]) < cap  # room for the next token
        lengths.append(int(cache.length[0, 0]))
    # The reference compresses after the token that completes 2L of window has attended: the hook
    # of the following token does it.
    assert compress_at[0] == prompt + (L - 3)
    assert np.diff(compress_at).tolist() == [L] * (len(compress_at) - 1)
    want, peak = ref.lagkv_stream(k[0], v[0], [prompt], sink=S, lag=L, keep=2, decode_tokens=96 - prompt)
    assert _kept(cache)[0] == want
    assert peak <= cap


def test_budget_mode_matches_kvpress_rank_selection_and_adapts_decode_rate():
    """Property 13 (kvpress / RULER protocol): exactly `budget` tokens, sink and window first, the
    rest spread over partitions by within-partition rank (+-1 token); decode keeps the adapted m."""
    k, v = _kv(8)
    lengths = [64, 20, 45]
    method = methods.get("lagkv", sink_size=S, lag_size=L, budget=30)
    out, _ = _oneshot(method, k, v, lengths)
    got = _kept(out)
    for b, n in enumerate(lengths):
        assert got[b] == ref.lagkv_budget(k[b], v[b], n, 30, sink=S, lag=L)
        complete = (n - S) // L
        for h in range(2):
            counts = [sum(S + p * L <= x < S + (p + 1) * L for x in got[b][h]) for p in range(complete - 1)]
            if n > 30 and complete >= 2:
                assert max(counts) - min(counts) <= 1
    # n=64: 7 partitions, window 12: (30 - 4 - 12) // 6 = 2; n=20 <= budget: m = L; n=45: (30 - 4 - 9) // 4 = 4.
    assert np.asarray(out.state["keep"])[:, 0].tolist() == [2, L, 4]
    ratio = methods.get("lagkv", sink_size=S, lag_size=L, compression_ratio=0.5)
    out, _ = _oneshot(ratio, k, v, lengths)
    assert out.length[:, 0].tolist() == [32, 12, 22]  # n=20: sink + window (12) exceed 10


def test_bf16_cache_is_scored_in_float32():
    """A bf16 cache keeps exactly what a float32 cache of the same (rounded) values keeps."""
    k, v = _kv(15)
    k16, v16 = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (k, v))
    method = methods.get("lagkv", sink_size=S, lag_size=L, retention=0.25)
    cache, pos = ref.make_cache(method, k16, v16, [64, 50, 33], dtype=jnp.bfloat16)
    out = _prefill_fn(method)(cache, jnp.zeros((3, 64, 4, 2)), ref.make_step(method, pos, method.capacity(64, 1)))
    assert out.k.dtype == jnp.bfloat16
    assert _kept(out) == _kept(_oneshot(method, k16, v16, [64, 50, 33])[0])


def test_skipped_layers_are_not_compressed():
    """The L2 variant skips layers 0 and 1 (its paper setting); other layers compress; a model with
    skipped layers needs the full capacity."""
    k, v = _kv(14, b=1)
    method = methods.get("lagkv", sink_size=S, lag_size=L, retention=0.25, variant="l2")
    cap = method.capacity(64, 1)
    assert cap == 65
    cache, pos = ref.make_cache(method, k, v, [64])
    fn = jax.jit(method.prefill)
    for layer, want in ((0, list(range(64))), (1, list(range(64))),
                        (2, ref.lagkv_oneshot(k[0], v[0], 64, sink=S, lag=L, keep=2, variant="l2", value_weight=0.0))):
        out = fn(cache, jnp.zeros((1, 64, 4, 8)), ref.make_step(method, pos, cap, layer=layer, num_layers=3))
        assert _kept(out)[0] == (want if layer == 2 else [want, want])


def test_config_errors_name_the_parameter():
    for kwargs, match in [
        (dict(retention=0.0), "retention"),
        (dict(retention=0.5, budget=10), "retention"),
        (dict(lag_size=0), "lag_size"),
        (dict(sink_size=-1), "sink_size"),
        (dict(variant="foo"), "variant"),
        (dict(value_weight=-1.0), "value_weight"),
        (dict(skip_layers=(-1,)), "skip_layers"),
        (dict(minmax_eps=-1.0), "minmax_eps"),
        (dict(retention=0.01, lag_size=8), "retention"),
        (dict(compression_ratio=0.95, lag_size=8), "compression_ratio"),
    ]:
        with pytest.raises(ConfigError, match=match):
            methods.get("lagkv", **kwargs)
    assert methods.get("lagkv").retention == 0.5
    assert methods.get("lagkv", variant="l2").resolved_skip_layers == (0, 1)


# ---- end to end ------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _model_step(config, method, tune, weights, rope, cache, tokens, positions, budget):
    with tuning.use(tune):  # as the decode loop traces it
        return forward.decode_step(config, weights, rope, method, cache, tokens, positions, budget)


def _layer0_kv(model, seq):
    """Layer 0's post-RoPE keys and values of every token (they never depend on the cache)."""
    state = kvjax.prefill(model, [list(seq)], method="full")
    layer0 = state.cache.layers[0]
    return np.asarray(layer0.k[0, :, : len(seq)]), np.asarray(layer0.v[0, :, : len(seq)])


def test_long_decode_stays_within_the_bound_and_matches_reference_on_layer0():
    """Recursive mode through the model: `length` / `pos` checked every step; layer 0's kept set
    equals the NumPy stream on that layer's K/V; capacity is the documented bound."""
    model = tiny_model()
    rng = np.random.default_rng(10)
    prompt, new = rng.integers(0, 96, 37).tolist(), 60
    method = methods.get("lagkv", sink_size=S, lag_size=L, retention=0.25)
    state = kvjax.prefill(model, [prompt], method=method, max_new_tokens=new)
    cap = state.cache.capacity
    total = 64 + new  # bucket + new tokens
    assert cap == min(total, S + 2 * ((total - S) // L - 1) + 2 * L + 1) < total
    feed = rng.integers(0, 96, new - 1)
    cache, bound_ok = state.cache, []
    for i, tok in enumerate(feed):
        _, cache = _model_step(model.config, method, tuning.current(), model.weights(), model.rope(), cache,
                               jnp.asarray([tok], jnp.int32), jnp.asarray([37 + i], jnp.int32), state.budget)
        stacked = cache.stacked()  # [L, ...]
        length = np.asarray(stacked.length)
        parts = np.asarray(stacked.state["parts"])
        bound_ok.append(bool((length < cap).all() and (length <= S + 2 * parts + 2 * L).all()))
        pos = np.asarray(stacked.pos)
        assert ((pos >= 0).sum(-1) == length).all() and (pos.max(-1) == 37 + i).all()
    assert all(bound_ok)
    seq = prompt + feed.tolist()
    k0, v0 = _layer0_kv(model, seq)
    want, _ = ref.lagkv_stream(k0, v0, [37], sink=S, lag=L, keep=2, decode_tokens=len(feed))
    assert [ref.kept_positions(cache.layer(0), 0, h) for h in range(2)] == want


def test_chunked_prefill_bounds_memory_and_follows_the_reference_schedule():
    """Chunk-by-chunk prefill (chunk = L, S a multiple of L: the paper's schedule): the cache is
    allocated at the method's capacity (far below the prompt); layer 0 keeps what the NumPy stream
    keeps; a single chunk equals one-shot prefill."""
    model = tiny_model()
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 96, 120).tolist()
    method = methods.get("lagkv", sink_size=L, lag_size=L, retention=0.25)
    state = kvjax.prefill(model, [prompt], method=method, max_new_tokens=2, chunk_size=L)
    assert state.cache.capacity == method.capacity(128, 2) < 120  # bucket 128
    k0, v0 = _layer0_kv(model, prompt)
    want, peak = ref.lagkv_stream(k0, v0, [L] * 15, sink=L, lag=L, keep=2)
    assert [ref.kept_positions(state.cache.layer(0), 0, h) for h in range(2)] == want
    assert peak <= state.cache.capacity + L
    one = kvjax.generate(model, [prompt], method=method, max_new_tokens=4)
    whole = kvjax.generate(model, [prompt], method=method, max_new_tokens=4, chunk_size=128)
    np.testing.assert_array_equal(one.tokens, whole.tokens)
    with pytest.raises(ConfigError, match="chunked prefill needs partition mode"):
        kvjax.prefill(model, [prompt], method="lagkv", method_args={"budget": 40}, chunk_size=32)


def test_generate_gqa_padded_batch_equals_each_alone_and_traces_once():
    """8 query heads on 2 KV heads; 3 right-padded prompts of different lengths give the same tokens
    as each prompt alone (first token = `full`'s); a second generate of the same shape bucket does not
    retrace the decode step."""
    model, prompts = ref.e2e_model(), ref.e2e_prompts(12)
    full = kvjax.generate(model, prompts, method="full", max_new_tokens=20)
    args = dict(sink_size=S, lag_size=L, budget=24)
    batch = kvjax.generate(model, prompts, method="lagkv", method_args=args, max_new_tokens=20)
    np.testing.assert_array_equal(batch.tokens[:, 0], full.tokens[:, 0])
    for i, p in enumerate(prompts):
        alone = kvjax.generate(model, [p], method="lagkv", method_args=args, max_new_tokens=20)
        np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0])
    before = dict(TRACE_COUNTS)
    kvjax.generate(model, ref.e2e_prompts(13), method="lagkv", method_args=args, max_new_tokens=20)
    assert TRACE_COUNTS["decode_step"] == before["decode_step"]


def test_bf16_storage():
    """bf16 cache: finite values, statistics in float32, and the lengths partition mode prescribes."""
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, 96, n).tolist() for n in (50, 31)]
    out = kvjax.generate(tiny_model(dtype=jnp.bfloat16), prompts, method="lagkv", max_new_tokens=12,
                         method_args=dict(sink_size=S, lag_size=L, retention=0.25), return_cache=True)
    assert out.cache.stacked().k.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out.cache.stacked().k, np.float32)).all()
    for b, n in enumerate((50, 31)):
        k, v = _kv(0, b=1, t=n + 11)  # in partition mode the kept count does not depend on the values
        kept, _ = ref.lagkv_stream(k[0], v[0], [n], sink=S, lag=L, keep=2, decode_tokens=11)
        assert (np.asarray(out.cache.stacked().length)[:, b] == len(kept[0])).all()
