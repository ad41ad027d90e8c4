"""SamKV: Eq. 1-3 and the block selection against NumPy transcriptions; the pipeline's plan and cache."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from ragdata import DOC_IDS, LAYOUT, PREFIX, QUERY, documents, model_for, rope_np

from kvjax import rag
from kvjax.rag import samkv
from kvjax.rag.recompute import fuse


# ---------------------------------------------------------------------------------------------
# NumPy transcriptions of the paper's equations (loops, float64)
# ---------------------------------------------------------------------------------------------
def eq1_np(q_que, q_loc):
    """Eq. 1 for D real documents: q_que [L, N, H], q_loc [D, L, N, H]."""
    d, layers = q_loc.shape[:2]
    out = np.zeros(q_loc.shape)
    for i in range(d):
        for n in range(layers):
            acc = q_que[n].astype(np.float64).copy()
            for j in range(d):
                if j == i:
                    continue
                a, b = q_que[n].ravel(), q_loc[j, n].ravel()
                cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
                acc += abs(cos) * q_loc[j, n] / (d - 1)
            out[i, n] = acc
    return out


def score_np(q, k):
    """<Q, K> summed over query heads, K head = h // G: q [N, H], k [K, H]."""
    g = q.shape[0] // k.shape[0]
    return sum(q[h] @ k[h // g] for h in range(q.shape[0]))


def eq23_np(q_hat, k_block, k_anchor, b_max, b_min, stable):
    """Eq. 2 per layer, Eq. 3 over the stable layers: returns P [D]."""
    d = q_hat.shape[0]
    p = np.zeros(d)
    for i in range(d):
        vals = []
        for n in stable:
            s_anc = score_np(q_hat[i, n], k_anchor[i, n])
            s_max = score_np(q_hat[i, n], k_block[i, n, b_max[i, n]])
            s_min = score_np(q_hat[i, n], k_block[i, n, b_min[i, n]])
            vals.append((s_max - s_anc) / (s_max - s_min) if s_min < s_anc <= s_max else 0.0)
        p[i] = np.mean(vals)
    return p


def select_np(scores, valid, n_sel):
    """Per-document top-n, then the pooled min-max-normalised filter keeping floor(sum n / D)."""
    d, layers, mb = scores.shape
    kept = np.zeros(scores.shape, bool)
    k_fin = int(sum(n_sel)) // d
    for n in range(layers):
        pool = []
        for i in range(d):
            idx = [b for b in range(mb) if valid[i, b]]
            order = sorted(idx, key=lambda b, i=i: (-scores[i, n, b], b))[: n_sel[i]]
            lo, hi = min(scores[i, n, b] for b in idx), max(scores[i, n, b] for b in idx)
            pool += [((scores[i, n, b] - lo) / (hi - lo + 1e-6), i, b) for b in order]
        pool.sort(key=lambda t: (-t[0], t[1] * mb + t[2]))
        for _, i, b in pool[:k_fin]:
            kept[i, n, b] = True
    return kept


def _random_stats(seed=0, d=3, layers=4, n=4, kv=2, h=8, mb=6):
    rng = np.random.default_rng(seed)
    return dict(
        q_que=rng.standard_normal((layers, n, h)).astype(np.float32),
        q_loc=rng.standard_normal((d + 1, layers, n, h)).astype(np.float32),  # last one: a padding document
        k_block=rng.standard_normal((d + 1, layers, mb, kv, h)).astype(np.float32),
        k_anchor=rng.standard_normal((d + 1, layers, kv, h)).astype(np.float32),
        b_max=rng.integers(0, mb, (d + 1, layers)), b_min=rng.integers(0, mb, (d + 1, layers)),
    )


def test_personalised_query_matches_eq1():
    r = _random_stats()
    valid = jnp.array([True, True, True, False])
    got = np.asarray(samkv.personalised_queries(jnp.asarray(r["q_que"]), jnp.asarray(r["q_loc"]), valid))
    np.testing.assert_allclose(got[:3], eq1_np(r["q_que"], r["q_loc"][:3]), rtol=1e-5, atol=1e-5)
    # One document: no bias; a document's own q_loc does not enter its query.
    one = samkv.personalised_queries(jnp.asarray(r["q_que"]), jnp.asarray(r["q_loc"]), jnp.array([1, 0, 0, 0], bool))
    np.testing.assert_allclose(np.asarray(one[0]), r["q_que"], rtol=1e-6)
    changed = r["q_loc"].copy()
    changed[0] *= 3.0
    again = samkv.personalised_queries(jnp.asarray(r["q_que"]), jnp.asarray(changed), valid)
    np.testing.assert_allclose(np.asarray(again[0]), got[0], rtol=1e-6)


@pytest.mark.parametrize("stable", [(0, 1, 2, 3), (2, 3)])
def test_top_p_matches_eq2_eq3(stable):
    r = _random_stats(seed=1)
    valid = jnp.array([True, True, True, False])
    q_hat = samkv.personalised_queries(jnp.asarray(r["q_que"]), jnp.asarray(r["q_loc"]), valid)
    blocks = samkv.scores(q_hat, jnp.asarray(r["k_block"]))
    s_anc = samkv.scores(q_hat, jnp.asarray(r["k_anchor"])[:, :, None])[..., 0]
    s_max = jnp.take_along_axis(blocks, jnp.asarray(r["b_max"])[..., None], axis=2)[..., 0]
    s_min = jnp.take_along_axis(blocks, jnp.asarray(r["b_min"])[..., None], axis=2)[..., 0]
    p, p_layer = samkv.top_p(s_anc, s_max, s_min, stable)
    want = eq23_np(np.asarray(q_hat, np.float64), r["k_block"], r["k_anchor"], r["b_max"], r["b_min"], stable)
    np.testing.assert_allclose(np.asarray(p)[:3], want[:3], rtol=1e-4, atol=1e-6)
    assert (np.asarray(p_layer) > 0).any() and (np.asarray(p_layer) == 0).any()  # both branches of Eq. 2 hit


def test_eq2_hand_case_range_and_affine_invariance():
    one = jnp.array([[1.0]])
    p, _ = samkv.top_p(one, 4 * one, 0 * one, (0,))
    assert float(p[0]) == pytest.approx(0.75)
    rng = np.random.default_rng(2)
    s = [jnp.asarray(rng.standard_normal((50, 1))) for _ in range(3)]
    p, _ = samkv.top_p(*s, (0,))
    p = np.asarray(p)
    assert ((p >= 0) & (p < 1)).all()
    scaled, _ = samkv.top_p(*(2.5 * x + 7.0 for x in s), (0,))
    np.testing.assert_allclose(np.asarray(scaled), p, rtol=1e-5, atol=1e-6)
    above, _ = samkv.top_p(5 * one, 4 * one, 0 * one, (0,))
    below, _ = samkv.top_p(-1 * one, 4 * one, 0 * one, (0,))
    below1, _ = samkv.top_p(-1 * one, 4 * one, 0 * one, (0,), below_min_gives_one=True)
    assert float(above[0]) == float(below[0]) == 0.0 and float(below1[0]) == 1.0


def test_block_selection_matches_numpy():
    rng = np.random.default_rng(3)
    d, layers, mb = 4, 3, 7
    scores = rng.standard_normal((d, layers, mb)).astype(np.float32)
    valid = np.ones((d, mb), bool)
    valid[1, 5:] = False
    valid[3] = False  # a padding document
    n_sel = np.array([3, 4, 6, 0])
    doc_valid = np.array([1, 1, 1, 0], bool)
    sel, kept = samkv.select_blocks(jnp.asarray(scores), jnp.asarray(valid), jnp.asarray(n_sel), jnp.asarray(doc_valid))
    sel, kept = np.asarray(sel), np.asarray(kept)
    np.testing.assert_array_equal(kept[:3], select_np(scores[:3], valid[:3], n_sel[:3]))
    assert not kept[3].any()
    for i in range(3):  # before the filter: exactly the top n_sel_i blocks of each document
        for n in range(layers):
            top = np.argsort(-np.where(valid[i], scores[i, n], -np.inf), kind="stable")[: n_sel[i]]
            assert set(np.flatnonzero(sel[i, n])) == set(top)
    assert (kept <= sel).all() and (kept.sum(axis=(0, 2)) == (3 + 4 + 6) // 3).all()
    np.testing.assert_array_equal(np.asarray(samkv.num_selected(jnp.array([0.5, 0.25, 0.0, 1.0]),
                                                                jnp.array([3, 6, 5, 4]))), [2, 2, 0, 4])


def test_fusion_eq4_properties():
    rng = np.random.default_rng(4)
    old, fresh = rng.standard_normal((2, 5, 8)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(fuse(jnp.asarray(old), jnp.asarray(old))), old, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(fuse(jnp.asarray(3 * old), jnp.asarray(old))), 3 * old, rtol=1e-5)
    out = np.asarray(fuse(jnp.asarray(fresh), jnp.asarray(old)))
    theta = np.clip(np.sum(fresh * old, -1) / (np.linalg.norm(fresh, axis=-1) * np.linalg.norm(old, axis=-1)), 0, 1)
    np.testing.assert_allclose(out, theta[:, None] * fresh + (1 - theta[:, None]) * old, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------
def _samkv(args=None, **kw):
    return rag.answer(model_for(), documents(), QUERY, prefix=PREFIX, strategy="samkv", strategy_args=args,
                      max_new_tokens=4, return_cache=True, **kw)


def _offsets():
    return np.cumsum([len(PREFIX), *map(len, DOC_IDS[:-1])])


def test_pipeline_p_matches_numpy_eq1_to_eq3_on_its_own_vectors():
    out = _samkv()
    model, docs = model_for(), documents()
    inv_freq = np.asarray(model.rope()[0])
    off = _offsets()
    q_loc = np.stack([rope_np(np.asarray(d.q_loc, np.float64), np.full(d.q_loc.shape[:2], o), inv_freq)
                      for d, o in zip(docs, off, strict=True)])
    q_hat = eq1_np(out.details["q_que"].astype(np.float64), q_loc)
    np.testing.assert_allclose(out.details["q_hat"][:3], q_hat, rtol=1e-4, atol=1e-4)
    k_block = np.stack([rope_np(np.asarray(d.k_block, np.float64), np.full(d.k_block.shape[:3], o), inv_freq)
                        for d, o in zip(docs, off, strict=True)])
    k_anchor = np.stack([rope_np(np.asarray(d.k_anchor, np.float64), np.full(d.k_anchor.shape[:2], o), inv_freq)
                         for d, o in zip(docs, off, strict=True)])
    b_max = np.stack([np.asarray(d.b_max) for d in docs])
    b_min = np.stack([np.asarray(d.b_min) for d in docs])
    want = eq23_np(q_hat, k_block, k_anchor, b_max, b_min, samkv.default_stable_layers(model.config))
    assert (want > 0).any()
    np.testing.assert_allclose(out.details["p"][:3], want, rtol=1e-4, atol=1e-5)
    m = np.array([LAYOUT.middle_blocks(len(d)) for d in DOC_IDS])
    np.testing.assert_array_equal(out.details["n_selected"][:3], np.floor(want * m + 0.5).astype(int))


def _kept_positions(kept_blocks):
    """Global positions SamKV must keep at each layer, from the block mask and the geometry."""
    off, layers = _offsets(), kept_blocks.shape[1]
    out = []
    for n in range(layers):
        keep = set(range(len(PREFIX)))
        for i, length in enumerate(map(len, DOC_IDS)):
            loc_start = length - LAYOUT.local_blocks * LAYOUT.block_size
            keep |= {off[i] + t for t in range(length) if t < LAYOUT.block_size or t >= loc_start}
            for b in np.flatnonzero(kept_blocks[i, n]):
                start = LAYOUT.block_size + b * LAYOUT.block_size
                keep |= {off[i] + t for t in range(start, min(start + LAYOUT.block_size, loc_start))}
        out.append(keep)
    return out


@pytest.mark.parametrize("args", [None, {"p_override": 0.6, "update": "overwrite"}])
def test_sequence_ratio_and_cache_match_the_selection_mask(args):
    out = _samkv(args)
    kept_blocks = out.details["kept_blocks"]
    assert kept_blocks[:, 0].sum() > 0 or args is None
    want = _kept_positions(kept_blocks)
    n_ctx = len(PREFIX) + sum(map(len, DOC_IDS))
    assert out.report.sequence_ratio == pytest.approx(np.mean([len(w) for w in want]) / n_ctx)
    assert len(set(kept_blocks.sum(axis=(0, 2)).tolist())) == 1  # the same block count in every layer
    cache = out.cache
    for n, w in enumerate(want):
        length = int(cache.layers[n].length[0, 0])
        stored = set(np.asarray(cache.layers[n].pos[0, 0, :length]).tolist())
        context = {p for p in stored if p < n_ctx}
        assert context == w  # prefix, init and local always; middle = exactly the kept blocks
        assert stored - context == set(range(n_ctx, n_ctx + len(QUERY) + 3))  # query + generated tokens


def test_recomputation_touches_only_the_recompute_set():
    base = _samkv({"p_override": 0.6})
    none = _samkv({"p_override": 0.6, "recompute": "none"})
    reuse = rag.answer(model_for(), documents(), QUERY, prefix=PREFIX, strategy="reuse", max_new_tokens=1,
                       return_cache=True)
    n_ctx = len(PREFIX) + sum(map(len, DOC_IDS))
    kind = np.zeros(n_ctx, int)  # 1 = init / local token of a document
    for o, length in zip(_offsets(), map(len, DOC_IDS), strict=True):
        t = np.arange(length)
        kind[o + t] = (t < LAYOUT.block_size) | (t >= length - LAYOUT.local_blocks * LAYOUT.block_size)
    for n in range(2):
        for out, name in ((none, "none"), (base, "default")):
            length = int(out.cache.layers[n].length[0, 0])
            pos = np.asarray(out.cache.layers[n].pos[0, 0, :length])
            ctx = pos[pos < n_ctx]
            k = np.asarray(out.cache.layers[n].k[0, :, : len(ctx)])
            ref = np.asarray(reuse.cache.layers[n].k[0][:, ctx])
            untouched = np.ones(len(ctx), bool) if name == "none" else (kind[ctx] == 0)
            np.testing.assert_allclose(k[:, untouched], ref[:, untouched], atol=1e-5, rtol=1e-5)
            if name == "default" and n > 0:  # layer-1 K/V depend on the token and its position only
                assert np.abs(k[:, kind[ctx] == 1] - ref[:, kind[ctx] == 1]).max() > 1e-3
    assert none.report.recompute_ratio == 0.0


def test_ablations_without_selection_keep_only_init_and_local():
    out = _samkv({"selection": False, "update": "overwrite"})
    assert not out.details["kept_blocks"].any()
    n_ctx = len(PREFIX) + sum(map(len, DOC_IDS))
    assert out.report.kept_tokens == len(PREFIX) + 3 * LAYOUT.keep_tokens
    assert out.report.sequence_ratio == pytest.approx((len(PREFIX) + 3 * LAYOUT.keep_tokens) / n_ctx)


def test_pauta_tokens_are_recomputed_only_at_their_layer():
    docs = list(documents())
    flagged = np.zeros(docs[1].pauta.shape, bool)
    flagged[1, 2] = flagged[0, 5] = True  # block 2 at layer 1, block 5 at layer 0
    docs[1] = dataclasses.replace(docs[1], pauta=jnp.asarray(flagged))
    args = {"p_override": 1.0, "cross_doc_filter": False, "update": "overwrite"}
    out = rag.answer(model_for(), docs, QUERY, prefix=PREFIX, strategy="samkv", strategy_args=args, max_new_tokens=1,
                     return_cache=True)
    reuse = rag.answer(model_for(), documents(), QUERY, prefix=PREFIX, strategy="reuse", max_new_tokens=1,
                       return_cache=True)
    n_ctx = len(PREFIX) + sum(map(len, DOC_IDS))
    assert out.report.sequence_ratio == 1.0  # every block kept
    rep = np.asarray(docs[1].rep_token)
    at_layer1, at_layer0 = _offsets()[1] + rep[1, 2], _offsets()[1] + rep[0, 5]
    assert at_layer1 != at_layer0
    assert out.report.recomputed_tokens == 3 * LAYOUT.keep_tokens + 2
    assert out.report.layer_recompute_ratio == pytest.approx((2 * 3 * LAYOUT.keep_tokens + 2) / (2 * n_ctx))
    k1, ref1 = np.asarray(out.cache.layers[1].k[0, :, :n_ctx]), np.asarray(reuse.cache.layers[1].k[0, :, :n_ctx])
    assert np.abs(k1[:, at_layer1] - ref1[:, at_layer1]).max() > 1e-3  # recomputed at layer 1
    np.testing.assert_allclose(k1[:, at_layer0], ref1[:, at_layer0], atol=1e-5)  # only at layer 0: stored K/V
