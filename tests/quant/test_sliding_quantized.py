"""A quantized cache on a model with sliding-window layers: the rings store K / V in the chosen format too.

Oracles: the NumPy reference quantizer (tests/quant/quant_reference.py) applied to what a ring of C slots must hold
(the last C positions, each at slot `p % C`): per token for int8 / int4, fp8 with the scale its first written rows
set, KIVI token by token (`KiviHead`: the ring's slots read what KIVI's cache holds for their positions); the
unquantized run's kept positions (int8: Jaccard >= 0.98 on every layer) and ring keys (int8 of them, the same
tokens); leaf shapes for `nbytes`; the trace counters for one compile per scheme and shape bucket.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import quant_reference as ref
from tiny import random_prompts, tiny_gemma3

import kvjax
from kvjax import cache as kvc
from kvjax.quant import QuantizedKV, parse_kv_dtype
from kvjax.quant import storage as qs
from kvjax.runtime import TRACE_COUNTS

WINDOW = 8
PROMPTS = (31, 12, 40)
NEW = 9
KIVI_SMALL = ("kivi2:group_size=4:residual=4", "kivi4:group_size=4:residual=6")
SCHEMES = ("int8", "fp8", "int4", *KIVI_SMALL)
SNAPKV = dict(method="snapkv", method_args=dict(budget=16, window_size=4))


def _fp8_with_scale(x: np.ndarray, s: float) -> np.ndarray:
    return np.clip(x / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s


def _fp8_scale(rows: np.ndarray) -> float:
    want = float(np.max(np.abs(rows))) * 4.0 / 448.0
    return 2.0 ** math.ceil(math.log2(want)) if want > 0 else 0.0  # 0: not set (all zeros so far)


def _reference_ring(spec, capacity: int, chunks: list[list[np.ndarray]], role: int) -> dict[int, np.ndarray]:
    """position -> the values a ring holds for it after `chunks` (each a list of `[n, H]` tokens of one head);
    `role` 0 keys, 1 values. Only the last `capacity` positions are returned."""
    tokens = np.concatenate([c[role] for c in chunks if len(c[role])], axis=0)
    top = len(tokens)
    live = range(max(0, top - capacity), top)
    if spec.scheme == "int8":
        return {p: ref.int8(tokens[p])[2] for p in live}
    if spec.scheme == "int4":
        return {p: ref.asym(tokens[p], 4)[3] for p in live}
    if spec.scheme == "fp8":  # the scale set by the first chunk that wrote rows (its last `capacity` tokens)
        first = next(c[role] for c in chunks if len(c[role]))
        s = _fp8_scale(first[-capacity:])
        return {p: _fp8_with_scale(tokens[p], s) for p in live}
    head = ref.KiviHead(spec.bits, spec.group_size, spec.residual)
    ks = [c for c in chunks if len(c[0])]
    head.prefill(ks[0][0], ks[0][1])
    for k, v in ks[1:]:
        for i in range(len(k)):
            head.append(k[i], v[i])
    view = head.view()[role]
    return {p: view[p] for p in live}


@pytest.mark.parametrize("capacity", [6, 8])
@pytest.mark.parametrize("kv_dtype", SCHEMES)
def test_ring_contents_equal_the_reference_quantizer(kv_dtype, capacity):
    """Chunks of several sizes (one longer than the ring, ragged rows padded with -1), then single tokens; after
    each write the dequantized ring equals the reference at every valid slot, for keys and values."""
    spec = parse_kv_dtype(kv_dtype)
    rng = np.random.default_rng(capacity)
    batch, heads, dim = 2, 2, 16
    ring = kvc.init(batch, heads, capacity, dim, np.float32, quant=spec, ring=True)
    keys = rng.standard_normal((batch, 64, heads, dim)).astype(np.float32)
    vals = rng.standard_normal((batch, 64, heads, dim)).astype(np.float32)
    written: list[list[list[int]]] = [[], []]  # per example: the positions of each chunk
    for sizes in ((3, 2), (11, 7), (1, 0), (4, 4), (1, 1), (1, 1), (9, 1), (1, 1)):
        t = max(sizes)
        positions = np.full((batch, t), -1, np.int32)
        k = np.zeros((batch, t, heads, dim), np.float32)
        v = np.zeros_like(k)
        for b, n in enumerate(sizes):
            start = sum(map(len, written[b]))
            positions[b, :n] = np.arange(start, start + n)
            k[b, :n], v[b, :n] = keys[b, start : start + n], vals[b, start : start + n]
            written[b].append(list(range(start, start + n)))
        ring = kvc.ring_append(ring, k, v, positions)
        assert isinstance(ring.k, QuantizedKV)
        pos = np.asarray(ring.pos)
        got = (np.asarray(qs.dequantize(ring.k)), np.asarray(qs.dequantize(ring.v)))
        for b in range(batch):
            for h in range(heads):
                chunks = [[keys[b, c, h] if c else np.zeros((0, dim)), vals[b, c, h] if c else np.zeros((0, dim))]
                          for c in written[b]]
                for role in (0, 1):
                    want = _reference_ring(spec, capacity, chunks, role)
                    assert sorted(int(p) for p in pos[b, h] if p >= 0) == sorted(want)
                    for slot, p in enumerate(pos[b, h]):
                        if p >= 0:
                            np.testing.assert_allclose(got[role][b, h, slot], want[int(p)], rtol=1e-6, atol=1e-6,
                                                       err_msg=f"{kv_dtype} b={b} h={h} p={p} role={role}")
        if spec.kivi:  # never more than `residual` positions pending in full precision
            pending = np.asarray(ring.k.top - ring.k.qlen)
            assert (pending >= 0).all() and (pending <= spec.residual).all()
            assert (np.asarray(ring.k.qlen) % spec.group_size == 0).all()


def _jaccard(a: list, b: list) -> float:
    a, b = set(a), set(b)
    return len(a & b) / max(1, len(a | b))


def _ring_bytes(spec, batch: int, heads: int, capacity: int, dim: int, dtype_bytes: int = 4) -> int:
    """What a quantized ring must cost, from the format's definition (codes, scales, zeros, KIVI's residual)."""
    codes = batch * heads * capacity * dim * spec.bits // 8
    if spec.scheme == "fp8":
        per_store = codes + batch * heads * 4
    elif spec.scheme == "int8":
        per_store = codes + batch * heads * capacity * 2
    elif spec.scheme == "int4":
        per_store = codes + 2 * batch * heads * capacity * 2
    else:
        residual = batch * heads * spec.ring * dim * dtype_bytes + 2 * batch * heads * 4  # ring, qlen, top
        groups = -(-capacity // spec.group_size) + 1
        per_store = 2 * codes + 2 * residual + 2 * batch * heads * groups * dim * 2 + 2 * batch * heads * capacity * 2
        return per_store + batch * heads * capacity * 4 + batch * heads * 4
    return 2 * per_store + batch * heads * capacity * 4 + batch * heads * 4  # + pos, length


@pytest.mark.parametrize("kv_dtype", SCHEMES)
def test_generate_on_a_sliding_model_at_every_scheme(kv_dtype):
    """A Gemma-3-style model (a window-8 ring, then a global layer), ragged batch of three, one-shot and chunked
    prefill: tokens end to end; the ring stored in the format at its true size; int8 keeps the unquantized run's
    positions (Jaccard >= 0.98 on every layer) and its ring reads the int8 of the unquantized run's keys; a second
    batch in the same bucket compiles nothing new."""
    spec = parse_kv_dtype(kv_dtype)
    model = tiny_gemma3(window=WINDOW)
    prompts = random_prompts(7, PROMPTS)
    for chunk in (None, 16):
        kw = dict(SNAPKV, max_new_tokens=NEW, stop_at_eos=False, return_cache=True, chunk_size=chunk)
        out = kvjax.generate(model, prompts, kv_dtype=kv_dtype, **kw)
        plain = kvjax.generate(model, prompts, **kw)
        assert out.tokens.shape == (3, NEW) and (out.tokens >= 0).all() and (out.tokens < 96).all()
        ring, plain_ring = out.cache.layers[0], plain.cache.layers[0]
        assert isinstance(ring.k, QuantizedKV) and ring.k.spec == spec and ring.capacity == WINDOW
        assert ring.nbytes == _ring_bytes(spec, 3, model.config.num_kv_heads, WINDOW, model.config.head_dim)
        if not spec.kivi:  # KIVI's full-precision ring of `residual + 1` rows outweighs a window of 8
            assert ring.nbytes < plain_ring.nbytes
        kept, kept_plain = kvc.positions_kept(out.cache), kvc.positions_kept(plain.cache)
        assert kept[0] == kept_plain[0]  # a ring holds its window whatever the format
        if spec.scheme == "int8":
            np.testing.assert_array_equal(out.tokens, plain.tokens)
            for layer, layer_plain in zip(kept, kept_plain, strict=True):
                for heads, heads_plain in zip(layer, layer_plain, strict=True):
                    for a, b in zip(heads, heads_plain, strict=True):
                        assert _jaccard(a, b) >= 0.98
            # Layer 0 sees the same tokens in both runs: its ring holds the int8 of the plain ring's keys.
            valid = np.asarray(kvc.valid_mask(ring))
            want = ref.int8(np.asarray(plain_ring.k))[2]
            np.testing.assert_allclose(np.asarray(qs.dequantize(ring.k))[valid], want[valid], rtol=1e-6, atol=1e-6)
    before = TRACE_COUNTS["prefill"], TRACE_COUNTS["decode_step"]
    kvjax.generate(model, random_prompts(8, PROMPTS), kv_dtype=kv_dtype, **kw)
    assert (TRACE_COUNTS["prefill"], TRACE_COUNTS["decode_step"]) == before


@pytest.mark.parametrize("kv_dtype", ["kivi2", "kivi4"])
def test_a_window_kivi_keeps_in_full_precision_stays_in_the_model_dtype(kv_dtype):
    """KIVI's defaults keep the newest 128 - 64 + 1 tokens or more in full precision: a window of 8 is never
    quantized, so its ring is the plain one (same bytes, same keys), while the global layer is quantized."""
    model = tiny_gemma3(window=WINDOW)
    prompts = random_prompts(7, PROMPTS)
    out = kvjax.generate(model, prompts, max_new_tokens=4, stop_at_eos=False, return_cache=True, kv_dtype=kv_dtype)
    plain = kvjax.generate(model, prompts, max_new_tokens=4, stop_at_eos=False, return_cache=True)
    assert not isinstance(out.cache.layers[0].k, QuantizedKV) and isinstance(out.cache.layers[1].k, QuantizedKV)
    assert out.cache.layers[0].nbytes == plain.cache.layers[0].nbytes
    assert not parse_kv_dtype(kv_dtype).quantizes_ring(65) and parse_kv_dtype(kv_dtype).quantizes_ring(66)


def test_shared_prefill_replay_on_a_quantized_sliding_model():
    """The shared-prefill sweep's rings (`prefill_from`) equal `generate.prefill`'s, quantized alike."""
    from kvjax.runtime import decode, shared_prefill

    model = tiny_gemma3(window=WINDOW)
    prompts = random_prompts(7, PROMPTS)
    method = kvjax.methods.get("snapkv", budget=16, window_size=4)
    rec = shared_prefill.record(model, prompts)
    for kv_dtype in ("int8", KIVI_SMALL[0]):
        state = shared_prefill.prefill_from(model, rec, method, max_new_tokens=NEW, kv_dtype=kv_dtype)
        tokens, _, cache = decode(model, state, max_new_tokens=NEW)
        want = kvjax.generate(model, prompts, method=method, max_new_tokens=NEW, return_cache=True, kv_dtype=kv_dtype)
        np.testing.assert_array_equal(np.asarray(tokens), want.tokens)
        assert kvc.positions_kept(cache) == kvc.positions_kept(want.cache)
