"""Fused scoring kernels (interpret mode) against the XLA reference ops: window / accumulated attention
scores per key, GQA 4:1 and 7:1, batch 3 with different per-head lengths, lengths not multiples of the
key block, NaN-poisoned unused slots and padding query rows, f32 and bf16."""

import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import TPU_SIM, assert_close, make_cache

from kvjax.ops import scoring as ops
from kvjax.pallas import scoring as kernels

C, H, T = 45, 16, 11


def case(rng, kv, g, dtype):
    """(kernel args, reference args): queries with padding rows (NaN for the kernel), a poisoned cache."""
    lengths = np.array([[45, 30, 17][:kv], [0, 9, 44][:kv], [23, 45, 1][:kv]])
    cache = make_cache(rng, lengths, C, H)
    q = rng.standard_normal((3, T, kv * g, H)).astype(np.float32)
    q_pos = np.stack([np.arange(C - T, C), np.arange(C - T, C), np.arange(10, 10 + T)]).astype(np.int32)
    q_pos[1, -4:] = -1  # right padding
    q_nan = np.where((q_pos >= 0)[..., None, None], q, np.nan)
    k, _, pos, stored = cache.arrays(dtype, poisoned=False)
    k_nan, _, _, _ = cache.arrays(dtype, poisoned=True)
    return ((jnp.asarray(q_nan, dtype), jnp.asarray(q_pos), k_nan, pos, stored),
            (jnp.asarray(q, dtype), jnp.asarray(q_pos), k, pos, stored))


@pytest.mark.parametrize("kv,g,dtype,row_reduce,group_reduce,pool,interpret", [
    (2, 4, jnp.float32, "sum", "mean", None, TPU_SIM),
    (1, 7, jnp.bfloat16, "mean", None, None, True),
    (2, 4, jnp.bfloat16, "sum", "max", (5, "max"), True),
])
def test_window_scores_kernel_equals_reference(kv, g, dtype, row_reduce, group_reduce, pool, interpret):
    got_args, ref_args = case(np.random.default_rng(0), kv, g, dtype)
    got = kernels.window_scores(*got_args, window=6, row_reduce=row_reduce, group_reduce=group_reduce,
                                block_k=16, pool=pool, interpret=interpret)
    want = ops.window_scores(*ref_args, window=6, row_reduce=row_reduce, group_reduce=group_reduce)
    if pool is not None:
        want = ops.pool1d(want, pool[0], pool[1], valid=jnp.repeat(ref_args[4], 1 if group_reduce else g, axis=1))
        finite = np.isfinite(np.asarray(want))  # max pooling over an empty head stays -inf in both
        np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
        got, want = jnp.where(finite, got, 0.0), jnp.where(finite, want, 0.0)
    assert_close(got, want, dtype)
    assert float(jnp.abs(got[1, 0]).max()) == 0.0  # example 1's first head is empty: scores 0


@pytest.mark.parametrize("kv,g,dtype,group_reduce", [(2, 4, jnp.float32, "mean"), (1, 7, jnp.bfloat16, "max")])
def test_accumulated_scores_kernel_equals_reference(kv, g, dtype, group_reduce):
    got_args, ref_args = case(np.random.default_rng(1), kv, g, dtype)
    got = kernels.accumulated_scores(*got_args, group_reduce=group_reduce, block_q=4, block_k=16, interpret=True)
    want = ops.accumulated_scores(*ref_args, group_reduce=group_reduce)
    assert_close(got, want, dtype)


def test_pool1d_kernel_equals_reference():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 2, 37)), jnp.float32)
    valid = jnp.asarray(rng.random((3, 2, 37)) > 0.3)
    for kind in ("avg", "max"):
        got = ops.pool1d(x, 7, kind, valid=valid, implementation="pallas")
        want = ops.pool1d(x, 7, kind, valid=valid)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_ops_dispatch_to_the_kernels():
    got_args, ref_args = case(np.random.default_rng(3), 2, 4, jnp.float32)
    scale = jnp.full((3, T), 0.3, jnp.float32)  # per-row scale, default block sizes (one key block)
    got = ops.window_scores(*got_args, window=3, scale=scale, implementation="pallas")
    assert_close(got, ops.window_scores(*ref_args, window=3, scale=scale, implementation="xla"), jnp.float32)
    got = ops.accumulated_scores(*got_args, group_reduce=None, implementation="pallas")
    assert_close(got, ops.accumulated_scores(*ref_args, group_reduce=None), jnp.float32)
