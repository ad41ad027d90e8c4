"""GPU (Triton) decode-attention kernels against the XLA references: compiled on a GPU backend
(`JAX_PLATFORMS=cuda pytest tests/pallas/test_pallas_gpu_attention.py`), in interpret mode elsewhere (CI).

Dense split-K (`kvjax.pallas.gpu_attention.decode_attention` vs `kvjax.ops.attention.decode_attention`)
and block-sparse (`block_sparse_decode_attention` vs `kvjax.ops.sparse_attention`, itself checked against
a float64 NumPy loop written from the op's definition): GQA 4:1 and 7:1, ragged batch (per-KV-head
lengths, an empty head, a padding query), float32 / bfloat16, dead blocks and splits, NaN-poisoned unused
K and V slots (kernel gets the poisoned cache, the reference the clean one)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import assert_close, make_cache

from kvjax import tuning
from kvjax.errors import ConfigError
from kvjax.ops import attention as ops
from kvjax.ops import sparse_attention as sparse_ops
from kvjax.pallas import gpu_attention as kernels
from kvjax.pallas import gpu_common

H = 16
#: None compiles the Triton kernel on a GPU backend; on CPU (CI) the kernels run in interpret mode.
INTERPRET = None if jax.default_backend() == "gpu" else True


def dense_case(rng, kv, g, dtype, per_query_head, capacity=100):
    lengths = np.array([[100, 30][:kv], [0, 9][:kv], [23, 70][:kv]])  # many dead 16-slot blocks
    cache = make_cache(rng, lengths, capacity, H)
    valid = cache.stored & (rng.random(cache.stored.shape) > 0.2)  # a retrieval method's attend mask
    if per_query_head:
        valid = valid[:, :, None, :] & (rng.random((3, kv, g, capacity)) > 0.3)
    q = jnp.asarray(rng.standard_normal((3, kv * g, H)), dtype)
    q_pos = jnp.asarray([capacity - 1, capacity - 10, -1], jnp.int32)  # the last example is a padding row
    k, v, pos, _ = cache.arrays(dtype, poisoned=False)
    k_nan, v_nan, _, _ = cache.arrays(dtype, poisoned=True)
    return (q, q_pos, k_nan, v_nan, pos, jnp.asarray(valid)), (q, q_pos, k, v, pos, jnp.asarray(valid))


@pytest.mark.parametrize("kv,g,dtype,per_query_head,window,splits,weights", [
    (2, 4, jnp.float32, False, None, 3, True),
    (1, 7, jnp.bfloat16, True, 40, 2, True),
    (2, 4, jnp.bfloat16, True, None, None, False),
    (1, 7, jnp.float32, False, None, 1, False),
])
def test_dense_kernel_equals_reference(kv, g, dtype, per_query_head, window, splits, weights):
    got_args, ref_args = dense_case(np.random.default_rng(0), kv, g, dtype, per_query_head)
    got = kernels.decode_attention(*got_args, sliding_window=window, return_weights=weights, block_k=16,
                                   num_splits=splits, interpret=INTERPRET)
    want = ops.decode_attention(*ref_args, sliding_window=window, return_weights=weights, implementation="xla")
    if weights:
        (got, got_w), (want, want_w) = got, want
        assert_close(got_w, want_w, dtype)  # float32 probabilities; bf16 dots round q and p
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    assert float(jnp.abs(got[2]).max()) == 0.0  # padding query: zeros


def test_dense_vmap_equals_loop():
    got_args, _ = dense_case(np.random.default_rng(2), 2, 4, jnp.float32, False)
    fn = lambda *a: kernels.decode_attention(*(x[None] for x in a), block_k=16, num_splits=2, interpret=INTERPRET)[0]  # noqa: E731
    batched = jax.vmap(fn)(*got_args)
    looped = jnp.stack([fn(*(x[i] for x in got_args)) for i in range(3)])
    np.testing.assert_array_equal(np.asarray(batched), np.asarray(looped))


def sparse_reference_np(q, q_pos, k, v, k_pos, k_valid, starts, count, ranges, block_size, window):
    """float64 loop over (example, query head): the slots in a range or a live block, valid and causal."""
    b, n, h = q.shape
    kv, c = k.shape[1], k.shape[2]
    g = n // kv
    out = np.zeros((b, n, h))
    for i in range(b):
        for head in range(n):
            kh = head // g
            att = []
            for slot in range(c):
                chosen = any(lo <= slot < hi for lo, hi in ranges[i, kh]) or any(
                    starts[i, kh, j] <= slot < starts[i, kh, j] + block_size for j in range(count[i, kh]))
                p = k_pos[i, kh, slot]
                ok = k_valid[i, kh, slot] and q_pos[i] >= 0 and p <= q_pos[i]
                if window is not None:
                    ok = ok and q_pos[i] - p < window
                if chosen and ok:
                    att.append(slot)
            if not att:
                continue
            logits = np.array([q[i, head] @ k[i, kh, s] for s in att]) / np.sqrt(h)
            w = np.exp(logits - logits.max())
            out[i, head] = (w / w.sum()) @ v[i, kh, att]
    return out


def sparse_case(rng, kv, g, dtype, capacity=160, block=16):
    lengths = np.minimum(np.array([[160, 100][:kv], [0, 50][:kv], [130, 160][:kv]]), capacity)
    cache = make_cache(rng, lengths, capacity, H, shuffle=False)
    # Per (example, KV head): up to 4 distinct blocks (aligned or not), a live count (0 for some heads),
    # a sink range [0, 8) and a local range ending at the head's length (a block may overlap it).
    starts = np.zeros((3, kv, 4), np.int32)
    for i in range(3):
        for h in range(kv):
            starts[i, h] = rng.choice(np.arange(0, capacity - block - 2, block), 4, replace=False) + rng.integers(0, 3)
            # aligned choices shifted by one offset per head stay at least `block` apart: disjoint
    count = rng.integers(0, 5, (3, kv)).astype(np.int32)
    starts[0, 0], count[0, 0] = [5, 40, 80, 136], 4  # overlapping the sinks [0, 8) and the local range
    ranges = np.stack([np.broadcast_to([0, 8], (3, kv, 2)),
                       np.stack([lengths - 24, lengths], axis=-1).clip(0)], axis=2).astype(np.int32)
    q = rng.standard_normal((3, kv * g, H)).astype(np.float32)
    q_pos = np.array([capacity - 1, 60, -1], np.int32)
    valid = cache.stored & (rng.random(cache.stored.shape) > 0.1)
    return cache, q, q_pos, valid, starts, count, ranges


@pytest.mark.parametrize("kv,g,dtype,window,splits,capacity", [
    (2, 4, jnp.float32, None, 2, 160),
    (1, 7, jnp.bfloat16, 100, 3, 150),  # no multiple of the block: windows clamped at the end of the cache
    (2, 4, jnp.bfloat16, None, None, 160),
])
def test_sparse_kernel_equals_reference(kv, g, dtype, window, splits, capacity):
    rng = np.random.default_rng(3)
    cache, q, q_pos, valid, starts, count, ranges = sparse_case(rng, kv, g, dtype, capacity)
    k, v, pos, _ = cache.arrays(dtype, poisoned=False)
    k_nan, v_nan, _, _ = cache.arrays(dtype, poisoned=True)
    common = (jnp.asarray(starts), jnp.asarray(count), jnp.asarray(ranges))
    qj = jnp.asarray(q, dtype)
    want = sparse_ops.block_sparse_decode_attention(qj, jnp.asarray(q_pos), k, v, pos, jnp.asarray(valid), *common,
                                                    block_size=16, sliding_window=window, implementation="xla")
    oracle = sparse_reference_np(np.asarray(qj, np.float64), q_pos, np.asarray(k, np.float64),
                                 np.asarray(v, np.float64), cache.pos, valid, starts, count, ranges, 16, window)
    assert_close(want, oracle, dtype)
    got = kernels.block_sparse_decode_attention(qj, jnp.asarray(q_pos), k_nan, v_nan, pos, jnp.asarray(valid),
                                                *common, block_size=16, sliding_window=window, chunk=16,
                                                num_splits=splits, interpret=INTERPRET)
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    assert float(jnp.abs(got[2]).max()) == 0.0


def test_sparse_with_every_block_equals_dense():
    """Every block of the cache listed (no ranges): the sparse op is the dense decode attention."""
    rng = np.random.default_rng(4)
    cache, q, q_pos, valid, _, _, _ = sparse_case(rng, 2, 4, jnp.float32)
    k, v, pos, _ = cache.arrays(jnp.float32, poisoned=True)
    starts = jnp.broadcast_to(jnp.arange(0, 160, 16, dtype=jnp.int32), (3, 2, 10))
    ranges = jnp.zeros((3, 2, 1, 2), jnp.int32)
    args = (jnp.asarray(q), jnp.asarray(q_pos), k, v, pos, jnp.asarray(valid))
    got = sparse_ops.block_sparse_decode_attention(*args, starts, 10, ranges, block_size=16, implementation="pallas")
    clean_k, clean_v, _, _ = cache.arrays(jnp.float32, poisoned=False)
    want = ops.decode_attention(args[0], args[1], clean_k, clean_v, pos, args[5], implementation="xla")
    assert_close(got, want, jnp.float32)


def test_ops_dispatch_and_validation():
    got_args, ref_args = dense_case(np.random.default_rng(1), 2, 4, jnp.float32, False)
    # On CPU "pallas" keeps the Mosaic TPU kernel (interpret mode); on a GPU it runs the Triton kernel.
    assert_close(ops.decode_attention(*got_args, implementation="pallas"),
                 ops.decode_attention(*ref_args, implementation="xla"), jnp.float32)
    with pytest.raises(ConfigError, match="power of two"):
        kernels.decode_attention(*got_args, block_k=24, interpret=INTERPRET)
    with pytest.raises(ConfigError, match="ranges"):
        sparse_ops.block_sparse_decode_attention(*ref_args, jnp.zeros((3, 2, 1), jnp.int32), 0,
                                                 jnp.zeros((3, 2, 2), jnp.int32), block_size=16)


def _as_backend_without_the_kernel(monkeypatch, backend: str, kernel: str) -> None:
    """jax reports `backend`; on "gpu" the Triton kernel `kernel` raises if reached (it cannot compile here)."""
    def refuse(*_, **__):
        raise AssertionError("the Triton kernel was called")

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    if backend == "gpu":
        monkeypatch.setattr(kernels, kernel, refuse)


@pytest.mark.parametrize("block_size,head_dim,backend", [(8, 16, "cpu"), (24, 16, "cpu"), (16, 24, "gpu")])
def test_auto_takes_xla_where_the_sparse_kernel_refuses_the_shapes(monkeypatch, block_size, head_dim, backend):
    """Where the tuning lists the block-sparse kernel (the GPU's default), "auto" runs XLA for the shapes the
    kernel refuses (a block size that is no power of two >= 16; on a GPU a head_dim that is no power of two)
    instead of raising its ConfigError; "pallas" still raises it."""
    rng = np.random.default_rng(6)
    cache = make_cache(rng, np.array([[50, 20], [33, 0]]), 64, head_dim, shuffle=False)
    k, v, pos, valid = cache.arrays(jnp.float32, poisoned=False)
    q = jnp.asarray(rng.standard_normal((2, 4, head_dim)), jnp.float32)
    q_pos = jnp.asarray([63, 40], jnp.int32)
    starts = jnp.asarray(np.broadcast_to([0, 2 * block_size], (2, 2, 2)), jnp.int32)
    ranges = jnp.asarray(np.broadcast_to([[0, 4], [30, 34]], (2, 2, 2, 2)), jnp.int32)
    args = (q, q_pos, k, v, pos, valid, starts, jnp.asarray([[2, 1], [1, 2]], jnp.int32), ranges)
    want = sparse_ops.block_sparse_decode_attention(*args, block_size=block_size, implementation="xla")
    oracle = sparse_reference_np(*(np.asarray(a, np.float64) if a.dtype == jnp.float32 else np.asarray(a)
                                   for a in args), block_size, None)
    assert_close(want, oracle, jnp.float32)

    _as_backend_without_the_kernel(monkeypatch, backend, "block_sparse_decode_attention")
    with tuning.override(auto_pallas={"block_sparse_decode_attention"}):
        got = sparse_ops.block_sparse_decode_attention(*args, block_size=block_size)
        if backend == "cpu":
            with pytest.raises(ConfigError, match="block_size must be a power of two"):
                sparse_ops.block_sparse_decode_attention(*args, block_size=block_size, implementation="pallas")
    assert_close(got, want, jnp.float32)  # the GPU tuning lays out the XLA dots differently: rounding apart


@pytest.mark.parametrize("groups,head_dim,backend", [(33, 16, "cpu"), (2, 24, "gpu")])
def test_auto_takes_xla_where_the_decode_kernels_refuse_the_shapes(monkeypatch, groups, head_dim, backend):
    """A tuning that lists `decode_attention` (the tuning docs' own example) makes "auto" run XLA for the shapes the
    kernels refuse, instead of raising their ConfigError: a per-query-head mask over more than 32 query heads per
    KV head, and on a GPU a head_dim that is no power of two; "pallas" still raises."""
    rng = np.random.default_rng(7)
    cache = make_cache(rng, np.array([[20, 7], [0, 13]]), 24, head_dim)
    k, v, pos, stored = cache.arrays(jnp.float32, poisoned=False)
    valid = stored[:, :, None, :] & jnp.asarray(rng.random((2, 2, groups, 24)) > 0.3)
    q = jnp.asarray(rng.standard_normal((2, 2 * groups, head_dim)), jnp.float32)
    args = (q, jnp.asarray([23, 15], jnp.int32), k, v, pos, valid)
    want = ops.decode_attention(*args, implementation="xla")

    _as_backend_without_the_kernel(monkeypatch, backend, "decode_attention")
    with tuning.override(auto_pallas={"decode_attention"}):
        got = ops.decode_attention(*args)
        if backend == "cpu":
            with pytest.raises(ConfigError, match="at most 32 heads per group, got 33"):
                ops.decode_attention(*args, implementation="pallas")
    assert_close(got, want, jnp.float32)


def test_loops_visit_exactly_the_live_blocks():
    """The kernels' loop bounds: a head's splits tile its live blocks exactly (dead blocks get no trip), also with
    split 0 charged `head` blocks of other work (KIVI's group and ring), which then takes that many fewer where it
    can; the strided splits of a block list / range chunks visit each live entry once."""
    for splits in range(1, 8):
        for nlive in range(0, 40):
            for head in (0, 1, 3, 9):
                seen, sizes = [], []
                for s in range(splits):
                    lo, hi = gpu_common.split_bounds(jnp.int32(nlive), splits, jnp.int32(s), head)
                    seen += list(range(int(lo), int(hi)))
                    sizes.append(max(0, int(hi) - int(lo)))
                assert seen == list(range(nlive)), (splits, nlive, head)
                # the most loaded split holds the even share of blocks + head, rounded up (or head alone, if more)
                assert max([sizes[0] + head] + sizes[1:]) <= max(-(-(nlive + head) // splits), head)
            for s in range(splits):
                assert int(kernels.strided_trips(jnp.int32(nlive), jnp.int32(s), splits)) == len(
                    range(s, nlive, splits))


@pytest.mark.parametrize("splits,g,gp,dtype", [(5, 4, 16, jnp.bfloat16), (1, 7, 16, jnp.float32),
                                               (3, 1, 16, jnp.bfloat16), (32, 4, 16, jnp.float32)])
def test_split_merge_kernel_equals_the_xla_merge(splits, g, gp, dtype):
    """`merge_split_heads` (one kernel) against `merge_splits` then the group's rows and the cast (XLA): partials
    with maxima far apart, a row no split attended (`l = 0` everywhere: output 0), and rows past the group
    holding garbage the merge must not read."""
    rng = np.random.default_rng(splits + g)
    acc = rng.standard_normal((2, 3, splits, gp, H)).astype(np.float32)
    m = (rng.standard_normal((2, 3, splits, gp)) * 20).astype(np.float32)
    l = rng.uniform(0.5, 3.0, (2, 3, splits, gp)).astype(np.float32)
    m[1, 2, :, 0], l[1, 2, :, 0] = -1e30, 0.0  # attended nothing
    acc[:, :, :, g:], m[:, :, :, g:] = np.nan, np.nan  # the padded rows: never read
    want = kvjax_merge_reference(acc, m, l, g, dtype)
    got = kernels.merge_split_heads(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l), g, dtype, interpret=INTERPRET)
    assert got.shape == (2, 3, g, H) and got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-6, atol=1e-6)
    assert not np.any(np.asarray(got[1, 2, 0], np.float32))


def kvjax_merge_reference(acc, m, l, g, dtype):
    """`kvjax.pallas._common.merge_splits` (the XLA merge) on the group's rows, cast to `dtype`."""
    from kvjax.pallas._common import merge_splits

    out = merge_splits(jnp.asarray(acc[:, :, :, :g]), jnp.asarray(m[:, :, :, :g]), jnp.asarray(l[:, :, :, :g]))[0]
    return out.astype(dtype)


def test_split_merge_kernel_counts_the_length_and_updates_head_values_in_place():
    """With `length` / `position`, the merge also returns the length with the token counted (a padding row's not)
    and each of `heads` as `update(old length, counted, value)`: against the same arithmetic in NumPy. The updates
    read the length before the step, as KIVI's `qlen` rule does."""
    rng = np.random.default_rng(7)
    acc = rng.standard_normal((2, 3, 4, 16, H)).astype(np.float32)
    m = rng.standard_normal((2, 3, 4, 16)).astype(np.float32)
    l = rng.uniform(0.5, 3.0, (2, 3, 4, 16)).astype(np.float32)
    length = rng.integers(0, 50, (2, 3)).astype(np.int32)
    position = np.array([17, -1], np.int32)
    extra = [rng.integers(0, 9, (2, 3)).astype(np.int32) for _ in range(2)]
    update = lambda old, counted, x: old * 100 + counted * 10 + x  # noqa: E731
    out, new_length, *new_extra = kernels.merge_split_heads(
        jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l), 4, jnp.float32, length=jnp.asarray(length),
        position=jnp.asarray(position), heads=tuple(jnp.asarray(x) for x in extra), update=update,
        interpret=INTERPRET)
    counted = (position >= 0).astype(np.int32)[:, None]
    np.testing.assert_array_equal(np.asarray(new_length), length + counted)
    for got, x in zip(new_extra, extra, strict=True):
        np.testing.assert_array_equal(np.asarray(got), length * 100 + counted * 10 + x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(kvjax_merge_reference(acc, m, l, 4, jnp.float32)),
                               rtol=2e-6, atol=1e-6)
    with pytest.raises(ConfigError, match="heads"):
        kernels.merge_split_heads(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l), 4, jnp.float32,
                                  heads=(jnp.asarray(extra[0]),), update=update, interpret=INTERPRET)
