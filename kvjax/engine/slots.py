"""The engine's slots: one cache whose batch axis is the slot axis, the per-slot decode state, and the insert.

Every slot holds one request's cache at the method's capacity for the engine's longest request (`SlotLayout`): the
longest prompt bucket (with the question where the method's layout puts it), the question's bucket, the engine's
`max_new_tokens`, the sliding-window rings sized for that whole sequence. A request is prefilled by the runtime's
own stages at its own bucket (`kvjax.runtime.stages`, the cache reserved for the engine's generation), so it runs
the programs `generate` runs for that bucket; `insert` then writes its rows into free slots: each leaf of its cache
is laid into an empty slot-sized leaf (its leading region; the rest stays as an empty cache has it) and scattered
at the slots' indices, in one jitted program per prefill shape with the slot cache donated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import ModelCache
from kvjax.errors import ConfigError
from kvjax.methods import capabilities as caps
from kvjax.methods.base import Method
from kvjax.quant.spec import KVQuant
from kvjax.runtime import sharding, stages
from kvjax.runtime.forward import TRACE_COUNTS

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Static shape of the slots (hashable: a static argument of the engine's programs)."""

    config: Any
    method: Method
    quant: KVQuant | None
    dtype: str
    slots: int
    bucket: int  # the longest prompt bucket, as the method's layout feeds it
    question_bucket: int  # the longest question fed after the prompt (0: none)
    max_new_tokens: int
    capacity: int  # slots of a managed layer (question included)
    layer_capacities: tuple[int, ...] | None

    @property
    def context(self) -> int:
        """The longest sequence a slot holds: what its sliding-window rings are sized for."""
        return self.bucket + self.question_bucket + self.max_new_tokens

    def empty(self, batch: int) -> ModelCache:
        """An empty cache of `batch` rows at the slots' shape."""
        return stages.init_cache(self.method, self.config, batch, self.capacity, self.dtype, self.quant,
                                 context=self.context, layer_capacities=self.layer_capacities)

    @functools.cached_property
    def batch_leaves(self) -> tuple[bool, ...]:
        """Which leaves of a slot cache (in `jax.tree.leaves` order) have the batch axis first
        (`stages.batch_leaves`)."""
        return stages.batch_leaves(self.empty)

    def slot_bytes(self) -> int:
        """Bytes one slot's cache holds."""
        return _bytes(lambda: self.empty(1))

    def prompt_pass_bytes(self) -> int:
        """Bytes the cache of one prefill of the longest bucket holds during its prompt pass: at most a slot's, but a
        context replay's (KVzip) holds the whole bucket uncompressed until its replay compacts it
        (`stages.allocate`)."""
        if not caps.replays_context(self.method):
            return self.slot_bytes()
        return _bytes(lambda: stages.init_cache(self.method, self.config, 1, self.bucket, self.dtype, self.quant,
                                                context=self.context))


def _bytes(make: Any) -> int:
    """Bytes of the arrays `make()` would allocate (nothing is allocated)."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(make)))


def layout(config: Any, method: Method, quant: KVQuant | None, dtype: Any, *, slots: int, max_prompt_tokens: int,
           max_question_tokens: int, max_new_tokens: int, chunk_size: int | None) -> SlotLayout:
    """The slots' shape for prompts of up to `max_prompt_tokens`, questions of up to `max_question_tokens` and
    generations of up to `max_new_tokens`: what `stages.plan` would allocate for the longest of each, plus the
    question's room (`stages.append_question` extends every managed layer by its bucket)."""
    longest = max_prompt_tokens
    question_bucket = 0
    if max_question_tokens > 0:
        if caps.question_in_prompt(method):  # read as the end of the prompt (and its start: Q-LLM)
            longest += max_question_tokens * (2 if caps.encodes_question(method) else 1)
        else:
            question_bucket = stages.bucket_length(max_question_tokens)
    chunk = method.prefill_window() if chunk_size is None else min(chunk_size, stages.bucket_length(longest))
    bucket = stages.bucket_length(longest, multiple=chunk or 1)
    capacity = stages.cache_capacity(method, bucket, max_new_tokens, quantized=quant is not None) + question_bucket
    layers = stages.cache_layer_capacities(method, bucket, max_new_tokens, config.method_layers)
    if layers is not None:
        layers = tuple(c + question_bucket for c in layers)
    return SlotLayout(config=config, method=method, quant=quant, dtype=jnp.dtype(dtype).name, slots=slots,
                      bucket=bucket, question_bucket=question_bucket, max_new_tokens=max_new_tokens,
                      capacity=capacity, layer_capacities=layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """Per-slot decode state, every field `[S, ...]`: the logits the next token is sampled from, the sequence's
    length before decode, its budget, the tokens it generated, its limit, whether it is still generating, its stop
    ids (-1: none), sampling settings, seed and sample index."""

    logits: Array  # [S, V] float32
    lengths: Array  # [S] int32
    budget: Array  # [S] int32
    count: Array  # [S] int32
    max_new: Array  # [S] int32
    active: Array  # [S] bool
    stop: Array  # [S, M] int32
    temperature: Array  # [S] float32
    top_p: Array  # [S] float32
    seed: Array  # [S] uint32
    sample: Array  # [S] uint32: which of its request's samples a slot draws

    def replace(self, **changes: Any) -> Slots:
        return dataclasses.replace(self, **changes)


def empty_slots(batch: int, vocab_size: int, stop_ids: int) -> Slots:
    """`batch` inactive slots (host arrays)."""
    zeros = np.zeros((batch,), np.int32)
    return Slots(logits=np.zeros((batch, vocab_size), np.float32), lengths=zeros, budget=zeros, count=zeros,
                 max_new=zeros, active=np.zeros((batch,), bool), stop=np.full((batch, stop_ids), -1, np.int32),
                 temperature=np.zeros((batch,), np.float32), top_p=np.ones((batch,), np.float32),
                 seed=np.zeros((batch,), np.uint32), sample=np.zeros((batch,), np.uint32))


def check_fits(layout: SlotLayout, cache: ModelCache) -> None:
    """Refuses (before the insert traces) a prefilled cache that would not fit the slots' shape."""
    want = jax.eval_shape(lambda: layout.empty(1))
    if jax.tree.structure(cache) != jax.tree.structure(want):
        raise ConfigError(f"{layout.method.name}: a prefilled cache's layout differs from the slots' (this storage "
                          "format stores a short ring differently from a long one)")
    for got, slot in zip(jax.tree.leaves(cache), jax.tree.leaves(want), strict=True):
        if got.ndim != slot.ndim or any(g > s for g, s in zip(got.shape[1:], slot.shape[1:], strict=True)):
            raise ConfigError(f"{layout.method.name}: a prefilled cache leaf {got.shape} does not fit the slots' "
                              f"{slot.shape}; raise the engine's max_prompt_tokens / max_new_tokens")


@functools.partial(jax.jit, static_argnums=0, static_argnames=("mesh",), donate_argnums=(1, 2))
def insert(layout: SlotLayout, cache: ModelCache, slots: Slots, new_cache: ModelCache, new_slots: Slots,
           source: Array, index: Array, mesh: Any = None) -> tuple[ModelCache, Slots]:
    """Writes a prefill's cache (`b` rows) into slots `index` `[m]` of `cache`, slot `index[i]` taking row
    `source[i]` (a request of several samples fills several slots from its one row), and `new_slots` (`m` rows)
    into the same slots of `slots`. With `m` = `b` (one sample each: `source` is `0..b-1`) the rows are scattered
    at once; with more slots than rows, one slot at a time, so the insert holds `b` slot-sized rows, never `m`."""
    TRACE_COUNTS["engine_insert"] += 1
    leaves, tree = jax.tree.flatten(cache)
    news = jax.tree.leaves(new_cache)
    b = next(new.shape[0] for new, batched in zip(news, layout.batch_leaves, strict=True) if batched)
    laid = {}  # leaf number -> the prefill's rows laid into slot-sized rows [b, ...]
    for n, (blank, new, batched) in enumerate(zip(jax.tree.leaves(layout.empty(b)), news, layout.batch_leaves,
                                                  strict=True)):
        if batched:  # else a constant of the method's, the same in every cache
            laid[n] = jax.lax.dynamic_update_slice(blank, new.astype(blank.dtype), (0,) * blank.ndim)
    out = list(leaves)
    if index.shape[0] == b:
        for n, rows in laid.items():
            out[n] = leaves[n].at[index].set(rows)
    else:
        def put(i: Array, carry: tuple) -> tuple:
            return tuple(jax.lax.dynamic_update_index_in_dim(
                slot, jax.lax.dynamic_index_in_dim(laid[n], source[i], keepdims=True), index[i], axis=0)
                for n, slot in zip(laid, carry, strict=True))

        for n, slot in zip(laid, jax.lax.fori_loop(0, index.shape[0], put, tuple(leaves[n] for n in laid)),
                           strict=True):
            out[n] = slot
    cache = jax.tree.unflatten(tree, out)
    slots = jax.tree.map(lambda old, new: old.at[index].set(new.astype(old.dtype)), slots, new_slots)
    if mesh is not None:
        cache = sharding.constrain_cache(cache, mesh)
    return cache, slots


@functools.partial(jax.jit, donate_argnums=0)
def end(slots: Slots, ended: Array) -> Slots:
    """Slots `ended` ([S] bool: a stop string found on the host) stop generating."""
    TRACE_COUNTS["engine_end"] += 1
    return slots.replace(active=slots.active & ~ended)


def kept_counts(cache: ModelCache, lengths: Array, count: Array) -> tuple[Array, Array]:
    """`[S]` tokens each slot's cache holds, mean over layers and KV heads: prompt tokens (position below the
    sequence's length) and generated ones (the `count` positions after it), as the eval's `kept_tokens` counts."""
    prompt, generated = [], []
    for layer in cache.layers:
        pos = layer.pos
        below = lengths[:, None, None]
        prompt.append(jnp.mean(jnp.sum((pos >= 0) & (pos < below), axis=-1), axis=-1))
        generated.append(jnp.mean(jnp.sum((pos >= below) & (pos < below + count[:, None, None]), axis=-1), axis=-1))
    return jnp.mean(jnp.stack(prompt), axis=0), jnp.mean(jnp.stack(generated), axis=0)
