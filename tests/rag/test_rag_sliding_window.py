"""The multi-context strategies on a model with sliding-window layers (Gemma 3's layout: local layers with their own
RoPE base and a window, global layers), on a tiny random model whose window (8) is far shorter than the documents.

Oracles:
- `recompute` is a full prefill of the concatenated prompt: its query logits equal a plain forward over that prompt
  (`DecoderLM.__call__`, which transformers' Gemma 3 is checked against in tests/models), and its tokens equal
  `kvjax.generate`'s of that prompt with the full cache;
- with one document and no prefix, the stored caches are that prefill's, so `reuse` equals the same forward;
- every strategy at its limit (CacheBlend at ratio 1, EPIC with k at least the document, SamKV keeping and
  recomputing everything) equals `recompute`;
- a sliding-window layer's decode cache is the ring of the context's last window: positions by `p % window`, keys
  the stored ones re-rotated with the layer's own (local) RoPE, checked in NumPy;
- a quantized request cache stores the rings in the format too, and `reuse` of one document equals `recompute`
  under it.
"""

import numpy as np
import pytest
from ragdata import DOC_IDS, LAYOUT, PREFIX, QUERY, reference_logits, rope_np
from tiny import tiny_gemma3

import kvjax
from kvjax import cache as kvc
from kvjax import rag
from kvjax.quant.spec import parse_kv_dtype
from kvjax.quant.storage import QuantizedKV

WINDOW = 8
TYPES = ("sliding_attention", "full_attention", "sliding_attention")
FULL_SAMKV = {"p_override": 1.0, "cross_doc_filter": False, "recompute": "all", "update": "overwrite"}


def _model():
    return tiny_gemma3(num_layers=3, window=WINDOW, layer_types=TYPES)


def _documents(analyze=True):
    return rag.prefill_documents(_model(), DOC_IDS, layout=LAYOUT, analyze=analyze)


_DOCS = {}


def _answer(strategy, args=None, *, prefix=PREFIX, docs=None, max_new_tokens=4, **kw):
    if docs is None:
        docs = _DOCS.setdefault("all", _documents())
    return rag.answer(_model(), docs, QUERY, prefix=prefix, strategy=strategy, strategy_args=args,
                      max_new_tokens=max_new_tokens, **kw)


def test_the_tiny_model_has_both_kinds_of_layer_and_windows_shorter_than_the_documents():
    config = _model().config
    assert config.layer_windows == (WINDOW, None, WINDOW) and _model().rope().local_inv_freq is not None
    assert min(map(len, DOC_IDS)) > 4 * WINDOW


def test_recompute_equals_a_plain_forward_and_generate_over_the_concatenated_prompt():
    out = _answer("recompute", return_cache=True)
    ref = reference_logits(_model(), PREFIX, DOC_IDS, QUERY)
    np.testing.assert_allclose(out.query_logits, ref, atol=1e-4, rtol=1e-4)
    prompt = PREFIX + sum(DOC_IDS, []) + QUERY
    gen = kvjax.generate(_model(), [prompt], method="full", max_new_tokens=4, stop_at_eos=False)
    np.testing.assert_array_equal(out.tokens, np.asarray(gen.tokens[0][:4]))
    for i in (0, 2):  # the rings hold the window, not the context
        assert out.cache.layers[i].k.shape[2] == WINDOW
    n_ctx = out.report.context_tokens
    assert out.report.kept_tokens == pytest.approx((2 * WINDOW + n_ctx) / 3)


def test_reuse_of_one_document_equals_a_plain_forward():
    one = _documents()[:1]
    out = _answer("reuse", prefix=None, docs=one)
    np.testing.assert_allclose(out.query_logits, reference_logits(_model(), [], DOC_IDS[:1], QUERY),
                               atol=1e-4, rtol=1e-4)
    several = _answer("reuse")  # documents prefilled apart miss each other, on the global layer
    assert np.abs(several.query_logits - reference_logits(_model(), PREFIX, DOC_IDS, QUERY)).max() > 1e-2


@pytest.mark.parametrize("strategy,args", [("cacheblend", {"recompute_ratio": 1.0}),
                                           ("epic", {"k": max(map(len, DOC_IDS))}), ("samkv", FULL_SAMKV)],
                         ids=["cacheblend", "epic", "samkv"])
def test_each_strategy_at_its_limit_equals_recompute(strategy, args):
    out = _answer(strategy, args)
    np.testing.assert_allclose(out.query_logits, reference_logits(_model(), PREFIX, DOC_IDS, QUERY),
                               atol=1e-4, rtol=1e-4)


def test_multi_infllm_with_a_local_window_over_the_whole_context_equals_the_plain_forward():
    """Multi-InfLLM streams the prompt through `kvjax.generate` (InfLLM on the global layer, rings on the others):
    with its local window past the whole prompt its last logits are the full forward's."""
    args = {"n_init": 4, "n_local": 256, "block_size": 4, "topk": 2, "repr_topk": 2}
    out = _answer("multi_infllm", args)
    ref = reference_logits(_model(), PREFIX, DOC_IDS, QUERY)
    np.testing.assert_allclose(out.query_logits[-1], ref[-1], atol=1e-4, rtol=1e-4)


def test_a_window_layer_holds_the_contexts_last_window_re_rotated_with_its_own_rope():
    docs = _DOCS.setdefault("all", _documents())
    out = _answer("reuse", prefix=None, docs=docs, return_cache=True, max_new_tokens=1)
    n_ctx = sum(map(len, DOC_IDS))  # the query and the answer went in after: look at slots of context positions
    rope = _model().rope()
    last_doc, offset = docs[-1], n_ctx - len(DOC_IDS[-1])
    ring = out.cache.layers[0]
    pos = np.asarray(ring.pos[0, 0])
    q_len = len(QUERY)
    context_slots = [s for s in range(WINDOW) if 0 <= pos[s] < n_ctx]
    # The query (q_len tokens) overwrote its slots; the others hold the context's last positions by p % window.
    assert sorted(pos[context_slots]) == list(range(n_ctx + q_len - WINDOW, n_ctx))
    for s in context_slots:
        assert pos[s] % WINDOW == s
        local = pos[s] - offset
        stored = np.asarray(last_doc.k[0][:, local], np.float64)
        want = rope_np(stored, np.full(stored.shape[:1], offset), np.asarray(rope.local_inv_freq))
        np.testing.assert_allclose(np.asarray(ring.k[0][:, s]), want, atol=1e-5, rtol=1e-5)
        assert not np.allclose(want, rope_np(stored, np.full(stored.shape[:1], offset), np.asarray(rope.inv_freq)),
                               atol=1e-3)


def test_samkv_rotates_each_layers_pooled_vectors_with_that_layers_rope():
    """Eq. 1-3 against NumPy (tests/rag/test_rag_samkv.py's references) with each document's pooled local query and
    block keys moved to its offset by its layer's RoPE: the local base on the window layers, the global one on the
    other."""
    from test_rag_samkv import eq1_np, eq23_np

    from kvjax.rag import samkv

    out = _answer("samkv")
    model, docs = _model(), _DOCS.setdefault("all", _documents())
    rope = model.rope()
    freqs = [np.asarray(rope.local_inv_freq if w is not None else rope.inv_freq) for w in model.config.layer_windows]
    offsets = np.cumsum([len(PREFIX), *map(len, DOC_IDS[:-1])])

    def moved(x, offset):  # [L, ...] of one document, layer by layer
        return np.stack([rope_np(np.asarray(x[i], np.float64), np.full(x.shape[1:-1], offset), freqs[i])
                         for i in range(len(freqs))])

    q_loc = np.stack([moved(d.q_loc, o) for d, o in zip(docs, offsets, strict=True)])
    q_hat = eq1_np(out.details["q_que"].astype(np.float64), q_loc)
    np.testing.assert_allclose(out.details["q_hat"][:3], q_hat, rtol=1e-4, atol=1e-4)
    k_block = np.stack([moved(d.k_block, o) for d, o in zip(docs, offsets, strict=True)])
    k_anchor = np.stack([moved(d.k_anchor, o) for d, o in zip(docs, offsets, strict=True)])
    b_max, b_min = (np.stack([np.asarray(getattr(d, f)) for d in docs]) for f in ("b_max", "b_min"))
    want = eq23_np(q_hat, k_block, k_anchor, b_max, b_min, samkv.default_stable_layers(model.config))
    np.testing.assert_allclose(out.details["p"][:3], want, rtol=1e-4, atol=1e-5)


def test_samkv_default_keeps_a_sparse_global_layer_and_the_rings():
    out = _answer("samkv", return_cache=True)
    n_ctx = out.report.context_tokens
    global_kept = (3 * out.report.kept_tokens - 2 * WINDOW)
    assert 0 < global_kept < n_ctx
    assert [layer.k.shape[2] for layer in out.cache.layers][::2] == [WINDOW, WINDOW]
    assert np.isfinite(out.query_logits).all() and len(out.tokens) == 4


@pytest.mark.parametrize("kv_dtype", ["int8", "kivi2"])
def test_a_quantized_request_cache_stores_the_rings_too(kv_dtype):
    one = _documents(analyze=False)[:1]
    reuse = _answer("reuse", prefix=None, docs=one, kv_dtype=kv_dtype, return_cache=True)
    recompute = _answer("recompute", prefix=None, docs=one, kv_dtype=kv_dtype)
    np.testing.assert_allclose(reuse.query_logits, recompute.query_logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(reuse.tokens, recompute.tokens)
    quant = parse_kv_dtype(kv_dtype)
    for i in (0, 2):
        assert isinstance(reuse.cache.layers[i].k, QuantizedKV) == quant.quantizes_ring(WINDOW)
    assert isinstance(reuse.cache.layers[1].k, QuantizedKV)
    plain = _answer("reuse", prefix=None, docs=one)
    assert np.abs(reuse.query_logits - plain.query_logits).max() < 0.5 * np.abs(plain.query_logits).max()



def test_multi_infllm_counts_the_context_positions_a_window_layer_attended():
    """Multi-InfLLM's kept tokens are the context positions its last decode step attended, per layer: a window
    layer's ring holds the last `WINDOW` positions fed, here the query's and the answer's only (slots were counted
    instead: a full ring counted `WINDOW` context tokens)."""
    args = {"n_init": 4, "n_local": 16, "block_size": 4, "topk": 2, "repr_topk": 2}
    out = _answer("multi_infllm", args, return_cache=True, stop_at_eos=False)
    n_ctx = len(PREFIX) + sum(map(len, DOC_IDS))
    fed = n_ctx + len(QUERY) + out.report.generated_tokens - 1  # the last token generated is not fed
    in_ring = max(0, n_ctx - max(0, fed - WINDOW))  # context positions among the ring's last WINDOW
    assert in_ring == 0
    glob = out.cache.layers[1]  # InfLLM's layer: slot = position
    retrieved = int((np.asarray(kvc.valid_mask(glob))[0, 0] & (np.arange(glob.capacity) < n_ctx)).sum())
    assert 0 < retrieved < n_ctx
    assert out.report.kept_tokens * 3 == pytest.approx(retrieved + 2 * in_ring)


def test_multi_infllm_counts_a_window_layers_ring_in_its_cache_bytes():
    """Multi-InfLLM's decode cache holds every context token of the global layer and a ring of `WINDOW` slots in
    each window layer, as reuse's does: the same kept bytes (it counted the whole context in every layer)."""
    args = {"n_init": 4, "n_local": 16, "block_size": 4, "topk": 2, "repr_topk": 2}
    infllm = _answer("multi_infllm", args, max_new_tokens=1).report
    reuse = _answer("reuse", max_new_tokens=1).report
    assert infllm.cache_bytes == reuse.cache_bytes < infllm.full_cache_bytes == reuse.full_cache_bytes
