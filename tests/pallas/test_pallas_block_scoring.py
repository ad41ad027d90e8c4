"""Block scoring kernels (interpret mode) against the methods' XLA code: Quest's page bound from min /
max keys (per query head, group mean / max) and InfLLM / ActQKV's representative-key similarity (dot /
cosine); pages and blocks past the live count are NaN-poisoned and must score 0. Then the ops of
`kvjax.ops.blocks` with implementation="pallas" against "xla", and the methods' scores with "auto"
forced to the kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import TPU_SIM, assert_close

from kvjax import cache as kvc
from kvjax import methods, tuning
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Step
from kvjax.methods.block_memory import similarity
from kvjax.methods.quest import page_bounds
from kvjax.methods.quest import page_scores as quest_page_scores
from kvjax.ops import _impl, blocks
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


# ------------------------------------------------------------------------------------------------
# The ops of `kvjax.ops.blocks`: implementation="pallas" (interpret mode on CPU) against "xla"
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_reduce,dtype,live", [
    (None, jnp.float32, True),
    ("mean", jnp.bfloat16, True),
    ("max", jnp.float32, True),
    ("mean", jnp.float32, False),
])
def test_page_scores_op_pallas_equals_xla(group_reduce, dtype, live):
    """Per-head lengths: empty, one token, a partly filled last page, every page full; the pages past the
    live count hold NaN for the kernel (with `num_pages`)."""
    rng = np.random.default_rng(2)
    b, kv, g, c, h, page = 4, 2, 3, 45, 16, 4
    lengths = np.array([[45, 0], [1, 13], [44, 16], [29, 45]])
    stored = np.arange(c)[None, None] < lengths[..., None]
    keys = jnp.asarray(rng.standard_normal((b, kv, c, h)), dtype)
    lo, hi = page_bounds(keys, jnp.asarray(stored), page)
    q = jnp.asarray(rng.standard_normal((b, kv, g, h)), dtype)
    kw = dict(group_reduce=group_reduce)
    if live:
        pages = jnp.asarray(-(-lengths // page), jnp.int32)
        poison = (np.arange(lo.shape[2])[None, None] < np.asarray(pages)[..., None])[..., None]
        want = blocks.page_scores(q, lo, hi, num_pages=pages, implementation="xla", **kw)
        got = blocks.page_scores(q, jnp.where(poison, lo, jnp.nan), jnp.where(poison, hi, jnp.nan),
                                 num_pages=pages, implementation="pallas", **kw)
        dead = ~np.asarray(poison[..., 0]) if group_reduce else ~np.asarray(poison[:, :, None, :, 0])
        assert np.all(np.asarray(want)[np.broadcast_to(dead, want.shape)] == 0.0)
    else:
        want = blocks.page_scores(q, lo, hi, implementation="xla", **kw)
        got = blocks.page_scores(q, lo, hi, implementation="pallas", **kw)
    assert want.shape == ((b, kv, g, lo.shape[2]) if group_reduce is None else (b, kv, lo.shape[2]))
    assert want.dtype == got.dtype == jnp.float32
    assert_close(got, want, dtype)
    # without num_pages and reduction the op is Quest's bound as the method defines it
    full = blocks.page_scores(q, lo, hi, implementation="xla")
    if group_reduce == "mean" and not live:
        assert_close(want, jnp.mean(full, axis=2), dtype)


@pytest.mark.parametrize("kind,dtype,live", [
    ("dot", jnp.float32, True),
    ("cosine", jnp.bfloat16, True),
    ("cosine", jnp.float32, False),
])
def test_representative_scores_op_pallas_equals_xla(kind, dtype, live):
    """Formed counts: all, none, part; blocks past the count hold NaN for the kernel (with `num_blocks`)."""
    rng = np.random.default_rng(3)
    nb, d = 21, 4 * 16
    formed = np.array([21, 0, 8, 1])
    rep = jnp.asarray(rng.standard_normal((4, nb, d)), dtype)
    probe = jnp.asarray(rng.standard_normal((4, d)), jnp.float32)
    if live:
        ok = np.arange(nb)[None] < formed[:, None]
        want = blocks.representative_scores(probe, rep, num_blocks=jnp.asarray(formed), kind=kind,
                                             implementation="xla")
        got = blocks.representative_scores(probe, jnp.where(ok[..., None], rep, jnp.nan),
                                           num_blocks=jnp.asarray(formed), kind=kind, implementation="pallas")
        assert np.all(np.asarray(want)[~ok] == 0.0)
    else:
        want = blocks.representative_scores(probe, rep, kind=kind, implementation="xla")
        got = blocks.representative_scores(probe, rep, kind=kind, implementation="pallas")
    assert want.shape == got.shape == (4, nb)
    assert_close(got, want, dtype)


def test_block_ops_dispatch_and_validate():
    assert {"page_scores", "representative_scores"} <= _impl.PALLAS_OPS
    assert _impl.resolve("page_scores", "auto") == "xla"  # "auto" is XLA until a kernel is measured faster
    assert _impl.resolve("representative_scores", "pallas") == "pallas"
    q, lo = jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 1, 3, 8))
    for impl in ("xla", "pallas"):
        with pytest.raises(ConfigError, match="group_reduce"):
            blocks.page_scores(q, lo, lo, group_reduce="sum", implementation=impl)
        with pytest.raises(ConfigError, match="kind"):
            blocks.representative_scores(jnp.zeros((1, 8)), jnp.zeros((1, 3, 8)), kind="l2", implementation=impl)
    with pytest.raises(ConfigError, match="implementation"):
        blocks.page_scores(q, lo, lo, implementation="triton")


@pytest.mark.parametrize("group_reduce", ["mean", "max"])
def test_quest_decode_with_the_kernel_attends_the_same_pages(group_reduce):
    """Quest's decode step, its "auto" op forced to the kernel, writes the same attend mask as with XLA."""
    rng = np.random.default_rng(4)
    b, kv, g, c, h = 3, 2, 3, 40, 16
    method = methods.get("quest", budget=12, page_size=4, dense_layers=0, group_reduce=group_reduce)
    lengths = np.array([[40, 40], [23, 23], [9, 9]])  # after the new token was appended
    stored = np.arange(c)[None, None] < lengths[..., None]
    spec = CacheSpec(batch=b, kv_heads=kv, capacity=c, num_heads=kv * g, head_dim=h, num_layers=1,
                     dtype=jnp.float32)
    cache = kvc.init(b, kv, c, h, jnp.float32, attend=True, state=method.init_cache_state(spec)).replace(
        k=jnp.asarray(np.where(stored[..., None], rng.standard_normal((b, kv, c, h)), 0), jnp.float32),
        v=jnp.zeros((b, kv, c, h), jnp.float32),
        pos=jnp.asarray(np.where(stored, np.arange(c), -1), jnp.int32),
        length=jnp.asarray(lengths, jnp.int32),
    )
    step = Step(positions=jnp.asarray(lengths[:, :1] - 1, jnp.int32), budget=jnp.full((b,), 12, jnp.int32),
                layer=jnp.int32(1), inv_freq=jnp.ones((h // 2,), jnp.float32), capacity=c, num_layers=1)
    cache = method.prefill(cache, jnp.zeros((b, 1, kv * g, h), jnp.float32), step)
    q = jnp.asarray(rng.standard_normal((b, 1, kv * g, h)), jnp.float32)
    want = method.decode(cache, q, step).attend
    with tuning.override(auto_pallas={"page_scores"}):
        assert "pallas_call" in str(jax.make_jaxpr(method.decode)(cache, q, step))
        got = method.decode(cache, q, step).attend
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.asarray(want)[0].all()  # the 40-token heads attend a subset of their pages


@pytest.mark.parametrize("name,extra,decode", [
    ("infllm", {}, True),
    ("qllm", dict(question_weight=2.0), False),  # the question term is on at prefill
])
def test_block_retrieval_scores_with_the_kernel_equal_xla(name, extra, decode):
    """InfLLM / Q-LLM (and ActQKV, a Q-LLM) block scores with the "auto" op forced to the kernel: the
    memory's unformed blocks hold NaN, and score 0 either way."""
    rng = np.random.default_rng(5)
    b, nb_max, n, h = 3, 11, 4, 16
    method = methods.get(name, n_init=2, n_local=4, block_size=2, window=4, repr_topk=1, topk=3, **extra)
    nb = jnp.asarray([11, 0, 5], jnp.int32)
    ok = np.arange(nb_max)[None] < np.asarray(nb)[:, None]
    rep = np.where(ok[..., None], rng.standard_normal((b, nb_max, n * h)), np.nan)
    state = dict(rep=jnp.asarray(rep, jnp.float32),
                 qv=jnp.asarray(rng.standard_normal((b, n * h)), jnp.float32),
                 qv_set=jnp.asarray([True, True, False]))
    probe = jnp.asarray(rng.standard_normal((b, n * h)), jnp.float32)
    clean = dict(state, rep=jnp.where(jnp.asarray(ok)[..., None], state["rep"], 0.0))
    want, want_ok = method._scores(probe, clean, nb, decode=decode)
    with tuning.override(auto_pallas={"representative_scores"}):
        calls = str(jax.make_jaxpr(lambda p, s, c: method._scores(p, s, c, decode=decode))(probe, state, nb))
        assert calls.count("pallas_call") == (2 if name == "qllm" else 1)  # + Q-LLM's question term
        got, got_ok = method._scores(probe, state, nb, decode=decode)
    np.testing.assert_array_equal(np.asarray(got_ok), np.asarray(want_ok))
    assert_close(got, want, jnp.float32)
