"""A model's fingerprint: what a saved cache records of the model that made it, so another model's cache is refused.

Used by the RAG document store (`kvjax.rag.store`) and by saved compressed contexts (`kvjax.runtime.contexts`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from typing import Any

import jax.numpy as jnp
import numpy as np

from kvjax.models.loader import flatten


def _config_dict(config: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str))


def config_digest(config: Any) -> str:
    """SHA-256 of a model config alone: what `model_fingerprint` hashes before the weights (no weights needed)."""
    return hashlib.sha256(json.dumps(_config_dict(config), sort_keys=True).encode()).hexdigest()


def model_fingerprint(model: Any) -> str:
    """SHA-256 over the model config, the dtype and 256 strided samples of every weight array (each layer's
    arrays by their flat names, `layers.{i}.qkv`, ...).

    Cheap (a few KB leave the device), and any change of architecture, dtype or checkpoint shows.
    """
    h = hashlib.sha256()
    h.update(json.dumps(_config_dict(model.config), sort_keys=True).encode())
    h.update(str(jnp.dtype(model.dtype)).encode())
    for name, w in sorted(flatten(model.weights()).items()):
        flat = jnp.ravel(w)
        stride = max(1, flat.shape[0] // 256)
        sample = np.asarray(flat[::stride][:256], dtype=np.float32)
        h.update(name.encode())
        h.update(str(tuple(w.shape)).encode())
        h.update(sample.tobytes())
    return h.hexdigest()


def model_summary(config: Any, dtype: Any) -> str:
    """One line naming a model's architecture and dtype, for error messages."""
    return (
        f"{config.model_type}, {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads}/{config.num_kv_heads} heads x {config.head_dim}, {jnp.dtype(dtype).name}"
    )


_FINGERPRINTS: dict[int, tuple[weakref.ref, str]] = {}


def fingerprint_of(model: Any) -> str:
    """`model_fingerprint`, memoised per live model object (a model's weights are not expected to change)."""
    hit = _FINGERPRINTS.get(id(model))
    if hit is not None and hit[0]() is model:
        return hit[1]
    fp = model_fingerprint(model)
    try:
        _FINGERPRINTS[id(model)] = (weakref.ref(model), fp)
    except TypeError:  # not weak-referenceable: just don't memoise
        pass
    return fp


__all__ = ["config_digest", "fingerprint_of", "model_fingerprint", "model_summary"]
