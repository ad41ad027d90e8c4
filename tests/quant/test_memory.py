"""The memory a quantized cache saves, on the Llama-3.1-8B shape at 32K tokens, without allocating it:
`cache.nbytes` of `jax.eval_shape(init_cache)` and the compiled init program's output size (XLA's own count of
the buffers it allocates). K / V part (codes, scales, zero points, KIVI's ring) against bfloat16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kvjax import methods
from kvjax.methods.base import CacheSpec
from kvjax.models.presets import preset_config
from kvjax.quant import KVQuant
from kvjax.runtime import step

CONTEXT = 32768
#: The issue's bound per scheme (fraction of the bfloat16 K / V bytes, scales included).
BOUND = {"int8": 0.53, "fp8": 0.53, "int4": 0.28, "kivi4": 0.30, "kivi2": 0.16}


def _spec(quant: KVQuant | None) -> CacheSpec:
    config = preset_config("llama-3.1-8b")
    return CacheSpec(batch=1, kv_heads=config.num_kv_heads, capacity=CONTEXT, num_heads=config.num_heads,
                     head_dim=config.head_dim, num_layers=config.num_layers, dtype=jnp.bfloat16, quant=quant)


def _kv_bytes(cache) -> int:
    return sum(x.size * x.dtype.itemsize for layer in cache.layers for x in jax.tree.leaves((layer.k, layer.v)))


@pytest.mark.parametrize("scheme", sorted(BOUND))
def test_kv_bytes_of_an_8b_cache_at_32k(scheme):
    full = methods.get("full")
    plain = jax.eval_shape(lambda: step.init_cache(full, _spec(None)))
    quant = KVQuant(scheme)
    shaped = jax.eval_shape(lambda: step.init_cache(full, _spec(quant)))
    ratio = _kv_bytes(shaped) / _kv_bytes(plain)
    assert _kv_bytes(plain) == 2 * 32 * 8 * CONTEXT * 128 * 2  # 4 GiB of bfloat16 K / V
    assert ratio <= BOUND[scheme], (scheme, ratio)
    # The stated bits per value match what is allocated (KIVI's ring aside: 129 tokens of 32768).
    assert abs(ratio * 16 - quant.bits_per_value(128)) < (0.07 if quant.kivi else 1e-4), ratio * 16
    # The whole cache (positions and lengths too) shrinks accordingly.
    assert shaped.nbytes < plain.nbytes * (BOUND[scheme] + 0.07)


def test_compiled_cache_buffers_shrink():
    """XLA's memory analysis of the program that allocates the cache (compiled, never run): two layers of the
    8B shape at 32K, bfloat16 against int8 and KIVI-2."""
    config = preset_config("llama-3.1-8b")
    full = methods.get("full")

    def out_bytes(quant):
        spec = CacheSpec(batch=1, kv_heads=config.num_kv_heads, capacity=CONTEXT, num_heads=config.num_heads,
                         head_dim=config.head_dim, num_layers=2, dtype=jnp.bfloat16, quant=quant)
        compiled = step._empty_cache.lower(full, spec, (None,) * spec.num_layers).compile()
        return compiled.memory_analysis().output_size_in_bytes

    plain = out_bytes(None)
    assert out_bytes(KVQuant("int8")) <= 0.53 * plain + 2 * 8 * CONTEXT * 8  # + positions (int32, in both)
    assert out_bytes(KVQuant("kivi2")) <= 0.16 * plain + 2 * 8 * CONTEXT * 8
