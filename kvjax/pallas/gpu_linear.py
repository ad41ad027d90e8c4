"""A weight product at decode's row counts as one Pallas Triton kernel: `x [M, D] @ w [D, N]`, M <= 64, with the
RMSNorm or the MLP's gated activation before it and the bias and residual adds after it optionally fused in.

At batch-1 decode every weight product is a GEMV that streams its matrix once; XLA:GPU runs it as a split-K Triton
GEMM fusion whose partial sums a second launch reduces (with the residual add or the activation product fused into
that reduction), and the RMSNorm before it as one or two launches more (`benchmarks/gpu_compile.py`). This kernel
is the candidate of issue 57's item 5: one program per `block_n` output columns walks the `D` axis in `block_k`
rows of `w`, so the matrix is read once and no partial sums leave the kernel.

* **Rows.** One row (batch-1 decode) multiplies each `[block_k, block_n]` tile in float32 into a `[block_k,
  block_n]` accumulator, summed over its rows once after the loop (Triton's dots need 16 rows; no cross-thread
  reduction per tile); 2 to 64 rows are a tensor-core dot per tile, the rows padded to a power of two of at least 16.
* **Norm** (`norm_weight`): each program computes its rows' `rsqrt(mean(x^2) + eps)` in a first pass over `x`
  (`D` values a row, a few KB), then normalises each chunk as it multiplies it, in Llama's convention (`weight *
  (x r)` rounded to x's dtype) or Gemma's (`(x r (1 + weight))` in float32, `plus_one`): the chunk equals
  `kvjax.ops.norm.rms_norm_xla`'s.
* **Gated activation** (`gated`): `x` is the MLP's gate|up `[M, 2, D]` and the product's input `act(gate) * up`, each
  chunk computed as it is multiplied (SiLU or GELU-tanh in float32, each step rounded to x's dtype as XLA's ops).
* **Bias, residual**: the product rounded to its dtype, then `bias` added in float32 and rounded, then `residual`
  likewise, as the decoder block's `out + bias` and `x + out`.
* **Tied LM head** (`transposed`): `w` is the embedding table `[N, D]`, each program reading `block_n` whole rows
  of it; `out_dtype=float32` gives the logits unrounded.

Accumulation is float32 (bf16 / f16 tiles go to the tensor cores as they are; float32 at the highest precision).
`D` must be a multiple of 16 and `N` of 16 (every model kvjax serves); `block_k` / `block_n` shrink to the largest
power of two dividing them. `kvjax.ops.linear.linear_xla` is the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax import tuning
from kvjax.errors import ConfigError
from kvjax.pallas._common import HIGHEST
from kvjax.pallas.gpu_common import compiler_params, interpret_mode, pow2
from kvjax.pallas.gpu_norm import norm_dtype, weighted

Array = jax.Array

#: Most rows the kernel takes: beyond, a product is a GEMM (prefill), XLA's.
MAX_ROWS = 64


def _divisor_block(extent: int, block: int) -> int:
    """The largest power of two <= `block` dividing `extent` (0 when even 16 does not)."""
    block = 1 << (max(block, 1).bit_length() - 1)
    while block >= 16 and extent % block:
        block //= 2
    return block if block >= 16 else 0


def supported(rows: int, depth: int, width: int) -> bool:
    """Whether the kernel takes `x [rows, depth] @ w [depth, width]`."""
    return 1 <= rows <= MAX_ROWS and depth % 16 == 0 and width % 16 == 0


def _activation(name: str, x: Array) -> Array:
    """`name`'s activation of float32 `x` (`kvjax.ops.linear.ACTIVATIONS`' formulas, in operations Triton lowers)."""
    if name == "silu":
        return x / (1.0 + jnp.exp(-x))
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * (x * x * x))))


def _kernel(*refs: Array, vector: bool, depth: int, block_k: int, has_norm: bool, has_bias: bool,
            has_residual: bool, eps: float, plus_one: bool, h_dtype: jnp.dtype, product_dtype: jnp.dtype,
            gated: str | None, transposed: bool) -> None:
    refs = list(refs)
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    nw_ref = refs.pop(0) if has_norm else None
    b_ref = refs.pop(0) if has_bias else None
    r_ref = refs.pop(0) if has_residual else None
    (o_ref,) = refs
    steps = depth // block_k

    def x_chunk(i: Array) -> Array:  # [block_k] (one row) or [Mp, block_k]
        span = pl.ds(i * block_k, block_k)
        if gated is None:
            return x_ref[span] if vector else x_ref[:, span]
        gate, up = (x_ref[0, span], x_ref[1, span]) if vector else (x_ref[:, 0, span], x_ref[:, 1, span])
        act = _activation(gated, gate.astype(jnp.float32)).astype(gate.dtype)
        return (act.astype(jnp.float32) * up.astype(jnp.float32)).astype(gate.dtype)

    if has_norm:
        def square_sum(i: Array, total: Array) -> Array:
            xf = x_chunk(i).astype(jnp.float32)
            return total + (jnp.sum(xf * xf) if vector else jnp.sum(xf * xf, axis=1))

        zero = jnp.zeros((), jnp.float32) if vector else jnp.zeros((x_ref.shape[0],), jnp.float32)
        inv = jax.lax.rsqrt(jax.lax.fori_loop(0, steps, square_sum, zero) / depth + eps)
        inv = inv if vector else inv[:, None]

    def body(i: Array, acc: Array) -> Array:
        h = x_chunk(i)
        if has_norm:
            nw = nw_ref[pl.ds(i * block_k, block_k)]
            h = weighted(h.astype(jnp.float32) * inv, nw if vector else nw[None, :], h.dtype, plus_one, h_dtype)
        span = pl.ds(i * block_k, block_k)
        tile = w_ref[:, span] if transposed else w_ref[span, :]  # [block_n, block_k] / [block_k, block_n]
        if vector:  # products summed over the chunks elementwise; across the chunk's `D` entries once, after the loop
            hf = h.astype(jnp.float32)
            return acc + (hf[None, :] if transposed else hf[:, None]) * tile.astype(jnp.float32)
        dot_dtype = jnp.promote_types(h.dtype, tile.dtype)
        precision = HIGHEST if dot_dtype == jnp.float32 else None
        return acc + jax.lax.dot_general(h.astype(dot_dtype), tile.astype(dot_dtype),
                                         (((1,), (1 if transposed else 0,)), ((), ())),
                                         precision=precision, preferred_element_type=jnp.float32)

    if not vector:
        shape = o_ref.shape
    else:  # the elementwise accumulator keeps the `D` chunk's axis where the tile has it
        shape = (o_ref.shape[0], block_k) if transposed else (block_k, o_ref.shape[0])
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(shape, jnp.float32))
    if vector:
        acc = jnp.sum(acc, axis=1 if transposed else 0)
    out = acc.astype(product_dtype)
    if has_bias:
        bias = b_ref[...] if vector else b_ref[...][None, :]
        out = (out.astype(jnp.float32) + bias.astype(jnp.float32)).astype(jnp.promote_types(product_dtype, bias.dtype))
    if has_residual:
        out = r_ref[...].astype(jnp.float32) + out.astype(jnp.float32)
    o_ref[...] = out.astype(o_ref.dtype)


#: The gated activations the kernel computes (`kvjax.ops.linear.ACTIVATIONS`).
GATED = ("silu", "gelu_pytorch_tanh")


def linear(x: Array, w: Array, *, norm_weight: Array | None = None, eps: float = 1e-6, plus_one: bool = False,
           gated: str | None = None, bias: Array | None = None, residual: Array | None = None,
           out_dtype: jnp.dtype | None = None, transposed: bool = False, block_n: int | None = None,
           block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
           interpret: bool | None = None) -> Array:
    """`[rmsnorm(x) | act(gate) * up] @ w [+ bias] [+ residual]` for `x` `[M, D]` (`[M, 2, D]` gate|up with `gated`,
    M <= 64), `w` `[D, N]`, `bias` `[N]`, `residual` `[M, N]`: the result of `kvjax.ops.linear.linear_xla` (dtype
    included). `out_dtype` is the product's dtype (its `preferred_element_type`: float32 logits from bf16 weights),
    by default its operands' promoted one. `transposed`: `w` is stored `[N, D]` (a tied LM head, the embedding
    table), each program reading `block_n` whole rows of it. The tile (`block_n` output columns per program,
    `block_k` of the `D` axis per loop step, `num_warps`, `num_stages`) defaults to the current tuning's
    `gpu_linear_*` fields."""
    if gated is not None:
        if gated not in GATED or norm_weight is not None or x.ndim != 3 or x.shape[1] != 2:
            raise ConfigError(f"linear: gated takes one of {GATED} (no norm) over a gate|up [M, 2, D] input, got "
                              f"{gated!r} over {x.shape}")
        rows, depth = x.shape[0], x.shape[2]
    else:
        rows, depth = x.shape
    width, w_depth = w.shape if transposed else w.shape[::-1]
    if w_depth != depth:
        axis = "columns" if transposed else "rows"
        raise ConfigError(f"linear: x has {depth} features but w has {w_depth} {axis}")
    if not supported(rows, depth, width):
        raise ConfigError(f"linear: the kernel takes 1 to {MAX_ROWS} rows and D, N multiples of 16, got x {x.shape} "
                          f"@ w {w.shape}; use kvjax.ops.linear.linear with implementation='auto' or 'xla'")
    if norm_weight is not None and norm_weight.shape != (depth,):
        raise ConfigError(f"linear: norm_weight must be [{depth}], got {norm_weight.shape}")
    knobs = tuning.current()
    bn = _divisor_block(width, block_n or knobs.gpu_linear_block_n)
    bk = _divisor_block(depth, block_k or knobs.gpu_linear_block_k)
    h_dtype = x.dtype if norm_weight is None else norm_dtype(x.dtype, norm_weight.dtype, plus_one)
    product_dtype = jnp.promote_types(h_dtype, w.dtype) if out_dtype is None else jnp.dtype(out_dtype)
    out_dtype = product_dtype
    if bias is not None:
        if bias.shape != (width,):
            raise ConfigError(f"linear: bias must be [{width}], got {bias.shape}")
        out_dtype = jnp.promote_types(bias.dtype, out_dtype)
    if residual is not None:
        if residual.shape != (rows, width):
            raise ConfigError(f"linear: residual must be {(rows, width)}, got {residual.shape}")
        out_dtype = jnp.promote_types(residual.dtype, out_dtype)
    vector = rows == 1
    padded = 1 if vector else max(16, pow2(rows))
    pad = lambda a: a if a.shape[0] == padded else jnp.pad(a, ((0, padded - rows),) + ((0, 0),) * (a.ndim - 1))  # noqa: E731
    row_block = (None,) if vector else (padded,)
    x_block = row_block + ((2, depth) if gated else (depth,))
    operands = [x if vector else pad(x), w]
    w_spec = pl.BlockSpec((bn, depth), lambda j: (j, 0)) if transposed else pl.BlockSpec((depth, bn), lambda j: (0, j))
    in_specs = [pl.BlockSpec(x_block, lambda j: (0,) * len(x_block)), w_spec]
    if norm_weight is not None:
        operands.append(norm_weight)
        in_specs.append(pl.BlockSpec((depth,), lambda j: (0,)))
    if bias is not None:
        operands.append(bias)
        in_specs.append(pl.BlockSpec((bn,), lambda j: (j,)))
    if residual is not None:
        operands.append(residual if vector else pad(residual))
        in_specs.append(pl.BlockSpec(row_block + (bn,), lambda j: (0, j)))
    kernel = functools.partial(_kernel, vector=vector, depth=depth, block_k=bk, has_norm=norm_weight is not None,
                               has_bias=bias is not None, has_residual=residual is not None, eps=float(eps),
                               plus_one=plus_one, h_dtype=h_dtype, product_dtype=product_dtype, gated=gated,
                               transposed=transposed)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((padded, width), out_dtype), grid=(width // bn,),
        in_specs=in_specs, out_specs=pl.BlockSpec(row_block + (bn,), lambda j: (0, j)),
        compiler_params=compiler_params(knobs.gpu_linear_num_warps if num_warps is None else num_warps,
                                knobs.gpu_linear_num_stages if num_stages is None else num_stages),
        interpret=interpret_mode(interpret), name="kvjax_gpu_linear",
    )(*operands)
    return out[:rows]
