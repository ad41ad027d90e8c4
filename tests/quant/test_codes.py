"""kvjax's quantize / dequantize / packing against the NumPy reference (tests/quant/quant_reference.py): every
scheme on ragged heads, requantization, and KIVI's residual window filling and flushing group by group."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import quant_reference as ref

from kvjax import cache as kvc
from kvjax.cli.parse import kv_dtype_specs
from kvjax.errors import ConfigError
from kvjax.quant import KVQuant, codes, parse_kv_dtype
from kvjax.quant import storage as st


def _heads(seed: int, shape=(2, 2, 12, 16)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 3] *= 9.0  # an outlier channel, as keys have
    return x


LENGTHS = np.array([[12, 7], [3, 12]], np.int32)


@pytest.mark.parametrize("bits", [2, 4])
def test_packing_is_planar_and_round_trips(bits):
    q = np.random.default_rng(bits).integers(0, 2**bits, size=(3, 5, 16)).astype(np.uint8)
    packed = np.asarray(codes.pack(jnp.asarray(q), bits))
    np.testing.assert_array_equal(packed, ref.pack(q, bits))
    assert packed.shape == (3, 5, 16 * bits // 8)
    np.testing.assert_array_equal(np.asarray(codes.unpack(jnp.asarray(packed), bits)), q)


def test_as_stored_is_bfloat16_rounding_to_nearest_even():
    """`codes.as_stored` (integer operations on the bits) equals ml_dtypes' float32 -> bfloat16 -> float32 on random
    bit patterns (every exponent: subnormals, overflow to inf, NaN kept), exact ties both ways and bf16 values."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, size=4096, dtype=np.uint32) << 16) | np.uint32(0x8000)  # exactly half-way
    x = np.concatenate([bits, ties]).view(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, 1.0, 3.0e38, -3.4e38, np.inf, -np.inf, 1e-40, -1e-45])])
    got = np.asarray(codes.as_stored(jnp.asarray(x)))
    with np.errstate(invalid="ignore"):  # NaN patterns
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_int8_and_int4_match_the_reference_per_token():
    x = _heads(0)
    q8 = st.quantize(KVQuant("int8"), "k", jnp.asarray(x), jnp.asarray(LENGTHS), jnp.float32)
    want_q, want_s, want_x = ref.int8(x)
    np.testing.assert_array_equal(np.asarray(q8.data), want_q)
    np.testing.assert_array_equal(np.asarray(q8.scale, np.float32)[..., 0], want_s)
    np.testing.assert_allclose(np.asarray(st.dequantize(q8)), want_x, rtol=0, atol=1e-6)
    assert np.all(np.abs(want_x - x) <= want_s[..., None] / 2 * (1 + 1e-3) + 1e-7)

    q4 = st.quantize(KVQuant("int4"), "v", jnp.asarray(x), jnp.asarray(LENGTHS), jnp.float32)
    want_q, want_s, want_z, want_x = ref.asym(x, 4)
    assert q4.data.dtype == jnp.uint8 and q4.data.shape[-1] == 8  # two codes per byte
    np.testing.assert_array_equal(np.asarray(codes.unpack(q4.data, 4)), want_q)
    np.testing.assert_array_equal(np.asarray(q4.scale, np.float32)[..., 0], want_s)
    np.testing.assert_array_equal(np.asarray(q4.zero, np.float32)[..., 0], want_z)
    np.testing.assert_allclose(np.asarray(st.dequantize(q4)), want_x, rtol=1e-6, atol=1e-6)


def test_fp8_scale_is_per_head_from_the_valid_tokens_only():
    x = _heads(1)
    x[1, 0, 5:] = 1000.0  # past head (1, 0)'s length: must not set its scale
    qa = st.quantize(KVQuant("fp8"), "k", jnp.asarray(x), jnp.asarray(LENGTHS), jnp.float32)
    got = np.asarray(st.dequantize(qa))
    for b in range(2):
        for k in range(2):
            n = LENGTHS[b, k]
            want_q, want_s, want_x = ref.fp8(x[b, k, :n])
            assert float(qa.scale[b, k]) == want_s
            np.testing.assert_array_equal(np.asarray(qa.data[b, k, :n]).view(np.uint8), want_q.view(np.uint8))
            np.testing.assert_array_equal(got[b, k, :n], want_x)
    assert qa.data.dtype == ml_dtypes.float8_e4m3fn and qa.scale.shape == (2, 2)


@pytest.mark.parametrize("first_write", ["quantize", "append_rows", "write_token"])
def test_an_fp8_head_first_written_with_zeros_takes_its_scale_from_the_first_nonzero_values(first_write):
    """A head whose first values are all zeros keeps its scale unset (0), so the first nonzero values set it, as they
    would have as the first write (before: the zeros fixed it at 1.0, and values of 1e-3, below e4m3's smallest
    normal at that scale, were stored as 0 or 2**-9)."""
    spec = KVQuant("fp8")
    zeros = jnp.zeros((1, 1, 8, 16), jnp.float32)
    if first_write == "quantize":
        qa = st.quantize(spec, "v", zeros, jnp.asarray([[3]]), jnp.float32)
    else:
        qa = st.quantize(spec, "v", zeros, jnp.asarray([[0]]), jnp.float32)  # empty: scale not set
        if first_write == "append_rows":
            qa = st.append_rows(qa, zeros[:, :, :3], jnp.asarray([[0]]), jnp.ones((1, 1, 3), bool))
        else:
            for slot in range(3):
                qa = st.write_token(qa, jnp.asarray([[slot]]), zeros[:, :, 0], jnp.asarray([[slot]]),
                                    jnp.asarray([[True]]))
    assert float(qa.scale[0, 0]) == 0.0
    small = np.random.default_rng(0).uniform(-1e-3, 1e-3, (1, 1, 4, 16)).astype(np.float32)
    qa = st.append_rows(qa, jnp.asarray(small), jnp.asarray([[3]]), jnp.ones((1, 1, 4), bool))
    _, want_s, want_x = ref.fp8(small[0, 0])
    assert float(qa.scale[0, 0]) == want_s
    got = np.asarray(st.dequantize(qa))[0, 0]
    np.testing.assert_array_equal(got[3:7], want_x)
    np.testing.assert_array_equal(got[:3], 0.0)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4", "kivi2", "kivi4"])
def test_requantizing_dequantized_values_gives_the_same_codes(scheme):
    spec = KVQuant(scheme, group_size=4, residual=4) if scheme.startswith("kivi") else KVQuant(scheme)
    x, lengths = jnp.asarray(_heads(2)), jnp.asarray(LENGTHS)
    for role in ("k", "v"):
        qa = st.quantize(spec, role, x, lengths, jnp.float32)
        again = st.requantize(qa, st.dequantize(qa), lengths, keep_slots=True)
        if qa.slotwise:
            for a, b in zip(jax.tree.leaves(qa), jax.tree.leaves(again), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            valid = np.arange(12)[None, None] < LENGTHS[..., None]
            np.testing.assert_array_equal(np.asarray(again.qlen), np.asarray(qa.qlen))
            np.testing.assert_array_equal(np.where(valid[..., None], st.dequantize(again), 0),
                                          np.where(valid[..., None], st.dequantize(qa), 0))


@pytest.mark.parametrize("scheme", ["int4", "kivi2", "kivi4"])
def test_requantizing_keeps_values_where_the_zero_rounds_away_from_the_minimum(scheme):
    # Groups spanning less than a few bfloat16 steps of their offset (a key channel near 10 varying by 0.1): the
    # stored zero misses the minimum by more than a quantization step, so the codes fall short of the full range
    # and quantizing the dequantized values again gives another (scale, zero). Every chunk of a prefill, and
    # every eviction on KIVI, requantized the cache so: unchanged slots drifted further each time.
    spec = KVQuant(scheme, group_size=4, residual=4) if scheme.startswith("kivi") else KVQuant(scheme)
    x = 10.04 + 0.05 * _heads(3)
    lengths = jnp.asarray(LENGTHS)
    valid = (np.arange(12)[None, None] < LENGTHS[..., None])[..., None]
    for role in ("k", "v"):
        qa = st.quantize(spec, role, jnp.asarray(x), lengths, jnp.float32)
        first = np.where(valid, np.asarray(st.dequantize(qa)), 0)
        for keep_slots in (True, False, True):
            qa = st.requantize(qa, st.dequantize(qa), lengths, keep_slots=keep_slots)
            np.testing.assert_array_equal(np.where(valid, np.asarray(st.dequantize(qa)), 0), first)
    # A chunked append requantizes a KIVI layer whole: the codes already stored stay as they were.
    cache = kvc.init(2, 2, 16, 16, jnp.float32, quant=spec)
    chunks = jnp.asarray(x.transpose(0, 2, 1, 3))  # [B, T, K, H]
    for start in range(0, 12, 3):
        stored = np.arange(16)[None, None, :, None] < (np.asarray(cache.k.qlen)[..., None, None] if spec.kivi
                                                      else start)
        before = [np.where(stored, np.asarray(read(cache)), 0) for read in (kvc.keys, kvc.values)]
        pos = jnp.asarray(np.broadcast_to(np.arange(start, start + 3, dtype=np.int32), (2, 3)))
        cache = kvc.append(cache, chunks[:, start:start + 3], chunks[:, start:start + 3], pos)
        for read, want in zip((kvc.keys, kvc.values), before, strict=True):
            np.testing.assert_array_equal(np.where(stored, np.asarray(read(cache)), 0), want)
    assert not spec.kivi or np.all(np.asarray(cache.k.qlen) == 8)  # two flushes happened


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_residual_fills_and_flushes_group_by_group_like_the_reference(bits):
    group, residual, h, steps = 4, 8, 8, 13
    spec = KVQuant(f"kivi{bits}", group_size=group, residual=residual)
    prompt = np.array([13, 8])  # 13: two groups quantized, five pending; 8: all pending (exactly R)
    rng = np.random.default_rng(bits)
    b, kv, cap = 2, 2, 13 + steps
    k = rng.standard_normal((b, 13 + steps, kv, h)).astype(np.float32)
    v = rng.standard_normal((b, 13 + steps, kv, h)).astype(np.float32)
    k[..., 0] += 5.0  # a shifted channel: per-channel keys quantize it on its own range
    pos = np.where(np.arange(13)[None] < prompt[:, None], np.arange(13)[None], -1).astype(np.int32)
    cache = kvc.append(kvc.init(b, kv, cap, h, jnp.float32, quant=spec), jnp.asarray(k[:, :13]),
                       jnp.asarray(v[:, :13]), jnp.asarray(pos))
    heads = [[ref.KiviHead(bits, group, residual) for _ in range(kv)] for _ in range(b)]
    for i in range(b):
        for j in range(kv):
            heads[i][j].prefill(k[i, :prompt[i], j], v[i, :prompt[i], j])
    append = jax.jit(kvc.append_token)
    flushed = set()
    for step in range(steps + 1):
        if step:
            t = prompt + step - 1  # each example's next token
            kt = k[np.arange(b), t][:, None]
            vt = v[np.arange(b), t][:, None]
            cache = append(cache, jnp.asarray(kt), jnp.asarray(vt), jnp.asarray(t[:, None].astype(np.int32)))
            for i in range(b):
                for j in range(kv):
                    heads[i][j].append(kt[i, 0, j], vt[i, 0, j])
        keys, values = np.asarray(kvc.keys(cache)), np.asarray(kvc.values(cache))
        for i in range(b):
            for j in range(kv):
                want_k, want_v = heads[i][j].view()
                n = len(want_k)
                assert int(cache.length[i, j]) == n and int(cache.k.qlen[i, j]) == heads[i][j].quantized
                flushed.add(heads[i][j].quantized)
                np.testing.assert_allclose(keys[i, j, :n], want_k, rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(values[i, j, :n], want_v, rtol=1e-6, atol=1e-6)
                assert n - heads[i][j].quantized <= residual
    assert flushed >= {0, 4, 8, 12, 16}  # the window flushed several times, from several starting points


def test_kv_dtype_names_parse_and_bad_values_are_named():
    assert parse_kv_dtype(None) is None and parse_kv_dtype("model") is None
    spec = parse_kv_dtype("kivi2:group_size=32:residual=64")
    assert spec == KVQuant("kivi2", group_size=32, residual=64) and parse_kv_dtype(spec.name) == spec
    assert KVQuant("kivi4").name == "kivi4" and KVQuant("kivi4").group_size == 64
    with pytest.raises(ConfigError, match="int3"):
        parse_kv_dtype("int3")
    with pytest.raises(ConfigError, match="residual=8 must be at least group_size=16"):
        KVQuant("kivi2", group_size=16, residual=8)
    with pytest.raises(ConfigError, match="group_size applies to kivi2 / kivi4 only"):
        KVQuant("int8", group_size=4)
    with pytest.raises(ConfigError, match="head_dim=6"):
        KVQuant("kivi2").check_head_dim(6)


@pytest.mark.parametrize("digit", ["\u00b2", "\u0663"])  # a superscript two int() refuses, an Arabic-Indic three
def test_kv_dtype_option_numbers_are_ascii_digits(digit):
    # str.isdigit() accepts both; the superscript then escaped as a bare ValueError (a traceback from the eval CLI).
    with pytest.raises(ConfigError, match="field=integer"):
        parse_kv_dtype(f"kivi2:group_size={digit}")
    with pytest.raises(ConfigError, match=f"--kv_dtype value 'int4:channel_group={digit}'"):
        kv_dtype_specs(f"model,int4:channel_group={digit}")


def test_a_kv_dtype_option_given_twice_is_refused():
    # The last one silently won: the cell ran (and was named) kivi2 at its default 64-token groups.
    with pytest.raises(ConfigError, match="'kivi2:group_size=32:group_size=64': group_size is given twice"):
        parse_kv_dtype("kivi2:group_size=32:group_size=64")
    with pytest.raises(ConfigError, match="residual is given twice"):
        kv_dtype_specs("int8,kivi4:residual=64:group_size=32:residual=64")
    assert parse_kv_dtype(" KIVI2:Group_Size=32:residual= 64 ") == KVQuant("kivi2", group_size=32, residual=64)
