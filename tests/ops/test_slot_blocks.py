"""The slot-blocked scoring ops of ExpectedAttention and CriticalKV against NumPy float64, with blocks smaller
than the slot axis (the `lax.map` path, a partial last block included)."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.errors import ConfigError
from kvjax.ops.scoring import gaussian_query_logits, projected_value_norms


def test_gaussian_query_logits_blocked():
    rng = np.random.default_rng(0)
    b, kv, g, c, h = 2, 2, 3, 21, 4
    mean = rng.standard_normal((b, kv * g, h))
    a = rng.standard_normal((b, kv * g, h, h))
    cov = a @ np.swapaxes(a, -1, -2)
    k = rng.standard_normal((b, kv, c, h))
    got = np.asarray(gaussian_query_logits(jnp.asarray(mean, jnp.float32), jnp.asarray(cov, jnp.float32),
                                           jnp.asarray(k, jnp.float32), scale=0.5, block=8))
    want = np.zeros((b, kv, g, c))
    for bi in range(b):
        for n in range(kv * g):
            for j in range(c):
                x = k[bi, n // g, j]
                want[bi, n // g, n % g, j] = 0.5 * mean[bi, n] @ x + 0.125 * x @ cov[bi, n] @ x
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_projected_value_norms_blocked():
    rng = np.random.default_rng(1)
    b, kv, g, c, h, d = 2, 2, 2, 13, 4, 6
    v = rng.standard_normal((b, kv, c, h))
    w = rng.standard_normal((kv * g, h, d))
    got = np.asarray(projected_value_norms(jnp.asarray(v, jnp.float32), jnp.asarray(w, jnp.float32), block=4))
    want = np.array([[[[np.abs(v[bi, n // g, j] @ w[n]).sum() for j in range(c)] for n in range(ki * g, ki * g + g)]
                      for ki in range(kv)] for bi in range(b)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ord", [2, 1])
def test_projected_value_norms_of_each_order_and_no_other(ord):
    """`ord=2` is the L2 norm (KVzip's), `ord=1` the L1 norm; any other order (or block) is refused by name instead
    of silently giving the L2 norm (or a ZeroDivisionError)."""
    rng = np.random.default_rng(2)
    v, w = rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((4, 4, 3))
    got = np.asarray(projected_value_norms(jnp.asarray(v, jnp.float32), jnp.asarray(w, jnp.float32), ord=ord, block=2))
    want = np.linalg.norm(np.einsum("kch,kghd->kgcd", v[0], w.reshape(2, 2, 4, 3)), ord=ord, axis=-1)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="ord must be 1 or 2, got 3"):
        projected_value_norms(jnp.asarray(v, jnp.float32), jnp.asarray(w, jnp.float32), ord=3)
    with pytest.raises(ConfigError, match="block must be a positive integer, got 0"):
        projected_value_norms(jnp.asarray(v, jnp.float32), jnp.asarray(w, jnp.float32), block=0)
