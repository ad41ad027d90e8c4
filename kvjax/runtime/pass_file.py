"""A prompt pass in one file: the compressed cache and the last hidden states a prefill's prompt stages leave.

What `kvjax.runtime.context_file` (a compressed context) and `kvjax.engine.prompt_store` (the engine's prompt
passes kept across jobs) write. The file is safetensors: the cache's leaves (`cache.<n>`, in `jax.tree.leaves`
order, at the size the method allocated), `last_hidden` and the caller's own arrays; its metadata (JSON under
`kvjax`) names the format and version, the caller's fields and each array's dtype, shape and SHA-256. Nothing is
unpickled. Dtypes NumPy lacks (bfloat16, the fp8 formats) are stored as unsigned integers of their width and viewed
back. A file is written beside its path and renamed into place, so a killed save leaves the previous file or none.
A loaded cache is checked leaf by leaf against the cache its plan allocates (`jax.eval_shape`, nothing allocated).
"""

from __future__ import annotations

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
from kvjax.methods.base import Method
from kvjax.runtime import stages

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


def method_record(method: Method) -> dict[str, Any]:
    """The method as a file names it; refused (`KvjaxError`) where its hyperparameters would not come back equal."""
    record = {"name": method.name, "hyperparameters": _jsonable(method.hyperparameters())}
    try:
        back = method_from_record(json.loads(json.dumps(record)))
    except (TypeError, ValueError, KvjaxError) as e:
        raise KvjaxError(f"{method.name}: its hyperparameters cannot be written to a file ({e})") from None
    if back != method:
        raise KvjaxError(f"{method.name}: its hyperparameters {method.hyperparameters()} do not survive JSON")
    return record


def method_from_record(record: dict[str, Any]) -> Method:
    return kvm.get(str(record.get("name")), **_from_json(record.get("hyperparameters") or {}))


def _stored(x: Any) -> tuple[np.ndarray, str]:
    """A host array safetensors can write, and the dtype to view it back as."""
    a = np.ascontiguousarray(np.asarray(x))
    name = jnp.dtype(a.dtype).name
    if a.dtype.kind == "V":  # an ml_dtypes format (bfloat16, fp8): its bits as unsigned integers
        a = a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))
    return a, name


def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def write(path: pathlib.Path, cache: Any, last_hidden: Any, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """Writes the cache, the last hidden states, `arrays` and `meta` (with `format` and `version`) to `path`
    (OSError on a file system error)."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    named = {f"cache.{n}": leaf for n, leaf in enumerate(jax.tree.leaves(cache))}
    named.update(last_hidden=last_hidden, **arrays)
    tensors, info = {}, {}
    for name, x in named.items():
        tensors[name], dtype = _stored(x)
        info[name] = {"dtype": dtype, "shape": list(np.shape(x)), "sha256": _sha256(tensors[name])}
    tmp = path.parent / f".{path.name}.kvjax-tmp-{os.getpid()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps({**meta, "arrays": info}, sort_keys=True)})
        except SafetensorError as e:  # how safetensors reports a failed write: a full disk, a read-only folder
            raise OSError(str(e)) from None
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read(path: pathlib.Path, format: str, version: int, what: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """`(metadata, arrays as stored)` of the file at `path`, refused (`CheckpointError`, naming it as `what`) unless it
    is a readable file of `format` at `version`."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(f"{what} {path} {'is not a file' if path.exists() else 'does not exist'}")
    try:
        with safe_open(str(path), "np") as f:
            raw = (f.metadata() or {}).get(_META_KEY)
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable {what} ({type(e).__name__}: {e})") from None
    try:
        meta = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: its kvjax metadata is unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != format:
        raise CheckpointError(f"{path} is not a {what} (no {format!r} metadata)")
    if meta.get("version") != version:
        raise CheckpointError(f"{path}: {what} format version {meta.get('version')} is not supported (this kvjax "
                              f"reads version {version})")
    return meta, tensors


def checked(path: pathlib.Path, name: str, tensors: dict[str, np.ndarray], meta: dict[str, Any], verify: bool,
            want: Any = None) -> np.ndarray:
    """Array `name` viewed back to its dtype, after its shape and dtype (against `want`'s too, where given) and,
    with `verify`, its SHA-256 are checked."""
    info = meta.get("arrays") or {}
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


def cache_and_hidden(path: pathlib.Path, tensors: dict[str, np.ndarray], meta: dict[str, Any], model: Any,
                     plan: stages.PrefillPlan, verify: bool) -> tuple[Any, Any]:
    """The prompt pass's cache (the tree its plan allocates, each leaf checked against it) and last hidden states,
    as device arrays."""
    want = jax.eval_shape(lambda: stages.init_cache(plan.method, model.config, plan.batch, plan.capacity, model.dtype,
                                                    plan.quant, context=plan.context,
                                                    layer_capacities=plan.layer_capacities))
    want_leaves, tree = jax.tree.flatten(want)
    stored = sum(name.startswith("cache.") for name in meta.get("arrays") or {})
    if stored != len(want_leaves):
        raise CheckpointError(f"{path}: it holds {stored} cache arrays where {plan.method.name}'s cache has "
                              f"{len(want_leaves)} (written by another kvjax?)")
    leaves = [jnp.asarray(checked(path, f"cache.{n}", tensors, meta, verify, w)) for n, w in enumerate(want_leaves)]
    hidden = jax.ShapeDtypeStruct((plan.batch, model.config.hidden_size), jnp.dtype(model.dtype))
    return jax.tree.unflatten(tree, leaves), jnp.asarray(checked(path, "last_hidden", tensors, meta, verify, hidden))


__all__ = ["cache_and_hidden", "checked", "method_from_record", "method_record", "read", "write"]
