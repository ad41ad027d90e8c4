"""The GPU decode-attention kernel over quantized caches (`kvjax.pallas.gpu_quantized`) against the XLA reference
on the same stores (`kvjax.ops.attention.decode_attention`, which dequantizes them): compiled on a GPU backend, in
interpret mode elsewhere (CI). Every scheme, GQA 4:1 and 7:1, ragged heads (an empty one), a padding query, a
sliding window, a capacity that is no block multiple, KIVI's ring and a `qlen` off a block boundary."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import assert_close, make_cache

from kvjax.ops import attention as ops
from kvjax.pallas import gpu_planes, gpu_quantized
from kvjax.quant import KVQuant
from kvjax.quant import storage as st

H = 16
INTERPRET = None if jax.default_backend() == "gpu" else True
SCHEMES = {
    "int8": KVQuant("int8"), "fp8": KVQuant("fp8"), "int4": KVQuant("int4"),
    "kivi2": KVQuant("kivi2", group_size=16, residual=24), "kivi4": KVQuant("kivi4", group_size=32, residual=32),
}


def _case(rng, spec, kv, g, dtype, capacity, qlen_hint=None, v_size=1.0):
    lengths = np.array([[100, 30][:kv], [0, 9][:kv], [61, 70][:kv]])
    cache = make_cache(rng, lengths, capacity, H)
    k, v, pos, stored = cache.arrays(dtype, poisoned=False)
    v = (v.astype(jnp.float32) * v_size).astype(dtype)
    length = jnp.asarray(lengths, jnp.int32)
    hint = None if qlen_hint is None else jnp.minimum(jnp.asarray(qlen_hint, jnp.int32), length)
    qk = st.quantize(spec, "k", k, length, dtype, qlen_hint=hint)
    qv = st.quantize(spec, "v", v, length, dtype, qlen_hint=hint)
    q = jnp.asarray(rng.standard_normal((3, kv * g, H)), dtype)
    q_pos = jnp.asarray([capacity - 1, capacity - 10, -1], jnp.int32)  # the last example is a padding row
    return q, q_pos, qk, qv, pos, stored


@pytest.mark.parametrize("scheme,kv,g,dtype,window,capacity", [
    ("int8", 2, 4, jnp.float32, None, 100),
    ("fp8", 1, 7, jnp.bfloat16, 40, 112),
    ("int4", 2, 4, jnp.bfloat16, None, 100),
    ("kivi2", 2, 4, jnp.float32, None, 112),
    ("kivi4", 1, 7, jnp.bfloat16, 50, 128),
    ("int4", 2, 4, jnp.float16, None, 100),  # compiled: `gpu_unpack`'s fp16 assembly (1024.0's mantissa)
    ("kivi2", 1, 4, jnp.float16, 30, 112),
])
def test_quantized_kernel_equals_the_dequantizing_reference(scheme, kv, g, dtype, window, capacity):
    spec = SCHEMES[scheme]
    args = _case(np.random.default_rng(0), spec, kv, g, dtype, capacity)
    assert gpu_quantized.supports(args[2], args[3], 16, args[5], False)
    got = gpu_quantized.decode_attention(*args, sliding_window=window, block_k=16, num_splits=3, interpret=INTERPRET)
    want = ops.decode_attention(*args, sliding_window=window, implementation="xla")
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    assert float(jnp.abs(got[2]).max()) == 0.0  # padding query: zeros


def test_kivi_with_qlen_off_a_block_boundary():
    """After an eviction KIVI's quantized prefix can end inside a block: the kernel stops at the last whole block,
    the rest of it is attended with the ring."""
    spec = SCHEMES["kivi2"]
    args = _case(np.random.default_rng(1), spec, 2, 4, jnp.float32, 112, qlen_hint=[[83, 21], [0, 0], [45, 53]])
    qlen = np.asarray(args[2].qlen)
    assert (qlen % 16 != 0).any() and (qlen > 0).any()
    got = gpu_quantized.decode_attention(*args, block_k=16, num_splits=2, interpret=INTERPRET)
    want = ops.decode_attention(*args, implementation="xla")
    assert_close(got, want, jnp.float32)


def test_layouts_the_kernel_leaves_to_the_dense_kernel():
    q, q_pos, qk, qv, pos, stored = _case(np.random.default_rng(2), KVQuant("int8", channel_group=8), 1, 4,
                                          jnp.float32, 64)
    assert not gpu_quantized.supports(qk, qv, 16, stored, False)  # a scale per 8 channels
    assert not gpu_quantized.supports(qk, qv, 16, stored[:, :, None], False)  # a per-query-head mask
    # The op's "pallas" path still answers (on CPU: the TPU kernel in interpret mode, dequantized).
    got = ops.decode_attention(q, q_pos, qk, qv, pos, stored, implementation="pallas")
    assert_close(got, ops.decode_attention(q, q_pos, qk, qv, pos, stored, implementation="xla"), jnp.float32)


@pytest.mark.parametrize("dtype,window,f16_dots", [(jnp.bfloat16, None, False), (jnp.float32, 40, False),
                                                  (jnp.bfloat16, None, True), (jnp.float16, 30, False)])
def test_int8_codes_read_in_pairs(dtype, window, f16_dots):
    """`int8_pairs` (`Tuning.gpu_int8_pairs`): the value codes handed over as int16 pairs of channels, and with
    float16 dots (`f16_dots`, or a float16 model) the key codes too, the query and the output in even and odd
    channels; the same output as the reference and (interpret mode) as the byte-wise read, to a unit in the last
    place; `as_pairs` a lossless bitcast with channel `2i` in the low byte."""
    args = _case(np.random.default_rng(3), SCHEMES["int8"], 2, 4, dtype, 100)
    kw = dict(sliding_window=window, block_k=16, num_splits=3, f16_dots=f16_dots, interpret=INTERPRET)
    got = gpu_quantized.decode_attention(*args, int8_pairs=True, **kw)
    assert_close(got, ops.decode_attention(*args, sliding_window=window, implementation="xla"), dtype)
    if INTERPRET:  # the same maths, the contractions summed in two halves: within a unit in the last place
        bytewise = gpu_quantized.decode_attention(*args, **kw)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(bytewise, np.float32),
                                   rtol={jnp.bfloat16: 2.0 ** -8, jnp.float16: 2.0 ** -10}.get(dtype, 1e-6), atol=1e-7)
    traced = str(jax.make_jaxpr(lambda *a: gpu_quantized.decode_attention(*a, int8_pairs=True, **kw))(*args))
    key_pairs = f16_dots or dtype == jnp.float16
    assert traced.count("i16[3,2,100,8]") == 1 + key_pairs  # the values' operand, [B, K, C, H / 2] (and the keys')
    assert gpu_quantized.reads_key_pairs(args[2], True, f16_dots) == key_pairs
    codes = args[2].data
    np.testing.assert_array_equal(np.asarray(gpu_planes.from_pairs(gpu_planes.as_pairs(codes))),
                                  np.asarray(codes))
    lo, hi = np.asarray(gpu_planes.as_pairs(codes)) << 8 >> 8, np.asarray(gpu_planes.as_pairs(codes)) >> 8
    np.testing.assert_array_equal(lo, np.asarray(codes)[..., 0::2])  # channel 2i in the low byte
    np.testing.assert_array_equal(hi, np.asarray(codes)[..., 1::2])


@pytest.mark.parametrize("dtype,window", [(jnp.bfloat16, None), (jnp.float32, 40), (jnp.float16, None)])
def test_int4_codes_read_in_pairs(dtype, window):
    """`int4_pairs` (`Tuning.gpu_int4_pairs`, on by default): the packed key and value bytes handed over as int16
    pairs, the query and the output in four planes (`plane_lanes`); the same output as the reference and (interpret
    mode) as the byte-wise read to a unit in the last place; `as_pairs` of packed bytes lossless."""
    args = _case(np.random.default_rng(6), SCHEMES["int4"], 2, 4, dtype, 100)
    kw = dict(sliding_window=window, block_k=16, num_splits=3, interpret=INTERPRET)
    got = gpu_quantized.decode_attention(*args, int4_pairs=True, **kw)
    assert_close(got, ops.decode_attention(*args, sliding_window=window, implementation="xla"), dtype)
    if INTERPRET:
        bytewise = gpu_quantized.decode_attention(*args, int4_pairs=False, **kw)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(bytewise, np.float32),
                                   rtol={jnp.bfloat16: 2.0 ** -8, jnp.float16: 2.0 ** -10}.get(dtype, 1e-6), atol=1e-6)
    traced = {on: str(jax.make_jaxpr(lambda *a, on=on: gpu_quantized.decode_attention(*a, int4_pairs=on, **kw))(*args))
              for on in (True, False)}
    assert traced[True].count("i16[3,2,100,4]") == 2 and "i16[" not in traced[False]  # [B, K, C, H / 4]: K and V
    packed = args[2].data
    np.testing.assert_array_equal(np.asarray(gpu_planes.from_pairs(gpu_planes.as_pairs(packed), jnp.uint8)),
                                  np.asarray(packed))


def test_plane_lanes_and_their_inverse():
    """`plane_lanes`: bytes' planes, or in pairs each byte plane's even and odd channels; `query_planes` takes them,
    `planes_to_channels` puts them back, `split_planes` / `join_planes` do so in registers."""
    h = 16
    assert [x.tolist() for x in gpu_planes.plane_lanes(h, 2, False)] == [list(range(8)), list(range(8, 16))]
    assert [x.tolist() for x in gpu_planes.plane_lanes(h, 4, True)] == [
        [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert [x.tolist() for x in gpu_planes.plane_lanes(h, 2, True)] == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    q = jnp.arange(3 * 16 * h, dtype=jnp.float32).reshape(3, 16, h)
    for parts, pairs in ((1, False), (2, False), (4, False), (2, True), (4, True)):
        planes = gpu_planes.query_planes(q, parts, pairs)
        lanes = gpu_planes.plane_lanes(h, parts, pairs)
        for i, lane in enumerate(lanes):
            np.testing.assert_array_equal(np.asarray(planes[:, i]), np.asarray(q[..., lane]))
        np.testing.assert_array_equal(np.asarray(gpu_planes.planes_to_channels(planes, pairs)), np.asarray(q))
        row = q[0, 0]
        split = gpu_planes.split_planes(row, parts, pairs)
        assert [x.tolist() for x in split] == [row[lane].tolist() for lane in lanes]
        np.testing.assert_array_equal(np.concatenate(gpu_planes.join_planes(split, pairs)), np.asarray(row))


def _f16_dots(scheme, pairs, v_size):
    """The kernel with float16 dots on a bf16 case whose values are `v_size` in size, and the reference, both
    divided by `v_size`."""
    args = _case(np.random.default_rng(4), SCHEMES[scheme], 2, 4, jnp.bfloat16, 100, v_size=v_size)
    kw = dict(block_k=16, num_splits=3, int8_pairs=pairs, interpret=INTERPRET)
    got = gpu_quantized.decode_attention(*args, f16_dots=True, **kw)
    want = ops.decode_attention(*args, implementation="xla")
    return [np.asarray(x, np.float32) / v_size for x in (got, want)], args, kw


@pytest.mark.parametrize("scheme,pairs", [("int8", False), ("int8", True), ("fp8", False)])
def test_8bit_codes_attended_with_float16_dots(scheme, pairs):
    """`f16_dots` (`Tuning.gpu_f16_dots`): an int8 / fp8 cache of a bf16 model attended with float16 dots (the codes
    exact, compiled by `gpu_unpack`'s int8 assembly; the query and the weights rounded to float16): the reference's
    output within bf16's tolerance, also for values a million times smaller, whose weights times scales lie far below
    float16's normals (relative to their size); the kernel's dots traced in float16 only where asked."""
    for v_size in (1.0, 1e-6):
        (got, want), args, kw = _f16_dots(scheme, pairs, v_size)
        assert_close(got, want, jnp.bfloat16)
    for asked in (True, False):
        traced = str(jax.make_jaxpr(lambda *a, asked=asked: gpu_quantized.decode_attention(*a, f16_dots=asked, **kw))(
            *args))
        assert bool(re.search(r"\bf16\[", traced)) == asked, asked  # float16, not bf16
    assert gpu_quantized.dots_dtype(args[2], True) == jnp.float16
    assert gpu_quantized.dots_dtype(args[2], False) == jnp.bfloat16


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_float16_dots_are_closer_to_the_exact_attention_than_bf16_dots(scheme):
    """Against a float64 attention over the same dequantized stores (one head group of 64 channels, 512 slots, a
    float32 query so that the output is not rounded to bf16), float16 dots err less than bf16 dots: their query and
    weights carry 3 more bits, and their codes are exact in both."""
    rng, h, c = np.random.default_rng(6), 64, 512
    length = jnp.full((1, 1), c, jnp.int32)
    k, v = (jnp.asarray(rng.standard_normal((1, 1, c, h)), jnp.bfloat16) for _ in range(2))
    qk, qv = (st.quantize(SCHEMES[scheme], role, x, length, jnp.bfloat16) for role, x in (("k", k), ("v", v)))
    q = jnp.asarray(rng.standard_normal((1, 4, h)) * 2, jnp.bfloat16).astype(jnp.float32)
    pos, valid = jnp.arange(c, dtype=jnp.int32)[None, None], jnp.ones((1, 1, c), bool)
    kd, vd = (np.asarray(st.dequantize(x, jnp.float32), np.float64)[0, 0] for x in (qk, qv))
    logits = np.asarray(q, np.float64)[0] @ kd.T / np.sqrt(h)
    weights = np.exp(logits - logits.max(1, keepdims=True))
    exact = (weights / weights.sum(1, keepdims=True)) @ vd
    err = {}
    for f16 in (False, True):
        got = gpu_quantized.decode_attention(q, jnp.asarray([c]), qk, qv, pos, valid, block_k=64, num_splits=2,
                                             f16_dots=f16, int8_pairs=scheme == "int8", interpret=INTERPRET)
        err[f16] = np.abs(np.asarray(got, np.float64)[0] - exact).max() / np.abs(exact).max()
    assert err[True] < 0.5 * err[False], err


def test_float16_weights_are_scaled_per_row(monkeypatch):
    """Cast unscaled, int8 weights times the scales of values 1e-6 in size flush to zero in float16: the output is
    then far from the reference (so the test above can fail), which the per-row scaling (`_weights`) prevents. (The
    codes' unit, 2^-10 in float16, is still taken back.)"""
    monkeypatch.setattr(gpu_quantized, "_weights", lambda w, dtype, at_most_one, unit=1.0: (w.astype(dtype), 1 / unit))
    (got, want), _, _ = _f16_dots("int8", False, 1e-6)
    assert np.abs(got - want).max() > 0.1 * np.abs(want).max()


def test_float16_weights_stay_finite_and_come_back():
    """`_weights` in float16: rows whose largest weight is 3, 1e-20, subnormal in float32 or zero give finite
    operands under 2^15 that, multiplied back, are the weights to float16's precision (rows above 2^-100)."""
    w = jnp.asarray([[3.0, 1.0, 1e-3, 0.0], [1e-20, 5e-21, 0.0, 0.0], [1e-42, 0.0, 0.0, 0.0], [0.0] * 4], jnp.float32)
    w16, back = gpu_quantized._weights(w, jnp.float16, at_most_one=False)
    w16 = np.asarray(w16, np.float32)
    assert np.isfinite(w16).all() and np.abs(w16).max() <= gpu_quantized.F16_TOP and w16[:2].max(axis=1).min() > 1e4
    np.testing.assert_allclose(w16[:2] * np.asarray(back)[:2], np.asarray(w)[:2], rtol=2.0 ** -10, atol=0)
    assert (w16[3] == 0).all() and np.isfinite(np.asarray(back)).all()
    w16_unit, back_unit = gpu_quantized._weights(w, jnp.float16, at_most_one=False, unit=2.0**-10)  # codes x 2^-10
    np.testing.assert_array_equal(np.asarray(w16_unit), np.asarray(w16, np.float16))
    np.testing.assert_array_equal(np.asarray(back_unit), np.asarray(back) * 1024)
    same, none = gpu_quantized._weights(w, jnp.bfloat16, at_most_one=False)
    assert none is None and same.dtype == jnp.bfloat16


def test_float16_dots_leave_other_caches_alone():
    """Sub-byte codes and float32 or float16 models keep their model dtype's dots."""
    int4 = _case(np.random.default_rng(5), SCHEMES["int4"], 1, 4, jnp.bfloat16, 32)[2]
    int8_f32 = _case(np.random.default_rng(5), SCHEMES["int8"], 1, 4, jnp.float32, 32)[2]
    int8_f16 = _case(np.random.default_rng(5), SCHEMES["int8"], 1, 4, jnp.float16, 32)[2]
    assert gpu_quantized.dots_dtype(int4, True) == jnp.bfloat16
    assert gpu_quantized.dots_dtype(int8_f32, True) == jnp.float32
    assert gpu_quantized.dots_dtype(int8_f16, False) == jnp.float16
