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
