"""Attention ops against a naive NumPy softmax attention written from the definition."""

import jax.numpy as jnp
import numpy as np
import pytest

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


def test_decode_attention_matches_naive_and_weights_sum_to_one():
    rng = np.random.default_rng(1)
    q, q_pos, k, v, k_pos, k_valid = random_case(rng, t=1)
    q_pos = np.full((3, 1), 60, np.int32)
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


def test_decode_attention_per_query_head_mask():
    rng = np.random.default_rng(3)
    q, q_pos, k, v, k_pos, k_valid = random_case(rng, t=1)
    q_pos = np.full((3, 1), 60, np.int32)
    g = 4
    per_head = rng.random((3, 2, g, k.shape[2])) > 0.4
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


def test_prefill_attention_rejects_unknown_implementation():
    from kvjax.errors import ConfigError

    args = [jnp.asarray(x) for x in random_case(np.random.default_rng(3), t=4, c=6)]
    with pytest.raises(ConfigError, match="implementation"):
        prefill_attention(*args, implementation="cudnn")
