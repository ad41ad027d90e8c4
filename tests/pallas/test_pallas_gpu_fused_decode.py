"""The fused decode kernel (`kvjax.pallas.gpu_fused_decode`: RoPE, the in-place write of the new token, split-K
attention) against its XLA twin, the composition the runtime runs today (`kvjax.ops.fused_decode`'s "xla" path:
`apply_rope` -> `kvjax.cache.append_token` -> `decode_attention`): the attention output AND the written layer
(keys, values, positions, lengths). Compiled on a GPU backend, in interpret mode elsewhere (CI).

Cases: float32 / bfloat16, GQA groups 1 / 4 / 8, ragged per-head lengths (an empty head, a head one slot from
full, a full one whose write clips onto its last slot), a padding row (position -1), a sliding window, empty
slots (position -1) inside a head's valid range, capacities that are no block multiple (and one below a block),
yarn's RoPE scaling and Gemma's query scale, int8, int4 and KIVI caches (codes, scales and zeros written as
`kvjax.quant.storage.write_token` does; KIVI's ring, its group flushed in the kernel, a prefix ending inside a
group), and the gathered slot list (duplicates, unlisted slots, the new slot
listed or not)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import assert_close

from kvjax import cache as kvc
from kvjax import tuning
from kvjax.errors import ConfigError
from kvjax.ops import fused_decode as fd
from kvjax.pallas import gpu_fused_decode as kernels
from kvjax.pallas import gpu_fused_kivi, gpu_token_codes
from kvjax.quant import KVQuant, codes
from kvjax.quant import storage as st

H = 16
INTERPRET = None if jax.default_backend() == "gpu" else True


def layer_case(rng, kv, g, capacity, lengths, dtype, quant=None, holes=False):
    """A layer whose heads hold `lengths` tokens (positions a permutation, some -1 holes if `holes`), and a new
    token per example (pre-RoPE q / k, v): positions `capacity + 3` and -1 (a padding row)."""
    batch = lengths.shape[0]
    stored = np.arange(capacity)[None, None] < lengths[..., None]
    perm = np.stack([np.stack([rng.permutation(capacity) for _ in range(kv)]) for _ in range(batch)])
    pos = np.where(stored, perm, -1)
    if holes:
        pos = np.where(stored & (rng.random(stored.shape) < 0.15), -1, pos)
    k = np.where(stored[..., None], rng.standard_normal((batch, kv, capacity, H)), 0)
    v = np.where(stored[..., None], rng.standard_normal((batch, kv, capacity, H)), 0)
    layer = kvc.init(batch, kv, capacity, H, dtype, quant=quant)
    length = jnp.asarray(lengths, jnp.int32)
    if quant is None:
        layer = layer.replace(k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype))
    else:
        layer = layer.replace(k=st.quantize(quant, "k", jnp.asarray(k, jnp.float32), length, dtype),
                              v=st.quantize(quant, "v", jnp.asarray(v, jnp.float32), length, dtype))
    layer = layer.replace(pos=jnp.asarray(pos, jnp.int32), length=length)
    q = jnp.asarray(rng.standard_normal((batch, 1, kv * g, H)), dtype)
    k_new = jnp.asarray(rng.standard_normal((batch, 1, kv, H)), dtype)
    v_new = jnp.asarray(rng.standard_normal((batch, 1, kv, H)), dtype)
    positions = jnp.asarray([[capacity + 3], [-1]][:batch], jnp.int32)
    return q, k_new, v_new, positions, layer


INV_FREQ = 1.0 / (10000.0 ** (np.arange(H // 2) / (H // 2)))


def both(args, tune=None, **kw):
    """(kernel, twin) results of one jitted program (one compile per case); `tune` overrides the kernel's tuning."""
    def run(q, k, v, positions, layer):
        common = dict(inv_freq=jnp.asarray(INV_FREQ, jnp.float32), **kw)
        with tuning.override(gpu_decode_block_k=16, gpu_quantized_block_k=16, **(tune or {})):
            got = fd.decode_append_attention(q, k, v, positions, layer, implementation="pallas", **common)
        want = fd.decode_append_attention(q, k, v, positions, layer, implementation="xla", **common)
        return got, want

    return jax.jit(run)(*args)


def assert_layers_match(got, want, dtype):
    """Positions, lengths and values exactly; the rotated keys within the dtype's tolerance (XLA may contract the
    RoPE's multiply-add differently inside and outside the kernel: one float32 ulp); quantized codes, scales and
    zeros exactly in interpret mode."""
    np.testing.assert_array_equal(np.asarray(got.pos), np.asarray(want.pos))
    np.testing.assert_array_equal(np.asarray(got.length), np.asarray(want.length))
    if not isinstance(want.k, st.QuantizedKV):
        assert got.k.dtype == want.k.dtype and got.v.dtype == want.v.dtype
        assert_close(got.k, want.k, dtype)
        np.testing.assert_array_equal(np.asarray(got.v), np.asarray(want.v))
        return
    for g, w in ((got.k, want.k), (got.v, want.v)):
        assert (g.zero is None) == (w.zero is None)
        if w.spec.scheme == "fp8":  # e4m3 codes compared as their values (codes one binade step apart: 1 / 8)
            gd, wd = (np.asarray(x.data, np.float32) for x in (g, w))
        else:
            gd, wd = (np.asarray(codes.unpack(x.data, x.spec.bits), np.int32) for x in (g, w))
        stats = [(np.asarray(a, np.float32), np.asarray(b, np.float32))
                 for a, b in ((g.scale, w.scale), (g.zero, w.zero)) if b is not None]
        if w.spec.kivi:  # the ring (the token in the model dtype) and the quantized prefix
            assert_close(g.residual, w.residual, dtype)
            np.testing.assert_array_equal(np.asarray(g.qlen), np.asarray(w.qlen))
        if INTERPRET:  # the same float32 maths: the storage's codes, scales and zeros, bit for bit
            np.testing.assert_array_equal(gd, wd)
            for gs, ws in stats:
                np.testing.assert_array_equal(gs, ws)
        elif w.spec.scheme == "fp8":  # compiled, a RoPE ulp may move a code at a tie to its neighbour
            assert (gd != wd).sum() <= 4
            np.testing.assert_allclose(gd, wd, rtol=0.13)
        else:  # compiled, a division or multiply-add may round differently: a code moves by one at a tie
            assert np.abs(gd - wd).max() <= 1 and (gd != wd).sum() <= 4
            for gs, ws in stats:
                np.testing.assert_allclose(gs, ws, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kv,g,dtype,capacity,lengths,window,extra", [
    # empty head, a head with one free slot, a full head (its write clips onto the last slot); no block multiple
    (2, 4, jnp.float32, 40, [[40, 39], [0, 30]], 24, dict(holes=True)),
    (1, 8, jnp.bfloat16, 100, [[77], [100]], None, dict(num_splits=3)),
    # multi-head attention, yarn's scale on cos / sin, Gemma's query scale, a capacity below one block
    (2, 1, jnp.float32, 12, [[5, 11], [0, 3]], None, dict(scaling=1.3, query_scale=0.7)),
])
def test_fused_kernel_equals_the_xla_composition(kv, g, dtype, capacity, lengths, window, extra):
    extra = dict(extra)
    holes = extra.pop("holes", False)
    splits = extra.pop("num_splits", None)
    args = layer_case(np.random.default_rng(0), kv, g, capacity, np.array(lengths), dtype, holes=holes)
    with tuning.override(gpu_target_programs=splits * 2 * kv if splits else 256):
        (got, got_layer), (want, want_layer) = both(args, sliding_window=window, **extra)
    assert got.dtype == dtype and got.shape == (2, 1, kv * g, H)
    assert_close(got, want, dtype)
    assert float(jnp.abs(got[1]).max()) == 0.0  # the padding row attends nothing
    assert_layers_match(got_layer, want_layer, dtype)


@pytest.mark.parametrize("dtype,plus_one,quant", [(jnp.float32, False, None), (jnp.bfloat16, True, None),
                                                 (jnp.bfloat16, False, KVQuant("int8")),
                                                 (jnp.float32, True, KVQuant("int4")),
                                                 (jnp.bfloat16, True, KVQuant("fp8"))])
@pytest.mark.parametrize("fused_operand", [False, True], ids=["q-k-v", "qkv"])
def test_fused_kernel_applies_qk_norm_before_rope(dtype, plus_one, quant, fused_operand):
    """QK-norm (Qwen3's `weight * x r`, Gemma 3's `x r (1 + weight)`) on the kernel's q and k rows, before RoPE,
    against the XLA composition with `rms_norm_xla` per head first; given the fused q|k|v operand or not."""
    rng = np.random.default_rng(3)
    q, k, v, positions, layer = layer_case(rng, 2, 4, 40, np.array([[30, 12], [20, 39]]), dtype, quant=quant)
    q, k = q * 3, k * 0.2  # rows whose norms are far from 1, so a missing or misplaced norm shows
    norms = (jnp.asarray(rng.standard_normal(H), dtype), jnp.asarray(rng.standard_normal(H), dtype), 1e-6, plus_one)
    fused = jnp.concatenate([q.reshape(2, 1, 2, 4, H), k[:, :, :, None], v[:, :, :, None]], axis=3)
    (got, got_layer), (want, want_layer) = both((q, k, v, positions, layer), qk_norm=norms,
                                                **(dict(qkv=fused) if fused_operand else {}))
    assert_close(got, want, dtype)
    assert_layers_match(got_layer, want_layer, dtype)
    (plain, _), _ = both((q, k, v, positions, layer))
    assert float(jnp.abs(plain.astype(jnp.float32) - want.astype(jnp.float32)).max()) > 0.05  # the norm mattered


@pytest.mark.parametrize("scheme,dtype", [("int8", jnp.bfloat16), ("int4", jnp.bfloat16), ("int4", jnp.float32),
                                          ("fp8", jnp.bfloat16), ("fp8", jnp.float32),
                                          ("int4", jnp.float16),  # compiled: `gpu_unpack`'s fp16 assembly
                                          ("int8", jnp.float16)])  # compiled: its int8 assembly
def test_fused_kernel_quantized_cache(scheme, dtype):
    """int8 (symmetric, one byte a value), int4 (asymmetric, two codes a byte in channel planes) and fp8 (e4m3, one
    power-of-two scale per head): the blocks' codes dequantized in the kernel, the new token's codes / scale / zero
    written as the storage writes them."""
    spec = KVQuant(scheme)
    args = layer_case(np.random.default_rng(1), 2, 4, 48, np.array([[40, 9], [47, 0]]), dtype, quant=spec)
    (got, got_layer), (want, want_layer) = both(args)
    assert_close(got, want, dtype)
    assert_layers_match(got_layer, want_layer, dtype)
    assert not np.array_equal(np.asarray(got_layer.k.data), np.asarray(args[4].k.data))  # the token was written


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_fused_kernel_at_the_gpus_quantized_tile(scheme, monkeypatch, fresh_kernel_traces):
    """The GPU's default tile for a quantized cache (`Tuning.gpu_quantized_block_k`: 128 slots) on a capacity that
    is no block multiple, ragged heads (one within the first block, one one slot from full, an empty one) and two
    splits: the output and the written layer as the XLA composition's, the kernel traced with 128-slot blocks."""
    blocks = []
    check = kernels.check_block
    monkeypatch.setattr(kernels, "check_block", lambda op, name, value: blocks.append(value) or check(op, name, value))
    gpu = tuning.default("gpu")
    assert gpu.tile(quantized=True)[0] == 128
    args = layer_case(np.random.default_rng(11), 2, 4, 300, np.array([[290, 100], [299, 0]]), jnp.bfloat16,
                      quant=KVQuant(scheme))

    def run(q, k, v, positions, layer):
        common = dict(inv_freq=jnp.asarray(INV_FREQ, jnp.float32))
        with tuning.override(gpu_quantized_block_k=gpu.gpu_quantized_block_k, gpu_target_programs=2 * 2 * 2):
            got = fd.decode_append_attention(q, k, v, positions, layer, implementation="pallas", **common)
        return got, fd.decode_append_attention(q, k, v, positions, layer, implementation="xla", **common)

    (got, got_layer), (want, want_layer) = jax.jit(run)(*args)
    assert blocks == [128]
    assert_close(got, want, jnp.bfloat16)
    assert_layers_match(got_layer, want_layer, jnp.bfloat16)


def _pairs_case(case, scheme="int8"):
    """(args, keyword arguments) of the cases `test_fused_kernel_reads_int8_codes_in_pairs` (and, over int4 stores,
    `test_fused_kernel_reads_int4_codes_in_pairs`) runs."""
    rng, spec = np.random.default_rng(12), KVQuant(scheme)
    if case == "ring":
        return ring_case(rng, [37, 24, 10, 50, -1], 24, jnp.bfloat16, quant=spec), dict(sliding_window=20, ring=True)
    dtype = jnp.float16 if case == "fp16" else jnp.bfloat16  # a float16 model: float16 dots whatever the flag
    args = layer_case(rng, 3, 4, 40, np.array([[30, 17, 25], [20, 39, 8]]), dtype, quant=spec)
    if case == "evict":
        slot = jnp.asarray([[4, 0, 25], [3, 7, 1]], jnp.int32)
        return args, dict(evict=(slot, jnp.asarray([[True, False, True], [True, True, True]])))
    if case == "qk_norm":
        norms = (jnp.asarray(rng.standard_normal(H), jnp.bfloat16), jnp.asarray(rng.standard_normal(H), jnp.bfloat16),
                 1e-6, True)
        return args, dict(qk_norm=norms, sliding_window=21)
    return args, {}


@pytest.mark.parametrize("f16_dots", [True, False])  # first (CI): keys and values in pairs
@pytest.mark.parametrize("case", ["plain", "evict", "ring", "qk_norm", "fp16"])
def test_fused_kernel_reads_int8_codes_in_pairs(case, f16_dots):
    """`Tuning.gpu_int8_pairs`: the int8 value codes handed to the kernel as int16 pairs of channels (a bitcast),
    and with float16 dots (`gpu_f16_dots`) the key codes too; the query, the output and the written token's codes
    in even and odd channels: the output and the written layer as the XLA composition's, and (interpret mode) the
    output as the kernel's without pairs to a unit in the last place."""
    args, kw = _pairs_case(case)
    dtype = jnp.float16 if case == "fp16" else jnp.bfloat16
    (got, got_layer), (want, want_layer) = both(args, tune=dict(gpu_int8_pairs=True, gpu_f16_dots=f16_dots), **kw)
    assert_close(got, want, dtype)
    assert_layers_match(got_layer, want_layer, dtype)
    assert got_layer.k.data.dtype == jnp.int8 and got_layer.k.data.shape == want_layer.k.data.shape
    (bytes_, _), _ = both(args, tune=dict(gpu_int8_pairs=False, gpu_f16_dots=f16_dots), **kw)
    if INTERPRET:  # the same maths, each dot summed in two halves: within a unit in the last place
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(bytes_, np.float32),
                                   rtol=2.0 ** -8 if dtype == jnp.bfloat16 else 2.0 ** -10)

    def kernel_inputs(pairs):
        with tuning.override(gpu_int8_pairs=pairs, gpu_f16_dots=f16_dots):
            return str(jax.make_jaxpr(lambda *a: fd.decode_append_attention(
                *a, inv_freq=jnp.asarray(INV_FREQ, jnp.float32), implementation="pallas", **kw))(*args))

    # a bitcast to int16 pairs for each operand read so, and one for the token's codes the kernel writes
    assert kernel_inputs(True).count("new_dtype=int16") == (4 if f16_dots or dtype == jnp.float16 else 2)
    assert "i16[" not in kernel_inputs(False)


@pytest.mark.parametrize("case", ["evict", "plain", "ring", "qk_norm", "fp16"])
def test_fused_kernel_reads_int4_codes_in_pairs(case):
    """`Tuning.gpu_int4_pairs` (on by default): an int4 cache's packed key and value bytes handed to the kernel as
    int16 pairs (bitcasts), the query, the output and the written token's codes in four planes: the output and the
    written layer as the XLA composition's, and (interpret mode) the output as the byte-wise read's to a unit in the
    last place."""
    args, kw = _pairs_case(case, "int4")
    dtype = jnp.float16 if case == "fp16" else jnp.bfloat16
    (got, got_layer), (want, want_layer) = both(args, tune=dict(gpu_int4_pairs=True), **kw)
    assert_close(got, want, dtype)
    assert_layers_match(got_layer, want_layer, dtype)
    assert got_layer.k.data.dtype == jnp.uint8 and got_layer.k.data.shape == want_layer.k.data.shape
    (bytes_, bytes_layer), _ = both(args, tune=dict(gpu_int4_pairs=False), **kw)
    assert_layers_match(got_layer, bytes_layer, dtype)
    if INTERPRET:
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(bytes_, np.float32),
                                   rtol=2.0 ** -8 if dtype == jnp.bfloat16 else 2.0 ** -10)

    def kernel_inputs(pairs):
        with tuning.override(gpu_int4_pairs=pairs):
            return str(jax.make_jaxpr(lambda *a: fd.decode_append_attention(
                *a, inv_freq=jnp.asarray(INV_FREQ, jnp.float32), implementation="pallas", **kw))(*args))

    # a bitcast to int16 pairs for each operand (keys, values) and for each of the token's packed rows written
    assert kernel_inputs(True).count("new_dtype=int16") == 4 and "i16[" not in kernel_inputs(False)


@pytest.mark.parametrize("scheme,pairs", [("int8", False), ("int8", True), ("fp8", False)])
def test_fused_kernel_float16_dots(scheme, pairs):
    """`Tuning.gpu_f16_dots`: an int8 / fp8 cache of a bf16 model attended with float16 dots (compiled, int8 codes
    by `gpu_unpack`'s assembly): the output and the written layer as the XLA composition's, the kernel's dots traced
    in float16 only where asked."""
    args = layer_case(np.random.default_rng(13), 2, 4, 48, np.array([[40, 9], [47, 0]]), jnp.bfloat16,
                      quant=KVQuant(scheme))
    (got, got_layer), (want, want_layer) = both(args, tune=dict(gpu_f16_dots=True, gpu_int8_pairs=pairs))
    assert_close(got, want, jnp.bfloat16)
    assert_layers_match(got_layer, want_layer, jnp.bfloat16)

    def traced(asked):
        with tuning.override(gpu_f16_dots=asked, gpu_int8_pairs=pairs):
            return str(jax.make_jaxpr(lambda *a: fd.decode_append_attention(
                *a, inv_freq=jnp.asarray(INV_FREQ, jnp.float32), implementation="pallas"))(*args))

    assert re.search(r"\bf16\[", traced(True)) and not re.search(r"\bf16\[", traced(False))  # not bf16


@pytest.mark.parametrize("dtype,quant", [(jnp.float32, None), (jnp.bfloat16, KVQuant("int8")),
                                         (jnp.float32, KVQuant("int4")), (jnp.bfloat16, KVQuant("fp8"))])
def test_fused_kernel_evicts_in_place(dtype, quant):
    """StreamingLLM's decode (`kvjax.cache.append_token` then `evict`): the token written into the evicted slot and
    slot `length` cleared, the length unchanged, the evicted token not attended; a head that evicts nothing; a
    head whose token evicts itself (not attended, not kept); the padding row (uncounted: evicts nothing)."""
    rng = np.random.default_rng(8)
    args = layer_case(rng, 3, 4, 40, np.array([[30, 17, 25], [20, 39, 8]]), dtype, quant=quant)
    slot = jnp.asarray([[4, 0, 25], [3, 7, 1]], jnp.int32)  # head (0, 2): its own slot, the token evicts itself
    where = jnp.asarray([[True, False, True], [True, True, True]])
    (got, got_layer), (want, want_layer) = both(args, evict=(slot, where))
    assert_close(got, want, dtype)
    assert float(jnp.abs(got[1]).max()) == 0.0
    assert_layers_match(got_layer, want_layer, dtype)
    assert np.asarray(want_layer.length).tolist() == [[30, 18, 25], [20, 39, 8]]  # evicting heads keep theirs
    assert int(want_layer.pos[0, 0, 4]) == 43 and int(want_layer.pos[0, 0, 30]) == -1
    (kept, _), _ = both(args)  # the same step without the eviction attends the evicted token
    assert float(jnp.abs(kept[0].astype(jnp.float32) - got[0].astype(jnp.float32)).max()) > 1e-3


@pytest.mark.parametrize("ring", [False, True])
def test_fused_kernel_sets_a_never_written_fp8_heads_scale(ring):
    """fp8's per-head scale is 0 until the head's first token (`kvjax.quant.storage.empty`): the kernel sets it from
    that token as `write_token` / `ring_write` do (a power of two leaving `FP8_HEADROOM` of room), keeps a set one,
    and leaves a padding row's never-written head unset (0), as the storage does: a write of no values sets no
    scale (before, both set 1.0, and the head's first real values were coded against it)."""
    dtype, spec = jnp.bfloat16, KVQuant("fp8")
    rng = np.random.default_rng(11)
    if ring:
        args = ring_case(rng, [30, -1], 24, dtype, quant=spec)
    else:
        args = layer_case(rng, 2, 4, 40, np.array([[30, 12], [20, 0]]), dtype, quant=spec)
    q, k_new, v_new, positions, layer = args
    unset = np.zeros((2, 2), bool)
    unset[0, 1] = unset[1, 1] = True  # (0, 1): the token sets it; (1, 1): a padding row
    if ring:
        unset[:] = [[False, False], [True, True]]  # the padding row's heads were never written
    layer = layer.replace(k=layer.k.replace(scale=jnp.where(unset, 0.0, layer.k.scale)),
                          v=layer.v.replace(scale=jnp.where(unset, 0.0, layer.v.scale)))
    if not ring:  # the head whose first token this is holds nothing yet
        layer = layer.replace(pos=layer.pos.at[0, 1].set(-1), length=layer.length.at[0, 1].set(0))
    k_new = k_new * 40.0  # a token far from the earlier ones' range: a scale set from it differs from theirs
    # The query shrunk as much, so the logits stay where one bfloat16 rounding of q moves the output within the
    # tolerance: at 40x they did not (a 1-ulp change of q moved it by 0.07), and the H200's XLA twin, which may skip
    # that rounding (excess precision), missed by 0.03 in run 14 (BENCHMARKS.md) while passing with it off.
    q = (q.astype(jnp.float32) / 40.0).astype(dtype)
    (got, got_layer), (want, want_layer) = both((q, k_new, v_new, positions, layer),
                                                **(dict(sliding_window=24, ring=True) if ring else {}))
    assert_close(got, want, dtype)
    assert_layers_match(got_layer, want_layer, dtype)
    scales = np.asarray(want_layer.k.scale)
    padding = np.zeros((2, 2), bool)
    padding[1, 1] = True
    if ring:
        padding[1] = True
    assert (scales[~padding] > 0).all()
    assert (scales[padding] == 0).all()  # the padding row's heads: no values, no scale
    assert (np.log2(scales[~padding]) == np.round(np.log2(scales[~padding]))).all()  # powers of two


def ring_case(rng, seen, capacity, dtype, quant=None, kv=2, g=4):
    """A sliding-window layer's ring after `seen[b]` tokens of each row (`kvjax.cache.ring_append`: position `p` at
    slot `p % C`, the length capped at C), and the next token at position `seen[b]` (-1: a padding row)."""
    batch = len(seen)
    pos = np.full((batch, kv, capacity), -1)
    for b, n in enumerate(seen):
        for p_ in range(max(n, 0)):
            pos[b, :, p_ % capacity] = p_
    length = np.minimum(np.maximum(seen, 0), capacity)[:, None].repeat(kv, 1)
    stored = pos >= 0
    k = np.where(stored[..., None], rng.standard_normal((batch, kv, capacity, H)), 0)
    v = np.where(stored[..., None], rng.standard_normal((batch, kv, capacity, H)), 0)
    layer = kvc.init(batch, kv, capacity, H, dtype, quant=quant)
    if quant is None:
        layer = layer.replace(k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype))
    else:
        n_ = jnp.asarray(length, jnp.int32)
        layer = layer.replace(k=st.quantize(quant, "k", jnp.asarray(k, jnp.float32), n_, dtype),
                              v=st.quantize(quant, "v", jnp.asarray(v, jnp.float32), n_, dtype))
    layer = layer.replace(pos=jnp.asarray(pos, jnp.int32), length=jnp.asarray(length, jnp.int32))
    q = jnp.asarray(rng.standard_normal((batch, 1, kv * g, H)), dtype)
    k_new = jnp.asarray(rng.standard_normal((batch, 1, kv, H)), dtype)
    v_new = jnp.asarray(rng.standard_normal((batch, 1, kv, H)), dtype)
    positions = jnp.asarray([[n] for n in seen], jnp.int32)
    return q, k_new, v_new, positions, layer


@pytest.mark.parametrize("dtype,quant,window", [(jnp.float32, None, 24), (jnp.bfloat16, None, 17),
                                                (jnp.bfloat16, KVQuant("int8"), 24),
                                                (jnp.float32, KVQuant("int4"), 20),
                                                (jnp.float32, KVQuant("fp8"), 24)])
def test_fused_kernel_sliding_window_ring(dtype, quant, window):
    """A sliding-window layer's ring (Gemma 3's local layers): the token written at slot `position % C` over the
    position that left the window, the length capped at C, a padding row writing nothing; rows wrapped several
    times, full exactly, and not yet full; a capacity that is no block multiple; windows of C and below."""
    seen = [37, 24, 10, 50, -1]  # the last: a padding row
    args = ring_case(np.random.default_rng(9), seen, 24, dtype, quant=quant)
    (got, got_layer), (want, want_layer) = both(args, sliding_window=window, ring=True)
    assert_close(got, want, dtype)
    assert float(jnp.abs(got[4]).max()) == 0.0
    assert_layers_match(got_layer, want_layer, dtype)
    assert np.asarray(want_layer.length)[:, 0].tolist() == [24, 24, 11, 24, 0]
    assert int(want_layer.pos[0, 0, 37 % 24]) == 37 and int(want_layer.pos[2, 0, 10]) == 10


KIVI = dict(group_size=16, residual=16)


@pytest.mark.parametrize("scheme,dtype,window", [("kivi2", jnp.float32, None), ("kivi4", jnp.bfloat16, 20),
                                                 ("kivi2", jnp.bfloat16, None)])
def test_fused_kernel_kivi_cache(scheme, dtype, window):
    """KIVI (keys per channel over groups of 16 slots, values per token, a 16-token full-precision ring): heads
    whose step flushes a group (16 pending + the token: quantized in the kernel, `qlen` moved), heads that do not,
    an empty head and a padding row (not counted: no flush); the whole groups split over the programs, the group
    at `qlen` and the ring read by split 0."""
    spec = KVQuant(scheme, **KIVI)
    lengths = np.array([[32, 40, 16], [47, 0, 33]])  # flush, no flush, flush; padding row: never
    args = layer_case(np.random.default_rng(6), 3, 2, 64, lengths, dtype, quant=spec)
    with tuning.override(gpu_target_programs=3 * 2 * 3):  # three splits over the whole groups
        (got, got_layer), (want, want_layer) = both(args, sliding_window=window)
    assert_close(got, want, dtype)
    assert float(jnp.abs(got[1]).max()) == 0.0
    assert_layers_match(got_layer, want_layer, dtype)
    before, after = np.asarray(args[4].k.qlen), np.asarray(want_layer.k.qlen)
    assert (after[0] == [32, 32, 16]).all() and (before[0] == [16, 32, 0]).all(), (before, after)  # flushes
    assert (after[1] == before[1]).all()


def test_fused_kernel_kivi_misaligned_qlen():
    """A quantized prefix ending inside a group (an op kept `qlen` where it was): the group's codes below it and
    its ring rows from it, read by split 0."""
    spec = KVQuant("kivi2", **KIVI)
    q, k_new, v_new, positions, layer = layer_case(np.random.default_rng(7), 2, 4, 64, np.array([[30, 45], [21, 9]]),
                                                   jnp.float32, quant=spec)
    hint = jnp.asarray([[20, 37], [21, 5]], jnp.int32)  # qlen inside groups [16, 32) and [32, 48)
    x = st.dequantize(layer.k), st.dequantize(layer.v)
    layer = layer.replace(k=st.quantize(spec, "k", x[0], layer.length, jnp.float32, qlen_hint=hint),
                          v=st.quantize(spec, "v", x[1], layer.length, jnp.float32, qlen_hint=hint))
    assert np.asarray(layer.k.qlen).tolist() == [[20, 37], [21, 5]]
    (got, got_layer), (want, want_layer) = both((q, k_new, v_new, positions, layer))
    assert_close(got, want, jnp.float32)
    assert_layers_match(got_layer, want_layer, jnp.float32)


@pytest.mark.parametrize("lengths,hint,flushes", [
    # head 0 flushes its group [32, 64) (two chunks); head 1 attends 38 ring rows (three chunks)
    ([[80, 70, 0], [112, 95, 20]], None, [True, False, False]),
    # prefixes ending inside groups (`qlen` 60, 40, 45): their codes over two chunks or one, then the ring
    ([[75, 70, 50], [60, 33, 9]], [[60, 40, 45], [40, 5, 9]], [False, False, False]),
], ids=["aligned", "inside-a-group"])
def test_fused_kernel_kivi_reads_its_group_and_ring_in_chunks(lengths, hint, flushes):
    """Groups of 32 slots and a ring of 49 rows, which split 0 reads, quantizes and attends `KIVI_CHUNK` (16) rows at
    a time: a group flushed over two chunks (its per-channel key range taken over both), a prefix's codes over
    one or two, the ring's pending rows over up to three."""
    assert gpu_fused_kivi.KIVI_CHUNK == 16
    spec = KVQuant("kivi2", group_size=32, residual=48)
    q, k_new, v_new, positions, layer = layer_case(np.random.default_rng(8), 3, 2, 128, np.array(lengths),
                                                   jnp.float32, quant=spec)
    if hint is not None:
        x = st.dequantize(layer.k), st.dequantize(layer.v)
        hint = jnp.asarray(hint, jnp.int32)
        layer = layer.replace(k=st.quantize(spec, "k", x[0], layer.length, jnp.float32, qlen_hint=hint),
                              v=st.quantize(spec, "v", x[1], layer.length, jnp.float32, qlen_hint=hint))
        assert (np.asarray(layer.k.qlen) == np.asarray(hint)).all()
    with tuning.override(gpu_target_programs=3 * 2 * 3):
        (got, got_layer), (want, want_layer) = both((q, k_new, v_new, positions, layer))
    assert_close(got, want, jnp.float32)
    assert_layers_match(got_layer, want_layer, jnp.float32)
    before, after = np.asarray(layer.k.qlen), np.asarray(want_layer.k.qlen)
    assert ((after[0] != before[0]) == flushes).all() and (after[1] == before[1]).all(), (before, after)


def test_int4_codes_are_the_storages():
    """The kernel's int4 codes, packed bytes, scale and zero of one token are `kvjax.quant.storage`'s (asymmetric
    over the head, planar packing), bit for bit, ties and a constant row (scale 0) included."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, H)).astype(np.float32) * 2
    x[:8, 0], x[:8, 1] = 0.0, 15.0 / 8  # scale = 1/8 exactly: the entries below fall on exact halves
    x[:8, 2:10] = (np.arange(8) + 0.5)[None, :] / 8
    x[8] = 0.75  # a constant row: scale 0
    codes_, packed, scale, zero = jax.jit(jax.vmap(gpu_token_codes.int4_codes))(jnp.asarray(x))
    want_q, want_scale, want_zero = codes.asymmetric(jnp.asarray(x), H, 4)
    np.testing.assert_array_equal(np.asarray(codes_, np.int32), np.asarray(want_q, np.int32))
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(codes.pack(want_q, 4)))
    np.testing.assert_array_equal(np.asarray(scale, np.float32), np.asarray(want_scale[:, 0], np.float32))
    np.testing.assert_array_equal(np.asarray(zero, np.float32), np.asarray(want_zero[:, 0], np.float32))


def test_fused_kernel_gathered_slots():
    """A slot list per head: duplicates, -1 entries, the new token's slot listed (twice) or not at all."""
    rng = np.random.default_rng(2)
    args = layer_case(rng, 2, 4, 40, np.array([[30, 12], [20, 39]]), jnp.float32)
    lengths = np.asarray(args[4].length)
    slots = rng.integers(0, 40, (2, 2, 21)).astype(np.int32)
    slots[..., :3] = slots[..., 3:6]  # duplicates
    slots[0, 0, 7] = slots[0, 0, 9] = lengths[0, 0]  # the new token's slot, listed twice
    slots[0, 1] = np.where(slots[0, 1] == lengths[0, 1], 0, slots[0, 1])  # not listed
    ok = rng.random(slots.shape) > 0.2
    ok[0, 0, [7, 9]] = True
    slots = np.where(rng.random(slots.shape) < 0.1, -1, slots)
    slots[0, 0, [7, 9]] = lengths[0, 0]
    (got, got_layer), (want, want_layer) = both(args, slots=jnp.asarray(slots), slots_ok=jnp.asarray(ok))
    assert_close(got, want, jnp.float32)
    assert_layers_match(got_layer, want_layer, jnp.float32)


def test_int8_codes_round_half_to_even_like_the_storage():
    """The kernel's int8 codes (float32 `1.5 * 2^23` rounding, no `round` in Triton) are the storage's, bit for bit,
    ties included."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, H)).astype(np.float32) * 3
    x[:, 0] = 127.0 / 4  # scale = 1/4 exactly: the other entries fall on exact halves below
    x[:8, 1:9] = (np.arange(8) - 3.5)[None, :] / 4
    got = jax.jit(jax.vmap(gpu_token_codes.int8_codes))(jnp.asarray(x))
    want_codes, want_scale = codes.symmetric(jnp.asarray(x), H)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want_codes))
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want_scale[:, 0], np.float32))


def test_dispatch_and_what_stays_on_xla():
    q, k_new, v_new, positions, layer = layer_case(np.random.default_rng(4), 1, 4, 32, np.array([[5], [6]]),
                                                   jnp.float32)
    inv = jnp.asarray(INV_FREQ, jnp.float32)
    with tuning.use(tuning.default("cpu")):
        assert not fd.uses("auto")  # CPU's tuning leaves it to XLA; the GPU's picks it (run 13)
    with tuning.use(tuning.default("gpu")):
        assert fd.uses("auto")
    with tuning.override(auto_pallas={"decode_append_attention"}):
        assert fd.uses("auto")
    masked = layer.replace(attend=jnp.ones(layer.pos.shape, bool))
    assert "retrieval mask" in fd.kernel_unsupported(masked)
    with pytest.raises(ConfigError, match="retrieval mask"):
        fd.decode_append_attention(q, k_new, v_new, positions, masked, inv_freq=inv, implementation="pallas")
    kivi = kvc.init(2, 1, 32, H, jnp.float32, quant=KVQuant("kivi2", group_size=16, residual=16))
    assert fd.kernel_unsupported(kivi) is None
    assert fd.auto_takes(layer) and not fd.auto_takes(kivi)  # "auto" leaves quantized caches to XLA by default
    with tuning.override(auto_fused_quantized=True):
        assert fd.auto_takes(kivi)
    assert fd.kernel_unsupported(kvc.init(2, 1, 32, H, jnp.float32, quant=KVQuant("fp8"))) is None
    small = kvc.init(2, 1, 32, H, jnp.float32, quant=KVQuant("kivi2", group_size=8, residual=16))
    assert "group_size" in fd.kernel_unsupported(small)
    grouped = kvc.init(2, 1, 32, H, jnp.float32, quant=KVQuant("int4", channel_group=8))
    assert "channel_group" in fd.kernel_unsupported(grouped)
    with pytest.raises(ConfigError, match="one token"):
        fd.decode_append_attention(jnp.concatenate([q, q], axis=1), k_new, v_new, positions, layer, inv_freq=inv)
    with pytest.raises(ConfigError, match="in-place eviction"):
        fd.decode_append_attention(q, k_new, v_new, positions, kvc.init(2, 1, 32, H, jnp.float32,
                                                                        quant=KVQuant("kivi2", group_size=16)),
                                   inv_freq=inv, evict=(jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1), bool)),
                                   implementation="pallas")
    with pytest.raises(ConfigError, match="slots and slots_ok"):
        fd.decode_append_attention(q, k_new, v_new, positions, layer, inv_freq=inv, slots=jnp.zeros((2, 1, 3),
                                                                                                       jnp.int32))
