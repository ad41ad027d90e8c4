"""Multi-context RAG with reusable per-document KV caches: SamKV and its baselines.

    from kvjax import rag
    docs = rag.prefill_documents(model, [doc1_ids, doc2_ids, doc3_ids])   # once per document
    rag.save_documents("/tmp/corpus", docs)                                 # orbax checkpoint
    docs = rag.load_documents("/tmp/corpus", model)                         # any later process
    out = rag.answer(model, docs, query_ids, strategy="samkv", max_new_tokens=32)
    out.tokens, out.report.sequence_ratio, out.report.recompute_ratio, out.report.ttft_s

Strategies: "reuse" (lower bound), "recompute" (upper bound), "cacheblend", "epic", "samkv", "multi_infllm".
"""

from kvjax.models.fingerprint import model_fingerprint
from kvjax.rag import cacheblend, epic, full_recompute, multi_infllm, reuse, samkv  # noqa: F401  (registration)
from kvjax.rag.analysis import BlockLayout
from kvjax.rag.base import Assembled, Strategy, available, get_strategy, register
from kvjax.rag.cacheblend import CacheBlend
from kvjax.rag.epic import Epic
from kvjax.rag.full_recompute import Recompute
from kvjax.rag.multi_infllm import MultiInfLLM
from kvjax.rag.pipeline import TRACE_COUNTS, RagResult, answer
from kvjax.rag.report import RequestReport, markdown_table
from kvjax.rag.reuse import Reuse
from kvjax.rag.samkv import SamKV
from kvjax.rag.store import DocumentCache, load_documents, prefill_documents, save_documents

__all__ = [
    "TRACE_COUNTS", "Assembled", "BlockLayout", "CacheBlend", "DocumentCache", "Epic", "MultiInfLLM", "RagResult",
    "Recompute", "RequestReport", "Reuse", "SamKV", "Strategy", "answer", "available", "get_strategy", "load_documents",
    "markdown_table", "model_fingerprint", "prefill_documents", "register", "save_documents",
]
