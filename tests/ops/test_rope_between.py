"""`rope.rotate_between`: a vector embedded at one position moved to another equals `apply_rope`'s embedding at the
new position up to float32 rounding of the rotations (the one by `start`'s float32 angles undone, the one by `end`'s
applied), where `rotate_by(end - start)` differs by float32's error in a large angle."""

import jax.numpy as jnp
import numpy as np

from kvjax.rope import apply_rope, rotate_between, rotate_by


def test_moved_vectors_are_the_embedding_at_the_new_position():
    rng = np.random.default_rng(0)
    inv = jnp.asarray(1.0 / 1e5 ** (np.arange(0, 64, 2) / 64), jnp.float32)  # SmolLM2's theta and head_dim
    x = jnp.asarray(rng.normal(size=(1, 200, 3, 64)), jnp.float32)  # pre-RoPE [B, T, heads, H]
    start = jnp.asarray(rng.integers(0, 1200, size=(1, 200)), jnp.int32)
    end = start + jnp.asarray(rng.integers(300, 900, size=(1, 200)), jnp.int32)
    embedded = apply_rope(x, start, inv)
    want = np.asarray(apply_rope(x, end, inv))
    moved = np.asarray(rotate_between(embedded, start[..., None], end[..., None], inv))
    shifted = np.asarray(rotate_by(embedded, (end - start)[..., None], inv))
    assert np.abs(moved - want).max() < 2e-6
    assert np.abs(shifted - want).max() > 10 * np.abs(moved - want).max()  # the error rotate_between removes
    np.testing.assert_allclose(np.asarray(rotate_between(embedded, start[..., None], start[..., None], inv)),
                               np.asarray(embedded), atol=1e-6)
