"""Shared data for the RAG tests: a tiny model, short documents, a 4-token block layout."""

from __future__ import annotations

import functools

import numpy as np
from tiny import tiny_model

from kvjax import rag

LAYOUT = rag.BlockLayout(block_size=4, init_blocks=1, local_blocks=2)
LENGTHS = (41, 60, 52)  # one padding bucket (64): one document program


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 96, n).tolist()


DOC_IDS = [ids(10 + i, n) for i, n in enumerate(LENGTHS)]
PREFIX = ids(1, 5)
QUERY = ids(102, 6)  # a query for which Eq. 2 selects middle blocks of one document


@functools.lru_cache(maxsize=8)
def documents(num_layers: int = 2, analyze: bool = True) -> tuple[rag.DocumentCache, ...]:
    model = tiny_model(**({} if num_layers == 2 else {"num_layers": num_layers}))
    return tuple(rag.prefill_documents(model, DOC_IDS, layout=LAYOUT, analyze=analyze))


def model_for(num_layers: int = 2):
    return tiny_model(**({} if num_layers == 2 else {"num_layers": num_layers}))


def reference_logits(model, prefix: list[int], docs: list[list[int]], query: list[int]) -> np.ndarray:
    """Logits at the query positions of a plain forward over the concatenated prompt."""
    seq = np.array(prefix + sum(docs, []) + query)
    logits, _ = model(seq[None])
    return np.asarray(logits[0, -len(query):])


def rope_np(x: np.ndarray, delta: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """NumPy RoPE shift by `delta` (broadcast over the leading axes) in the rotate-half layout."""
    ang = np.asarray(delta, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
    ang = np.concatenate([ang, ang], -1)
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)
