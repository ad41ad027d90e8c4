"""A weight product of the decoder block, with the RMSNorm or the MLP's gated activation before it and the bias and
residual adds after it optionally fused: `[rmsnorm(x) | act(gate) * up] . w [+ bias] [+ residual]`.

`spec` is the product's einsum, `x`'s trailing axes contracted with `w`'s leading ones in the same order (the
block's weights are `[in..., out...]`: `"btd,dkgh->btkgh"` with `qkv`, `"btnh,nhd->btd"` with `o`); the norm, over
`x`'s last axis, needs a single contracted axis. With `gated` (an `ACTIVATIONS` name) `x` is the MLP's gate|up
`[..., 2, F]` and the product's input `act(x[..., 0, :]) * x[..., 1, :]`, which `spec` names.

The XLA path (`linear_xla`, and "auto" wherever the tuning does not pick the kernel) is the block's own sequence:
`kvjax.ops.norm.rms_norm` (itself the norm kernel where the tuning lists `rms_norm`) or the gated activation,
`jnp.einsum(spec, ...)`, `out + bias`, then `residual + out`. `implementation="pallas"` runs the whole of it as one
Triton kernel (`kvjax.pallas.gpu_linear`: compiled on a GPU, interpreted elsewhere) where it applies: at most 64 rows
(decode; prefill's GEMMs stay XLA's), in / out sizes multiples of 16, and no device mesh (a sharded weight stays with
XLA's partitioner, which inserts the row-parallel products' all-reduce before the residual add). Elsewhere the XLA
path runs. "auto" picks the kernel
only where the current tuning's `auto_pallas` lists `linear`: on no backend (on the H200, run 13, its products
took 1.8-2.6x XLA's time: `kvjax.tuning`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError
from kvjax.ops._impl import resolve
from kvjax.ops._shard import current_mesh
from kvjax.ops.norm import rms_norm

Array = jax.Array

OP = "linear"

#: The MLP activations by Hugging Face's `hidden_act` name.
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def contracted(spec: str) -> int:
    """How many of `w`'s leading axes `spec` contracts with `x`'s trailing ones (a `ConfigError` for any other
    einsum)."""
    inputs, _, out = spec.replace(" ", "").partition("->")
    x_axes, _, w_axes = inputs.partition(",")
    n = sum(axis not in out for axis in w_axes)
    if not out or n == 0 or x_axes[len(x_axes) - n:] != w_axes[:n] or out != x_axes[: len(x_axes) - n] + w_axes[n:]:
        raise ConfigError(f"linear: {spec!r} is not x's trailing axes contracted with w's leading ones in order")
    return n


def linear_xla(x: Array, w: Array, spec: str, *, norm_weight: Array | None = None, eps: float = 1e-6,
               plus_one: bool = False, gated: str | None = None, bias: Array | None = None,
               residual: Array | None = None, preferred_element_type: jnp.dtype | None = None) -> Array:
    """The reference: `rms_norm` (when `norm_weight`) or the gated activation (when `gated`), `jnp.einsum(spec,
    ..., preferred_element_type=)`, `out + bias`, `residual + out`."""
    if gated is not None:
        h = ACTIVATIONS[gated](x[..., 0, :]) * x[..., 1, :]
    else:
        h = x if norm_weight is None else rms_norm(x, norm_weight, eps, plus_one)
    out = jnp.einsum(spec, h, w, preferred_element_type=preferred_element_type)
    if bias is not None:
        out = out + bias
    return out if residual is None else residual + out


def _kernel_applies(x: Array, w: Array, contract: int, gated: str | None) -> bool:
    from kvjax.pallas import gpu_linear

    if gated is not None and gated not in gpu_linear.GATED:
        return False
    rows = math.prod(x.shape[: x.ndim - contract - (gated is not None)])
    return _kernel_takes(rows, math.prod(w.shape[:contract]), math.prod(w.shape[contract:]))


def _kernel_takes(rows: int, depth: int, width: int) -> bool:
    """Whether the kernel takes `[rows, depth] . [depth, width]` here: its sizes, and no device mesh."""
    from kvjax.pallas import gpu_linear

    mesh = current_mesh()
    return (mesh is None or mesh.size <= 1) and gpu_linear.supported(rows, depth, width)


def linear(x: Array, w: Array, spec: str, *, norm_weight: Array | None = None, eps: float = 1e-6,
           plus_one: bool = False, gated: str | None = None, bias: Array | None = None, residual: Array | None = None,
           preferred_element_type: jnp.dtype | None = None, implementation: str = "auto") -> Array:
    """`[rms_norm(x) | act(gate) * up] . w [+ bias] [+ residual]` (see the module docstring); `bias` has the
    product's output axes (`w.shape[contract:]`); `preferred_element_type` the product's dtype, as the einsum's
    (float32 logits from bf16 weights)."""
    contract = contracted(spec)
    if norm_weight is not None and contract != 1:
        raise ConfigError(f"linear: a fused norm needs one contracted axis, {spec!r} contracts {contract}")
    if gated is not None and (gated not in ACTIVATIONS or norm_weight is not None or contract != 1
                              or x.ndim < 2 or x.shape[-2] != 2):
        raise ConfigError(f"linear: gated takes one of {sorted(ACTIVATIONS)} (no norm, one contracted axis) over a "
                          f"gate|up [..., 2, F] input, got {gated!r} over {x.shape}")
    if resolve(OP, implementation) != "pallas" or not _kernel_applies(x, w, contract, gated):
        return linear_xla(x, w, spec, norm_weight=norm_weight, eps=eps, plus_one=plus_one, gated=gated, bias=bias,
                          residual=residual, preferred_element_type=preferred_element_type)
    from kvjax.pallas import gpu_linear

    lead, out_shape = x.shape[: x.ndim - contract - (gated is not None)], w.shape[contract:]
    depth, width = math.prod(w.shape[:contract]), math.prod(out_shape)
    rows = x.reshape(-1, 2, depth) if gated is not None else x.reshape(-1, depth)
    flat_residual = None if residual is None else jnp.broadcast_to(residual, (*lead, *out_shape)).reshape(-1, width)
    out = gpu_linear.linear(rows, w.reshape(depth, width), norm_weight=norm_weight, eps=eps, plus_one=plus_one,
                            gated=gated, bias=None if bias is None else bias.reshape(width),
                            residual=flat_residual, out_dtype=preferred_element_type)
    return out.reshape(*lead, *out_shape)


def tied_logits(x: Array, table: Array, *, norm_weight: Array, eps: float = 1e-6, plus_one: bool = False,
                implementation: str = "auto") -> Array:
    """Float32 logits `rms_norm(x) . table^T` of rows `x` `[M, D]` against a tied LM head, the embedding `table`
    `[V, D]` read as it lies: one kernel (`gpu_linear.linear(transposed=True)`, each program a block of whole
    rows of the table) where the tuning lists `linear` and it applies, else the norm and XLA's einsum."""
    if resolve(OP, implementation) != "pallas" or not _kernel_takes(x.shape[0], x.shape[1], table.shape[0]):
        h = rms_norm(x, norm_weight, eps, plus_one)
        return jnp.einsum("md,vd->mv", h, table, preferred_element_type=jnp.float32)
    from kvjax.pallas import gpu_linear

    return gpu_linear.linear(x, table, norm_weight=norm_weight, eps=eps, plus_one=plus_one, out_dtype=jnp.float32,
                             transposed=True)
