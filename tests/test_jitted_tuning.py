"""The jitted programs of calibration and training take the tuning as a static argument (issue 59): a later
`tuning.override` compiles a program of its own instead of silently reusing the first trace's tuning.

Oracle: the tuning the model's code reads while it is traced, recorded by a spy around the decoder block (the
code that reads `Tuning.mlp_rows`). Before the fix both programs were traced once, under the first call's tuning,
and a second call under another override reused that trace (the spy saw one value, not two). The results are
the same under both tunings (`mlp_rows` splits the MLP's rows; it changes no value).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tiny import tiny_model

from kvjax import tuning
from kvjax.calibrate import activations
from kvjax.models import block
from kvjax.train import loop

ROWS = (3, 5)  # mlp_rows values no other test uses: each override's program is traced here


def _spy_on_decoder_block(monkeypatch) -> list:
    seen = []
    real = block.decoder_block

    def spy(*args, **kwargs):
        seen.append(tuning.current().mlp_rows)
        return real(*args, **kwargs)

    monkeypatch.setattr(block, "decoder_block", spy)
    return seen


def test_calibration_forward_honours_a_later_override(monkeypatch):
    model = tiny_model(seed=0, num_layers=1)
    seen = _spy_on_decoder_block(monkeypatch)
    outputs = []
    for rows in ROWS:
        hidden = []
        with tuning.override(mlp_rows=rows):
            activations.run_layers(model, list(range(1, 12)), hidden.append)
        outputs.append(hidden)
    assert seen == list(ROWS)  # one trace per tuning, each under its own
    np.testing.assert_allclose(outputs[0][0].q, outputs[1][0].q, rtol=1e-6, atol=1e-6)


def test_train_step_honours_a_later_override(monkeypatch):
    model = tiny_model(seed=1, num_layers=1)
    optimizer = optax.sgd(1e-3)
    tokens = jnp.asarray(np.arange(1, 13, dtype=np.int32)[None])
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    mask = jnp.ones((1, 12), jnp.float32)
    seen = _spy_on_decoder_block(monkeypatch)
    losses = []
    for rows in ROWS:
        weights = jax.tree.map(jnp.copy, model.weights())  # fresh buffers: the step donates them
        with tuning.override(mlp_rows=rows):
            _, _, loss = loop._train_step(model.config, tuning.current(), optimizer, 0.0, weights,
                                          optimizer.init(weights), model.rope(), tokens, positions, mask)
        losses.append(float(loss))
    assert seen == list(ROWS)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
