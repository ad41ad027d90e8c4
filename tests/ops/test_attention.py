"""Attention ops against a naive NumPy softmax attention written from the definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import tuning
from kvjax.ops import attention as att
from kvjax.ops.attention import decode_attention, prefill_attention


def naive(q, q_pos, k, v, k_pos, k_valid, window=None):
    b, t, n, h = q.shape
    kv = k.shape[1]
    g = n // kv
    out = np.zeros((b, t, n, h), np.float64)
    for bi in range(b):
        for ti in range(t):
            if q_pos[bi, ti] < 0:
                continue
            for ni in range(n):
                ki = ni // g
                ok = k_valid[bi, ki] & (k_pos[bi, ki] <= q_pos[bi, ti])
                if window is not None:
                    ok &= q_pos[bi, ti] - k_pos[bi, ki] < window
                if not ok.any():
                    continue
                s = (k[bi, ki][ok] @ q[bi, ti, ni]) / np.sqrt(h)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[bi, ti, ni] = p @ v[bi, ki][ok]
    return out


def random_case(rng, b=3, t=37, n=8, kv=2, c=53, h=16):
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k = rng.standard_normal((b, kv, c, h)).astype(np.float32)
    v = rng.standard_normal((b, kv, c, h)).astype(np.float32)
    # Shuffled positions (a compressed cache is not contiguous), some empty slots.
    k_pos = np.stack([np.stack([rng.permutation(c) for _ in range(kv)]) for _ in range(b)]).astype(np.int32)
    k_valid = rng.random((b, kv, c)) > 0.2
    q_pos = np.tile(np.arange(c - t, c, dtype=np.int32), (b, 1))
    q_pos[1, -5:] = -1  # padding rows
    return q, q_pos, k, v, k_pos, k_valid


@pytest.mark.parametrize("block_q,block_k", [(512, 1024), (8, 16), (5, 7)])
@pytest.mark.parametrize("window", [None, 9])
def test_prefill_attention_matches_naive(block_q, block_k, window):
    rng = np.random.default_rng(0)
    q, q_pos, k, v, k_pos, k_valid = random_case(rng)
    got = prefill_attention(
        jnp.asarray(q), jnp.asarray(q_pos), jnp.asarray(k), jnp.asarray(v), jnp.asarray(k_pos),
        jnp.asarray(k_valid), sliding_window=window, block_q=block_q, block_k=block_k,
    )
    np.testing.assert_allclose(np.asarray(got), naive(q, q_pos, k, v, k_pos, k_valid, window), atol=2e-5)
    assert np.all(np.asarray(got)[1, -5:] == 0)  # padding rows give zeros, not NaN


def prefill_case(rng, b=2, t=45, n=6, kv=3, h=16, past=0):
    """A one-shot prefill's layout: a chunk attending itself (after `past` earlier keys), positions in
    order, the second example shorter (padding query rows, empty key slots)."""
    c = past + t
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k = rng.standard_normal((b, kv, c, h)).astype(np.float32)
    v = rng.standard_normal((b, kv, c, h)).astype(np.float32)
    q_pos = np.tile(np.arange(past, c, dtype=np.int32), (b, 1))
    q_pos[1, -7:] = -1
    k_pos = np.broadcast_to(np.arange(c, dtype=np.int32), (b, kv, c)).copy()
    k_valid = np.ones((b, kv, c), bool)
    k_valid[1, :, -7:] = False
    return q, q_pos, k, v, k_pos, k_valid


@pytest.mark.parametrize("block_q,block_k", [(8, 8), (4, 16), (16, 4)])
@pytest.mark.parametrize("window", [None, 11, 20])
@pytest.mark.parametrize("past", [0, 13])
def test_prefill_attention_in_prompt_order_matches_naive(block_q, block_k, window, past):
    """Ordered positions take all three tile branches (skipped, unmasked, masked); the result must not
    depend on which."""
    rng = np.random.default_rng(4)
    case = prefill_case(rng, past=past)
    got = prefill_attention(*map(jnp.asarray, case), sliding_window=window, block_q=block_q, block_k=block_k)
    np.testing.assert_allclose(np.asarray(got), naive(*case, window), atol=2e-5)
    assert np.all(np.asarray(got)[1, -7:] == 0)


def tile_modes_and_masks(case, bq, bk, window):
    """Every tile's `_tile_mode` next to its exact `[B, K, bq, bk]` mask, blocks cut as the op cuts them."""
    q, q_pos, k, v, k_pos, k_valid = case
    qp = np.asarray(att._pad_axis(jnp.asarray(q_pos), 1, bq, -1))
    kp = np.asarray(att._pad_axis(jnp.asarray(k_pos), 2, bk, -1))
    kv = np.asarray(att._pad_axis(jnp.asarray(k_valid), 2, bk, False))
    for i in range(qp.shape[1] // bq):
        q_blk = jnp.asarray(qp[:, i * bq : (i + 1) * bq])
        for j in range(kp.shape[2] // bk):
            kp_blk, kv_blk = jnp.asarray(kp[:, :, j * bk : (j + 1) * bk]), jnp.asarray(kv[:, :, j * bk : (j + 1) * bk])
            mode = int(att._tile_mode(att._query_block_span(q_blk), att._key_block_span(kp_blk, kv_blk), window))
            yield mode, np.asarray(att._key_mask(q_blk, kp_blk, kv_blk, window))


@pytest.mark.parametrize("window", [None, 30])
def test_tile_mode_never_skips_a_visible_key_nor_unmasks_a_hidden_one(window):
    """Against the exact mask: a skipped tile has no visible (query, key) pair and an unmasked one has
    no hidden pair, on ordered and shuffled positions. On ordered ones both shortcuts do happen."""
    rng = np.random.default_rng(5)
    for case, ordered in ((prefill_case(rng, past=13), True), (random_case(rng), False)):
        modes = []
        for mode, mask in tile_modes_and_masks(case, 8, 8, window):
            modes.append(mode)
            if mode == att.TILE_SKIP:
                assert not mask.any()
            elif mode == att.TILE_WHOLE:
                assert mask.all()
        if ordered:
            assert {att.TILE_SKIP, att.TILE_WHOLE, att.TILE_MASKED} <= set(modes)


@pytest.mark.parametrize("keys_as_rows", [False, True])
def test_decode_attention_matches_naive_and_weights_sum_to_one(keys_as_rows):
    """Both score layouts (`q K^T`, and `K q^T` then a transpose: the tuning's `decode_keys_as_rows`) against
    the reference."""
    rng = np.random.default_rng(1)
    q, q_pos, k, v, k_pos, k_valid = random_case(rng, t=1)
    q_pos = np.full((3, 1), 60, np.int32)
    with tuning.override(decode_keys_as_rows=keys_as_rows):
        out, w = decode_attention(
            jnp.asarray(q[:, 0]), jnp.asarray(q_pos[:, 0]), jnp.asarray(k), jnp.asarray(v),
            jnp.asarray(k_pos), jnp.asarray(k_valid), return_weights=True,
        )
    np.testing.assert_allclose(np.asarray(out), naive(q, q_pos, k, v, k_pos, k_valid)[:, 0], atol=2e-5)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, atol=1e-5)
    assert np.all(np.asarray(w)[np.broadcast_to(~k_valid[:, :, None], w.shape)] == 0)


def test_bf16_inputs_stay_close_to_float32():
    rng = np.random.default_rng(2)
    q, q_pos, k, v, k_pos, k_valid = random_case(rng)
    args = [jnp.asarray(x) for x in (q, q_pos, k, v, k_pos, k_valid)]
    ref = prefill_attention(*args)
    bf = [a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in args]
    got = prefill_attention(*bf)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), atol=5e-2)


@pytest.mark.parametrize("keys_as_rows", [False, True])
def test_decode_attention_per_query_head_mask(keys_as_rows):
    rng = np.random.default_rng(3)
    q, q_pos, k, v, k_pos, k_valid = random_case(rng, t=1)
    q_pos = np.full((3, 1), 60, np.int32)
    g = 4
    per_head = rng.random((3, 2, g, k.shape[2])) > 0.4
    with tuning.override(decode_keys_as_rows=keys_as_rows):
        out = decode_attention(
            jnp.asarray(q[:, 0]), jnp.asarray(q_pos[:, 0]), jnp.asarray(k), jnp.asarray(v), jnp.asarray(k_pos),
            jnp.asarray(per_head),
        )
    for head in range(8):  # each query head attends exactly its own visible slots
        visible = per_head[:, head // g, head % g]
        ref = naive(q[:, :, head : head + 1], q_pos, k[:, head // g : head // g + 1], v[:, head // g : head // g + 1],
                    k_pos[:, head // g : head // g + 1], visible[:, None])
        np.testing.assert_allclose(np.asarray(out)[:, head], ref[:, 0, 0], atol=2e-5)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("block_q", [256, 8])
def test_prefill_attention_through_jax_dot_product_attention_matches_naive(window, block_q):
    """`implementation="dot_product_attention"` (jax.nn.dot_product_attention's XLA path on CPU, cuDNN's on
    GPUs): GQA, shuffled positions, empty slots, a sliding window and padding rows, against the reference."""
    rng = np.random.default_rng(2)
    case = random_case(rng)
    args = [jnp.asarray(x) for x in case]
    got = prefill_attention(*args, sliding_window=window, block_q=block_q, implementation="dot_product_attention")
    np.testing.assert_allclose(np.asarray(got), naive(*case, window), atol=2e-5)
    ref = prefill_attention(*args, sliding_window=window, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6)
    assert np.all(np.asarray(got)[1, -5:] == 0)


@pytest.mark.parametrize("implementation", ["xla", "prefill_attention", "dot_product_attention"])
@pytest.mark.parametrize("window", [None, 7])
def test_causal_prefix_attention_matches_naive(implementation, window):
    """Prompts from position 0, right-padded: every path equals the reference; padding rows give 0."""
    rng = np.random.default_rng(5)
    b, t, n, kv, h = 3, 29, 8, 2, 16
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k = rng.standard_normal((b, t, kv, h)).astype(np.float32)
    v = rng.standard_normal((b, t, kv, h)).astype(np.float32)
    lengths = np.asarray([29, 11, 1], np.int32)
    pos = np.where(np.arange(t)[None] < lengths[:, None], np.arange(t)[None], -1).astype(np.int32)
    k_pos = np.broadcast_to(pos[:, None], (b, kv, t))
    want = naive(q, pos, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), k_pos, k_pos >= 0, window)
    got = att.causal_prefix_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                                      sliding_window=window, implementation=implementation)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    assert np.all(np.asarray(got)[1, 11:] == 0) and np.all(np.asarray(got)[2, 1:] == 0)


def test_causal_prefix_attention_auto_follows_the_backend_policy(monkeypatch):
    """"auto" takes the one fused call only when the tuning's `auto_causal_prefix` is set, for 16-bit inputs."""
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((1, 16, 4, 16)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 16, 2, 16)), jnp.bfloat16)
    lengths = jnp.asarray([13], jnp.int32)
    calls = []
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    ref = att.causal_prefix_attention(q, k, k, lengths, implementation="xla")
    with tuning.override(auto_causal_prefix=False):
        att.causal_prefix_attention(q, k, k, lengths)
    assert not any(kw.get("is_causal") for kw in calls)
    with tuning.override(auto_causal_prefix=True):
        got = att.causal_prefix_attention(q, k, k, lengths)
    assert calls[-1]["is_causal"] and calls[-1]["query_seq_lengths"] is not None
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=3e-2)
    with pytest.raises(att.ConfigError, match="causal_prefix_attention: implementation"):
        att.causal_prefix_attention(q, k, k, lengths, implementation="cudnn")


@pytest.mark.parametrize("blocks", [dict(block_q=0), dict(block_k=0), dict(block_q=-2), dict(block_k=2.5)])
def test_prefill_attention_refuses_a_block_that_is_no_positive_integer(blocks):
    """A block of 0 was a ZeroDivisionError in the padding helper, a negative one a reshape TypeError, a float a
    `pad_width` TypeError: each is one ConfigError naming the argument, on both blockwise paths. Blocks of 1 still
    run (against the naive reference)."""
    args = [jnp.asarray(x) for x in random_case(np.random.default_rng(3), t=4, c=6)]
    (name, value), = blocks.items()
    for implementation in ("xla", "dot_product_attention"):
        with pytest.raises(att.ConfigError, match=f"prefill_attention: {name} must be a positive integer, got {value}"):
            prefill_attention(*args, implementation=implementation, **blocks)
    got = prefill_attention(*args, implementation="xla", block_q=1, block_k=1)
    np.testing.assert_allclose(np.asarray(got), naive(*(np.asarray(x) for x in args)), atol=1e-5)


def test_prefill_attention_rejects_unknown_implementation():
    from kvjax.errors import ConfigError

    args = [jnp.asarray(x) for x in random_case(np.random.default_rng(3), t=4, c=6)]
    with pytest.raises(ConfigError, match="implementation"):
        prefill_attention(*args, implementation="cudnn")


@pytest.mark.parametrize("n", [6, 1])  # 6 (and 1) query heads over 4 KV heads: no whole GQA groups
def test_query_heads_that_do_not_group_over_the_kv_heads_are_named(n):
    """Each attention op, on every path, refuses a query head count that is no multiple of the KV heads with one
    ConfigError naming both counts (the XLA paths reshaped into a TypeError deep inside jax)."""
    q, q_pos, k, v, k_pos, k_valid = (jnp.asarray(x) for x in random_case(np.random.default_rng(4), t=3, n=n, kv=4,
                                                                         c=8))
    match = f"{n} query heads are not a multiple of 4 KV heads"
    for implementation in ("xla", "dot_product_attention", "auto"):
        with pytest.raises(att.ConfigError, match=f"prefill_attention: {match}"):
            prefill_attention(q, q_pos, k, v, k_pos, k_valid, implementation=implementation)
    for implementation in ("xla", "pallas", "auto"):
        with pytest.raises(att.ConfigError, match=f"decode_attention: {match}"):
            decode_attention(q[:, 0], q_pos[:, 0], k, v, k_pos, k_valid, implementation=implementation)
    prompt = jnp.swapaxes(k[:, :, :3], 1, 2)  # [B, T, K, H]
    for implementation in ("xla", "dot_product_attention"):
        with pytest.raises(att.ConfigError, match=f"causal_prefix_attention: {match}"):
            att.causal_prefix_attention(q, prompt, prompt, jnp.asarray([3, 2, 1]), implementation=implementation)


@pytest.mark.parametrize("window", [0, -4, True])
def test_a_window_that_masks_every_key_is_refused(window):
    """sliding_window 0 / negative (or a bool) masked every key, so each attention op returned zeros without a word
    (0 is what a user might pass for "no window"); it is one ConfigError naming the value. A window of 1 (each
    query sees its own position) still runs, against the naive reference."""
    from kvjax import cache as kvc
    from kvjax.ops import fused_decode, sparse_attention

    q, q_pos, k, v, k_pos, k_valid = (jnp.asarray(x) for x in random_case(np.random.default_rng(6), t=3, c=8))
    match = f"sliding_window must be a positive integer or None, got {window!r}"
    with pytest.raises(att.ConfigError, match=f"prefill_attention: {match}"):
        prefill_attention(q, q_pos, k, v, k_pos, k_valid, sliding_window=window)
    with pytest.raises(att.ConfigError, match=f"decode_attention: {match}"):
        decode_attention(q[:, 0], q_pos[:, 0], k, v, k_pos, k_valid, sliding_window=window)
    prompt = jnp.swapaxes(k[:, :, :3], 1, 2)
    with pytest.raises(att.ConfigError, match=f"causal_prefix_attention: {match}"):
        att.causal_prefix_attention(q, prompt, prompt, jnp.asarray([3, 2, 1]), sliding_window=window)
    starts, ranges = jnp.zeros((3, 2, 1), jnp.int32), jnp.zeros((3, 2, 1, 2), jnp.int32)
    with pytest.raises(att.ConfigError, match=f"block_sparse_decode_attention: {match}"):
        sparse_attention.block_sparse_decode_attention(q[:, 0], q_pos[:, 0], k, v, k_pos, k_valid, starts, 1, ranges,
                                                       block_size=4, sliding_window=window)
    layer = kvc.init(3, 2, 8, 16, jnp.float32)
    inv_freq = jnp.ones((8,), jnp.float32)
    with pytest.raises(att.ConfigError, match=f"decode_append_attention: {match}"):
        fused_decode.decode_append_attention(q[:, :1], k[:, :, :1].swapaxes(1, 2), v[:, :, :1].swapaxes(1, 2),
                                             q_pos[:, :1], layer, inv_freq=inv_freq, sliding_window=window)
    got = prefill_attention(q, q_pos, k, v, k_pos, k_valid, sliding_window=1, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), naive(*(np.asarray(x) for x in (q, q_pos, k, v, k_pos, k_valid)),
                                                      window=1), atol=1e-5)


@pytest.mark.parametrize("capability,head_dim,want", [("8.0", 256, "xla"), ("9.0", 256, "cudnn"), ("8.0", 128, "cudnn"),
                                                     ("9.0", 100, "xla"), ("9.0", 264, "xla")])
def test_cudnn_attention_only_for_the_head_dims_it_takes(monkeypatch, capability, head_dim, want):
    """On a GPU the fused paths ask `jax.nn.dot_product_attention` for cuDNN only where cuDNN takes the head_dim (a
    multiple of 8, at most 128 before Hopper, 256 from it): an A100 running Gemma 3's 256-wide heads in bf16 got
    cuDNN's NotImplementedError from the default prefill. A GPU is faked (backend name and the device's compute
    capability); the call records the implementation asked for and runs jax's XLA one."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((2, 5, 4, head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 5, 2, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 5, 2, head_dim)), jnp.bfloat16)
    lengths = jnp.asarray([5, 3])
    want_out = att.causal_prefix_attention(q, k, v, lengths, implementation="xla")

    class Device:
        compute_capability = capability

    asked = []
    real = jax.nn.dot_product_attention

    def recorded(*args, implementation=None, **kwargs):
        asked.append(implementation)
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *_: [Device()])
    monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
    got = att.causal_prefix_attention(q, k, v, lengths, implementation="dot_product_attention")
    pos = jnp.where(jnp.arange(5)[None] < lengths[:, None], jnp.arange(5)[None], -1)
    k_pos = jnp.broadcast_to(pos[:, None], (2, 2, 5))
    got_blocks = prefill_attention(q, pos, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), k_pos, k_pos >= 0,
                                   implementation="dot_product_attention")
    assert asked == [want, want]
    for out in (got, got_blocks):
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), atol=2e-2)


def test_prefill_attention_auto_takes_the_backend_path_for_16_bit_inputs(monkeypatch):
    """"auto" follows the tuning's `auto_prefill` for bf16 inputs without `return_lse` (cuDNN on GPU); float32
    inputs and `return_lse` stay on the blockwise XLA path. Checked by which path runs and by its output."""
    from kvjax.ops import attention as attention_ops

    case = random_case(np.random.default_rng(4), t=12, c=16)
    args = [jnp.asarray(x) for x in case]
    bf16 = [args[0].astype(jnp.bfloat16), args[1], args[2].astype(jnp.bfloat16), args[3].astype(jnp.bfloat16),
            *args[4:]]
    calls = []
    real = attention_ops._dot_product_attention
    monkeypatch.setattr(attention_ops, "_dot_product_attention", lambda *a: calls.append(a[0].dtype) or real(*a))
    with tuning.override(auto_prefill="dot_product_attention"):
        got = prefill_attention(*bf16)
        assert calls == [jnp.bfloat16]
        want = prefill_attention(*bf16, implementation="xla")
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)
        prefill_attention(*args)  # float32: XLA
        prefill_attention(*bf16, return_lse=True)  # the lse needs the XLA path
        assert calls == [jnp.bfloat16]
    with tuning.override(auto_prefill="xla"):
        prefill_attention(*bf16)
    assert calls == [jnp.bfloat16]


def test_auto_policy_per_backend(monkeypatch):
    """The measured GPU policy (BENCHMARKS.md): "auto" runs the block-sparse kernel, keeps dense decode on
    XLA; on CPU every op stays XLA under "auto" while "pallas" still reaches the kernel. `tuning.default()`
    follows the running backend."""
    from kvjax.ops import _impl

    with tuning.use(tuning.default("cpu")):
        assert _impl.resolve("block_sparse_decode_attention", "auto") == "xla"
        assert _impl.resolve("decode_attention", "pallas") == "pallas"
    with tuning.use(tuning.default("gpu")):
        assert _impl.resolve("block_sparse_decode_attention", "auto") == "pallas"
        assert _impl.resolve("decode_attention", "auto") == "xla"
        assert _impl.resolve("window_scores", "auto") == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert tuning.current() == tuning.default("gpu")
    assert _impl.resolve("block_sparse_decode_attention", "auto") == "pallas"


def test_decode_dots_in_cache_dtype_match_the_float32_dots():
    """`Tuning.decode_dots_in_cache_dtype`: bf16 K / V read as stored with float32 results (q and p cast to bf16)
    against the reference's float32 dots of the same bf16 values: within bf16 rounding of q and p."""
    from kvjax import tuning

    rng = np.random.default_rng(11)
    b, kv, g, c, h = 2, 2, 4, 300, 64
    q = jnp.asarray(rng.normal(size=(b, kv * g, h)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(b, kv, c, h)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(b, kv, c, h)), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, kv, c))
    valid = pos < jnp.asarray([250, 300])[:, None, None]
    q_pos = jnp.asarray([260, 310], jnp.int32)
    want = decode_attention(q, q_pos, k, v, pos, valid, implementation="xla")
    with tuning.override(decode_dots_in_cache_dtype=True):
        got = jax.jit(lambda *a: decode_attention(*a, implementation="xla"))(q, q_pos, k, v, pos, valid)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with tuning.override(decode_dots_in_cache_dtype=True):  # float32 caches: the knob changes nothing
        same = decode_attention(f32[0], q_pos, f32[1], f32[2], pos, valid, implementation="xla")
    np.testing.assert_array_equal(np.asarray(same), np.asarray(decode_attention(f32[0], q_pos, f32[1], f32[2], pos,
                                                                                  valid, implementation="xla")))
