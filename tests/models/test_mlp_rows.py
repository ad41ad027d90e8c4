"""The MLP in row slices (CPU, `transformer.MLP_ROWS`) against the whole-input MLP written out in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models import transformer


def numpy_swiglu(lw, x):
    gate, up = x @ lw["gate"], x @ lw["up"]
    return (gate / (1 + np.exp(-gate)) * up) @ lw["down"]


@pytest.mark.parametrize("batch,tokens", [(1, 2048), (2, 768), (3, 100)])
def test_sliced_mlp_equals_the_whole_mlp(batch, tokens):
    rng = np.random.default_rng(0)
    d, f = 48, 80
    lw = {n: rng.standard_normal(s).astype(np.float32) * 0.2 for n, s in (("gate", (d, f)), ("up", (d, f)),
                                                                          ("down", (f, d)))}
    x = rng.standard_normal((batch, tokens, d)).astype(np.float32)
    got = jax.jit(transformer._mlp)({k: jnp.asarray(v) for k, v in lw.items()}, jnp.asarray(x))
    ref = numpy_swiglu({k: v.astype(np.float64) for k, v in lw.items()}, x.astype(np.float64))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)


def test_long_inputs_are_sliced_on_cpu():
    """(1, 2048) and (2, 768) rows are multiples of 512: a `lax.map` over slices; 300 rows run whole."""
    lw = {"gate": jnp.ones((8, 16)), "up": jnp.ones((8, 16)), "down": jnp.ones((16, 8))}
    text = str(jax.make_jaxpr(transformer._mlp)(lw, jnp.ones((2, 768, 8))))
    assert "scan" in text or "map" in text
    assert "scan" not in str(jax.make_jaxpr(transformer._mlp)(lw, jnp.ones((1, 300, 8))))
