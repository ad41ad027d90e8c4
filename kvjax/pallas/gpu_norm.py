"""RMSNorm as one Pallas Triton kernel: one program per row of `[R, D]`.

XLA:GPU compiles a batch-1 decode step's RMSNorm into two launches: its `[1, 1, D]` input reduces to a scalar,
which XLA's Triton normalisation rewrite does not take (it does with 16 rows), so the reduction and the scale
run apart (`benchmarks/gpu_compile.py`). Here each program reads its row once, in float32: `r = rsqrt(mean(x^2) +
eps)`, then Llama's convention `weight * (x r)` rounded to x's dtype first, or Gemma's `(x r (1 + weight))` in
float32 (`plus_one`), as `kvjax.ops.norm.rms_norm_xla`, its reference. A row longer than a power of two is read
with clamped lanes (the repeats weigh 0 in the mean and store the last value again), since Triton loads power-of-two
shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.pallas.gpu_attention import _params, _pow2, interpret_mode

Array = jax.Array


def _kernel(x_ref: Array, w_ref: Array, o_ref: Array, *, width: int, lanes: int, eps: float,
            plus_one: bool) -> None:
    lane = jnp.arange(lanes, dtype=jnp.int32)
    idx = jnp.minimum(lane, width - 1)
    x = x_ref[idx]
    xf = x.astype(jnp.float32)
    live = (lane < width).astype(jnp.float32)
    scaled = xf * jax.lax.rsqrt(jnp.sum(xf * xf * live) / width + eps)
    w = w_ref[idx]
    if plus_one:
        o_ref[idx] = (scaled * (1.0 + w.astype(jnp.float32))).astype(o_ref.dtype)
    else:
        o_ref[idx] = (w * scaled.astype(x.dtype)).astype(o_ref.dtype)


def rms_norm(x: Array, weight: Array, eps: float, plus_one: bool = False, *, num_warps: int | None = None,
             interpret: bool | None = None) -> Array:
    """RMSNorm of the rows of `x` `[R, D]` with `weight` `[D]`: `kvjax.ops.norm.rms_norm_xla`'s result, its dtype
    included (Llama's convention promotes `weight * x`; Gemma's returns x's dtype). `num_warps` defaults to the
    current tuning's `gpu_num_warps`."""
    rows, width = x.shape
    dtype = x.dtype if plus_one else jnp.result_type(weight.dtype, x.dtype)
    kernel = functools.partial(_kernel, width=width, lanes=_pow2(width), eps=float(eps), plus_one=plus_one)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows, width), dtype), grid=(rows,),
        in_specs=[pl.BlockSpec((None, width), lambda i: (i, 0)), pl.BlockSpec((width,), lambda i: (0,))],
        out_specs=pl.BlockSpec((None, width), lambda i: (i, 0)), compiler_params=_params(num_warps, 1),
        interpret=interpret_mode(interpret), name="kvjax_gpu_rms_norm",
    )(x, weight)
