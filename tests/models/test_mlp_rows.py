"""The MLP in row slices (`kvjax.tuning` field `mlp_rows`, 512 on CPU) against the whole-input MLP written out
in NumPy, and the model's outputs with and without slicing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

from kvjax import tuning
from kvjax.models import block


def numpy_swiglu(lw, x):
    gate, up = x @ lw["gate"], x @ lw["up"]
    return (gate / (1 + np.exp(-gate)) * up) @ lw["down"]


@functools.partial(jax.jit, static_argnums=0)
def _mlp(tune, lw, x):
    with tuning.use(tune):
        return block.mlp(lw, x)


@pytest.mark.parametrize("rows", [512, None])
@pytest.mark.parametrize("batch,tokens", [(1, 2048), (2, 768), (3, 100)])
def test_sliced_mlp_equals_the_whole_mlp(batch, tokens, rows):
    rng = np.random.default_rng(0)
    d, f = 48, 80
    lw = {n: rng.standard_normal(s).astype(np.float32) * 0.2 for n, s in (("gate", (d, f)), ("up", (d, f)),
                                                                          ("down", (f, d)))}
    x = rng.standard_normal((batch, tokens, d)).astype(np.float32)
    fused = {"gate_up": np.stack([lw["gate"], lw["up"]], axis=1), "down": lw["down"]}  # [D, 2, F]
    with tuning.override(mlp_rows=rows):
        got = _mlp(tuning.current(), {k: jnp.asarray(v) for k, v in fused.items()}, jnp.asarray(x))
    ref = numpy_swiglu({k: v.astype(np.float64) for k, v in lw.items()}, x.astype(np.float64))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)


def test_long_inputs_are_sliced_on_cpu():
    """(1, 2048) and (2, 768) rows are multiples of 512: a `lax.map` over slices; 300 rows run whole; the tuning's
    `mlp_rows=None` runs everything whole."""
    assert tuning.default("cpu").mlp_rows == 512
    lw = {"gate_up": jnp.ones((8, 2, 16)), "down": jnp.ones((16, 8))}

    def jaxpr(shape):  # a new function each time: make_jaxpr caches traces per function, not per tuning
        return str(jax.make_jaxpr(lambda lw, x: block.mlp(lw, x))(lw, jnp.ones(shape)))

    with tuning.use(tuning.default("cpu")):
        text = jaxpr((2, 768, 8))
        assert "scan" in text or "map" in text
        assert "scan" not in jaxpr((1, 300, 8))
    with tuning.override(mlp_rows=None):
        assert "scan" not in jaxpr((2, 768, 8))


def test_model_logits_do_not_depend_on_the_row_slices():
    """The model's forward compiles the tuning in force (a static argument): slicing changes the program, not
    its values beyond float32 rounding (1024 tokens: two 512-row slices; logits up to ~12)."""
    model = tiny_model()
    tokens = np.random.default_rng(1).integers(0, 96, (1, 1024))
    with tuning.override(mlp_rows=512):
        sliced, _ = model(tokens)
    with tuning.override(mlp_rows=None):
        whole, _ = model(tokens)
    np.testing.assert_allclose(np.asarray(sliced), np.asarray(whole), rtol=1e-4, atol=1e-4)
