"""The "own Flax model" example runs every registered method through the per-layer step API.

Oracle: kvjax's own model (`kvjax.generate`) on the same weights. The example's decoder is written with its own
NNX modules; its parameters are copied into a `DecoderLM`, and both must generate the same greedy tokens with
every method (and the same kept positions, since the step API is the one kvjax's model calls).
"""

import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from golden_cases import METHODS

import kvjax
from kvjax import methods
from kvjax.models.config import ModelConfig, RopeConfig
from kvjax.models.model import DecoderLM

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "own_flax_model.py"
spec = importlib.util.spec_from_file_location("own_flax_model", _PATH)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 64, size=32)]  # a whole prompt bucket


def _as_kvjax(model) -> DecoderLM:
    """The example's parameters in kvjax's layout (`kvjax.models.loader.param_shapes`)."""
    block = model.blocks[0]
    n, k, h, d = block.heads, block.kv_heads, block.head_dim, n_dim(model)
    weights = {"embed": model.embed.embedding[...], "final_norm": model.norm.scale[...],
               "lm_head": model.head.kernel[...]}
    for i, b in enumerate(model.blocks):
        weights.update({
            f"layers.{i}.attn_norm": b.norm1.scale[...], f"layers.{i}.mlp_norm": b.norm2.scale[...],
            f"layers.{i}.q": b.wq.kernel[...].reshape(d, n, h), f"layers.{i}.k": b.wk.kernel[...].reshape(d, k, h),
            f"layers.{i}.v": b.wv.kernel[...].reshape(d, k, h), f"layers.{i}.o": b.wo.kernel[...].reshape(n, h, d),
            f"layers.{i}.gate": b.gate.kernel[...], f"layers.{i}.up": b.up.kernel[...],
            f"layers.{i}.down": b.down.kernel[...],
        })
    config = ModelConfig(
        model_type="llama", vocab_size=64, hidden_size=d, intermediate_size=b.gate.kernel.shape[1],
        num_layers=len(model.blocks), num_heads=n, num_kv_heads=k, head_dim=h, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0), max_position_embeddings=4096, eos_token_ids=(),
    )
    return DecoderLM(config, weights, dtype=jnp.float32)


def n_dim(model) -> int:
    return model.embed.embedding.shape[1]


@pytest.fixture(scope="module")
def models():
    own = example.TinyDecoder(rngs=nnx.Rngs(0))
    return own, _as_kvjax(own)


def test_every_method_is_covered():
    assert sorted(METHODS) == methods.available()


@pytest.mark.parametrize("name", sorted(METHODS))
def test_own_model_generates_what_kvjax_generates(name, models):
    own, reference = models
    method = methods.get(name, **METHODS[name])
    tokens, cache = example.generate(own, PROMPT, method, max_new_tokens=6)
    expect = kvjax.generate(reference, [PROMPT], method=method, max_new_tokens=6, return_cache=True)
    assert tokens == expect.tokens[0].tolist(), name
    for mine, theirs in zip(cache.layers, expect.cache.layers, strict=True):
        assert kvjax.cache.positions_kept(mine) == kvjax.cache.positions_kept(theirs), name


def test_a_compressed_cache_is_allocated_smaller():
    own = example.TinyDecoder(rngs=nnx.Rngs(0))
    _, full = example.generate(own, PROMPT, methods.get("full"), max_new_tokens=6)
    stream = methods.get("streaming_llm", budget=10, sink_size=2)
    _, compressed = example.generate(own, PROMPT, stream, max_new_tokens=6)
    kept = kvjax.cache.positions_kept(compressed.layers[1])[0][1]
    newest = len(PROMPT) + 4  # the last generated token is never fed back
    assert kept == [0, 1, *range(newest - 7, newest + 1)]
    assert compressed.nbytes < full.nbytes / 2
