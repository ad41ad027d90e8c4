"""A compressed context in one file (`save_context` / `load_context`), to ask it questions in a later process.

The file is `kvjax.runtime.pass_file`'s (safetensors, nothing unpickled, a SHA-256 per array): the compressed
cache at the size the method allocated, the context's last hidden state and its token ids, and metadata naming the
method and its hyperparameters, the storage format, the sizes the cache was planned for and the model's fingerprint.
Loading plans the context again from them and checks every array against that plan's cache.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import numpy as np

from kvjax.errors import CheckpointError, KvjaxError
from kvjax.models.fingerprint import model_summary
from kvjax.runtime import pass_file, sharding
from kvjax.runtime.contexts import CompressedContext, check_context_mesh, check_model, context_plan

FORMAT = "kvjax.context"
FORMAT_VERSION = 1
_WHAT = "kvjax context file"


def save_context(context: CompressedContext, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Writes `context` to the file `path` (see the module docstring); an existing file only with `overwrite`."""
    if not isinstance(context, CompressedContext):
        raise KvjaxError(f"save_context: expected a CompressedContext, got {type(context).__name__}")
    path = pathlib.Path(path).expanduser().absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists; pass overwrite=True to replace it")
    plan = context.plan
    meta = {
        "format": FORMAT, "version": FORMAT_VERSION, "method": pass_file.method_record(plan.method),
        "kv_dtype": None if plan.quant is None else plan.quant.name, "chunk_size": plan.chunk,
        "max_new_tokens": plan.max_new_tokens, "max_question_tokens": context.max_question_tokens,
        "fingerprint": context.fingerprint,
    }
    try:
        pass_file.write(path, context.cache, context.last_hidden, {"tokens": context.tokens}, meta)
    except OSError as e:
        raise CheckpointError(f"cannot save the context to {path}: {e.strerror or e}") from None


def load_context(path: str | os.PathLike, model: Any, *, verify: bool = True, mesh: Any = None) -> CompressedContext:
    """Reads a context `save_context` wrote, for `model` (another model's is refused, `CheckpointError`). With
    `verify`, every array's SHA-256 is checked. `mesh`: one process's devices to place it on (as
    `compress_context`'s), whatever it was saved from."""
    check_context_mesh(mesh)
    path = pathlib.Path(path).expanduser().absolute()
    meta, tensors = pass_file.read(path, FORMAT, FORMAT_VERSION, _WHAT)
    tokens = pass_file.checked(path, "tokens", tensors, meta, verify)
    try:
        plan = context_plan(model, tokens.tolist(), method=pass_file.method_from_record(meta.get("method") or {}),
                            method_args=None, max_new_tokens=meta["max_new_tokens"],
                            max_question_tokens=meta["max_question_tokens"], chunk_size=meta["chunk_size"],
                            kv_dtype=meta["kv_dtype"], mesh=mesh)
    except KvjaxError as e:
        raise CheckpointError(f"{path}: its method or sizes do not fit this kvjax and model ({e})") from None
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: its metadata lacks {e} (file not written by this kvjax)") from None
    context = CompressedContext(tokens=tokens.astype(np.int32), plan=plan, cache=None, last_hidden=None,
                                max_question_tokens=int(meta["max_question_tokens"]),
                                fingerprint=str(meta.get("fingerprint")))
    try:
        check_model(model, context)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e} ({model_summary(model.config, model.dtype)})") from None
    cache, last_hidden = pass_file.cache_and_hidden(path, tensors, meta, model, plan, verify)
    if mesh is not None:  # placed as `compress_context` on the mesh places its cache
        cache, last_hidden = sharding.shard_cache(cache, mesh), sharding.shard_batch(last_hidden, mesh)
    return dataclasses.replace(context, cache=cache, last_hidden=last_hidden, mesh=mesh)


__all__ = ["FORMAT", "FORMAT_VERSION", "load_context", "save_context"]
