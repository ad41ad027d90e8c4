"""Block scoring kernels (interpret mode) against the methods' XLA code: Quest's page bound from min /
max keys (per query head, group mean / max) and InfLLM / ActQKV's representative-key similarity (dot /
cosine); pages and blocks past the live count are NaN-poisoned and must score 0."""

import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import TPU_SIM, assert_close

from kvjax.methods.block_memory import similarity
from kvjax.methods.quest import page_bounds
from kvjax.methods.quest import page_scores as quest_page_scores
from kvjax.pallas.block_scoring import page_scores, representative_scores


@pytest.mark.parametrize("kv,g,dtype,group_reduce,interpret", [
    (2, 4, jnp.float32, None, TPU_SIM),
    (1, 7, jnp.bfloat16, "mean", True),
    (2, 4, jnp.bfloat16, "max", True),
])
def test_quest_page_kernel_equals_reference(kv, g, dtype, group_reduce, interpret):
    rng = np.random.default_rng(0)
    c, h, page = 70, 16, 8
    lengths = np.array([[70, 33][:kv], [0, 9][:kv], [64, 65][:kv]])
    stored = np.arange(c)[None, None] < lengths[..., None]
    keys = jnp.asarray(rng.standard_normal((3, kv, c, h)), dtype)
    lo, hi = page_bounds(keys, jnp.asarray(stored), page)
    pages = -(-lengths // page)
    filled = np.arange(lo.shape[2])[None, None] < pages[..., None]
    q = jnp.asarray(rng.standard_normal((3, kv, g, h)), dtype)
    want = quest_page_scores(q, lo, hi)
    if group_reduce is not None:
        want = jnp.mean(want, axis=2) if group_reduce == "mean" else jnp.max(want, axis=2)
    want = jnp.where(filled if group_reduce else filled[:, :, None], want, 0.0)
    poison = filled[..., None]
    got = page_scores(q, jnp.where(poison, lo, jnp.nan), jnp.where(poison, hi, jnp.nan),
                      num_pages=jnp.asarray(pages), group_reduce=group_reduce, block_pages=3, interpret=interpret)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("kind,dtype", [("dot", jnp.float32), ("cosine", jnp.bfloat16)])
def test_representative_kernel_equals_reference(kind, dtype):
    rng = np.random.default_rng(1)
    nb, d = 19, 7 * 16  # 7 query heads x head_dim 16, flattened as in the block memory
    formed = np.array([19, 0, 7])
    ok = np.arange(nb)[None] < formed[:, None]
    rep = rng.standard_normal((3, nb, d))
    probe = jnp.asarray(rng.standard_normal((3, d)), jnp.float32)
    want = jnp.where(ok, similarity(probe, jnp.asarray(np.where(ok[..., None], rep, 0), dtype), kind), 0.0)
    got = representative_scores(probe, jnp.asarray(np.where(ok[..., None], rep, np.nan), dtype),
                                num_blocks=jnp.asarray(formed), kind=kind, block_blocks=8, interpret=True)
    assert_close(got, want, dtype)
