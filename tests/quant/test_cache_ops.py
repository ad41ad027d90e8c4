"""Every per-layer cache op on a quantized cache against the same op on its dequantized values.

Per-token layouts (int8, fp8, int4) move codes and scales with their slots: the op's result dequantizes to exactly
the plain op's result on the dequantized cache. KIVI requantizes what moved between slot groups: slots whose
group nothing touched keep their values exactly, moved ones stay within half a quantization step (of the scales
now stored), and the full-precision ring stays exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvc
from kvjax.quant import KVQuant, QuantizedKV
from kvjax.quant import storage as st

B, KV, C, H = 2, 2, 24, 8
LENGTHS = np.array([20, 13])
SCHEMES = {
    "int8": KVQuant("int8"), "fp8": KVQuant("fp8"), "int4": KVQuant("int4"),
    "kivi2": KVQuant("kivi2", group_size=4, residual=4), "kivi4": KVQuant("kivi4", group_size=4, residual=6),
}
INV_FREQ = 1.0 / (10000.0 ** (np.arange(0, H, 2) / H))


def _filled(spec: KVQuant) -> kvc.KVCache:
    rng = np.random.default_rng(0)
    k = rng.standard_normal((B, 20, KV, H)).astype(np.float32)
    v = rng.standard_normal((B, 20, KV, H)).astype(np.float32)
    pos = np.where(np.arange(20)[None] < LENGTHS[:, None], np.arange(20)[None], -1).astype(np.int32)
    cache = kvc.init(B, KV, C, H, jnp.float32, score=True, quant=spec)
    cache = kvc.append(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos))
    return cache.replace(score=jnp.asarray(rng.random((B, KV, C)), jnp.float32))


def _step_size(qa: QuantizedKV) -> np.ndarray:
    """`[B, K, C, H]` the quantization step each stored value was rounded to (0 in KIVI's ring)."""
    if qa.spec.per_head_scale:
        return np.broadcast_to(np.asarray(qa.scale)[:, :, None, None] * 2.0**-3 * 448, qa.shape)  # loose for fp8
    if qa.key_groups:
        step = np.repeat(np.asarray(qa.scale, np.float32), qa.spec.group_size, axis=2)[:, :, :qa.capacity]
    else:
        s = np.asarray(qa.scale, np.float32)
        step = np.repeat(s, qa.head_dim // s.shape[-1], axis=-1)
    if qa.spec.kivi:
        step = np.where((np.arange(qa.capacity)[None, None] >= np.asarray(qa.qlen)[..., None])[..., None], 0, step)
    return step


def _check(got: kvc.KVCache, want: kvc.KVCache, exact: bool) -> None:
    """`got` (the op on the quantized cache) against `want` (the op on its dequantized copy): equal values, or
    (`exact` False: values were requantized) within half a step of the scales now stored."""
    np.testing.assert_array_equal(got.pos, want.pos)
    np.testing.assert_array_equal(got.length, want.length)
    np.testing.assert_array_equal(got.score, want.score)
    assert isinstance(got.k, QuantizedKV) and got.k.capacity == want.k.shape[2]
    valid = np.asarray(kvc.stored_mask(got))[..., None]
    for qa, plain in ((got.k, want.k), (got.v, want.v)):
        values = np.asarray(st.dequantize(qa))
        plain = np.asarray(plain)
        if exact:
            np.testing.assert_array_equal(np.where(valid, values, 0), np.where(valid, plain, 0))
        else:
            bound = _step_size(qa) / 2 * (1 + 1e-3) + 1e-6
            assert np.all(np.where(valid, np.abs(values - plain) <= bound, True)), np.abs(values - plain).max()


def _ops():
    rng = np.random.default_rng(1)
    keep = jnp.asarray(rng.random((B, KV, C)) < 0.6)
    indices = jnp.asarray(np.stack([np.stack([rng.permutation(C)[:10] for _ in range(KV)]) for _ in range(B)]))
    victim = jnp.asarray([[3, 17], [0, 12]], jnp.int32)
    delta = jnp.asarray(rng.integers(-5, 5, (B, KV, C)), jnp.int32)
    return {
        "compact": lambda c: kvc.compact(c, indices, jnp.asarray([[10, 7], [4, 10]], jnp.int32)),
        "keep_where": lambda c: kvc.keep_where(c, keep, 16),
        "evict": lambda c: kvc.evict(c, victim, jnp.asarray([[True, True], [True, False]])),
        "truncate": lambda c: kvc.truncate(c, 15),
        "extend": lambda c: kvc.extend(c, 5),
        "rerotate": lambda c: kvc.rerotate(c, delta, jnp.asarray(INV_FREQ, jnp.float32)),
    }


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_cache_ops_move_codes_with_their_scales(scheme):
    spec = SCHEMES[scheme]
    cache = _filled(spec)
    plain = kvc.dequantized(cache)
    for name, op in _ops().items():
        got, want = jax.jit(op)(cache), op(plain)
        try:
            # Rotated keys are new values: requantized in every layout.
            _check(got, want, exact=not spec.kivi and name != "rerotate")
        except AssertionError as e:
            raise AssertionError(f"{scheme} {name}: {e}") from e
    # take_slots reads only the slots asked for, dequantized.
    slots = jnp.asarray(np.random.default_rng(2).integers(0, 13, (B, KV, 5)), jnp.int32)
    np.testing.assert_array_equal(kvc.take_slots(cache.k, slots), kvc.take_slots(plain.k, slots))
    np.testing.assert_array_equal(kvc.take_slots(cache.v, slots[..., 0]), kvc.take_slots(plain.v, slots[..., 0]))


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_appending_one_token_writes_its_slot_only(scheme):
    spec = SCHEMES[scheme]
    cache = _filled(spec)
    token = np.random.default_rng(3).standard_normal((B, 1, KV, H)).astype(np.float32)
    out = jax.jit(kvc.append_token)(cache, jnp.asarray(token), jnp.asarray(token), jnp.asarray([[20], [13]], np.int32))
    chunk = kvc.append(cache, jnp.asarray(token), jnp.asarray(token), jnp.asarray([[20], [13]], np.int32))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(chunk), strict=True):  # one token: the same writes
        np.testing.assert_array_equal(a, b)
    before, after = np.asarray(kvc.keys(cache)), np.asarray(kvc.keys(out))
    for b, n in enumerate(LENGTHS):
        np.testing.assert_array_equal(after[b, :, :n], before[b, :, :n])
        step = np.abs(token[b, 0]).max(-1, keepdims=True) * (2.0**-3 if scheme == "fp8" else 2 / 15)
        assert np.all(np.abs(after[b, :, n] - token[b, 0]) <= step)


def test_cache_nbytes_counts_codes_scales_and_ring():
    for name, spec in SCHEMES.items():
        cache = kvc.init(B, KV, C, H, jnp.bfloat16, quant=spec)
        kv_bytes = sum(x.nbytes for x in jax.tree.leaves((cache.k, cache.v)))
        codes = 2 * B * KV * C * H * spec.bits // 8
        assert kv_bytes > codes and cache.nbytes == kv_bytes + cache.pos.nbytes + cache.length.nbytes, name
        assert kvc.keys(cache).dtype == jnp.bfloat16 and kvc.keys(cache).shape == (B, KV, C, H)
