"""Per-document KV caches: prefill each document once, keep what the strategies need, save / load.

A document is prefilled alone at its own positions `0..N-1` (no BOS is added: put one in the
request prefix, or in the document's tokens if you want one per document). What is kept, per layer:

* `k` (post-RoPE at the local positions) and `v`, one `[K, N_pad, H]` array per layer (in buffers of its
  own, as the runtime keeps weights and caches) in the model dtype; a request re-rotates the keys by the
  document's offset in the assembled prompt (`R(o + t) = R(o) R(t)`);
* SamKV's query-independent statistics (`kvjax.rag.analysis`): the local-query mean `q_loc`, the
  middle-block mean keys, the anchor key, the A.1 representative tokens, power-law exponents,
  max / min blocks and PauTa outliers.

Documents are padded to a length bucket (a multiple of the block size); each layer is the model's decoder
block (`kvjax.models.block.decoder_block`) in a program of its own, called once per layer, so prefilling a
corpus compiles one program per bucket whatever the model's depth.

`save_documents` / `load_documents` use orbax-checkpoint; every
cache carries a fingerprint of the model that made it (config hash, dtype, sampled weight
checksums) and per-array SHA-256 checksums, so a cache made by another model, or a damaged
checkpoint, is refused with a `CheckpointError` instead of producing wrong answers. A store is
written to a hidden sibling directory and renamed into place once sealed by `kvjax_store.json`
(every file's size and SHA-256), which `load_documents` checks before orbax reads anything.

Store format version 2 writes K / V as one entry per layer (`k/<layer>`), so a store loads straight into
per-layer buffers; version 1 (kvjax before the per-layer layout: one stacked `[L, ...]` array per field)
is refused with one error saying to prefill and save the documents again.

Quantized documents (`prefill_documents(..., kv_dtype="int8" | "fp8" | "int4" | "kivi2" | "kivi4")`) keep each
layer's K / V as a `kvjax.quant.QuantizedKV` (`[1, K, N_pad, ...]` codes, scales, KIVI's ring): what they cost in
memory and on disk. Their store is format version 3 (each layer's store written leaf by leaf under `k/<layer>/`,
the format named in the manifest) and loads quantized; version 2 stores still load. `answer` reads the documents
dequantized (`DocumentCache.dequantized`) and, by default, keeps the request's cache in their format.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import glob
import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax import tuning
from kvjax.errors import CheckpointError, KvjaxError
from kvjax.models import block
from kvjax.models.fingerprint import fingerprint_of, model_summary
from kvjax.quant import storage as qs
from kvjax.quant.spec import KVQuant, parse_kv_dtype
from kvjax.quant.storage import QuantizedKV
from kvjax.rag.analysis import BlockLayout, geometry, layer_statistics
from kvjax.rope import rotate_by
from kvjax.runtime import forward, sharding
from kvjax.runtime.generate import bucket_length
from kvjax.validation import as_bool, orbax_path_problem, token_ids

Array = jax.Array

#: Traces of the per-layer document prefill program (one per document bucket, whatever the model's depth).
TRACE_COUNTS: collections.Counter[str] = collections.Counter()

FORMAT = "kvjax.rag.documents"
FORMAT_VERSION = 2
#: A store of quantized documents (K / V as `QuantizedKV` leaves); plain stores are still written as version 2.
QUANTIZED_VERSION = 3
#: The version kvjax wrote before the per-layer layout (one stacked `[L, ...]` array per field).
_STACKED_VERSION = 1
#: Written last by `save_documents`: the size and SHA-256 of every file; a store without it is incomplete.
STORE_RECORD = "kvjax_store.json"
#: Statistics arrays, present when a document was prefilled with `analyze=True`.
STAT_FIELDS = ("q_loc", "k_block", "k_anchor", "rep_token", "unimportance", "alpha", "pauta", "b_max", "b_min")
ARRAY_FIELDS = ("tokens", "k", "v", *STAT_FIELDS)
#: Fields held as one array per decoder layer (a tuple); the statistics are small and stay stacked on `[L]`.
LAYER_FIELDS = ("k", "v")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DocumentCache:
    """One document's reusable prefill. Arrays are padded to `N_pad` tokens / `MB` middle blocks.

    tokens `[N_pad]` int32; k, v: one `[K, N_pad, H]` array per layer (prefilled with `kv_dtype`: one
    `QuantizedKV` of `[1, K, N_pad, H]` per layer, `dequantized()` gives the arrays). The query-independent statistics
    (a few vectors per layer and block, not K/V) are stacked on `[L]`: q_loc `[L, N, H]`; k_block
    `[L, MB, K, H]`; k_anchor `[L, K, H]`; rep_token / unimportance / alpha / pauta `[L, MB]`; b_max / b_min
    `[L]`. The statistics are None for a cache prefilled with `analyze=False`.
    """

    tokens: Array
    k: tuple[Array | QuantizedKV, ...]
    v: tuple[Array | QuantizedKV, ...]
    q_loc: Array | None = None
    k_block: Array | None = None
    k_anchor: Array | None = None
    rep_token: Array | None = None
    unimportance: Array | None = None
    alpha: Array | None = None
    pauta: Array | None = None
    b_max: Array | None = None
    b_min: Array | None = None
    length: int = dataclasses.field(default=0, metadata=dict(static=True))
    layout: BlockLayout = dataclasses.field(default_factory=BlockLayout, metadata=dict(static=True))
    fingerprint: str = dataclasses.field(default="", metadata=dict(static=True))

    @property
    def padded_length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def analyzed(self) -> bool:
        return self.q_loc is not None

    @property
    def num_middle_blocks(self) -> int:
        return self.layout.middle_blocks(self.length)

    @property
    def token_ids(self) -> list[int]:
        return np.asarray(self.tokens[: self.length]).tolist()

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))

    @property
    def quantization(self) -> KVQuant | None:
        """The K / V storage format (None: the model dtype)."""
        return self.k[0].spec if isinstance(self.k[0], QuantizedKV) else None

    def dequantized(self) -> DocumentCache:
        """This document with K / V as `[K, N_pad, H]` arrays in the model dtype (itself when not quantized)."""
        if self.quantization is None:
            return self
        return dataclasses.replace(self, k=tuple(_dequantize_layer(x) for x in self.k),
                                   v=tuple(_dequantize_layer(x) for x in self.v))


@jax.jit
def _dequantize_layer(x: QuantizedKV) -> Array:
    return qs.dequantize(x, x.dtype)[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _quantize_layer(spec: KVQuant, role: str, x: Array, n: Array) -> QuantizedKV:
    """One layer's `[K, N_pad, H]` K or V of an `n`-token document, quantized (`[1, K, N_pad, ...]`)."""
    length = jnp.full((1, x.shape[0]), n, jnp.int32)
    return qs.quantize(spec, role, x[None], length, x.dtype)


# ---------------------------------------------------------------------------------------------
# Model fingerprint
# ---------------------------------------------------------------------------------------------
def check_same_model(doc: DocumentCache, model: Any, what: str = "document cache") -> None:
    """Raises `CheckpointError` when `doc` was not made by `model` (config, dtype or weights)."""
    fp = fingerprint_of(model)
    if doc.fingerprint != fp:
        raise CheckpointError(
            f"{what} was made by a different model or config (fingerprint {doc.fingerprint[:12] or 'none'} "
            f"!= {fp[:12]} of this model: {model_summary(model.config, model.dtype)}); prefill the "
            "documents again with this model"
        )


# ---------------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------------
def constrain_document(arrays: dict[str, Array], mesh: Any) -> dict[str, Array]:
    """Inside `jax.jit`: one layer's k / v `[K, N, H]` with K on `model`, its statistics replicated."""
    def pin(name: str, x: Array) -> Array:
        spec = sharding.heads_spec(x.shape, mesh, 0) if name in LAYER_FIELDS else P()
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return {name: pin(name, x) for name, x in arrays.items()}


def place_document(doc: DocumentCache, mesh: Any) -> DocumentCache:
    """`doc` placed on `mesh` like `prefill_documents(..., mesh=mesh)` places it (no copy when it already is)."""
    def put(name: str, x: Any) -> Any:
        if x is None:
            return None
        if name in LAYER_FIELDS:
            return tuple(sharding.shard_heads(layer, mesh, 0) for layer in x)
        return sharding.replicate(x, mesh)

    return dataclasses.replace(doc, **{name: put(name, getattr(doc, name)) for name in ARRAY_FIELDS})


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), static_argnames=("mesh",), donate_argnums=(7,))
def _document_layer(config: Any, layout: BlockLayout, analyze: bool, tune: tuning.Tuning, window: int | None,
                    lw: dict, rope: tuple, x: Array, n: Array, mesh: Any = None) -> tuple[Array, dict[str, Array]]:
    """One decoder layer of a document prefill (`x` `[1, N_pad, D]`, `n` real tokens): the layer's output and
    what the document keeps of the layer (k / v `[K, N_pad, H]`, the A.1 statistics with `analyze`). One
    program serves every layer of a shape and window (`window`: the layer's, None for a global layer; `rope` its
    `(inv_freq, scaling)`); `tune` is the `kvjax.tuning` in force (static)."""
    TRACE_COUNTS["document_layer"] += 1
    n_pad = x.shape[1]
    geo = geometry(n, n_pad, layout)
    pos = jnp.where(geo.valid, jnp.arange(n_pad, dtype=jnp.int32), -1)

    def attention(q: Array, k: Array, v: Array) -> tuple[Array, dict[str, Array]]:
        attn = block.self_attention(q, k, v, pos[None], sliding_window=window)
        out = {"k": jnp.swapaxes(k[0], 0, 1), "v": jnp.swapaxes(v[0], 0, 1)}
        if analyze:
            out.update(layer_statistics(q[0], k[0], pos, geo, sliding_window=window))
        return attn, out

    # Pallas kernels run per shard of `mesh` (a static argument; None: as is); the ops read `tune` while tracing.
    with sharding.kernel_mesh(mesh), tuning.use(tune):
        x, out = block.decoder_block(config, lw, x, pos[None], rope, attention)
    return x, out if mesh is None else constrain_document(out, mesh)


@jax.jit
def _stack_statistics(per_layer: list[dict[str, Array]]) -> dict[str, Array]:
    """The layers' statistics stacked on `[L]` (small: vectors per layer and block, not K/V)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


def _prefill_document(config: Any, layout: BlockLayout, analyze: bool, weights: dict, rope: tuple,
                      tokens: Array, n: Array, mesh: Any = None, quant: KVQuant | None = None) -> dict[str, Any]:
    """Every layer of one document, layer by layer, each with its window and RoPE (`rope`: the model's `Ropes`): k / v
    as one array per layer (quantized with `quant`), the statistics stacked."""
    x = forward.embed(config, block.global_weights(weights), tokens[None])
    keys, values, stats = [], [], []
    tune = tuning.current()
    for i, lw in enumerate(weights["layers"]):
        x, out = _document_layer(config, layout, analyze, tune, config.layer_window(i), lw,
                                 block.layer_rope(config, rope, i), x, n, mesh=mesh)
        k, v = out.pop("k"), out.pop("v")
        if quant is not None:
            k, v = _quantize_layer(quant, "k", k, n), _quantize_layer(quant, "v", v, n)
        keys.append(k)
        values.append(v)
        stats.append(out)
    arrays: dict[str, Any] = {"k": tuple(keys), "v": tuple(values)}
    if analyze:
        arrays.update(_stack_statistics(stats))
    return arrays


def prefill_documents(
    model: Any,
    documents: Iterable[Sequence[int]],
    *,
    layout: BlockLayout | None = None,
    analyze: bool = True,
    mesh: Any = None,
    kv_dtype: str | KVQuant | None = None,
) -> list[DocumentCache]:
    """Prefills every document alone (positions `0..N-1`) into a reusable `DocumentCache`.

    `layout` fixes SamKV's block geometry (default: 64-token blocks, 1 init + 2 local blocks);
    `analyze=False` skips SamKV's statistics (enough for reuse / CacheBlend / EPIC).
    `mesh`: a `jax.sharding.Mesh` (`data`, `model`) (see `kvjax.runtime.sharding`): the weights are
    placed on it as `generate` places them, and each cache's k / v have their KV heads on `model`
    (the statistics replicated).
    `kv_dtype`: keep K / V quantized (`kvjax.quant`: "int8", "fp8", "int4", "kivi2", "kivi4"); None: the model dtype.
    """
    sharding.check_mesh(mesh)
    quant = parse_kv_dtype(kv_dtype)
    if quant is not None:
        quant.check_head_dim(model.config.head_dim)
    layout = BlockLayout() if layout is None else layout
    if not isinstance(layout, BlockLayout):
        raise KvjaxError(f"layout must be a kvjax.rag.BlockLayout (e.g. BlockLayout(block_size=64)), got a "
                         f"{type(layout).__name__} {layout!r:.80}")
    analyze = as_bool(analyze, "analyze")
    if isinstance(documents, np.ndarray | jax.Array):
        if np.ndim(documents) != 2:
            raise KvjaxError("documents must be a list of token lists, or a [num_docs, length] array")
        documents = list(np.asarray(documents))
    if not isinstance(documents, Iterable) or isinstance(documents, str | bytes):
        raise KvjaxError(f"documents must be a list of token lists (one list per document), got {documents!r:.80}")
    documents = list(documents)  # a generator is read once, here
    if len(documents) and isinstance(documents[0], int | np.integer):
        raise KvjaxError("documents must be a list of token lists (one list per document), not one flat list")
    config = model.config
    weights, put = _placed_weights(model, mesh)
    out = []
    for i, doc in enumerate(documents):
        ids = token_ids(doc, f"documents[{i}]", config.vocab_size).reshape(-1)
        if ids.size == 0:
            raise KvjaxError(f"documents[{i}] is empty")
        if ids.size > config.max_position_embeddings:
            raise KvjaxError(
                f"document {i} has {ids.size} tokens, more than the model's {config.max_position_embeddings}"
            )
        out.append(_prefill_one(model, ids, layout, analyze, document_rope(model, int(ids.size)), weights, put,
                                mesh=mesh, quant=quant))
    return out


def _placed_weights(model: Any, mesh: Any) -> tuple[dict, Any]:
    """The model's weights (on `mesh` as `generate` places them) and how the document's own arrays are put."""
    if mesh is None:
        return model.weights(), jnp.asarray
    return sharding.shard_weights(model.weights(), mesh), functools.partial(sharding.replicate, mesh=mesh)


def _prefill_one(model: Any, ids: np.ndarray, layout: BlockLayout, analyze: bool, rope: tuple, weights: dict,
                 put: Any, *, mesh: Any = None, quant: KVQuant | None = None) -> DocumentCache:
    """One document's cache: its checked ids `[N]` padded to their bucket and prefilled with `rope`."""
    n_pad = bucket_length(ids.size, minimum=16, multiple=layout.block_size)
    tokens = np.zeros(n_pad, np.int32)
    tokens[: ids.size] = ids
    arrays = _prefill_document(model.config, layout, analyze, weights, rope, put(tokens), put(np.int32(ids.size)),
                               mesh=mesh, quant=quant)
    return DocumentCache(tokens=put(tokens), length=int(ids.size), layout=layout, fingerprint=fingerprint_of(model),
                         **arrays)


def document_rope(model: Any, length: int) -> tuple:
    """The RoPE a document of `length` tokens is prefilled with: the model's for a sequence of that length (LongRoPE's
    long factors past the pretrained context, as its forward picks them)."""
    return model.rope(length)


@jax.jit
def _rerotated_keys(keys: tuple[Array, ...], src: tuple[Array, ...], dst: tuple[Array, ...]) -> tuple[Array, ...]:
    """Each layer's keys `[K, N_pad, H]`, stored rotated at positions `0..N_pad-1` with the frequencies `src[i]`,
    rotated at the same positions with `dst[i]` instead (float32 maths)."""
    def one(k: Array, f_src: Array, f_dst: Array) -> Array:
        t = jnp.broadcast_to(jnp.arange(k.shape[1], dtype=jnp.int32), k.shape[:2])
        kf = k.astype(jnp.float32)
        return rotate_by(rotate_by(kf, -t, f_src), t, f_dst).astype(k.dtype)

    return tuple(one(k, a, b) for k, a, b in zip(keys, src, dst, strict=True))


def _layer_frequencies(model: Any, rope: tuple, num_layers: int) -> tuple[Array, ...]:
    return tuple(block.layer_rope(model.config, rope, i)[0] for i in range(num_layers))


def _same_frequencies(src: tuple[Array, ...], dst: tuple[Array, ...]) -> bool:
    return all(a is b or np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(src, dst, strict=True))


def prefix_in_rope(model: Any, prefix: DocumentCache, rope: tuple, mesh: Any = None) -> DocumentCache:
    """A request's prefix (model-dtype K / V) as prefilled with the request's RoPE `rope`: itself where it was
    prefilled with those frequencies (`document_rope`), else prefilled again from its tokens. Nothing precedes a
    prefix, so it is then exact; re-rotating its keys (`in_rope`) would leave its deeper layers computed with the
    other frequencies."""
    stored = document_rope(model, prefix.length)
    if _same_frequencies(_layer_frequencies(model, stored, prefix.num_layers),
                         _layer_frequencies(model, rope, prefix.num_layers)):
        return prefix
    weights, put = _placed_weights(model, mesh)
    return _prefill_one(model, np.asarray(prefix.token_ids, np.int64), prefix.layout, False, rope, weights, put,
                        mesh=mesh)


def in_rope(model: Any, doc: DocumentCache, rope: tuple) -> DocumentCache:
    """`doc` (model-dtype K / V) with its stored keys rotated with the frequencies of `rope` (a request's) instead of
    those it was prefilled with (`document_rope`); itself where they agree (every model but a LongRoPE one whose
    request passes the pretrained context and the document does not). The SamKV statistics are pooled vectors and
    stay as they are."""
    src = _layer_frequencies(model, document_rope(model, doc.length), doc.num_layers)
    dst = _layer_frequencies(model, rope, doc.num_layers)
    if _same_frequencies(src, dst):
        return doc
    return dataclasses.replace(doc, k=_rerotated_keys(doc.k, src, dst))


# ---------------------------------------------------------------------------------------------
# Save / load (orbax-checkpoint)
# ---------------------------------------------------------------------------------------------
def _digest(x: Any) -> str:
    a = np.ascontiguousarray(np.asarray(x))
    return hashlib.sha256(a.tobytes()).hexdigest()


def save_documents(path: str | os.PathLike, documents: Iterable[DocumentCache], *, overwrite: bool = False) -> None:
    """Saves document caches to the directory `path` (orbax: arrays + a JSON manifest).

    The manifest records each cache's length, layout, model fingerprint, and the shape, dtype and
    SHA-256 of every array, so `load_documents` can refuse a mismatched or damaged checkpoint. The
    store is written into a hidden sibling directory, sealed with `STORE_RECORD` (size and SHA-256 of
    every file, written last) and renamed into place, so a save killed at any point leaves either
    no store at `path` (or the previous one, with `overwrite`) or a complete one. A path that cannot be written
    (an unwritable or read-only folder, a file where a folder should be, a full disk) is a `CheckpointError` naming
    it.
    """
    if isinstance(documents, DocumentCache) or not isinstance(documents, Iterable) or isinstance(documents,
                                                                                                   str | bytes):
        raise KvjaxError(f"save_documents: documents must be a list of DocumentCache, got one "
                         f"{type(documents).__name__}")
    documents = list(documents)  # a generator is read once, here
    overwrite = as_bool(overwrite, "overwrite")  # a truthy string ("no") would replace the store
    path = pathlib.Path(path).expanduser().absolute()
    problem = orbax_path_problem(path)  # the store orbax would leave (sealed here all the same) is unreadable
    if problem:
        raise CheckpointError(f"cannot save the document store to {path}: {problem}; choose another name")
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists; pass overwrite=True to replace it")
    if path.exists() and not (path / STORE_RECORD).is_file() and not (path / "manifest").is_dir() and (
            not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(f"{path} exists and is not a kvjax document store; refusing to replace it")
    if not documents:
        raise KvjaxError("save_documents: no documents given")
    arrays: dict[str, dict[str, Any]] = {}
    manifest = []
    quantized = any(isinstance(doc, DocumentCache) and doc.quantization is not None for doc in documents)
    for i, doc in enumerate(documents):
        if not isinstance(doc, DocumentCache):
            raise KvjaxError(f"save_documents: item {i} is a {type(doc).__name__}, not a DocumentCache")
        fields = {f: getattr(doc, f) for f in ARRAY_FIELDS if getattr(doc, f) is not None}
        # Per-layer fields are one entry per layer (`k/0`, `k/1`, ...): written and read where they lie.
        arrays[f"doc_{i}"] = {f: _layer_entries(x) if f in LAYER_FIELDS else x for f, x in fields.items()}
        entry = {
            "length": doc.length,
            "layout": doc.layout.to_dict(),
            "fingerprint": doc.fingerprint,
            "num_layers": doc.num_layers,
            "arrays": {f: [_array_info(layer) for layer in x] if f in LAYER_FIELDS else _array_info(x)
                       for f, x in fields.items()},
        }
        if doc.quantization is not None:
            entry["kv_dtype"] = doc.quantization.name
            entry["kv_model_dtype"] = doc.k[0].dtype_name
        manifest.append(entry)
    meta = {"format": FORMAT, "version": QUANTIZED_VERSION if quantized else FORMAT_VERSION, "documents": manifest}
    try:
        _write_store(path, arrays, meta, overwrite)
    except OSError as e:  # an unwritable folder, a path under a file, a read-only file system, a full disk
        raise CheckpointError(f"cannot save the document store to {path}: {_why_unwritable(path, e)}") from None


def _why_unwritable(path: pathlib.Path, error: OSError) -> str:
    """What stops a store being written at `path`: a file where a folder of its path should be, else the error."""
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                return f"{parent} is a file, not a folder"
            break
    where = f" ({error.filename})" if error.filename and str(error.filename) != str(path) else ""
    return f"{error.strerror or error}{where}"


def _write_store(path: pathlib.Path, arrays: dict[str, Any], meta: dict[str, Any], overwrite: bool) -> None:
    """`save_documents`' writing: into a hidden sibling, sealed, renamed into place (OSError on a file system error)."""
    import orbax.checkpoint as ocp

    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in sorted(path.parent.glob(f".{glob.escape(path.name)}.kvjax-*")):  # left by a save that was killed
        owner = re.search(r"\.kvjax-(?:tmp|old)-(\d+)", stale.name)
        if owner and int(owner.group(1)) != os.getpid() and _alive(int(owner.group(1))):
            continue  # another process is saving there right now
        if ".kvjax-old-" in stale.name and not path.exists() and (stale / STORE_RECORD).is_file():
            os.rename(stale, path)  # killed between its two renames: the previous store comes back first
        else:
            shutil.rmtree(stale, ignore_errors=True)
    if path.exists() and not overwrite:  # a previous store the loop above brought back is not replaced either
        raise CheckpointError(f"{path} already exists; pass overwrite=True to replace it")
    tmp = path.parent / f".{path.name}.kvjax-tmp-{os.getpid()}"
    old = path.parent / f".{path.name}.kvjax-old-{os.getpid()}"
    tmp.mkdir()  # a folder nothing can be written in fails here, as an OSError, not somewhere inside orbax
    tmp.rmdir()
    try:
        try:
            with quiet_orbax(), ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
                ckpt.save(tmp, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                       manifest=ocp.args.JsonSave(meta)))
        except OSError:
            raise
        except (ValueError, RuntimeError) as e:  # how orbax / tensorstore report a failed write (a full disk)
            raise OSError(f"{type(e).__name__}: {e}") from None
        _seal(tmp)
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
    finally:
        for leftover in (tmp, old, *path.parent.glob(f"{glob.escape(tmp.name)}.*")):  # orbax's own temporary folder too
            shutil.rmtree(leftover, ignore_errors=True)


def _layer_entries(layers: Sequence[Any]) -> dict[str, Any]:
    """A per-layer field as the store holds it: `{"0": layer_0, "1": layer_1, ...}` (a quantized layer as the
    dict of its leaves)."""
    return {str(i): _store_leaves(x) if isinstance(x, QuantizedKV) else x for i, x in enumerate(layers)}


def _array_info(x: Any) -> dict[str, Any]:
    if isinstance(x, QuantizedKV):  # one entry per leaf of the store
        return {name: _array_info(leaf) for name, leaf in _store_leaves(x).items()}
    return {"shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name, "sha256": _digest(x)}


_STORE_LEAVES = ("data", "scale", "zero", "residual", "qlen")


def _store_leaves(x: QuantizedKV) -> dict[str, Any]:
    """A `QuantizedKV` as the store writes it: its array leaves by name (absent ones left out)."""
    return {name: getattr(x, name) for name in _STORE_LEAVES if getattr(x, name) is not None}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _file_sha256(file: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _seal(root: pathlib.Path) -> None:
    """Writes `STORE_RECORD` (every file's size and SHA-256) last, flushed to disk: the store is complete."""
    files = {
        f.relative_to(root).as_posix(): {"size": f.stat().st_size, "sha256": _file_sha256(f)}
        for f in sorted(root.rglob("*")) if f.is_file()
    }
    record = root / STORE_RECORD
    with open(record, "w") as out:
        json.dump({"format": FORMAT, "version": FORMAT_VERSION, "files": files}, out, indent=1)
        out.flush()
        os.fsync(out.fileno())


def _check_files(path: pathlib.Path, verify: bool) -> None:
    """Every file the store's record lists is present, of the recorded size and (with `verify`) SHA-256,
    so orbax is only ever handed a complete, undamaged store."""
    record = path / STORE_RECORD
    if not record.is_file():
        raise CheckpointError(
            f"{path} is not a complete kvjax document store: it has no {STORE_RECORD} (the save was interrupted, "
            "an older kvjax wrote it, or it is another kind of directory); prefill and save the documents again"
        )
    try:
        files = json.loads(record.read_text())["files"]
        items = [(str(k), int(v["size"]), str(v["sha256"])) for k, v in files.items()]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: {STORE_RECORD} is unreadable or truncated ({type(e).__name__}: {e})") from e
    for rel, size, sha in items:
        file = path / rel
        if ".." in pathlib.PurePosixPath(rel).parts or not file.is_file():
            raise CheckpointError(f"{path}: {rel} is missing: the store is truncated or damaged")
        if file.stat().st_size != size:
            raise CheckpointError(f"{path}: {rel} has {file.stat().st_size} bytes where the store recorded {size}: "
                                  "the file is truncated or damaged")
        if verify and _file_sha256(file) != sha:
            raise CheckpointError(f"{path}: {rel} fails its SHA-256 checksum: the file is damaged")


@contextlib.contextmanager
def quiet_orbax():
    """Keeps orbax's (absl) log lines off the terminal while it runs: its errors too (the traceback of a failed
    write), which the caller reports as one `CheckpointError`."""
    loggers = [logging.getLogger(name) for name in ("absl", "orbax", "orbax.checkpoint")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _read_manifest(path: pathlib.Path) -> dict[str, Any]:
    meta_file = path / "manifest" / "metadata"
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a kvjax document-cache checkpoint (no manifest); it is missing or "
                              "truncated")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the manifest is unreadable or truncated ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a kvjax document-cache checkpoint")
    if meta.get("version") == _STACKED_VERSION:
        raise CheckpointError(
            f"{path}: format version {_STACKED_VERSION} was written by a kvjax that stored each document's K/V "
            f"stacked over layers; this kvjax keeps them per layer (version {FORMAT_VERSION}) and does not read "
            "the old layout: prefill and save the documents again"
        )
    if meta.get("version") not in (FORMAT_VERSION, QUANTIZED_VERSION):
        raise CheckpointError(f"{path}: format version {meta.get('version')} is not supported (expected "
                              f"{FORMAT_VERSION} or {QUANTIZED_VERSION})")
    return meta


def load_documents(path: str | os.PathLike, model: Any = None, *, verify: bool = True) -> list[DocumentCache]:
    """Loads the caches saved by `save_documents`.

    With `model`, caches made by another model / config / dtype are refused (`CheckpointError`).
    With `verify`, every array is checked against the shape, dtype and SHA-256 in the manifest.
    """
    import orbax.checkpoint as ocp

    verify = as_bool(verify, "verify")
    path = pathlib.Path(path).expanduser().absolute()
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        kept = sorted(path.parent.glob(f".{glob.escape(path.name)}.kvjax-old-*"))
        if kept and not path.exists():
            what += f" (a save killed while replacing it left the previous store in {kept[0]})"
        raise CheckpointError(f"document-cache checkpoint {path} {what}")
    _check_files(path, verify)
    meta = _read_manifest(path)
    docs_meta = meta["documents"]
    if model is not None:
        fp = fingerprint_of(model)
        for i, d in enumerate(docs_meta):
            if d.get("fingerprint") != fp:
                raise CheckpointError(
                    f"{path}: document {i} was made by a different model or config (fingerprint "
                    f"{str(d.get('fingerprint'))[:12]} != {fp[:12]} of this model: "
                    f"{model_summary(model.config, model.dtype)})"
                )
    try:
        with quiet_orbax(), ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
            restored = ckpt.restore(path, args=ocp.args.Composite(arrays=ocp.args.StandardRestore()))["arrays"]
    except Exception as e:  # orbax / tensorstore raise many types for damaged files
        raise CheckpointError(f"{path}: the cache arrays are unreadable or truncated ({type(e).__name__}: {e})") from e
    out = []
    for i, d in enumerate(docs_meta):
        stored = restored.pop(f"doc_{i}", None) if isinstance(restored, dict) else None
        if stored is None or set(stored) != set(d["arrays"]):
            raise CheckpointError(f"{path}: document {i} is missing arrays (checkpoint truncated?)")
        fields: dict[str, Any] = {}
        for name, info in d["arrays"].items():
            if name not in LAYER_FIELDS:
                fields[name] = _checked_array(path, i, name, stored.pop(name), info, verify)
                continue
            layers = stored.pop(name)
            count = d.get("num_layers")
            if not isinstance(info, list) or len(info) != count or not isinstance(layers, dict) or (
                    set(layers) != {str(j) for j in range(count)}):
                raise CheckpointError(f"{path}: document {i} array {name!r} does not hold the {count} layers its "
                                      "manifest names (checkpoint truncated?)")
            # Each layer's buffer as restored (no stacked copy); popped so nothing else keeps it alive.
            fields[name] = tuple(_checked_layer(path, i, f"{name}[{j}]", layers.pop(str(j)), info[j], verify, d,
                                                name) for j in range(count))
        out.append(DocumentCache(length=int(d["length"]), layout=BlockLayout(**d["layout"]),
                                 fingerprint=d["fingerprint"], **fields))
    return out


def _checked_layer(path: pathlib.Path, doc: int, name: str, x: Any, info: dict[str, Any], verify: bool,
                   meta: dict[str, Any], field: str) -> Array | QuantizedKV:
    """One layer's K or V: an array, or (a quantized document) its `QuantizedKV` rebuilt from its leaves."""
    if "kv_dtype" not in meta:
        return _checked_array(path, doc, name, x, info, verify)
    try:
        spec = parse_kv_dtype(meta["kv_dtype"])
    except KvjaxError as e:
        raise CheckpointError(f"{path}: document {doc} names an unknown kv_dtype ({e})") from e
    if not isinstance(x, dict) or set(x) != set(info):
        raise CheckpointError(f"{path}: document {doc} array {name!r} does not hold the quantized leaves its manifest "
                              "names (checkpoint truncated?)")
    leaves = {leaf: _checked_array(path, doc, f"{name}.{leaf}", x[leaf], info[leaf], verify) for leaf in info}
    data = leaves["data"]
    return QuantizedKV(**leaves, spec=spec, role=field, dtype_name=str(meta["kv_model_dtype"]),
                       head_dim=int(data.shape[-1]) * 8 // spec.bits)


def _checked_array(path: pathlib.Path, doc: int, name: str, x: Any, info: dict[str, Any], verify: bool) -> Array:
    """`x` as a device array, after its shape, dtype and (with `verify`) SHA-256 are checked against `info`."""
    if list(x.shape) != info["shape"] or jnp.dtype(x.dtype).name != info["dtype"]:
        raise CheckpointError(
            f"{path}: document {doc} array {name!r} has shape {list(x.shape)} / {jnp.dtype(x.dtype).name}, "
            f"the manifest says {info['shape']} / {info['dtype']}"
        )
    if verify and _digest(x) != info["sha256"]:
        raise CheckpointError(f"{path}: document {doc} array {name!r} fails its checksum (file damaged)")
    return jnp.asarray(x)
