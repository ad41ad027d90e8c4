"""RMSNorm as one Pallas Triton kernel: one program per row of `[R, D]`.

XLA:GPU compiles a batch-1 decode step's RMSNorm into two launches: its `[1, 1, D]` input reduces to a scalar,
which XLA's Triton normalisation rewrite does not take (it does with 16 rows), so the reduction and the scale
run apart (`benchmarks/gpu_compile.py`). Here each program reads its row once, in float32: `r = rsqrt(mean(x^2) +
eps)`, then Llama's convention `weight * (x r)` rounded to x's dtype first, or Gemma's `(x r (1 + weight))` in
float32 (`plus_one`), as `kvjax.ops.norm.rms_norm_xla`, its reference; with `residual`, that row is added to the
normed one (rounded to its dtype first), as Gemma's post-attention and post-MLP norms feed the residual stream. A
row longer than a power of two is read
with clamped lanes (the repeats weigh 0 in the mean and store the last value again), since Triton loads power-of-two
shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.pallas.gpu_common import compiler_params, interpret_mode, pow2

Array = jax.Array


def weighted(scaled: Array, weight: Array, x_dtype: jnp.dtype, plus_one: bool, dtype: jnp.dtype) -> Array:
    """The norm's weight applied to `scaled = x rsqrt(mean(x^2) + eps)` (float32), in `dtype`: Llama's convention
    (`weight * scaled` rounded to x's dtype first) or Gemma's (`scaled (1 + weight)` in float32). Shared by the
    kernels that fuse an RMSNorm (`gpu_linear`, `gpu_fused_decode`'s QK-norm)."""
    if plus_one:
        return (scaled * (1.0 + weight.astype(jnp.float32))).astype(dtype)
    return (weight * scaled.astype(x_dtype)).astype(dtype)


def norm_dtype(x_dtype: jnp.dtype, weight_dtype: jnp.dtype, plus_one: bool) -> jnp.dtype:
    """The dtype of `rms_norm_xla(x, weight, ...)`: x's in Gemma's convention, promoted with the weight's in Llama's."""
    return jnp.dtype(x_dtype) if plus_one else jnp.promote_types(weight_dtype, x_dtype)


def _kernel(x_ref: Array, w_ref: Array, *refs: Array, width: int, lanes: int, eps: float, plus_one: bool,
            normed_dtype: jnp.dtype | None) -> None:
    r_ref, o_ref = refs if normed_dtype is not None else (None, refs[0])
    lane = jnp.arange(lanes, dtype=jnp.int32)
    idx = jnp.minimum(lane, width - 1)
    x = x_ref[idx]
    xf = x.astype(jnp.float32)
    live = (lane < width).astype(jnp.float32)
    scaled = xf * jax.lax.rsqrt(jnp.sum(xf * xf * live) / width + eps)
    if r_ref is None:
        o_ref[idx] = weighted(scaled, w_ref[idx], x.dtype, plus_one, o_ref.dtype)
        return
    normed = weighted(scaled, w_ref[idx], x.dtype, plus_one, normed_dtype)  # as the XLA norm returns it
    o_ref[idx] = (r_ref[idx].astype(jnp.float32) + normed.astype(jnp.float32)).astype(o_ref.dtype)


def rms_norm(x: Array, weight: Array, eps: float, plus_one: bool = False, *, residual: Array | None = None,
             num_warps: int | None = None, interpret: bool | None = None) -> Array:
    """RMSNorm of the rows of `x` `[R, D]` with `weight` `[D]`: `kvjax.ops.norm.rms_norm_xla`'s result, its dtype
    included (Llama's convention promotes `weight * x`; Gemma's returns x's dtype); with `residual` `[R, D]`,
    `residual + rms_norm_xla(...)` in their promoted dtype. `num_warps` defaults to the current tuning's
    `gpu_num_warps`."""
    rows, width = x.shape
    normed = norm_dtype(x.dtype, weight.dtype, plus_one)
    dtype = normed if residual is None else jnp.promote_types(residual.dtype, normed)
    kernel = functools.partial(_kernel, width=width, lanes=pow2(width), eps=float(eps), plus_one=plus_one,
                               normed_dtype=None if residual is None else normed)
    row = pl.BlockSpec((None, width), lambda i: (i, 0))
    in_specs, operands = [row, pl.BlockSpec((width,), lambda i: (0,))], [x, weight]
    if residual is not None:
        in_specs.append(row)
        operands.append(residual)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows, width), dtype), grid=(rows,), in_specs=in_specs,
        out_specs=row, compiler_params=compiler_params(num_warps, 1), interpret=interpret_mode(interpret),
        name="kvjax_gpu_rms_norm",
    )(*operands)
