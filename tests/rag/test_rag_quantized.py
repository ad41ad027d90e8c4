"""Quantized document caches: prefilled quantized, saved and loaded quantized (store format 3), answered over.

The reference is the same documents prefilled in the model dtype: a quantized document dequantizes to them within
its format's error, and an answer over int8 documents with an int8 request cache is the answer over the
dequantized documents with the same request cache (the strategies read model-dtype K / V)."""

from __future__ import annotations

import json

import jax
import numpy as np
from ragdata import DOC_IDS, LAYOUT, QUERY, documents, model_for

from kvjax import rag
from kvjax.quant import KVQuant, QuantizedKV


def test_quantized_documents_save_load_and_answer(tmp_path):
    model = model_for()
    plain = documents(analyze=False)
    docs = rag.prefill_documents(model, DOC_IDS, layout=LAYOUT, analyze=False, kv_dtype="int8")
    assert isinstance(docs[0].k[0], QuantizedKV) and docs[0].quantization == KVQuant("int8")
    kv = lambda d: sum(x.nbytes for x in jax.tree.leaves((d.k, d.v)))  # noqa: E731
    assert kv(docs[0]) < 0.6 * kv(plain[0])
    for d, p in zip(docs, plain, strict=True):
        for layer, ref in zip(d.dequantized().k, p.k, strict=True):
            got, want = np.asarray(layer)[:, :d.length], np.asarray(ref)[:, :p.length]
            assert np.abs(got - want).max() <= np.abs(want).max(-1, keepdims=True).max() / 127

    rag.save_documents(tmp_path / "store", docs)
    meta = json.loads((tmp_path / "store" / "manifest" / "metadata").read_text())
    assert meta["version"] == rag.store.QUANTIZED_VERSION and meta["documents"][0]["kv_dtype"] == "int8"
    loaded = rag.load_documents(tmp_path / "store", model)
    assert loaded[0].quantization == KVQuant("int8") and loaded[0].k[0].dtype == docs[0].k[0].dtype
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(docs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    out = rag.answer(model, loaded, QUERY, strategy="reuse", max_new_tokens=3, stop_at_eos=False, return_cache=True)
    assert isinstance(out.cache.layers[0].k, QuantizedKV)  # the request cache keeps the documents' format
    same = rag.answer(model, [d.dequantized() for d in loaded], QUERY, strategy="reuse", max_new_tokens=3,
                      stop_at_eos=False, kv_dtype="int8")
    np.testing.assert_array_equal(out.tokens, same.tokens)
    np.testing.assert_allclose(out.query_logits, same.query_logits, rtol=1e-6, atol=1e-6)


def test_the_report_counts_the_kept_bytes_in_the_request_cache_format():
    """`cache_bytes` is the kept context's K / V as the request cache stores them: per token what the quantized
    documents store per token (codes and scales, every layer's K and V), not the model dtype's bytes."""
    model = model_for()
    n_ctx = sum(map(len, DOC_IDS))
    for fmt in ("int8", "int4"):
        docs = rag.prefill_documents(model, DOC_IDS, layout=LAYOUT, analyze=False, kv_dtype=fmt)
        d = docs[0]
        per_token = sum(x.nbytes for x in jax.tree.leaves((d.k, d.v))) / d.padded_length
        out = rag.answer(model, docs, QUERY, strategy="reuse", max_new_tokens=1)
        assert out.report.cache_bytes == out.report.full_cache_bytes == round(n_ctx * per_token), fmt
        assert out.report.cache_bytes < out.report.cache_bytes_allocated, fmt  # the kept part of the allocation
