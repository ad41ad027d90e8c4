"""`rope.integer_cos_sin` / `rotate_by_integer` (table-built rotations for integer offsets) against float64 NumPy
cos / sin of the same angles, and against `rotate_by`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.rope import integer_cos_sin, rotate_by, rotate_by_integer


@pytest.mark.parametrize("head_dim,theta", [(32, 1e4), (64, 5e5)])
def test_integer_cos_sin_matches_float64(head_dim, theta):
    inv = (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    delta = np.array([-9000, -4097, -65, -64, -63, -1, 0, 1, 63, 64, 65, 127, 4095, 8191, 9000])
    cos, sin = jax.jit(integer_cos_sin, static_argnums=2)(jnp.asarray(delta), jnp.asarray(inv), 9000)
    angles = delta[:, None].astype(np.float64) * inv.astype(np.float64)
    # float32 maths on angles up to ~9000 rad: float32's own cos(delta * f) is off by ~1e-4 here too
    np.testing.assert_allclose(np.asarray(cos), np.cos(angles), atol=5e-4)
    np.testing.assert_allclose(np.asarray(sin), np.sin(angles), atol=5e-4)
    small = np.abs(delta) < 128  # small offsets: float32 exact to rounding
    np.testing.assert_allclose(np.asarray(cos)[small], np.cos(angles)[small], atol=2e-6)
    np.testing.assert_allclose(np.asarray(sin)[small], np.sin(angles)[small], atol=2e-6)


def test_rotate_by_integer_equals_rotate_by():
    rng = np.random.default_rng(0)
    inv = jnp.asarray(1.0 / 1e4 ** (np.arange(0, 16, 2) / 16), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 3, 50, 16)), jnp.float32)
    delta = jnp.asarray(rng.integers(-300, 300, size=(2, 3, 50)), jnp.int32)
    np.testing.assert_allclose(
        np.asarray(rotate_by_integer(x, delta, inv, 300)), np.asarray(rotate_by(x, delta, inv)), atol=2e-5
    )
