"""RAG on a LongRoPE model (Phi-3): a request past the pretrained context rotates with the long factors, as a
forward of the whole prompt (and `kvjax.generate`) does."""

import numpy as np
from ragdata import LAYOUT, ids, reference_logits
from tiny import tiny_model

import kvjax
from kvjax import cache as kvc
from kvjax import rag
from kvjax.models.config import RopeConfig

_HALF = 8  # head_dim 16: one factor per rotary frequency
_ORIGINAL = 32  # the pretrained context: the long factors past 32 positions
DOCS = [ids(60, 20), ids(61, 25)]  # each document within the pretrained context, the request past it
QUERY = ids(62, 6)


def _model():
    longrope = RopeConfig(theta=10000.0, rope_type="longrope", original_max_position_embeddings=_ORIGINAL,
                          short_factor=tuple(1.0 + 0.1 * i for i in range(_HALF)),
                          long_factor=tuple(1.0 + 0.5 * i for i in range(_HALF)))
    return tiny_model(model_type="phi3", rope=longrope)


def _keys_by_position(cache, layer: int) -> dict[int, np.ndarray]:
    """Layer `layer`'s stored keys of the first KV head, by position."""
    c = cache.layers[layer]
    stored = np.asarray(kvc.stored_mask(c))[0, 0]
    pos, k = np.asarray(c.pos)[0, 0], np.asarray(c.k)[0, :, :, :]
    return {int(p): k[:, s] for s, p in enumerate(pos) if stored[s]}


def test_a_request_past_the_pretrained_context_rotates_with_the_long_factors():
    model = _model()
    docs = rag.prefill_documents(model, DOCS, layout=LAYOUT, analyze=False)
    prompt = sum(DOCS, []) + QUERY
    assert all(len(d) < _ORIGINAL for d in DOCS) and len(prompt) > _ORIGINAL
    # recompute is a full prefill of the prompt: the forward's logits, generate's tokens (decode included)
    full = rag.answer(model, docs, QUERY, strategy="recompute", max_new_tokens=4, stop_at_eos=False,
                      return_cache=True)
    np.testing.assert_allclose(full.query_logits, reference_logits(model, [], DOCS, QUERY), atol=1e-4, rtol=1e-4)
    ref = kvjax.generate(model, [prompt], max_new_tokens=4, stop_at_eos=False)
    assert full.tokens.tolist() == np.asarray(ref.tokens[0]).tolist()
    # reuse: the documents' layer-0 keys (the token at its position) moved to the long factors, as the full prefill's
    reuse = rag.answer(model, docs, QUERY, strategy="reuse", max_new_tokens=1, return_cache=True)
    got, want = _keys_by_position(reuse.cache, 0), _keys_by_position(full.cache, 0)
    for p in range(len(sum(DOCS, []))):
        np.testing.assert_allclose(got[p], want[p], atol=1e-4, rtol=1e-4, err_msg=f"position {p}")


def test_a_document_past_the_pretrained_context_is_prefilled_with_the_long_factors():
    """One document longer than the pretrained context, reused alone: its own forward's logits."""
    model = _model()
    long_doc = ids(63, 40)
    docs = rag.prefill_documents(model, [long_doc], layout=LAYOUT, analyze=False)
    out = rag.answer(model, docs, QUERY, strategy="reuse", max_new_tokens=1)
    np.testing.assert_allclose(out.query_logits, reference_logits(model, [], [long_doc], QUERY), atol=1e-4,
                               rtol=1e-4)


def test_the_prefix_of_a_request_past_the_pretrained_context_is_exact():
    """The prefix is prefilled with the request's (long) factors, also when given as a cache prefilled alone (short
    factors): EPIC recomputing every document token then equals the forward of the whole prompt, as at any length."""
    model = _model()
    prefix = ids(64, 5)
    docs = rag.prefill_documents(model, DOCS, layout=LAYOUT, analyze=False)
    ref = reference_logits(model, prefix, DOCS, QUERY)
    for given in (prefix, rag.prefill_documents(model, [prefix], layout=LAYOUT, analyze=False)[0]):
        out = rag.answer(model, docs, QUERY, prefix=given, strategy="epic", strategy_args={"k": 64}, max_new_tokens=1)
        np.testing.assert_allclose(out.query_logits, ref, atol=1e-4, rtol=1e-4, err_msg=type(given).__name__)
