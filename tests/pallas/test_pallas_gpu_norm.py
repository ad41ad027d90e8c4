"""The RMSNorm Triton kernel (`kvjax.pallas.gpu_norm`) against its XLA reference (`kvjax.ops.norm.rms_norm_xla`):
compiled on a GPU backend, in interpret mode elsewhere (CI). Rows of power-of-two and other widths (the clamped
lanes), Llama's and Gemma's conventions, bf16 and f32, a float32 weight with bf16 states (the promoted result
dtype), the residual added after Gemma's post-norms, and the op's dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import assert_close

from kvjax import tuning
from kvjax.ops import norm as ops
from kvjax.pallas import gpu_norm

INTERPRET = None if jax.default_backend() == "gpu" else True


@pytest.mark.parametrize("rows,width", [(1, 4096), (3, 64), (2, 3584), (5, 100)])
@pytest.mark.parametrize("x_dtype,w_dtype,plus_one", [(jnp.bfloat16, jnp.bfloat16, False),
                                                      (jnp.float32, jnp.float32, False),
                                                      (jnp.bfloat16, jnp.float32, False),
                                                      (jnp.bfloat16, jnp.bfloat16, True)])
def test_kernel_equals_the_xla_norm(rows, width, x_dtype, w_dtype, plus_one):
    rng = np.random.default_rng(rows * width)
    x = jnp.asarray(rng.standard_normal((rows, width)) * 3, x_dtype)
    w = jnp.asarray(rng.standard_normal(width), w_dtype)
    want = ops.rms_norm_xla(x, w, 1e-6, plus_one)
    got = gpu_norm.rms_norm(x, w, 1e-6, plus_one, interpret=INTERPRET)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, jnp.bfloat16 if want.dtype == jnp.bfloat16 else jnp.float32)


@pytest.mark.parametrize("rows,width,dtype,plus_one", [(1, 3840, jnp.bfloat16, True), (3, 64, jnp.float32, True),
                                                     (2, 100, jnp.bfloat16, False)])
def test_kernel_adds_the_residual_as_the_post_norms_do(rows, width, dtype, plus_one):
    """Gemma's post-attention / post-MLP norm feeding the residual stream, `residual + rms_norm_xla(x)`: the normed
    row rounded to its dtype, then added, in one kernel; through the op too (reshaped rows, its XLA path)."""
    rng = np.random.default_rng(width)
    x = jnp.asarray(rng.standard_normal((rows, width)) * 3, dtype)
    residual = jnp.asarray(rng.standard_normal((rows, width)) * 20, dtype)
    w = jnp.asarray(rng.standard_normal(width), dtype)
    want = residual + ops.rms_norm_xla(x, w, 1e-6, plus_one)
    got = gpu_norm.rms_norm(x, w, 1e-6, plus_one, residual=residual, interpret=INTERPRET)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, dtype)
    plain = gpu_norm.rms_norm(x, w, 1e-6, plus_one, interpret=INTERPRET)
    assert float(jnp.abs(got.astype(jnp.float32) - plain.astype(jnp.float32)).max()) > 1.0  # the residual is in
    with tuning.override(auto_pallas=tuning.current().auto_pallas | {ops.OP}):
        op = ops.rms_norm(x.reshape(1, rows, width), w, 1e-6, plus_one, residual=residual.reshape(1, rows, width))
    assert_close(op[0], want, dtype)
    xla = ops.rms_norm(x, w, 1e-6, plus_one, residual=residual, implementation="xla")
    np.testing.assert_array_equal(np.asarray(xla, np.float32), np.asarray(want, np.float32))  # the block's expression


def test_op_dispatch_keeps_xla_unless_the_tuning_lists_it():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 64)), jnp.float32)
    w = jnp.ones((64,), jnp.float32)
    calls = []
    kernel = gpu_norm.rms_norm
    try:
        gpu_norm.rms_norm = lambda *a, **kw: calls.append(1) or kernel(*a, interpret=INTERPRET, **kw)
        with tuning.use(tuning.default("cpu")):
            ops.rms_norm(x, w, 1e-5)
        assert not calls  # "auto" on CPU's defaults: XLA (the GPU's list the kernel since run 13)
        with tuning.override(auto_pallas=tuning.current().auto_pallas | {ops.OP}):
            got = ops.rms_norm(x, w, 1e-5)
        assert calls == [1] and got.shape == x.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(ops.rms_norm_xla(x, w, 1e-5)), rtol=1e-6, atol=1e-6)
        # A prefill's rows (more than a decode batch) keep XLA's norm under "auto"; "pallas" still runs the kernel.
        rows = jnp.asarray(np.random.default_rng(1).standard_normal((1, ops.AUTO_MAX_ROWS + 1, 64)), jnp.float32)
        with tuning.override(auto_pallas=tuning.current().auto_pallas | {ops.OP}):
            ops.rms_norm(rows[:, :-1], w, 1e-5)
            assert calls == [1, 1]
            got = ops.rms_norm(rows, w, 1e-5)
        assert calls == [1, 1]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ops.rms_norm_xla(rows, w, 1e-5)))
        ops.rms_norm(rows, w, 1e-5, implementation="pallas")
        assert calls == [1, 1, 1]
    finally:
        gpu_norm.rms_norm = kernel
