"""Rotary position embeddings in Hugging Face's rotate-half layout.

Shared by the models (to embed positions) and the cache (to re-rotate stored keys), so it sits at
the bottom of the import graph. Frequencies come from `kvjax.models.rope_scaling`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scaling: float = 1.0
) -> jax.Array:
    """Rotates `x` [..., T, heads, head_dim] by `positions` [..., T] (float32 maths, x's dtype out).

    `scaling` is the attention factor some rope types (yarn) fold into cos / sin, as HF does.
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)  # [..., T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., T, 1, H]
    cos = jnp.cos(angles) * scaling
    sin = jnp.sin(angles) * scaling
    xf = x.astype(jnp.float32)
    return (xf * cos + _rotate_half(xf) * sin).astype(x.dtype)


def rotate_by(x: jax.Array, delta: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates already-embedded vectors `x` [..., head_dim] by `delta` [...] more positions.

    RoPE rotations compose (R(a) R(b) = R(a + b)) and the yarn scale is a plain factor, so a key
    stored at position p becomes exactly the key at p + delta; used for cache re-rotation.
    """
    angles = delta.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    xf = x.astype(jnp.float32)
    return (xf * jnp.cos(angles) + _rotate_half(xf) * jnp.sin(angles)).astype(x.dtype)


def rotate_between(x: jax.Array, start: jax.Array, end: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Moves vectors `x` [..., head_dim] embedded at positions `start` [...] to positions `end` [...].

    The rotation by `start`'s float32 angles (`start * f`, as `apply_rope` rounds them) is undone and the one by
    `end`'s applied, so the result is the vector `apply_rope` embeds at `end` up to float32 rounding of the two
    rotations. (`rotate_by(x, end - start)` rotates by the rounded `(end - start) * f` instead, off by up to an ulp of
    the large angles: about 1e-4 radians at position 2,000.)
    """
    f = inv_freq.astype(jnp.float32)

    def cos_sin(positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        angles = positions.astype(jnp.float32)[..., None] * f
        angles = jnp.concatenate([angles, angles], axis=-1)
        return jnp.cos(angles), jnp.sin(angles)

    (c0, s0), (c1, s1) = cos_sin(start), cos_sin(end)
    xf = x.astype(jnp.float32)
    back = xf * c0 - _rotate_half(xf) * s0  # at position 0 again
    return (back * c1 + _rotate_half(back) * s1).astype(x.dtype)


_TABLE_STEP = 64


def integer_cos_sin(delta: jax.Array, inv_freq: jax.Array, max_abs: int) -> tuple[jax.Array, jax.Array]:
    """cos / sin of `delta * inv_freq` `[..., H/2]` float32 for integer `delta` `[...]` with `|delta| <= max_abs`.

    Built from two small tables by angle addition, `delta = 64 a + b`: `max_abs / 64 + 64` sin / cos
    evaluations instead of one per element, which makes re-rotating thousands of keys per decode step
    cheap. The angles of both tables are exact multiples of the frequencies, so this is as accurate as
    evaluating `cos(delta * f)` in float32 (more, for large `delta`, whose product rounds).
    """
    f = inv_freq.astype(jnp.float32)
    half = f.shape[0]
    high = jnp.arange(max_abs // _TABLE_STEP + 1, dtype=jnp.float32)[:, None] * (_TABLE_STEP * f)
    low = jnp.arange(_TABLE_STEP, dtype=jnp.float32)[:, None] * f
    # cos | sin side by side: one gather per table (XLA:CPU gathers rows far faster than it evaluates sin / cos)
    high = jnp.concatenate([jnp.cos(high), jnp.sin(high)], axis=-1)
    low = jnp.concatenate([jnp.cos(low), jnp.sin(low)], axis=-1)
    mag = jnp.abs(delta.astype(jnp.int32))
    a = jnp.take(high, mag // _TABLE_STEP, axis=0, mode="clip")
    b = jnp.take(low, mag % _TABLE_STEP, axis=0, mode="clip")
    ca, sa, cb, sb = a[..., :half], a[..., half:], b[..., :half], b[..., half:]
    cos = ca * cb - sa * sb
    sin = sa * cb + ca * sb
    return cos, jnp.where((delta < 0)[..., None], -sin, sin)


def rotate_by_integer(x: jax.Array, delta: jax.Array, inv_freq: jax.Array, max_abs: int) -> jax.Array:
    """`rotate_by` for integer `delta` with `|delta| <= max_abs` (static), through `integer_cos_sin`."""
    cos, sin = integer_cos_sin(delta, inv_freq, max_abs)
    cos = jnp.concatenate([cos, cos], axis=-1)
    sin = jnp.concatenate([sin, sin], axis=-1)
    xf = x.astype(jnp.float32)
    return (xf * cos + _rotate_half(xf) * sin).astype(x.dtype)
