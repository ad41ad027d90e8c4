"""RMSNorm over the last axis, the one every decoder block of kvjax runs (`kvjax.models.block.norm`).

The XLA path (`rms_norm_xla`, and "auto" wherever the tuning does not pick the kernel): statistics in float32, then
Llama's convention (cast back, then scale by `weight`) or Gemma's (`plus_one`: scale by `1 + weight` in float32,
then cast back). `implementation="pallas"` runs one Triton kernel over the rows (`kvjax.pallas.gpu_norm`: compiled
on a GPU, interpreted elsewhere; per shard under a mesh), where XLA:GPU compiles a batch-1 decode step's norm into
two launches. "auto" picks it only where the current tuning's `auto_pallas` lists `rms_norm` (the GPU's default
since the H200 run 13, with the fused decode kernel: `kvjax.tuning`), and only for a decode's rows (at most
`AUTO_MAX_ROWS`, as the weight products' kernel): a prefill's thousands of rows are one launch of XLA's own
normalization already, so the kernel saves nothing there and the prefill stays as it was.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvjax.ops._impl import resolve
from kvjax.ops._shard import per_shard

Array = jax.Array

OP = "rms_norm"

#: The most rows "auto" hands the kernel (a decode step's batch; `kvjax.pallas.gpu_linear.MAX_ROWS` alike).
AUTO_MAX_ROWS = 64


def rms_norm_xla(x: Array, weight: Array, eps: float, plus_one: bool = False) -> Array:
    """RMSNorm of `x` over its last axis with statistics in float32 (the reference)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def rms_norm(x: Array, weight: Array, eps: float, plus_one: bool = False, *, residual: Array | None = None,
             implementation: str = "auto") -> Array:
    """RMSNorm of `x` `[B, ..., D]` over its last axis with `weight` `[D]` (see the module docstring); with
    `residual` (x's shape), `residual + ` that norm (Gemma's post-norms, which feed the residual stream: one kernel
    for both)."""
    prefill_rows = math.prod(x.shape[:-1]) > AUTO_MAX_ROWS
    if resolve(OP, implementation) != "pallas" or (implementation == "auto" and prefill_rows):
        out = rms_norm_xla(x, weight, eps, plus_one)
        return out if residual is None else residual + out
    from kvjax.pallas import gpu_norm

    rows = x.reshape(-1, x.shape[-1])
    if residual is None:
        out = per_shard(lambda r, w: gpu_norm.rms_norm(r, w, eps, plus_one), (rows, weight), ("b.", None), "b.",
                        batch=rows.shape[0], heads=1)
    else:
        out = per_shard(lambda r, w, s: gpu_norm.rms_norm(r, w, eps, plus_one, residual=s),
                        (rows, weight, residual.reshape(rows.shape)), ("b.", None, "b."), "b.",
                        batch=rows.shape[0], heads=1)
    return out.reshape(x.shape)
