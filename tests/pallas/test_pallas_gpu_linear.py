"""The weight-product Triton kernel (`kvjax.pallas.gpu_linear`) against its XLA reference (`kvjax.ops.linear.
linear_xla`: `kvjax.ops.norm.rms_norm`, `jnp.einsum`, `residual + out`): compiled on a GPU backend, in interpret mode
elsewhere (CI). One row (the multiply-and-sum path) and 2 to 64 (the dot path, rows padded), several tiles per row of
`w` and per program, the fused norm in both conventions, the residual, bf16 and f32; the op's dispatch and where it
keeps XLA; the decoder block with it gives the XLA decode's tokens."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import assert_close
from tiny import random_prompts, tiny_gemma3, tiny_model

import kvjax
from kvjax import tuning
from kvjax.errors import ConfigError
from kvjax.ops import _shard
from kvjax.ops import fused_decode as fd
from kvjax.ops import linear as ops
from kvjax.ops import norm as norm_ops
from kvjax.pallas import gpu_linear

gen = importlib.import_module("kvjax.runtime.generate")
INTERPRET = None if jax.default_backend() == "gpu" else True


def _case(rows, depth, width, dtype, norm, residual, seed=0):
    rng = np.random.default_rng(seed + rows * depth + width)
    x = jnp.asarray(rng.standard_normal((rows, depth)) * 2, dtype)
    w = jnp.asarray(rng.standard_normal((depth, width)) / np.sqrt(depth), dtype)
    nw = jnp.asarray(rng.standard_normal(depth), dtype) if norm else None
    r = jnp.asarray(rng.standard_normal((rows, width)), dtype) if residual else None
    return x, w, nw, r


@pytest.mark.parametrize("rows,depth,width,block_n,block_k", [
    (1, 512, 96, 32, 128),     # several tiles per row of w (4) and per program; 3 programs
    (1, 4096, 64, 16, 256),    # a model's hidden width: 16 tiles
    (3, 192, 48, 16, 64),      # rows padded to 16; a depth of 3 tiles
    (16, 256, 128, 64, 32),
    (40, 64, 32, 32, 256),     # rows padded to 64; the tile shrinks to the depth
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("norm,plus_one,residual,bias", [(False, False, False, False), (True, False, True, False),
                                                         (True, True, False, True), (False, False, True, True)])
def test_kernel_equals_the_xla_product(rows, depth, width, block_n, block_k, dtype, norm, plus_one, residual, bias):
    x, w, nw, r = _case(rows, depth, width, dtype, norm, residual)
    b = jnp.asarray(np.random.default_rng(width).standard_normal(width), dtype) if bias else None
    want = ops.linear_xla(x, w, "td,dn->tn", norm_weight=nw, eps=1e-6, plus_one=plus_one, bias=b, residual=r)
    got = gpu_linear.linear(x, w, norm_weight=nw, eps=1e-6, plus_one=plus_one, bias=b, residual=r, block_n=block_n,
                            block_k=block_k, interpret=INTERPRET)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, jnp.dtype(dtype).type)


@pytest.mark.parametrize("rows", [1, 5])
def test_float32_product_of_bf16_operands_as_the_lm_head(rows):
    """`out_dtype=float32` (the LM head's logits, `preferred_element_type` in the reference): the float32 accumulator
    stored as it is, not rounded to bf16 first, with the final norm fused."""
    x, w, nw, _ = _case(rows, 256, 96, jnp.bfloat16, True, False)
    want = ops.linear_xla(x, w, "td,dn->tn", norm_weight=nw, preferred_element_type=jnp.float32)
    got = gpu_linear.linear(x, w, norm_weight=nw, out_dtype=jnp.float32, block_n=32, block_k=64, interpret=INTERPRET)
    assert got.dtype == want.dtype == jnp.float32
    # One row multiplies elementwise; interpreted by XLA:CPU, which drops the bf16 rounding of an elementwise chain
    # (the normed chunk stays float32), it is within bf16's tolerance there. The dot path keeps float32's.
    on_cpu_one_row = rows == 1 and jax.default_backend() != "gpu"
    assert_close(got, want, jnp.bfloat16 if on_cpu_one_row else jnp.float32)
    values = np.asarray(got)
    assert not np.array_equal(values, np.asarray(got.astype(jnp.bfloat16), np.float32))  # not rounded to bf16


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype,plus_one", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_transposed_weight_as_a_tied_lm_head(rows, dtype, plus_one):
    """`transposed`: `w` stored `[N, D]` (the embedding table of a tied head), read a block of whole rows per
    program: the product with the untransposed matrix, float32 logits, the final norm fused (both conventions)."""
    x, w, nw, _ = _case(rows, 256, 96, dtype, True, False, seed=3)
    table = w.T
    want = ops.linear_xla(x, w, "td,dn->tn", norm_weight=nw, plus_one=plus_one, preferred_element_type=jnp.float32)
    got = gpu_linear.linear(x, table, norm_weight=nw, plus_one=plus_one, out_dtype=jnp.float32, transposed=True,
                            block_n=32, block_k=64, interpret=INTERPRET)
    assert got.shape == want.shape and got.dtype == jnp.float32
    on_cpu_one_row = rows == 1 and dtype == jnp.bfloat16 and jax.default_backend() != "gpu"  # as above
    assert_close(got, want, jnp.bfloat16 if on_cpu_one_row else jnp.float32)
    op = ops.tied_logits(x, table, norm_weight=nw, plus_one=plus_one)  # "auto" off the tuning: XLA's einsum
    assert_close(op, want, jnp.float32)
    with pytest.raises(ConfigError, match="w has 96 columns"):
        gpu_linear.linear(x, w, transposed=True, interpret=INTERPRET)


def test_promoted_dtypes_follow_the_reference():
    """A float32 norm weight over bf16 states promotes the normed input (Llama's convention), and a float32
    residual the sum, as in the XLA sequence."""
    x, w, _, _ = _case(2, 64, 32, jnp.bfloat16, False, False)
    nw = jnp.linspace(0.5, 1.5, 64, dtype=jnp.float32)
    r = jnp.ones((2, 32), jnp.float32)
    want = ops.linear_xla(x, w, "td,dn->tn", norm_weight=nw, residual=r)
    got = gpu_linear.linear(x, w, norm_weight=nw, residual=r, interpret=INTERPRET)
    assert got.dtype == want.dtype == jnp.float32
    assert_close(got, want, jnp.bfloat16)


@pytest.mark.parametrize("shape_x,shape_w,why", [((65, 64), (64, 32), "1 to 64 rows"), ((1, 100), (100, 32), "16"),
                                                 ((1, 64), (64, 40), "16"), ((1, 64), (32, 32), "rows")])
def test_kernel_names_what_it_does_not_take(shape_x, shape_w, why):
    with pytest.raises(ConfigError, match=why):
        gpu_linear.linear(jnp.ones(shape_x), jnp.ones(shape_w), interpret=True)


def test_specs_contracting_anything_but_leading_axes_are_refused():
    assert ops.contracted("btd,dkgh->btkgh") == 1 and ops.contracted("btnh,nhd->btd") == 2
    for spec in ("btnh,hnd->btd", "btd,kd->btk", "btd,df->bft"):
        with pytest.raises(ConfigError, match="trailing axes"):
            ops.contracted(spec)
    with pytest.raises(ConfigError, match="one contracted axis"):
        ops.linear(jnp.ones((1, 1, 2, 16)), jnp.ones((2, 16, 32)), "btnh,nhd->btd", norm_weight=jnp.ones(16))


def test_op_runs_the_kernel_only_where_listed_and_it_applies(monkeypatch):
    calls = []
    kernel = gpu_linear.linear
    monkeypatch.setattr(gpu_linear, "linear", lambda *a, **kw: calls.append(a[0].shape) or kernel(
        *a, interpret=INTERPRET, **kw))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 1, 4, 16)), jnp.float32)
    o = jnp.asarray(np.random.default_rng(2).standard_normal((4, 16, 32)), jnp.float32)
    r = jnp.ones((2, 1, 32), jnp.float32)
    want = ops.linear_xla(x, o, "btnh,nhd->btd", residual=r)
    ops.linear(x, o, "btnh,nhd->btd", residual=r)
    assert not calls  # "auto" on every backend's defaults: XLA
    with tuning.override(auto_pallas=tuning.current().auto_pallas | {ops.OP}):
        got = ops.linear(x, o, "btnh,nhd->btd", residual=r)
        assert calls == [(2, 64)]  # [B * T, N * H] rows
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        ops.linear(jnp.ones((1, 65, 64)), jnp.ones((64, 32)), "btd,dn->btn")  # prefill rows: XLA's GEMM
        ops.linear(jnp.ones((1, 1, 100)), jnp.ones((100, 32)), "btd,dn->btn")  # a depth off the tile: XLA
        mesh = type("Mesh", (), {"size": 8})()
        with _shard.kernel_mesh(mesh):  # a mesh: XLA's partitioner (row-parallel products all-reduce first)
            ops.linear(x, o, "btnh,nhd->btd", residual=r)
        assert calls == [(2, 64)]


@pytest.mark.parametrize("model_fn", [
    lambda: tiny_model(),
    lambda: tiny_model(dtype=jnp.bfloat16, qkv_bias=True, o_bias=True, mlp_bias=True),
    lambda: tiny_gemma3(window=8),
    lambda: tiny_gemma3(window=8, tie_word_embeddings=True),
], ids=["llama", "biases-bf16", "gemma3", "gemma3-tied"])
@pytest.mark.parametrize("fused_attention", [False, True], ids=["xla-attention", "fused-attention"])
def test_decode_with_the_linear_kernel_equals_the_xla_decode(model_fn, fused_attention, monkeypatch):
    """Every weight product of the decode step on the kernel (norms, the activation product and residual adds fused
    where the family allows: Gemma's post-norms keep the add apart; biases inside) gives the XLA decode's greedy tokens,
    beside XLA's attention or the fused decode kernel (which then reads the q|k|v projection as it is)."""
    model = model_fn()
    state = kvjax.prefill(model, random_prompts(3, (11, 17)), method="full", max_new_tokens=5)
    copy = lambda s: dataclasses.replace(s, cache=jax.tree.map(jnp.copy, s.cache))  # noqa: E731  (decode donates)
    # The XLA decode and the variants from a base without the kernels under test: the GPU's defaults list the fused
    # decode and norm kernels (run 13), with which "xla-attention" and "fused-attention" would be one program.
    base = tuning.current().auto_pallas - {ops.OP, fd.OP, norm_ops.OP}
    with tuning.override(auto_pallas=base):
        want = gen.decode(model, copy(state), max_new_tokens=5, stop_at_eos=False)
    calls = []
    kernel = gpu_linear.linear
    monkeypatch.setattr(gpu_linear, "linear", lambda *a, **kw: calls.append(
        tuple(kw.get(name) is not None for name in ("norm_weight", "gated", "residual", "bias"))
        + (kw.get("transposed", False),)) or kernel(*a, **kw))
    chosen = {ops.OP} | ({fd.OP} if fused_attention else set())
    with tuning.override(auto_pallas=base | chosen):
        got = gen.decode(model, copy(state), max_new_tokens=5, stop_at_eos=False)
    layers = model.config.num_layers
    assert len(calls) == 4 * layers + 1, calls  # qkv, o, gate_up, down per layer and the LM head, traced once
    # The head, with the final norm; a tied one reads the embedding table as it lies.
    assert calls[-1] == (True, False, False, False, model.config.tie_word_embeddings)
    norms, gated, residuals, biases, _ = (sum(fused) for fused in zip(*calls[:-1], strict=True))
    assert norms == 2 * layers and gated == layers  # the two norms and the activation product fused
    # The residual adds fuse where nothing comes between the product and the add (Gemma's post-norms do); the
    # biases are added inside.
    assert residuals == (0 if "post_attn_norm" in model.weights()["layers"][0] else 2 * layers)
    assert biases == (4 * layers if "o_bias" in model.weights()["layers"][0] else 0)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


@pytest.mark.parametrize("rows,depth,width", [(1, 256, 64), (2, 96, 32), (16, 512, 48)])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gated_kernel_equals_the_xla_activation_product(rows, depth, width, activation, dtype):
    """The MLP's down product with `act(gate) * up` computed per chunk in the kernel, and its residual."""
    rng = np.random.default_rng(rows + depth)
    gate_up = jnp.asarray(rng.standard_normal((rows, 2, depth)) * 2, dtype)
    w = jnp.asarray(rng.standard_normal((depth, width)) / np.sqrt(depth), dtype)
    r = jnp.asarray(rng.standard_normal((rows, width)), dtype)
    want = ops.linear_xla(gate_up, w, "tf,fd->td", gated=activation, residual=r)
    got = gpu_linear.linear(gate_up, w, gated=activation, residual=r, block_k=64, interpret=INTERPRET)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, jnp.dtype(dtype).type)


def test_gated_inputs_are_checked():
    with pytest.raises(ConfigError, match="gated"):
        gpu_linear.linear(jnp.ones((1, 3, 64)), jnp.ones((64, 32)), gated="silu", interpret=True)
    with pytest.raises(ConfigError, match="gated"):
        ops.linear(jnp.ones((1, 1, 2, 64)), jnp.ones((64, 32)), "btf,fd->btd", gated="relu")
