"""`kvjax.generate(..., kv_dtype=...)` end to end: every scheme, a ragged batch, chunked prefill, one compile per
scheme and shape bucket, and the decode step reading exactly the dequantized cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import random_prompts, tiny_model

import kvjax
from kvjax import cache as kvc
from kvjax import methods
from kvjax.errors import KvjaxError
from kvjax.quant import KVQuant, QuantizedKV
from kvjax.runtime import TRACE_COUNTS, forward

SCHEMES = ["int8", "fp8", "int4", "kivi2:group_size=4:residual=8", "kivi4:group_size=8:residual=8"]
PROMPTS = (31, 12, 40)
H2O = methods.get("h2o", budget=16)  # evicts during decode after observing the attention


@pytest.mark.parametrize("kv_dtype", SCHEMES)
def test_generate_at_every_scheme_chunked_with_a_ragged_batch(kv_dtype):
    model = tiny_model(num_layers=2)
    spec = kvjax.quant.parse_kv_dtype(kv_dtype)
    out = kvjax.generate(model, random_prompts(1, PROMPTS), method=H2O, max_new_tokens=6, chunk_size=16,
                         kv_dtype=kv_dtype, return_cache=True, stop_at_eos=False)
    assert out.tokens.shape == (3, 6) and (out.num_tokens == 6).all()
    plain = kvjax.generate(model, random_prompts(1, PROMPTS), method=H2O, max_new_tokens=6, chunk_size=16,
                           return_cache=True, stop_at_eos=False)
    for layer, ref in zip(out.cache.layers, plain.cache.layers, strict=True):
        assert isinstance(layer.k, QuantizedKV) and layer.k.spec == spec and layer.v.role == "v"
        np.testing.assert_array_equal(layer.length, ref.length)  # the same budget kept
        assert layer.nbytes < ref.nbytes
        if spec.kivi:  # never more than `residual` tokens pending in full precision
            pending = np.asarray(layer.length - layer.k.qlen)
            assert (pending >= 0).all() and (pending <= spec.residual).all()
    # A second batch in the same bucket compiles nothing new.
    before = TRACE_COUNTS["prefill"], TRACE_COUNTS["decode_step"]
    kvjax.generate(model, random_prompts(2, PROMPTS), method=H2O, max_new_tokens=6, chunk_size=16,
                   kv_dtype=kv_dtype, stop_at_eos=False)
    assert (TRACE_COUNTS["prefill"], TRACE_COUNTS["decode_step"]) == before


@pytest.mark.parametrize("kv_dtype", ["kivi2:group_size=4:residual=8", "kivi4:group_size=4:residual=4"])
def test_a_decode_step_attends_the_dequantized_cache(kv_dtype):
    """The step's logits on a quantized cache equal those on a model-dtype cache holding its dequantized values
    after the step's append (KIVI writes the new token in full precision, and this step flushes a group: the twin
    holds the flushed group as the quantized cache does). Per-token layouts go through the same dequantizing
    attention (tests/quant/test_cache_ops.py checks what they dequantize to)."""
    model = tiny_model(num_layers=2)
    state = kvjax.prefill(model, random_prompts(3, PROMPTS), method="snapkv",
                          method_args=dict(budget=16, window_size=4), max_new_tokens=2, kv_dtype=kv_dtype)
    tokens = jnp.argmax(state.logits, -1).astype(jnp.int32)
    positions = jnp.asarray(state.prompt_lengths)
    step = jax.jit(forward.decode_step, static_argnums=(0, 3))
    logits, after = step(model.config, model.weights(), model.rope(), state.method, state.cache, tokens, positions,
                         state.budget)
    # The model-dtype twin holds exactly what the quantized cache holds after this step's append.
    twin = after.map_layers(lambda layer: kvc.dequantized(layer))
    twin = twin.map_layers(lambda layer: layer.replace(length=layer.length - 1, pos=jnp.where(
        jnp.arange(layer.capacity) < (layer.length - 1)[..., None], layer.pos, -1)))
    want, _ = step(model.config, model.weights(), model.rope(), state.method, twin, tokens, positions, state.budget)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bad_kv_dtype_is_refused_before_tracing():
    model = tiny_model(num_layers=2)
    with pytest.raises(KvjaxError, match="kv_dtype must be"):
        kvjax.generate(model, [[1, 2, 3]], max_new_tokens=1, kv_dtype="int3")
    with pytest.raises(KvjaxError, match="channel_group=5 does not divide head_dim=16"):
        kvjax.generate(model, [[1, 2, 3]], max_new_tokens=1, kv_dtype=KVQuant("int8", channel_group=5))
