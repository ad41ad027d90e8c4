"""Split-K decode attention kernel (interpret mode) against `kvjax.ops.attention.decode_attention`: GQA
4:1 and 7:1, batch 3 with different per-KV-head lengths (one empty head, one padding query), per-head
and per-query-head masks, sliding window, dead blocks and splits, NaN-poisoned unused K and V slots."""

import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import TPU_SIM, assert_close, make_cache

from kvjax.ops import attention as ops
from kvjax.pallas.decode_attention import decode_attention

C, H = 45, 16


def case(rng, kv, g, dtype, per_query_head):
    lengths = np.array([[45, 30][:kv], [0, 9][:kv], [23, 44][:kv]])
    cache = make_cache(rng, lengths, C, H)
    valid = cache.stored & (rng.random(cache.stored.shape) > 0.2)  # a retrieval method's attend mask
    if per_query_head:
        valid = valid[:, :, None, :] & (rng.random((3, kv, g, C)) > 0.3)
    q = jnp.asarray(rng.standard_normal((3, kv * g, H)), dtype)
    q_pos = jnp.asarray([C - 1, C - 10, -1], jnp.int32)  # the last example is a padding row
    k, v, pos, _ = cache.arrays(dtype, poisoned=False)
    k_nan, v_nan, _, _ = cache.arrays(dtype, poisoned=True)
    return (q, q_pos, k_nan, v_nan, pos, jnp.asarray(valid)), (q, q_pos, k, v, pos, jnp.asarray(valid))


@pytest.mark.parametrize("kv,g,dtype,per_query_head,window,block_k,splits,interpret", [
    (2, 4, jnp.float32, False, None, 16, 2, TPU_SIM),
    (1, 7, jnp.bfloat16, True, 9, 8, 3, True),
    (2, 4, jnp.bfloat16, True, None, 16, 1, True),
])
def test_decode_kernel_equals_reference(kv, g, dtype, per_query_head, window, block_k, splits, interpret):
    got_args, ref_args = case(np.random.default_rng(0), kv, g, dtype, per_query_head)
    got, got_w = decode_attention(*got_args, sliding_window=window, return_weights=True, block_k=block_k,
                                  num_splits=splits, interpret=interpret)
    want, want_w = ops.decode_attention(*ref_args, sliding_window=window, return_weights=True)
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    assert_close(got_w, want_w, jnp.float32)  # probabilities are float32 either way
    assert float(jnp.abs(got[2]).max()) == 0.0  # padding query: zeros


def test_ops_dispatch_to_the_kernel():
    got_args, ref_args = case(np.random.default_rng(1), 2, 4, jnp.float32, False)
    got = ops.decode_attention(*got_args, implementation="pallas")
    assert_close(got, ops.decode_attention(*ref_args, implementation="xla"), jnp.float32)
