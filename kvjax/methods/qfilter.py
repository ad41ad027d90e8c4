"""`qfilter`: Q-Filters, "Leveraging QK Geometry for Efficient KV Cache Compression" (Godey et al., 2025; kvpress's
`QFilterPress`).

Queries and keys of a head share a direction along which they are strongly anisotropic, so the attention a key
receives is estimated, without any query, by its projection on that direction. The paper computes it offline per
layer and KV head (the filter `f_{l,k}`, a head_dim vector from an SVD of observed queries) and publishes it; each
key then scores `s_i = -<f_{l,k}, k_i>` (post-RoPE keys, kvpress's sign convention for the published filters) and
each KV head keeps its `budget` best keys. No attention weight is read, so any attention kernel works.

Filters are read from a local directory in the published layout (the Hugging Face repositories
`nthngdy/<model>_qfilt`, as `huggingface_hub`'s `PyTorchModelHubMixin` saves them): `model.safetensors` holding
`q_filters` `[layers, kv_heads, head_dim]` and `config.json` with `num_layers`, `num_kv_heads`, `kv_head_dim`. Only
safetensors is read, never a pickle. The directory name `<model>_qfilt` is the model the filters are for; `model=`
is checked against it when both are known.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import safetensors

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Step
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod

Array = jax.Array

TENSOR_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TENSOR_NAME = "q_filters"
DIR_SUFFIX = "_qfilt"
_CONFIG_KEYS = ("num_layers", "num_kv_heads", "kv_head_dim")


@dataclasses.dataclass(frozen=True)
class QFilters:
    """Filters read from disk: `filters` `[layers, kv_heads, head_dim]` float32; `model_name` from the directory."""

    file: pathlib.Path
    filters: np.ndarray
    model_name: str | None


def load_qfilters(path: str | pathlib.Path) -> QFilters:
    """Reads a published Q-Filters directory (`model.safetensors` + `config.json`); ConfigError naming the file for
    anything missing, unsafe or inconsistent."""
    directory = pathlib.Path(path).expanduser()
    tensors, config = directory / TENSOR_FILE, directory / CONFIG_FILE
    if not tensors.is_file():
        pickled = sorted(p.name for p in directory.glob("*.bin")) if directory.is_dir() else []
        hint = f" ({', '.join(pickled)} is a pickle, which kvjax never loads)" if pickled else ""
        raise ConfigError(f"qfilter: no {TENSOR_FILE} at {str(tensors)!r}{hint}; filters= must name a Q-Filters "
                          f"directory holding {TENSOR_FILE} and {CONFIG_FILE} (the nthngdy/<model>{DIR_SUFFIX} layout)")
    try:
        with safetensors.safe_open(str(tensors), framework="numpy") as f:
            if TENSOR_NAME not in f.keys():
                raise ConfigError(f"qfilter: {str(tensors)!r} holds no tensor {TENSOR_NAME!r} (it has "
                                  f"{', '.join(f.keys()) or 'none'})")
            filters = np.asarray(f.get_tensor(TENSOR_NAME)).astype(np.float32)
    except (safetensors.SafetensorError, OSError) as e:
        raise ConfigError(f"qfilter: cannot read {str(tensors)!r} as safetensors (corrupt or truncated?): {e}") from e
    if filters.ndim != 3 or not np.isfinite(filters).all():
        raise ConfigError(f"qfilter: {TENSOR_NAME!r} in {str(tensors)!r} must be finite [layers, kv_heads, head_dim], "
                          f"got shape {filters.shape}")
    if config.is_file():
        try:
            meta = json.loads(config.read_text())
        except (ValueError, OSError) as e:
            raise ConfigError(f"qfilter: cannot read {str(config)!r} as JSON: {e}") from e
        given = tuple(meta.get(k) for k in _CONFIG_KEYS) if isinstance(meta, dict) else None
        if given != filters.shape:
            raise ConfigError(f"qfilter: {str(config)!r} gives {dict(zip(_CONFIG_KEYS, given or (), strict=False))} "
                              f"but {str(tensors)!r} holds {TENSOR_NAME} of shape {filters.shape}")
    name = directory.resolve().name
    return QFilters(tensors, filters, name[: -len(DIR_SUFFIX)] if name.endswith(DIR_SUFFIX) else None)


def write_qfilters(directory: str | pathlib.Path, filters: np.ndarray) -> pathlib.Path:
    """Writes `filters` `[layers, kv_heads, head_dim]` in the published layout (for tests and benchmarks)."""
    import safetensors.numpy

    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    filters = np.ascontiguousarray(filters)
    safetensors.numpy.save_file({TENSOR_NAME: filters}, str(out / TENSOR_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(dict(zip(_CONFIG_KEYS, map(int, filters.shape), strict=True))))
    return out


def filter_name(model: str) -> str:
    """The `<name>` of `nthngdy/<name>_qfilt` for a model name or path (kvpress's naming: Meta-Llama -> Llama but for
    the 405B model)."""
    base = model.rstrip("/").split("/")[-1]
    return base if "Meta-Llama-3.1-405B" in base else base.replace("Meta-Llama", "Llama")


def filter_scores(keys: Array, filters: Array, valid: Array) -> Array:
    """`-<f_k, k_i>` `[B, K, C]` float32 for keys `[B, K, C, H]` and filters `[K, H]` (0 on invalid slots)."""
    s = -jnp.einsum("bkch,kh->bkc", keys.astype(jnp.float32), filters.astype(jnp.float32))
    return jnp.where(valid, s, 0.0)


@register
@dataclasses.dataclass(frozen=True)
class QFilter(ScoringMethod):
    """Keep the keys with the most negative projection on the head's Q-Filter. `filters`: the filter directory
    (required); `model`: checked against the directory's `<model>_qfilt` name when given."""

    name = "qfilter"

    filters: str | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.filters, str | pathlib.Path) or not str(self.filters):
            raise ConfigError(f"{self.name}: needs filters= (a Q-Filters directory holding {TENSOR_FILE} and "
                              f"{CONFIG_FILE})")
        loaded = load_qfilters(self.filters)
        if self.model is not None and loaded.model_name is not None \
                and filter_name(self.model).lower() != loaded.model_name.lower():
            raise ConfigError(f"{self.name}: the filters {str(loaded.file)!r} are for {loaded.model_name!r}, not for "
                              f"the model {self.model!r}")
        object.__setattr__(self, "_loaded", loaded)

    @property
    def table(self) -> np.ndarray:
        """`[layers, kv_heads, head_dim]` float32 filters."""
        return self._loaded.filters  # type: ignore[attr-defined]

    def check_cache_spec(self, spec: CacheSpec) -> None:
        want = (spec.num_layers, spec.kv_heads, spec.head_dim)
        if self.table.shape != want:
            model = f"the model {self.model!r}" if self.model else "the model"
            shape = "{} layers x {} KV heads x head_dim {}"
            raise ConfigError(f"{self.name}: the filters {str(self._loaded.file)!r} have "  # type: ignore[attr-defined]
                              f"{shape.format(*self.table.shape)} but {model} has {shape.format(*want)}")

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        filters = jnp.asarray(self.table)[step.layer]
        return filter_scores(kvc.keys(cache, jnp.float32), filters, kvc.stored_mask(cache))


__all__ = ["QFilter", "QFilters", "filter_name", "filter_scores", "load_qfilters", "write_qfilters"]
