"""Scoring ops against naive NumPy references written from the definitions (float64 loops)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import pool, window_votes

from kvjax.errors import ConfigError
from kvjax.ops import scoring


def random_case(rng, b=3, t=29, n=8, kv=2, c=37, h=16, dtype=np.float32):
    """Shuffled key positions (a compressed cache), empty slots, right-padded query rows."""
    q = rng.standard_normal((b, t, n, h)).astype(dtype)
    k = rng.standard_normal((b, kv, c, h)).astype(dtype)
    k_pos = np.stack([np.stack([rng.permutation(c) for _ in range(kv)]) for _ in range(b)]).astype(np.int32)
    k_valid = rng.random((b, kv, c)) > 0.2
    q_pos = np.tile(np.arange(c - t, c, dtype=np.int32), (b, 1))
    if b == 3:
        q_pos[1, -7:] = -1  # example 1 is shorter: its window ends 7 rows earlier
        q_pos[2, -2:] = -1
    return q, q_pos, k, k_pos, k_valid


def _args(case):
    return tuple(jnp.asarray(x) for x in case)


@pytest.mark.parametrize(
    "row_reduce,group_reduce,block_k",
    [("sum", "mean", 1024), ("mean", "max", 5), ("sum", None, 8), ("mean", "mean", 37)],
)
def test_window_scores_match_reference(row_reduce, group_reduce, block_k):
    case = random_case(np.random.default_rng(0))
    got = scoring.window_scores(
        *_args(case), window=6, row_reduce=row_reduce, group_reduce=group_reduce, block_k=block_k
    )
    want = window_votes(*case, 6, row_reduce, group_reduce)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=2e-5)


def test_window_scores_window_longer_than_chunk_and_per_row_scale():
    case = random_case(np.random.default_rng(1), t=5)
    scale = np.random.default_rng(2).uniform(0.1, 0.5, size=(3, 5)).astype(np.float32)
    got = scoring.window_scores(*_args(case), window=64, scale=jnp.asarray(scale), block_k=4)
    np.testing.assert_allclose(np.asarray(got), window_votes(*case, 64, scale=scale), atol=2e-6, rtol=2e-5)
    # Each valid window row adds probability mass 1; example 1 has no valid row in this chunk.
    got_sum = scoring.window_scores(*_args(case), window=3, group_reduce=None)
    want = np.broadcast_to(np.array([[3.0], [0.0], [3.0]]), (3, 8))
    np.testing.assert_allclose(np.asarray(got_sum).sum(-1), want, rtol=1e-5)


def test_window_scores_bf16_storage():
    case = random_case(np.random.default_rng(3))
    bf = [jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 else jnp.asarray(x) for x in case]
    got = scoring.window_scores(*bf, window=4, block_k=16)
    exact = [np.asarray(x.astype(jnp.float32)) if x.dtype == jnp.bfloat16 else np.asarray(x) for x in bf]
    np.testing.assert_allclose(np.asarray(got), window_votes(*exact, 4), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("group_reduce,block_q,block_k", [("mean", 512, 1024), ("max", 4, 7), (None, 7, 5)])
def test_accumulated_scores_match_reference(group_reduce, block_q, block_k):
    case = random_case(np.random.default_rng(4))
    got = scoring.accumulated_scores(*_args(case), group_reduce=group_reduce, block_q=block_q, block_k=block_k)
    want = window_votes(*case, case[0].shape[1], "sum", group_reduce)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=2e-5)


def _largest_intermediate(fn, *args) -> int:
    """Elements of the largest array any equation of `fn`'s jaxpr (sub-jaxprs included) makes."""

    def walk(jaxpr) -> int:
        best = 0
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                best = max(best, int(np.prod(getattr(var.aval, "shape", ()) or (1,))))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                best = max(best, walk(sub))
        return best

    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def test_scores_never_materialise_rows_by_keys():
    b, t, n, kv, c, h = 1, 128, 4, 2, 128, 8
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, kv, c, h)), jnp.float32)
    k_pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, kv, c))
    q_pos = jnp.arange(t, dtype=jnp.int32)[None]
    valid = jnp.ones((b, kv, c), bool)
    # Nothing bigger than the inputs or one block of logits per head; T x C per head is 16x that.
    bound = max(q.size, k.size, b * n * 16 * 16)
    acc = _largest_intermediate(
        lambda *a: scoring.accumulated_scores(*a, block_q=16, block_k=16), q, q_pos, k, k_pos, valid
    )
    win = _largest_intermediate(lambda *a: scoring.window_scores(*a, window=8, block_k=16), q, q_pos, k, k_pos, valid)
    assert max(acc, win) <= bound < b * n * t * c // 8, (acc, win)


@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
def test_pool1d_matches_pytorch_semantics(kind, kernel):
    rng = np.random.default_rng(6)
    x = rng.random((3, 2, 11)).astype(np.float32)
    got = scoring.pool1d(jnp.asarray(x), kernel, kind)
    np.testing.assert_allclose(np.asarray(got), pool(x, kernel, kind), rtol=1e-6)
    # Masked entries act like the padding.
    valid = rng.random((3, 2, 11)) > 0.3
    masked = np.where(valid, x, 0.0 if kind == "avg" else -np.inf)
    got = scoring.pool1d(jnp.asarray(x), kernel, kind, valid=jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(got), pool(masked, kernel, kind), rtol=1e-6)


def test_pool1d_equals_torch_when_available():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(7).random((2, 3, 13)).astype(np.float32)
    for kernel in (3, 5):
        avg = torch.nn.functional.avg_pool1d(torch.from_numpy(x), kernel, stride=1, padding=kernel // 2)
        mx = torch.nn.functional.max_pool1d(torch.from_numpy(x), kernel, stride=1, padding=kernel // 2)
        np.testing.assert_allclose(np.asarray(scoring.pool1d(jnp.asarray(x), kernel, "avg")), avg.numpy(), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(scoring.pool1d(jnp.asarray(x), kernel, "max")), mx.numpy(), rtol=1e-6)


def test_norm_scores():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 2, 9, 16)).astype(np.float32)
    valid = rng.random((3, 2, 9)) > 0.3
    xb = jnp.asarray(x, jnp.bfloat16)
    exact = np.asarray(xb.astype(jnp.float32)).astype(np.float64)
    norms = np.linalg.norm(exact, axis=-1)
    np.testing.assert_allclose(np.asarray(scoring.key_norm_scores(xb)), norms, rtol=1e-6)
    got = scoring.value_norm_scores(xb, jnp.asarray(valid), squared=True)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.where(valid, norms**2, 0.0), rtol=1e-5)


def test_bad_arguments_raise_clear_errors():
    case = _args(random_case(np.random.default_rng(9), b=1, t=3, c=4))
    with pytest.raises(ConfigError, match="window"):
        scoring.window_scores(*case, window=0)
    with pytest.raises(ConfigError, match="row_reduce"):
        scoring.window_scores(*case, window=2, row_reduce="median")
    with pytest.raises(ConfigError, match="group_reduce"):
        scoring.accumulated_scores(*case, group_reduce="sum")
    with pytest.raises(ConfigError, match="kernel"):
        scoring.pool1d(jnp.ones((1, 4)), 4)
    with pytest.raises(ConfigError, match="kind"):
        scoring.pool1d(jnp.ones((1, 4)), 3, "min")
    with pytest.raises(ValueError, match="pallas"):  # no kernel for the norm scores
        scoring.key_norm_scores(jnp.ones((1, 1, 2, 2)), implementation="pallas")
    with pytest.raises(ValueError, match="implementation"):
        scoring.key_norm_scores(jnp.ones((1, 1, 2, 2)), implementation="cuda")
    assert np.asarray(scoring.pool1d(jnp.ones((1, 4)), 3, implementation="xla")).shape == (1, 4)


@pytest.mark.parametrize("block_q,block_k", [(256, 256), (5, 7)])
def test_accumulated_scores_from_prefill_attention_lse_match_reference(block_q, block_k):
    """The one-pass path: the row log-sum-exp of `prefill_attention(return_lse=True)` over the same
    (shuffled, partly empty) cache gives the reference column sums; rows with no visible key add nothing."""
    from kvjax.ops.attention import prefill_attention

    case = random_case(np.random.default_rng(5))
    q, q_pos, k, k_pos, k_valid = _args(case)
    v = jnp.asarray(np.random.default_rng(6).standard_normal(k.shape).astype(np.float32))
    _, lse = prefill_attention(q, q_pos, k, v, k_pos, k_valid, block_q=block_q, block_k=block_k, return_lse=True)
    assert lse.shape == (3, 2, 4, q.shape[1]) and bool(jnp.all(jnp.isinf(lse[1, :, :, -7:])))
    got = scoring.accumulated_scores(q, q_pos, k, k_pos, k_valid, lse=lse, block_q=block_q, block_k=block_k)
    want = window_votes(*case, case[0].shape[1], "sum", "mean")
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=2e-5)


def ordered_case(rng, b=2, t=45, n=6, kv=3, c=45, h=16):
    """A contiguous cache (positions 0..c-1, all valid) and the prompt's last `t` rows as queries, with
    example 1 right-padded: tiles below the causal diagonal are taken whole, those above skipped."""
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k = rng.standard_normal((b, kv, c, h)).astype(np.float32)
    k_pos = np.broadcast_to(np.arange(c, dtype=np.int32), (b, kv, c)).copy()
    k_valid = np.ones((b, kv, c), bool)
    q_pos = np.tile(np.arange(c - t, c, dtype=np.int32), (b, 1))
    q_pos[1, -5:] = -1
    return q, q_pos, k, k_pos, k_valid


@pytest.mark.parametrize("block_q,block_k", [(8, 8), (4, 16), (16, 4)])
@pytest.mark.parametrize("given_lse", [False, True])
def test_accumulated_scores_tile_modes_match_reference(block_q, block_k, given_lse):
    """Causally ordered keys, where the skip / whole / masked tile branches all occur: the column sums
    still equal the float64 reference, with the row statistics computed here or given by the attention."""
    from kvjax.ops.attention import prefill_attention

    for t in (45, 29):  # the whole prompt, and a last chunk over keys before it
        case = ordered_case(np.random.default_rng(7), t=t)
        q, q_pos, k, k_pos, k_valid = _args(case)
        lse = None
        if given_lse:
            v = jnp.asarray(np.random.default_rng(8).standard_normal(k.shape).astype(np.float32))
            _, lse = prefill_attention(q, q_pos, k, v, k_pos, k_valid, block_q=block_q, block_k=block_k,
                                       return_lse=True)
        got = scoring.accumulated_scores(q, q_pos, k, k_pos, k_valid, lse=lse, group_reduce=None,
                                         block_q=block_q, block_k=block_k)
        want = window_votes(*case, t, "sum", None)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=2e-5)
