"""Running Pallas kernels per shard of a device mesh (`jax.shard_map` over `data` and `model`).

XLA's SPMD partitioner cannot split a `pallas_call` (a Mosaic custom call), so under a mesh each kernel
runs inside `shard_map` on its device's block: the batch axis on `data`, the KV-head axis (or the query
heads grouped over it) on `model`, like the cache (`kvjax.runtime.sharding`). Every kvjax kernel is
independent across examples and KV heads, so the per-shard result is the single-device one.

The mesh comes from `kernel_mesh(mesh)`, a context entered at trace time (`kvjax.runtime.generate` enters
it inside its jitted prefill / decode programs, whose jit cache keys on the static `mesh`), else from
JAX's own context mesh (`jax.set_mesh`, part of the jit cache key too). Without either, or on a
one-device mesh, the kernel is called as is.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from kvjax.errors import ConfigError


def _shard_map(fn: Callable, mesh: Any, in_specs: tuple, out_specs: Any) -> Callable:
    """`jax.shard_map` (jax 0.10 / 0.11), falling back to the experimental spelling of older releases."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


DATA = "data"
MODEL = "model"

#: Role of each axis of an operand, one character per axis: "b" batch (on `data`), "h" KV heads or the
#: query heads grouped over them (on `model`), "." anything else (never split).
Role = str

_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar("kvjax_kernel_mesh", default=None)


@contextlib.contextmanager
def kernel_mesh(mesh: Any) -> Iterator[None]:
    """Runs the Pallas kernels of `kvjax.ops` per shard of `mesh` (axes `data`, `model`) within the block.

    Read when an op is traced: enter it inside the function you `jax.jit` (or make the mesh a static
    argument of it), since a jit cache does not see it. `None` restores the default (JAX's context mesh).
    """
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def current_mesh() -> Any:
    """The mesh kernels run on: `kernel_mesh`'s, else JAX's context mesh if it names `data` or `model`.

    None inside a `shard_map` that already made `data` / `model` manual (the operands are per shard)."""
    get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    context = get_abstract_mesh() if get_abstract_mesh is not None else None
    names = tuple(getattr(context, "axis_names", ()) or ())
    if set(getattr(context, "manual_axes", ()) or ()) & {DATA, MODEL}:
        return None
    mesh = _MESH.get()
    if mesh is not None:
        return mesh
    return context if DATA in names or MODEL in names else None


def split_axis(mesh: Any, axis: str, size: int) -> str | None:
    """`axis` when the mesh splits it (more than one device) and it divides `size`, else None (replicated)."""
    n = dict(mesh.shape).get(axis, 1)
    return axis if n > 1 and size % n == 0 else None


def rows_role(ndim: int) -> Role:
    """Role of a `[B, heads, ..., C]` / `[B, C]` / `[C]` operand of a row-wise op (`pool1d`, `topk_keep`)."""
    if ndim >= 3:
        return "bh" + "." * (ndim - 2)
    return "b." if ndim == 2 else "." * ndim


def batch_heads_role(ndim: int) -> Role:
    """Role of a `[B, K, ...]` operand."""
    return "bh" + "." * (ndim - 2)


def check_query_heads(op: str, query_heads: int, kv_heads: int) -> None:
    if query_heads % kv_heads:
        raise ConfigError(f"{op}: {query_heads} query heads are not a multiple of {kv_heads} KV heads")


def _spec(role: Role, data: str | None, model: str | None) -> P:
    return P(*(data if r == "b" else model if r == "h" else None for r in role))


def per_shard(
    kernel: Callable[..., Any],
    args: Sequence[Any],
    in_roles: Sequence[Role | None],
    out_roles: Any,
    *,
    batch: int,
    heads: int,
) -> Any:
    """`kernel(*args)`, run per shard of `current_mesh()` (a plain call without a mesh).

    `in_roles` gives each operand's `Role` (None: replicated, e.g. an absent optional operand);
    `out_roles` is a pytree of roles shaped like the kernel's output (None for an output that is None).
    `data` splits the batch when it divides `batch`, `model` the heads when it divides `heads` (the KV
    heads); an axis it does not divide runs whole on every device of that mesh axis, as the runtime
    replicates it (`kvjax.runtime.sharding`), so per-shard shapes always divide.
    """
    mesh = current_mesh()
    if mesh is None or mesh.size <= 1:
        return kernel(*args)
    data, model = split_axis(mesh, DATA, batch), split_axis(mesh, MODEL, heads)
    in_specs = []
    for x, role in zip(args, in_roles, strict=True):
        if x is None or role is None:
            in_specs.append(P())
            continue
        if len(role) != x.ndim:
            raise ValueError(f"role {role!r} does not fit an operand of shape {x.shape}")
        in_specs.append(_spec(role, data, model))
    out_specs = jax.tree.map(lambda role: _spec(role, data, model), out_roles)
    return _shard_map(kernel, mesh, tuple(in_specs), out_specs)(*args)
