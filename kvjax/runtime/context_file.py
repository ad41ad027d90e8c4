"""A compressed context in one file (`save_context` / `load_context`), to ask it questions in a later process.

The file is safetensors: the compressed cache's leaves (`cache.<n>`, in `jax.tree.leaves` order, at the size the
method allocated), the context's last hidden state and its token ids; its metadata (JSON under `kvjax`) names the
format version, the method and its hyperparameters, the storage format, the sizes the cache was planned for, the
model's fingerprint and each array's dtype and SHA-256. Nothing is unpickled. Dtypes NumPy lacks (bfloat16, the
fp8 formats) are stored as unsigned integers of their width and viewed back. A file is written beside its path and
renamed into place, so a killed save leaves the previous file or none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import CheckpointError, KvjaxError
from kvjax.methods import registry as kvm
from kvjax.methods.base import per_example_budget
from kvjax.models.fingerprint import model_summary
from kvjax.runtime import stages
from kvjax.runtime.contexts import CompressedContext, check_model, context_plan

FORMAT = "kvjax.context"
FORMAT_VERSION = 1
_META_KEY = "kvjax"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    """JSON back to a hyperparameter: lists are tuples again (the frozen methods hold tuples)."""
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    return value


def method_record(method: Any) -> dict[str, Any]:
    """The method as the file names it; refused (`KvjaxError`) where its hyperparameters would not come back equal."""
    record = {"name": method.name, "hyperparameters": _jsonable(method.hyperparameters())}
    try:
        back = kvm.get(record["name"], **_from_json(json.loads(json.dumps(record["hyperparameters"]))))
    except (TypeError, ValueError, KvjaxError) as e:
        raise KvjaxError(f"{method.name}: its hyperparameters cannot be saved in a context file ({e})") from None
    if back != method:
        raise KvjaxError(f"{method.name}: its hyperparameters {method.hyperparameters()} do not survive JSON; "
                         "the context cannot be saved")
    return record


def _stored(x: Any) -> tuple[np.ndarray, str]:
    """A host array safetensors can write, and the dtype to view it back as."""
    a = np.ascontiguousarray(np.asarray(x))
    name = jnp.dtype(a.dtype).name
    if a.dtype.kind == "V":  # an ml_dtypes format (bfloat16, fp8): its bits as unsigned integers
        a = a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))
    return a, name


def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def save_context(context: CompressedContext, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Writes `context` to the file `path` (safetensors; see the module docstring)."""
    from safetensors.numpy import save_file

    if not isinstance(context, CompressedContext):
        raise KvjaxError(f"save_context: expected a CompressedContext, got {type(context).__name__}")
    path = pathlib.Path(path).expanduser().absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists; pass overwrite=True to replace it")
    plan = context.plan
    arrays = {f"cache.{n}": leaf for n, leaf in enumerate(jax.tree.leaves(context.cache))}
    arrays["last_hidden"], arrays["tokens"] = context.last_hidden, context.tokens
    tensors, info = {}, {}
    for name, x in arrays.items():
        tensors[name], dtype = _stored(x)
        info[name] = {"dtype": dtype, "shape": list(np.shape(x)), "sha256": _sha256(tensors[name])}
    meta = {
        "format": FORMAT, "version": FORMAT_VERSION, "method": method_record(plan.method),
        "kv_dtype": None if plan.quant is None else plan.quant.name, "chunk_size": plan.chunk,
        "max_new_tokens": plan.max_new_tokens, "max_question_tokens": context.max_question_tokens,
        "fingerprint": context.fingerprint, "arrays": info,
    }
    tmp = path.parent / f".{path.name}.kvjax-tmp-{os.getpid()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise CheckpointError(f"cannot save the context to {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(f"context file {path} {'is not a file' if path.exists() else 'does not exist'}")
    try:
        with safe_open(str(path), "np") as f:
            raw = (f.metadata() or {}).get(_META_KEY)
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable kvjax context file ({type(e).__name__}: {e})") from None
    try:
        meta = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: its kvjax metadata is unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a kvjax context file (no {FORMAT!r} metadata)")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: context format version {meta.get('version')} is not supported (this kvjax "
                              f"reads version {FORMAT_VERSION})")
    return meta, tensors


def _checked(path: pathlib.Path, name: str, tensors: dict[str, np.ndarray], info: dict[str, Any], verify: bool,
             want: Any = None) -> np.ndarray:
    """Array `name` viewed back to its dtype, after its shape, dtype and (with `verify`) SHA-256 are checked."""
    if name not in tensors or name not in info:
        raise CheckpointError(f"{path}: array {name!r} is missing (file truncated or not written by this kvjax)")
    stored, expected = tensors[name], info[name]
    if verify and _sha256(np.ascontiguousarray(stored)) != expected["sha256"]:
        raise CheckpointError(f"{path}: array {name!r} fails its SHA-256 checksum: the file is damaged")
    a = stored.view(jnp.dtype(expected["dtype"])) if jnp.dtype(expected["dtype"]) != stored.dtype else stored
    if list(a.shape) != expected["shape"] or (want is not None and (
            tuple(a.shape) != tuple(want.shape) or a.dtype != want.dtype)):
        wanted = expected if want is None else {"shape": list(want.shape), "dtype": jnp.dtype(want.dtype).name}
        raise CheckpointError(f"{path}: array {name!r} is {list(a.shape)} {a.dtype}, expected {wanted['shape']} "
                              f"{wanted['dtype']}")
    return a


def load_context(path: str | os.PathLike, model: Any, *, verify: bool = True) -> CompressedContext:
    """Reads a context `save_context` wrote, for `model` (another model's is refused, `CheckpointError`). With
    `verify`, every array's SHA-256 is checked."""
    path = pathlib.Path(path).expanduser().absolute()
    meta, tensors = _read(path)
    info = meta.get("arrays") or {}
    tokens = _checked(path, "tokens", tensors, info, verify)
    record = meta.get("method") or {}
    try:
        method = kvm.get(str(record.get("name")), **_from_json(record.get("hyperparameters") or {}))
        plan = context_plan(model, tokens.tolist(), method=method, method_args=None,
                            max_new_tokens=meta["max_new_tokens"], max_question_tokens=meta["max_question_tokens"],
                            chunk_size=meta["chunk_size"], kv_dtype=meta["kv_dtype"])
    except KvjaxError as e:
        raise CheckpointError(f"{path}: its method or sizes do not fit this kvjax and model ({e})") from None
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: its metadata lacks {e} (file not written by this kvjax)") from None
    context = CompressedContext(tokens=tokens.astype(np.int32), plan=plan, cache=None, last_hidden=None,
                                budget=per_example_budget(plan.method, plan.lengths),
                                max_question_tokens=int(meta["max_question_tokens"]),
                                fingerprint=str(meta.get("fingerprint")))
    try:
        check_model(model, context)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e} ({model_summary(model.config, model.dtype)})") from None
    want_cache = jax.eval_shape(lambda: stages.init_cache(plan.method, model.config, 1, plan.capacity, model.dtype,
                                                          plan.quant, context=plan.context,
                                                          layer_capacities=plan.layer_capacities))
    want_leaves, tree = jax.tree.flatten(want_cache)
    stored = sum(name.startswith("cache.") for name in info)
    if stored != len(want_leaves):
        raise CheckpointError(f"{path}: it holds {stored} cache arrays where {plan.method.name}'s cache has "
                              f"{len(want_leaves)} (written by another kvjax?)")
    leaves = [jnp.asarray(_checked(path, f"cache.{n}", tensors, info, verify, want))
              for n, want in enumerate(want_leaves)]
    hidden = jax.ShapeDtypeStruct((1, model.config.hidden_size), jnp.dtype(model.dtype))
    last_hidden = jnp.asarray(_checked(path, "last_hidden", tensors, info, verify, hidden))
    return dataclasses.replace(context, cache=jax.tree.unflatten(tree, leaves), last_hidden=last_hidden)


__all__ = ["FORMAT", "FORMAT_VERSION", "load_context", "method_record", "save_context"]
