"""`kvjax.runtime.compiled_memory`: compiled programs hold memory mappings until JAX's caches are cleared;
`release_if_needed` clears them past a fraction of the kernel's limit, and not below it."""

import sys

import jax
import jax.numpy as jnp
import pytest

from kvjax.runtime import compiled_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")


def _compile_many(n: int) -> list:
    fns = []
    for i in range(n):
        f = jax.jit(lambda x, i=i: jnp.sin(x) * i + jnp.cos(x + i))
        f(jnp.ones((i + 3,))).block_until_ready()
        fns.append(f)
    return fns


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="counts the mappings XLA:CPU links each compiled program into")
def test_compiled_programs_hold_mappings_until_released():
    assert compiled_memory.mapping_limit() > 0
    before = compiled_memory.mapping_count()
    _compile_many(60)
    grown = compiled_memory.mapping_count()
    assert grown > before + 60  # each XLA:CPU program is linked into fresh mappings
    assert not compiled_memory.release_if_needed(fraction=1.0)  # far below the limit: nothing cleared
    assert compiled_memory.mapping_count() >= grown - 5
    assert compiled_memory.release_if_needed(fraction=0.0)  # "above" any fraction: cleared
    assert compiled_memory.mapping_count() < grown - 60
    # still usable afterwards: programs compile again
    assert float(jax.jit(lambda x: x + 1)(jnp.float32(1))) == 2.0


def test_outside_linux_it_does_nothing(monkeypatch):
    monkeypatch.setattr(compiled_memory, "_LIMIT", "/nonexistent/max_map_count")
    assert compiled_memory.mapping_limit() is None
    assert not compiled_memory.release_if_needed(fraction=0.0)
