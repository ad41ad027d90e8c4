"""`answer`: one RAG request over stored document caches, end to end.

Assemble the stored caches with the chosen strategy (one jitted program per strategy and request
bucket) into a per-layer `ModelCache`, prefill the query on it at positions `N_ctx + j` (the full
context length, whatever was dropped) with `kvjax.runtime.forward.prefill_chunk` (the runtime's per-layer
prefill programs), then decode with `kvjax.runtime.generate.decode`.

Documents stored quantized (`prefill_documents(..., kv_dtype=...)`) are read dequantized for the assembly; the
request's cache is then quantized again (by default in their format, `kv_dtype=`) for the query prefill and the
decode.

With `mesh=` every step runs sharded as `kvjax.generate` runs (`kvjax.runtime.sharding`): weights
split over `model`, the stored and assembled caches with their KV heads on `model`. A request is
one example, so the `data` axis only replicates it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax import tuning
from kvjax.cache import ModelCache
from kvjax.errors import ConfigError, KvjaxError
from kvjax.methods.full import Full
from kvjax.quant.spec import KVQuant, parse_kv_dtype
from kvjax.rag.assemble import RequestInfo, build_request, place_request
from kvjax.rag.base import Assembled, Strategy, get_strategy
from kvjax.rag.multi_infllm import MultiInfLLM
from kvjax.rag.report import RequestReport
from kvjax.rag.store import DocumentCache, check_same_model, in_rope, place_document, prefill_documents, prefix_in_rope
from kvjax.runtime import forward, sharding
from kvjax.runtime.generate import PrefillState, decode, prefill
from kvjax.validation import as_bool, as_int, eos_ids, token_ids

Array = jax.Array
_FULL = Full()

#: Traces of the jitted request programs (tests check one compile per bucket).
TRACE_COUNTS: collections.Counter[str] = collections.Counter()


@dataclasses.dataclass
class RagResult:
    """tokens: the generated ids (EOS included, nothing after). query_logits `[q_len, V]`: float32
    logits at every query position (the last one gives the first answer token; `multi_infllm`, which
    streams through the runtime's prefill, gives the last position only, `[1, V]`). report: the
    request's metrics. details: the strategy's diagnostics (NumPy). cache: the final decode cache
    when asked for."""

    tokens: np.ndarray
    query_logits: np.ndarray
    report: RequestReport
    details: dict[str, np.ndarray]
    cache: ModelCache | None = None

    def text(self, tokenizer: Any) -> str:
        return tokenizer.decode(self.tokens.tolist(), skip_special_tokens=True)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), static_argnames=("mesh",))
def _build(strategy: Strategy, config: Any, tune: tuning.Tuning, weights: dict, rope: tuple, req: Any,
           mesh: Any = None) -> Assembled:
    """`strategy.build` as one program per strategy and request bucket; `tune` is the `kvjax.tuning` in force
    (static: another tuning compiles another program)."""
    TRACE_COUNTS[f"build:{strategy.name}"] += 1
    # Pallas kernels run per shard of `mesh` (a static argument; None: as is); the ops read `tune` while tracing.
    with sharding.kernel_mesh(mesh), tuning.use(tune):
        out = strategy.build(config, weights, rope, req)
    return out if mesh is None else dataclasses.replace(out, cache=sharding.constrain_cache(out.cache, mesh))


def _quantized_ring(ring: kvc.KVCache, quant: KVQuant) -> kvc.KVCache:
    """A sliding-window layer's ring in `quant`'s ring format where the format stores rings of its size
    (`KVQuant.quantizes_ring`; else it stays as it is, as `kvjax.generate`'s would): its tokens written, slot by
    slot, into an empty quantized ring."""
    batch, kv_heads, capacity, head_dim = ring.k.shape
    if not quant.quantizes_ring(capacity):
        return ring
    empty = kvc.init(batch, kv_heads, capacity, head_dim, ring.k.dtype, quant=quant, ring=True)
    return kvc.ring_append(empty, jnp.swapaxes(ring.k, 1, 2), jnp.swapaxes(ring.v, 1, 2), ring.pos[:, 0])


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(cache: ModelCache, quant: KVQuant, windows: tuple[int | None, ...]) -> ModelCache:
    """The assembled cache stored in `quant` (every layer; `windows`: each layer's, None for a global layer)."""
    return cache.replace(layers=tuple(kvc.quantized(layer, quant) if window is None else _quantized_ring(layer, quant)
                                      for layer, window in zip(cache.layers, windows, strict=True)))


@functools.partial(jax.jit, static_argnums=(1, 2))  # no donation: every output buffer is larger
def _extend(cache: ModelCache, extra: int, windows: tuple[int | None, ...]) -> ModelCache:
    """Every global layer with `extra` more empty slots (room for the query and the new tokens); a sliding-window
    layer's ring keeps its window."""
    TRACE_COUNTS["query"] += 1
    return cache.replace(layers=tuple(kvc.extend(layer, extra) if window is None else layer
                                      for layer, window in zip(cache.layers, windows, strict=True)))


def _prefill_query(config: Any, extra: int, weights: dict, rope: tuple, cache: ModelCache, query: Array,
                   query_pos: Array, mesh: Any = None) -> tuple[Array, ModelCache]:
    """The query `[q_pad]` prefilled on the assembled cache grown by `extra` slots, through the runtime's
    per-layer prefill programs (every layer's cache donated to its program): logits `[q_pad, V]`, the cache."""
    cache = _extend(cache, extra, config.layer_windows)
    budget = np.full((1,), cache.capacity, np.int32)
    tokens, positions = sharding.to_host(query)[None], sharding.to_host(query_pos)[None]
    if mesh is not None:
        cache = sharding.shard_cache(cache, mesh)
        budget, tokens, positions = (sharding.shard_batch(x, mesh) for x in (budget, tokens, positions))
    hidden, cache = forward.prefill_chunk(config, weights, rope, _FULL, cache, tokens, positions, budget, mesh=mesh)
    return forward.final_logits(config, weights, hidden[0]), cache


def _context_bytes(config: Any, dtype: Any, quant: KVQuant | None, tokens: Sequence[int]) -> int:
    """Bytes of the K / V of `tokens[l]` tokens in each layer `l` as the request cache stores them: the model dtype,
    or `quant`'s codes plus scales and zero points (`KVQuant.bits_per_value`; a sliding-window ring the format does
    not store, as `_quantized_ring` leaves it, in the model dtype)."""
    values = 2 * config.num_kv_heads * config.head_dim  # K and V of one token
    total = 0.0
    for n, window in zip(tokens, config.layer_windows, strict=True):
        plain = quant is None or (window is not None and not quant.quantizes_ring(window))
        bits = jnp.dtype(dtype).itemsize * 8 if plain else quant.bits_per_value(config.head_dim)
        total += int(n) * values * bits / 8
    return round(total)


def _kv_bytes(cache: ModelCache) -> int:
    """Bytes of the K / V arrays of every layer, as allocated."""
    return sum(int(layer.k.nbytes + layer.v.nbytes) for layer in cache.layers)


def _as_ids(ids: Any, what: str, vocab: int, *, allow_empty: bool = False) -> list[int]:
    """`ids` as one list of token ids in the vocabulary (empty only with `allow_empty`)."""
    arr = token_ids(ids, what, vocab)
    if arr.ndim != 1 or (arr.size == 0 and not allow_empty):
        raise KvjaxError(f"{what} must be a {'' if allow_empty else 'non-empty '}list of token ids, got shape "
                         f"{arr.shape}")
    return arr.tolist()


def _document_list(documents: Any) -> list[DocumentCache]:
    """`documents` as a non-empty list of `DocumentCache`s, or a `KvjaxError` naming what was passed instead."""
    if isinstance(documents, DocumentCache) or not isinstance(documents, Iterable) or isinstance(documents,
                                                                                                   str | bytes):
        raise KvjaxError(f"documents must be a list of DocumentCache (kvjax.rag.prefill_documents), got one "
                         f"{type(documents).__name__}")
    docs = list(documents)
    if not docs:
        raise KvjaxError("answer: at least one document is needed")
    for i, d in enumerate(docs):
        if not isinstance(d, DocumentCache):
            raise KvjaxError(f"documents[{i}] is a {type(d).__name__}; prefill it with kvjax.rag.prefill_documents")
    return docs


def answer(
    model: Any,
    documents: Sequence[DocumentCache],
    query_ids: Sequence[int],
    *,
    strategy: str | Strategy = "samkv",
    strategy_args: dict[str, Any] | None = None,
    prefix: Sequence[int] | DocumentCache | None = None,
    max_new_tokens: int = 16,
    eos_token_id: int | Sequence[int] | None = None,
    stop_at_eos: bool = True,
    return_cache: bool = False,
    mesh: Any = None,
    kv_dtype: Any = "auto",
) -> RagResult:
    """Answers `query_ids` over the stored `documents` (in prompt order) with a multi-context strategy.

    The prompt is `[prefix][doc_1]...[doc_D][query]`. `prefix` (instruction, BOS) is token ids
    (prefilled exactly for this request) or a `DocumentCache` prefilled once. `strategy`: "reuse",
    "recompute", "cacheblend", "epic", "samkv", "multi_infllm" or a `Strategy` instance;
    `strategy_args` its hyperparameters. Greedy decoding of up to `max_new_tokens`.

    `mesh`: a `jax.sharding.Mesh` with axes (`data`, `model`) (see `kvjax.runtime.sharding`): the
    weights, the document caches (wherever they were prefilled or loaded) and the assembled cache are
    placed on it as `kvjax.generate` places them (KV heads on `model`), and the query prefill and the
    decode run on it. The answer does not depend on the mesh. A request is one example, so `data`
    only replicates it; an axis that does not divide the KV heads is replicated too.

    `kv_dtype`: the request cache's storage (`kvjax.quant`) for the query prefill and the decode: "auto" (the
    documents' format: quantized documents give a quantized request cache), None / "model", or a scheme.
    """
    sharding.check_mesh(mesh)
    config = model.config
    if strategy_args is not None and not isinstance(strategy_args, dict):
        raise ConfigError(f"strategy_args must be a dict of hyperparameters, got {type(strategy_args).__name__}")
    strat = get_strategy(strategy, **(strategy_args or {}))
    docs = _document_list(documents)
    for i, d in enumerate(docs):
        check_same_model(d, model, f"documents[{i}]")
        if d.layout != docs[0].layout:
            raise ConfigError(f"documents[{i}] has block layout {d.layout}, documents[0] {docs[0].layout}")
        if strat.needs_stats and not d.analyzed:
            raise ConfigError(f"{strat.name} needs documents prefilled with analyze=True (documents[{i}] was not)")
    quant = docs[0].quantization if kv_dtype == "auto" else parse_kv_dtype(kv_dtype)
    if quant is not None:
        quant.check_head_dim(config.head_dim)
    docs = [d.dequantized() for d in docs]  # the strategies assemble from model-dtype K / V
    query = _as_ids(query_ids, "query_ids", config.vocab_size)
    if eos_token_id is not None:
        eos_ids(eos_token_id, config.vocab_size)
    max_new_tokens = as_int(max_new_tokens, "max_new_tokens", minimum=1)
    stop_at_eos, return_cache = as_bool(stop_at_eos, "stop_at_eos"), as_bool(return_cache, "return_cache")
    weights = model.weights()

    start = time.perf_counter()
    prefix_doc = None
    if isinstance(prefix, DocumentCache):
        check_same_model(prefix, model, "prefix")
        prefix_doc = prefix.dequantized()
    elif prefix is not None:
        prefix_ids = _as_ids(prefix, "prefix", config.vocab_size, allow_empty=True)
        if prefix_ids:  # an empty prefix is no prefix
            prefix_doc = prefill_documents(model, [prefix_ids], layout=docs[0].layout, analyze=False, mesh=mesh)[0]
    prefix_len = prefix_doc.length if prefix_doc is not None else 0
    lens = [d.length for d in docs]
    info = RequestInfo(num_docs=len(docs), prefix_len=prefix_len, doc_lens=tuple(lens),
                       doc_offsets=tuple(int(x) for x in np.cumsum([prefix_len, *lens[:-1]])),
                       query_len=len(query), layout=docs[0].layout)
    total = info.context_len + len(query) + max_new_tokens
    if total > config.max_position_embeddings:
        raise KvjaxError(f"context {info.context_len} + query {len(query)} + {max_new_tokens} new tokens exceeds "
                         f"the model's maximum context of {config.max_position_embeddings}")
    strat.validate(info, config)
    if isinstance(strat, MultiInfLLM):
        return _answer_infllm(model, strat, prefix_doc, docs, query, info, start, max_new_tokens, eos_token_id,
                              stop_at_eos, return_cache, mesh, quant)
    # The RoPE of the whole prompt, as `generate` picks it (LongRoPE: the long factors past the pretrained context),
    # for the assembly, the query and the decode; each layer rotates with its own (`block.layer_rope`). Stored keys
    # prefilled with other frequencies (a short document) are rotated with these; the prefix, which nothing precedes,
    # is prefilled with them (again, where it was prefilled with others) and stays exact.
    rope = model.rope(info.context_len + len(query))
    docs = [in_rope(model, d, rope) for d in docs]
    prefix_doc = prefix_in_rope(model, prefix_doc, rope, mesh) if prefix_doc is not None else None
    if mesh is not None:
        weights = sharding.shard_weights(weights, mesh)
        docs = [place_document(d, mesh) for d in docs]  # the request is assembled on the mesh
        prefix_doc = place_document(prefix_doc, mesh) if prefix_doc is not None else None
    req, info = build_request(prefix_doc, docs, query, with_stats=strat.needs_stats, scalars=strat.scalars(info))
    if mesh is not None:
        req = place_request(req, mesh)
    assembled = _build(strat, config, tuning.current(), weights, rope, req, mesh=mesh)
    extra = int(req.query.shape[0]) + int(max_new_tokens)
    request_cache = assembled.cache if quant is None else _quantize(assembled.cache, quant, config.layer_windows)
    logits, cache = _prefill_query(config, extra, weights, rope, request_cache, req.query, req.query_pos,
                                   mesh=mesh)
    first = jax.block_until_ready(logits[len(query) - 1])
    ttft = time.perf_counter() - start

    state = PrefillState(cache=cache, logits=first[None], prompt_lengths=np.array([info.context_len + len(query)]),
                         budget=jnp.full((1,), cache.capacity, jnp.int32), method=_FULL, mesh=mesh, rope=rope,
                         max_new_tokens=int(max_new_tokens))
    t1 = time.perf_counter()
    out, count, final_cache = decode(model, state, max_new_tokens=int(max_new_tokens), eos_token_id=eos_token_id,
                                     stop_at_eos=stop_at_eos, mesh=mesh)
    decode_s = time.perf_counter() - t1
    n_gen = int(count[0])

    # A sliding-window layer holds the ring of the context's last window, whatever the strategy kept.
    kept = np.array([n if w is None else min(w, info.context_len)
                     for n, w in zip(sharding.to_host(assembled.kept), config.layer_windows, strict=True)])
    n_ctx = info.context_len
    report = RequestReport(
        strategy=strat.name, num_documents=len(docs), context_tokens=n_ctx, query_tokens=len(query),
        kept_tokens=float(kept.mean()), sequence_ratio=float(kept.mean()) / n_ctx,
        recomputed_tokens=int(assembled.selected), recompute_ratio=int(assembled.selected) / n_ctx,
        layer_recompute_ratio=float(np.asarray(assembled.recomputed).sum()) / (config.num_layers * n_ctx),
        ttft_s=ttft, cache_bytes=_context_bytes(config, model.dtype, quant, kept),
        full_cache_bytes=_context_bytes(config, model.dtype, quant, [n_ctx] * config.num_layers),
        cache_bytes_allocated=_kv_bytes(final_cache), generated_tokens=n_gen,
        decode_s=decode_s,
    )
    return RagResult(
        tokens=np.asarray(out[0, :n_gen]), query_logits=sharding.to_host(logits[: len(query)]), report=report,
        details={k: sharding.to_host(v) for k, v in assembled.details.items()},
        cache=final_cache if return_cache else None,
    )


def _context_attended(layer: kvc.KVCache, n_ctx: int) -> int:
    """Slots of the first example's first KV head that the last step attended and that hold a context position."""
    attend, pos = sharding.to_host(kvc.valid_mask(layer))[0, 0], sharding.to_host(layer.pos)[0, 0]
    return int(np.sum(attend & (pos >= 0) & (pos < n_ctx)))


def _answer_infllm(model: Any, strat: MultiInfLLM, prefix_doc: DocumentCache | None, docs: list[DocumentCache],
                   query: list[int], info: RequestInfo, start: float, max_new_tokens: int, eos_token_id: Any,
                   stop_at_eos: bool, return_cache: bool, mesh: Any = None, quant: KVQuant | None = None) -> RagResult:
    """Multi-InfLLM: the concatenated context and the query streamed through InfLLM, then its decode."""
    config = model.config
    context = (prefix_doc.token_ids if prefix_doc is not None else []) + sum((d.token_ids for d in docs), [])
    state = prefill(model, [context], method=strat.method(), max_new_tokens=int(max_new_tokens), question_ids=[query],
                    mesh=mesh, kv_dtype=quant)
    first = jax.block_until_ready(state.logits)
    ttft = time.perf_counter() - start
    t1 = time.perf_counter()
    out, count, cache = decode(model, state, max_new_tokens=int(max_new_tokens), eos_token_id=eos_token_id,
                               stop_at_eos=stop_at_eos, mesh=mesh)
    decode_s = time.perf_counter() - t1
    n_ctx, n_gen = info.context_len, int(count[0])
    # The context positions the last step attended, per layer: InfLLM's retrieval on a global layer (slot = position),
    # the ring's window on a sliding-window layer (slot = position % window: by position, not by slot).
    attended = np.array([_context_attended(layer, n_ctx) for layer in cache.layers])
    # InfLLM keeps every context token of a global layer; a sliding-window layer's ring holds at most its window.
    held = [n_ctx if w is None else min(w, n_ctx) for w in config.layer_windows]
    report = RequestReport(
        strategy=strat.name, num_documents=len(docs), context_tokens=n_ctx, query_tokens=len(query),
        kept_tokens=float(attended.mean()), sequence_ratio=float(attended.mean()) / n_ctx,
        recomputed_tokens=n_ctx, recompute_ratio=1.0, layer_recompute_ratio=1.0, ttft_s=ttft,
        cache_bytes=_context_bytes(config, model.dtype, quant, held),
        full_cache_bytes=_context_bytes(config, model.dtype, quant, [n_ctx] * config.num_layers),
        cache_bytes_allocated=_kv_bytes(cache), generated_tokens=n_gen, decode_s=decode_s,
    )
    return RagResult(tokens=np.asarray(out[0, :n_gen]), query_logits=sharding.to_host(first), report=report, details={},
                     cache=cache if return_cache else None)
