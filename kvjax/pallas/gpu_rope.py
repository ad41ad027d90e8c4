"""The new token's query rows and key in registers, inside the fused decode kernel (`kvjax.pallas.gpu_fused_decode`):
QK-norm, then RoPE (HF rotate-half), then the family's query scale, each rounded to the model dtype where the
decoder block rounds it (`kvjax.ops.norm.rms_norm_xla`, `kvjax.rope.apply_rope`).

Triton has no concatenation, so `rotate_half(x) = sign * x[perm]` is read as a second, permuted load of the same
row, and `cos` / `sin` come from the layer's `inv_freq` at the token's position, float32."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvjax.pallas.gpu_norm import weighted
from kvjax.pallas.gpu_planes import plane_lanes

Array = jax.Array


def rope_rows(x: Array, x_perm: Array, cos: Array, sin: Array) -> Array:
    """float32 `x cos + rotate_half(x) sin` (`sin` carries rotate-half's sign)."""
    return x.astype(jnp.float32) * cos + x_perm.astype(jnp.float32) * sin


def head_normed(xs: list[Array], x_perms: list[Array], weights: list[Array], perm_weights: list[Array], eps: float,
                plus_one: bool, dtype: jnp.dtype) -> tuple[list[Array], list[Array]]:
    """QK-norm of rows given as channel planes `xs` (`[..., H / P]` each; one plane: the whole row) and of their
    rotate-half partners `x_perms` (the same rows' statistics), as `kvjax.ops.norm.rms_norm_xla` of each row with
    the head's weight (`weights` / `perm_weights`: its entries at each plane's channels and their partners'), in
    `dtype`."""
    xf = [x.astype(jnp.float32) for x in xs]
    width = sum(x.shape[-1] for x in xs)
    inv = jax.lax.rsqrt(sum(jnp.sum(x * x, axis=-1, keepdims=True) for x in xf) / width + eps)
    return ([weighted(x * inv, w, xs[0].dtype, plus_one, dtype) for x, w in zip(xf, weights, strict=True)],
            [weighted(x.astype(jnp.float32) * inv, w, xs[0].dtype, plus_one, dtype)
             for x, w in zip(x_perms, perm_weights, strict=True)])


def rope_terms(lane: Array, position: Array, inv_ref: Array, scaling: Array, head_dim: int) -> tuple[Array, Array]:
    """`cos` and `sin` (carrying rotate-half's sign) at channels `lane` for the token at `position`, float32, the
    RoPE's attention factor `scaling` applied."""
    half = head_dim // 2
    angle = position.astype(jnp.float32) * inv_ref[jax.lax.rem(lane, half)].astype(jnp.float32)
    return jnp.cos(angle) * scaling, jnp.where(lane < half, -1.0, 1.0) * (jnp.sin(angle) * scaling)


def rotated_query_planes(qkv_ref: Array, qn_ref: Array | None, inv_ref: Array, rows: Array, position: Array,
                         scaling: Array, parts: int, *, pairs: bool, qk_norm: tuple[float, bool] | None,
                         query_scale: float) -> list[Array]:
    """The group's query rows `rows` after QK-norm, RoPE and the family's query scale (each rounded to q's dtype as
    the decoder block rounds it), then scaled by `1 / sqrt(H)` in float32: `[Gp, H / parts]` for each of `parts`
    channel planes (`gpu_planes.plane_lanes`: the codes' byte planes, where `pairs` each one's even and odd
    channels). Each plane is loaded by its own channels rather than sliced from the whole row in registers: a
    sliced register tensor leaves Triton a layout that costs conversions on every step of the loop that reads it
    (BENCHMARKS.md)."""
    h = qkv_ref.shape[1]
    dtype = qkv_ref.dtype
    lanes = plane_lanes(h, parts, pairs)
    partners = [jax.lax.rem(lane + h // 2, h) for lane in lanes]  # rotate-half's channel for each
    xs = [qkv_ref[rows, :]] if parts == 1 else [qkv_ref[rows[:, None], lane[None, :]] for lane in lanes]
    x_perms = [qkv_ref[rows[:, None], partner[None, :]] for partner in partners]
    if qk_norm is not None:  # QK-norm (Qwen3, Gemma 3): each head's row normed over head_dim, before RoPE
        xs, x_perms = head_normed(xs, x_perms, [qn_ref[...]] if parts == 1 else [qn_ref[lane] for lane in lanes],
                                  [qn_ref[partner] for partner in partners], *qk_norm, dtype)
    planes = []
    for x, x_perm, lane in zip(xs, x_perms, lanes, strict=True):
        cos, sin = rope_terms(lane, position, inv_ref, scaling, h)
        q = rope_rows(x, x_perm, cos[None, :], sin[None, :]).astype(dtype)
        if query_scale != 1.0:
            q = (q.astype(jnp.float32) * query_scale).astype(dtype)
        planes.append(q.astype(jnp.float32) / math.sqrt(h))
    return planes
