"""Every dot inside the GPU kernels contracts at least 16 values, the least Triton's `tt.dot` takes.

Run 13 (H200) compiled the quantized kernels' bfloat16 dots over an 8-channel int4 plane (head_dim 16) as an
m16n8k16 MMA that counted each channel twice: every logit doubled (KIVI-2's 4-channel planes: 4x). Those outputs are
reproduced bit for bit here in interpret mode by scaling the short dots' logits by 16 / D (test below), and the
kernels now sum a short contraction as a broadcast product instead. The check walks each kernel's jaxpr (the
same on every backend), so it holds on the CPU for what Triton would be given on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Jaxpr
from test_pallas_gpu_fused_decode import INV_FREQ, KIVI, both, layer_case
from test_pallas_gpu_quantized import SCHEMES, _case

from kvjax import tuning
from kvjax.ops import fused_decode as fd
from kvjax.pallas import gpu_attention, gpu_common, gpu_fused_kivi, gpu_quantized
from kvjax.quant import KVQuant

TRITON_MIN_K = 16  # Triton's frontend asserts K >= 16 for 16- and 32-bit dots (gpu_common.MIN_DOT_K)


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside its equations (loops, branches, calls, kernels)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, Jaxpr):
                    yield from _eqns(inner)


def _kernel_contractions(fn, *args) -> list[int]:
    """The contraction length of every `dot_general` inside a `pallas_call` of `fn(*args)`."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    sizes, kernels = [], 0
    for eqn in _eqns(jaxpr):
        if eqn.primitive.name != "pallas_call":
            continue
        kernels += 1
        for inner in _eqns(eqn.params["jaxpr"]):
            if inner.primitive.name == "dot_general":
                (contract, _), _ = inner.params["dimension_numbers"]
                sizes.append(int(np.prod([inner.invars[0].aval.shape[d] for d in contract])))
    assert kernels, "no Pallas kernel traced"
    return sizes


@pytest.mark.parametrize("scheme", ["int4", "kivi2", "kivi4", "int8"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fused_kernel_dots_contract_16_or_more(scheme, dtype):
    spec = KVQuant(scheme, **(KIVI if scheme.startswith("kivi") else {}))
    lengths = np.array([[32, 40, 16], [47, 0, 33]]) if spec.kivi else np.array([[40, 9], [47, 0]])
    args = layer_case(np.random.default_rng(1), lengths.shape[1], 2, 64, lengths, dtype, quant=spec)

    def run(q, k, v, positions, layer):
        with tuning.override(gpu_decode_block_k=16, gpu_quantized_block_k=16):
            return fd.decode_append_attention(q, k, v, positions, layer, implementation="pallas",
                                              inv_freq=jnp.asarray(INV_FREQ, jnp.float32))

    sizes = _kernel_contractions(run, *args)
    assert sizes and min(sizes) >= TRITON_MIN_K, sizes


@pytest.mark.parametrize("scheme", ["int4", "kivi2", "kivi4"])
def test_quantized_kernel_dots_contract_16_or_more(scheme):
    args = _case(np.random.default_rng(0), SCHEMES[scheme], 2, 4, jnp.bfloat16, 128)
    sizes = _kernel_contractions(
        lambda *a: gpu_quantized.decode_attention(*a, block_k=16, num_splits=2, interpret=True), *args)
    assert sizes and min(sizes) >= TRITON_MIN_K, sizes


def test_dense_kernel_dots_contract_16_or_more_at_head_dim_8():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 8, 8)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 2, 64, 8)), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (1, 2, 64))
    args = (q, jnp.asarray([70], jnp.int32), k, k, pos, jnp.ones((1, 2, 64), bool))
    sizes = _kernel_contractions(lambda *a: gpu_attention.decode_attention(*a, interpret=True), *args)
    assert sizes and min(sizes) >= TRITON_MIN_K, sizes
    got = gpu_attention.decode_attention(*args, interpret=True)
    s = np.einsum("bkgh,bksh->bkgs", np.asarray(q, np.float64).reshape(1, 2, 4, 8) / np.sqrt(8),
                  np.asarray(k, np.float64))
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bkgs,bksh->bkgh", p / p.sum(-1, keepdims=True), np.asarray(k, np.float64)).reshape(1, 8, 8)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("contract_b", [0, 1])
@pytest.mark.parametrize("d", [4, 8, 16])
def test_short_dot_equals_the_float64_product(contract_b, d):
    rng = np.random.default_rng(d)
    a = jnp.asarray(rng.standard_normal((16, d)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((32, d) if contract_b else (d, 32)), jnp.bfloat16)
    got = gpu_common.dot(a, b, contract_b)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    want = a64 @ (b64.T if contract_b else b64)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)  # bf16 products are exact in f32


def test_run_13s_int4_outputs_are_the_doubled_logits(monkeypatch, fresh_kernel_traces):
    """The H200's int4 / bfloat16 output of `test_fused_kernel_quantized_cache[int4-bfloat16]` (run 13's log, its
    first entries) is what the kernel gives with every short dot's logits scaled by 16 / D: the diagnosis above.
    Run 13's kernel read int4 codes a byte at a time (`gpu_int4_pairs=False`: two planes of 8 channels here)."""
    short = gpu_common.dot

    def replicated(a, b, contract_b):  # Triton's m16n8k16 MMA on a D < 16 contraction, as the H200 ran it
        out = short(a, b, contract_b)
        return out * (TRITON_MIN_K / a.shape[1]) if a.shape[1] < TRITON_MIN_K else out

    monkeypatch.setattr(gpu_quantized, "dot", replicated)
    monkeypatch.setattr(gpu_fused_kivi, "dot", replicated)
    args = layer_case(np.random.default_rng(1), 2, 4, 48, np.array([[40, 9], [47, 0]]), jnp.bfloat16,
                      quant=KVQuant("int4"))
    (got, _), (want, _) = both(args, tune=dict(gpu_int4_pairs=False))
    h200 = [0.00823974609375, -0.08349609375, -0.0859375, -0.271484375, -0.2373046875]  # run13_log.txt
    np.testing.assert_allclose(np.asarray(got, np.float32)[0, 0, 0, :5], h200, rtol=0, atol=4e-3)  # bf16 ulps
    assert np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max() > 0.1
