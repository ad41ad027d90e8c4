"""Device meshes and partition specs: batch on `data`, heads / KV heads / MLP on `model`.

    from kvjax.runtime import sharding
    mesh = sharding.make_mesh(data=2, model=4)            # or sharding.mesh_from_spec("data:2,model:4")
    model = sharding.shard_model(model, mesh)              # weights placed once
    out = kvjax.generate(model, prompts, method="snapkv", method_args={"budget": 512},
                         max_new_tokens=32, mesh=mesh)

Layout (Megatron-style tensor parallelism, as MaxText / tpu-inference lay out a decoder):

| array                       | shape              | spec                              |
|-----------------------------|--------------------|-----------------------------------|
| qkv (+ bias)                | `[D, K, G + 2, H]` | K on `model` (whole GQA groups)   |
| o                           | `[N, H, D]`        | N on `model`                      |
| gate_up (+ bias) / down     | `[D, 2, F]` / `[F, D]` | F on `model`                  |
| embed / lm_head             | `[V, D]` / `[D, V]` | V on `model`                     |
| norms, o / down biases      |                    | replicated                        |
| cache k, v                  | `[B, K, C, H]`     | B on `data`, K on `model`         |
| cache pos, score, attend    | `[B, K, C]`        | B on `data`, K on `model`         |
| cache length                | `[B, K]`           | B on `data`, K on `model`         |
| method state                | `[B, ...]`         | B on `data` (shared leaves too)   |

Layer weights and caches are per layer (one buffer each, `kvjax.models.block`, `kvjax.cache.ModelCache`);
the table gives one layer's shapes.

An axis that the mesh axis does not divide is replicated instead (e.g. 8 query heads but 4 KV
heads on `model:8`: the fused qkv and the cache are replicated over `model`, o is split; a batch of 3 on
`data:2` is replicated). Results do not depend on the mesh: every method indexes slots per
(example, KV head), so a shard holding whole heads runs exactly what one device would run; only
the summation order of the sharded contractions (o_proj, MLP down, logits) changes, at float
rounding level. The methods are plain XLA, so `jax.jit`'s sharding propagation partitions them;
a Pallas kernel (`implementation="pallas"`) does not auto-partition, so `kvjax.ops` runs it inside
`jax.shard_map` over (`data`, `model`) on the mesh of `kernel_mesh` (entered by `generate`'s jitted
programs), with the same rule: an axis the mesh axis does not divide runs whole (`kvjax.ops._shard`).

Meshes are built from this process's devices by default (`jax.local_devices()`): in a multi-host
job every process runs its own share of the samples on its own mesh (see `docs/scale.md`). Pass
`devices=jax.devices()` for one mesh over every host; then every process must call `generate` with
the same inputs (single-program, multi-data).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.cache import KVCache, ModelCache
from kvjax.errors import ConfigError
from kvjax.ops._shard import DATA, MODEL, split_axis
from kvjax.ops._shard import kernel_mesh as kernel_mesh  # re-exported: Pallas kernels per shard of a mesh

AXES = (DATA, MODEL)

# Which axis of each weight is split over `model` (None: replicated). Keys are the names of
# `kvjax.models.block`'s weights: the global ones and, without a prefix, those of one layer.
_MODEL_AXIS: dict[str, int | None] = {
    "embed": 0,
    "lm_head": 1,
    "final_norm": None,
    "attn_norm": None,
    "mlp_norm": None,
    "qkv": 1,  # [D, K, G + 2, H]: whole KV-head groups (their queries, key and value) per shard
    "o": 0,
    "q_norm": None,
    "k_norm": None,
    "post_attn_norm": None,
    "post_mlp_norm": None,
    "qkv_bias": 0,
    "o_bias": None,
    "gate_up": 2,  # [D, 2, F]: the matching columns of gate and up per shard
    "down": 0,
    "gate_up_bias": 1,
    "down_bias": None,
}


def parse_mesh(spec: str) -> dict[str, int]:
    """`"data:2,model:4"` -> `{"data": 2, "model": 4}` (a missing axis is 1); ConfigError when malformed."""
    sizes = {DATA: 1, MODEL: 1}
    seen: set[str] = set()
    items = [s.strip() for s in (spec or "").split(",") if s.strip()]
    if not items:
        raise ConfigError(f"mesh {spec!r} is empty; use e.g. data:2,model:4")
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip()
        if not sep or name not in sizes:
            raise ConfigError(f"mesh entry {item!r} is not data:N or model:N (mesh {spec!r})")
        if name in seen:
            raise ConfigError(f"mesh {spec!r} names axis {name!r} twice")
        try:
            size = int(value)
        except ValueError:
            raise ConfigError(f"mesh entry {item!r}: {value.strip()!r} is not an integer") from None
        if size <= 0:
            raise ConfigError(f"mesh entry {item!r}: axis sizes must be > 0")
        sizes[name] = size
        seen.add(name)
    return sizes


def make_mesh(data: int = 1, model: int = 1, *, devices: Sequence[Any] | None = None) -> Mesh:
    """A `(data, model)` mesh over `devices` (default: this process's devices, the first data*model)."""
    devices = list(jax.local_devices() if devices is None else devices)
    need = data * model
    if data <= 0 or model <= 0:
        raise ConfigError(f"mesh axis sizes must be > 0, got data={data}, model={model}")
    if need > len(devices):
        raise ConfigError(
            f"mesh data:{data},model:{model} needs {need} devices but {len(devices)} are available "
            f"({devices[0].platform if devices else 'none'}); on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX starts"
        )
    auto = (AxisType.Auto, AxisType.Auto)  # sharding propagation, not sharding-in-types
    if need == len(devices) and devices == list(jax.devices()):
        # Topology-aware order (ICI rings on TPU) when the mesh takes every device.
        return jax.make_mesh((data, model), AXES, axis_types=auto, devices=devices)
    return Mesh(np.asarray(devices[:need], dtype=object).reshape(data, model), AXES, axis_types=auto)


def mesh_from_spec(spec: str, *, devices: Sequence[Any] | None = None) -> Mesh:
    """`make_mesh` from a `"data:D,model:M"` string (the eval CLI's `--mesh`)."""
    sizes = parse_mesh(spec)
    return make_mesh(sizes[DATA], sizes[MODEL], devices=devices)


def weight_spec(name: str, shape: Sequence[int], mesh: Mesh) -> P:
    """The PartitionSpec of one weight (a global name, or a layer weight's name without prefix) on `mesh`; a name
    the layout table does not list is refused (placing it whole on every device could hide a missed shard)."""
    if name not in _MODEL_AXIS:
        raise ConfigError(f"sharding: no layout for the weight {name!r} (add it to kvjax/runtime/sharding.py's "
                          "_MODEL_AXIS)")
    axis = _MODEL_AXIS[name]
    spec: list[str | None] = [None] * len(shape)
    if axis is not None and axis < len(shape):
        spec[axis] = split_axis(mesh, MODEL, shape[axis])
    return P(*spec)


def weight_shardings(weights: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """The weights' pytree of NamedShardings (`layers`: one dict per layer)."""
    def named(group: dict[str, Any]) -> dict[str, NamedSharding]:
        return {k: NamedSharding(mesh, weight_spec(k, np.shape(v), mesh)) for k, v in group.items()}

    out: dict[str, Any] = named({k: v for k, v in weights.items() if k != "layers"})
    out["layers"] = tuple(named(layer) for layer in weights["layers"])
    return out


def _put(x: Any, sharding: NamedSharding) -> jax.Array:
    """Places `x` with `sharding`: a no-op when it already is. On a mesh spanning processes, a process-local
    value (the same on every process) becomes a global array by slicing it on the host."""
    if isinstance(x, jax.Array):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if not sharding.mesh.is_multi_process or not x.is_fully_addressable:
            return jax.device_put(x, sharding)
    elif not sharding.mesh.is_multi_process:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_weights(weights: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """The weights placed on `mesh` (no copy for weights already placed that way)."""
    return jax.tree.map(_put, weights, weight_shardings(weights, mesh))


def shard_model(model: Any, mesh: Mesh) -> Any:
    """A `DecoderLM` with the same config and weights placed on `mesh` (the original is untouched)."""
    from kvjax.models.model import DecoderLM

    return DecoderLM(model.config, shard_weights(model.weights(), mesh))


def _cache_field_spec(shape: Sequence[int], mesh: Mesh) -> P:
    """Spec of a `[B, K, ...]` cache field: B on data, K on model."""
    spec: list[str | None] = [None] * len(shape)
    spec[0] = split_axis(mesh, DATA, shape[0])
    if len(shape) > 1:
        spec[1] = split_axis(mesh, MODEL, shape[1])
    return P(*spec)


def _state_spec(x: Any, batch: int, mesh: Mesh) -> P:
    """Method state leaves are batch-first; only B is split."""
    shape = np.shape(x)
    spec: list[str | None] = [None] * len(shape)
    if shape and shape[0] == batch:
        spec[0] = split_axis(mesh, DATA, batch)
    return P(*spec)


def cache_specs(cache: KVCache | ModelCache, mesh: Mesh) -> KVCache | ModelCache:
    """A pytree of PartitionSpecs shaped like `cache` (one layer's cache, or a model's)."""
    if isinstance(cache, ModelCache):
        batch = cache.batch_size
        shared = None if cache.shared is None else jax.tree.map(lambda x: _state_spec(x, batch, mesh), cache.shared)
        return ModelCache(tuple(cache_specs(layer, mesh) for layer in cache.layers), shared)

    def field(x: Any) -> Any:
        # A quantized store (kvjax.quant.QuantizedKV) is a pytree of [B, K, ...] leaves: each placed alike.
        return jax.tree.map(lambda leaf: _cache_field_spec(leaf.shape, mesh), x)

    return KVCache(
        k=field(cache.k), v=field(cache.v), pos=field(cache.pos), length=field(cache.length),
        score=field(cache.score), attend=field(cache.attend),
        state=jax.tree.map(lambda x: _state_spec(x, cache.batch_size, mesh), cache.state),
    )


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def shard_cache(cache: KVCache | ModelCache, mesh: Mesh) -> KVCache | ModelCache:
    """The cache placed on `mesh` (see the module table)."""
    specs = cache_specs(cache, mesh)
    return jax.tree.map(lambda x, s: _put(x, NamedSharding(mesh, s)), cache, specs, is_leaf=_is_spec)


def constrain_cache(cache: KVCache | ModelCache, mesh: Mesh) -> KVCache | ModelCache:
    """Inside `jax.jit`: pins the cache layout so it stays the same across chunks and decode steps."""
    specs = cache_specs(cache, mesh)
    return jax.tree.map(
        lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), cache, specs, is_leaf=_is_spec
    )


def batch_spec(shape: Sequence[int], mesh: Mesh) -> P:
    """Batch-first arrays (tokens, positions, lengths, logits): B on data, the rest replicated."""
    if not shape:
        return P()
    return P(split_axis(mesh, DATA, shape[0]), *([None] * (len(shape) - 1)))


def shard_batch(x: Any, mesh: Mesh) -> jax.Array:
    """A batch-first array placed on `mesh`, B on `data`."""
    return _put(x, NamedSharding(mesh, batch_spec(np.shape(x), mesh)))


def check_mesh(mesh: Any, what: str = "mesh") -> None:
    """ConfigError unless `mesh` is None or a `jax.sharding.Mesh` whose axes are among (`data`, `model`).

    An axis the mesh leaves out counts as size 1; an axis size that does not divide the batch or the
    KV heads is not an error: that array is replicated over it (see the module docstring).
    """
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        hint = " (a string: build it with sharding.mesh_from_spec)" if isinstance(mesh, str) else ""
        raise ConfigError(
            f"{what} must be a jax.sharding.Mesh with axes {AXES}, e.g. kvjax.runtime.sharding.make_mesh(data=2, "
            f"model=4); got {type(mesh).__name__}{hint}"
        )
    unknown = [name for name in mesh.axis_names if name not in AXES]
    if unknown:
        raise ConfigError(
            f"{what} has axes {tuple(mesh.axis_names)}; kvjax shards over axes named {AXES} (batch on 'data', "
            f"heads / KV heads / MLP on 'model'), not {unknown}: build it with kvjax.runtime.sharding.make_mesh"
        )


def heads_spec(shape: Sequence[int], mesh: Mesh, heads_axis: int) -> P:
    """An array with a KV-head axis at `heads_axis` (on `model`, where it divides) and no batch axis."""
    spec: list[str | None] = [None] * len(shape)
    spec[heads_axis] = split_axis(mesh, MODEL, shape[heads_axis])
    return P(*spec)


def shard_heads(x: Any, mesh: Mesh, heads_axis: int) -> jax.Array:
    """`x` placed on `mesh` with its KV-head axis `heads_axis` on `model`, the rest replicated."""
    return _put(x, NamedSharding(mesh, heads_spec(np.shape(x), mesh, heads_axis)))


def replicate(x: Any, mesh: Mesh) -> jax.Array:
    """`x` placed whole on every device of `mesh`."""
    return _put(x, NamedSharding(mesh, P()))


def to_host(x: jax.Array) -> np.ndarray:
    """NumPy value of a (possibly multi-host) array: every process gets the whole array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def maybe_initialize_distributed() -> bool:
    """Calls `jax.distributed.initialize()` when this process was launched as part of a multi-process job.

    Launched that way means `KVJAX_DISTRIBUTED=1` (cluster auto-detection: Cloud TPU pods, SLURM,
    Open MPI, Kubernetes) or `JAX_COORDINATOR_ADDRESS` set (with `KVJAX_NUM_PROCESSES` and
    `KVJAX_PROCESS_ID` where the cluster cannot be detected). `KVJAX_DISTRIBUTED=0` turns it off.
    Returns whether JAX's distributed runtime is up. Call it before anything touches a device.
    """
    flag = os.environ.get("KVJAX_DISTRIBUTED", "").strip().lower()
    if flag in ("0", "false", "no"):
        return False
    if jax.distributed.is_initialized():
        return True
    if flag not in ("1", "true", "yes") and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return False
    kwargs: dict[str, Any] = {}
    for env, key in (("KVJAX_NUM_PROCESSES", "num_processes"), ("KVJAX_PROCESS_ID", "process_id")):
        value = os.environ.get(env)
        if value is not None:
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise ConfigError(f"{env}={value!r} is not an integer") from None
    jax.distributed.initialize(**kwargs)
    return True
