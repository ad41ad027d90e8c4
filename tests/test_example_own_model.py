"""The "own Flax model" example works with two methods, with kvjax's cache and hooks only."""

import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import cache as kvc
from kvjax import methods

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "own_flax_model.py"
spec = importlib.util.spec_from_file_location("own_flax_model", _PATH)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def _teacher_forced(model, seq):
    full = methods.get("full")
    caches = [kvc.init(1, 2, len(seq), 16, jnp.float32) for _ in model.blocks]
    logits, _ = example.run(model, jnp.asarray([seq]), jnp.arange(len(seq))[None], caches, full, False,
                            jnp.asarray([len(seq)], jnp.int32))
    return np.argmax(np.asarray(logits[0]), -1)


def test_full_and_streaming_llm_in_a_foreign_model():
    model = example.TinyDecoder(rngs=nnx.Rngs(0))
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 64, size=30)]
    tokens, caches = example.generate(model, prompt, methods.get("full"), max_new_tokens=6)
    ref = _teacher_forced(model, prompt + tokens)
    np.testing.assert_array_equal(ref[len(prompt) - 1 : -1], tokens)

    stream = methods.get("streaming_llm", budget=10, sink_size=2)
    s_tokens, s_caches = example.generate(model, prompt, stream, max_new_tokens=6)
    kept = sorted(int(p) for p in np.asarray(s_caches[1].pos[0, 1]) if p >= 0)
    newest = len(prompt) + 4  # the last generated token is never fed back
    assert kept == [0, 1, *range(newest - 7, newest + 1)]
    assert sum(c.nbytes for c in s_caches) < sum(c.nbytes for c in caches) / 2
    assert len(s_tokens) == 6
