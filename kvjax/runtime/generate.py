"""Generation with a compressed cache: validated inputs, bucketed prefill, a jitted decode loop.

`generate` = `prefill` (one shot, or chunk by chunk with `chunk_size`) + `decode` (one
`lax.while_loop` over tokens, EOS-aware, the cache donated). Prompts are right-padded to a length
bucket so a whole evaluation compiles a handful of programs; per-example prompt lengths are
first-class (positions of padding are -1 and never enter the cache).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import tuning
from kvjax.cache import ModelCache
from kvjax.errors import KvjaxError
from kvjax.methods import capabilities as caps
from kvjax.methods.base import Method
from kvjax.quant.spec import KVQuant
from kvjax.runtime import forward, sharding, stages
from kvjax.runtime.compile_cache import ensure_compilation_cache
from kvjax.runtime.forward import TRACE_COUNTS
from kvjax.runtime.stages import (
    PrefillState,
    bucket_length,
    cache_capacity,
    check_context,
    init_cache,
    resolve_kv_dtype,
)
from kvjax.validation import as_bool, as_int, as_seed
from kvjax.validation import eos_ids as checked_eos_ids

Array = jax.Array

__all__ = [
    "TRACE_COUNTS", "GenerationResult", "PrefillState", "bucket_length", "cache_capacity", "check_context", "decode",
    "generate", "init_cache", "prefill", "resolve_kv_dtype",
]

_KEEP_ALL = stages.KEEP_ALL


@dataclasses.dataclass
class GenerationResult:
    """`tokens` `[B, max_new_tokens]` (after EOS: `pad_id`), `num_tokens` `[B]` generated counts
    (EOS included), `prompt_lengths` `[B]`, and the final `cache` when asked for."""

    tokens: np.ndarray
    num_tokens: np.ndarray
    prompt_lengths: np.ndarray
    cache: ModelCache | None = None

    def texts(self, tokenizer: Any) -> list[str]:
        return [
            tokenizer.decode(row[:n].tolist(), skip_special_tokens=True)
            for row, n in zip(self.tokens, self.num_tokens, strict=True)
        ]


def prefill(
    model: Any,
    input_ids: Any,
    *,
    method: str | Method = "full",
    max_new_tokens: int = 1,
    prompt_lengths: Any = None,
    chunk_size: int | None = None,
    method_args: dict | None = None,
    question_ids: Any = None,
    mesh: Any = None,
    kv_dtype: str | KVQuant | None = None,
) -> PrefillState:
    """Prefills the prompts into a cache allocated at the method's capacity.

    One shot by default; with `chunk_size` the prompt goes through chunk by chunk (one compiled
    program for all chunks), and a compressing method keeps the cache at its budget in between,
    so peak KV memory is bounded by capacity + chunk.

    `question_ids` (one token list per example, may be empty) are fed after the prompt has been
    compressed, without compression (kvpress's query-agnostic setting: the context is compressed
    without seeing the question); the cache grows by the question's bucket for them. Methods with
    the `QuestionReader` capability (retrieval methods) instead prefill the question through their own hooks as
    the end of the prompt; methods with `encodes_question` also get it before the context (question +
    context + question, as Q-LLM's prompts; `Method.mark_question`). Without `chunk_size`, a method's
    `prefill_window()` (if any) is the chunk size.

    `mesh`: a `jax.sharding.Mesh` with axes (`data`, `model`) (see `kvjax.runtime.sharding`): the
    batch goes on `data`, heads / KV heads / MLP and the cache's KV heads on `model`.

    `kv_dtype`: how the cache stores keys and values (`kvjax.quant`): None / "model" the model dtype, or
    "int8", "fp8", "int4", "kivi2", "kivi4" (options as "kivi2:group_size=32:residual=64", or a
    `kvjax.quant.KVQuant`). It composes with every method: the method keeps its tokens, the format stores each
    in fewer bits. One compiled program per format and shape bucket.

    The work is `kvjax.runtime.stages`: a host-side plan (inputs checked, question layout, bucket, capacity,
    passes), then allocate -> prompt -> [context replay] -> [question] -> finish.
    """
    ensure_compilation_cache()
    plan = stages.plan(model.config, input_ids, method=method, max_new_tokens=max_new_tokens,
                       prompt_lengths=prompt_lengths, chunk_size=chunk_size, method_args=method_args,
                       question_ids=question_ids, mesh=mesh, kv_dtype=kv_dtype)
    return stages.run(model, plan, mesh)


def decode_program_key(method: Method) -> Method:
    """The method the decode program is compiled for: a method whose decode only appends (no observer, no
    per-head mask, no retrieval, no rewritten attention) decodes exactly as `full` does, whatever it did at
    prefill, so all such methods share one program per cache shape."""
    plain = method.decode_appends_only and not (caps.gathers(method) or caps.rewrites_attention(method))
    return _KEEP_ALL if plain else method


def _is_real(value: Any) -> bool:
    """A Python or NumPy real number (a bool is no temperature or top_p)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def _check_sampling(temperature: float, top_p: float) -> None:
    if not _is_real(temperature) or not 0 <= temperature < float("inf"):
        raise KvjaxError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not _is_real(top_p) or not 0.0 < top_p <= 1.0:
        raise KvjaxError(f"top_p must be a number in (0, 1], got {top_p!r}")


def _sample(logits: Array, key: Array, temperature: float, top_p: float) -> Array:
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        choice = jax.random.categorical(key, sorted_logits, axis=-1)
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), static_argnames=("mesh",), donate_argnums=(8,))
def _decode_loop(config, method, max_new, temperature, top_p, tune, weights, rope, cache, first_logits,
                 lengths, budget, eos_ids, pad_id, seed, mesh=None):
    batch = first_logits.shape[0]
    key, sub = jax.random.split(jax.random.key(seed))  # made here: an eager key would compile on its own
    first = _sample(first_logits, sub, temperature, top_p)
    out = jnp.full((batch, max_new), pad_id, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos_ids)
    count = jnp.ones((batch,), jnp.int32)

    def cond(carry):
        i, _, _, _, done, _, _ = carry
        return (i < max_new) & ~jnp.all(done)

    def body(carry):
        TRACE_COUNTS["decode_step"] += 1
        i, cache, out, prev, done, count, key = carry
        with sharding.kernel_mesh(mesh), tuning.use(tune):
            # A finished row's cache is frozen from its last token on: what it keeps is read at its end, so it does
            # not depend on when the batch's longest answer ends.
            logits, cache = forward.decode_step(config, weights, rope, method, cache, prev, lengths + i - 1, budget,
                                                active=~done)
        if mesh is not None:
            cache = sharding.constrain_cache(cache, mesh)
        key, sub = jax.random.split(key)
        tok = jnp.where(done, pad_id, _sample(logits, sub, temperature, top_p))
        out = jax.lax.dynamic_update_index_in_dim(out, tok, i, axis=1)
        count = count + (~done).astype(jnp.int32)
        done = done | jnp.isin(tok, eos_ids)
        return i + 1, cache, out, tok, done, count, key

    carry = (jnp.int32(1), cache, out, first, done, count, key)
    _, cache, out, _, _, count, _ = jax.lax.while_loop(cond, body, carry)
    return out, count, cache


def decode(
    model: Any,
    state: PrefillState,
    *,
    max_new_tokens: int,
    seed: int = 0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    stop_at_eos: bool = True,
    mesh: Any = None,
) -> tuple[np.ndarray, np.ndarray, ModelCache]:
    """Generates up to `max_new_tokens` per example in one jitted `while_loop` (cache donated).

    `mesh`: see `prefill`; defaults to the mesh `state` was prefilled on. `max_new_tokens` is at most the
    `max_new_tokens` `prefill` sized the cache for: past it the cache has no room for the new tokens. The state's
    cache is donated (written in place), so a state decodes once; prefill again to decode it again.
    """
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state.cache)):
        raise KvjaxError("decode: this PrefillState's cache was donated to an earlier decode (a state decodes once); "
                         "prefill again to decode it again")
    _check_sampling(temperature, top_p)
    as_int(max_new_tokens, "max_new_tokens", minimum=1)
    stop_at_eos = as_bool(stop_at_eos, "stop_at_eos")
    if state.max_new_tokens is not None and max_new_tokens > state.max_new_tokens:
        raise KvjaxError(f"max_new_tokens={max_new_tokens} exceeds the {state.max_new_tokens} new tokens the cache was "
                         "prefilled for: pass prefill(..., max_new_tokens=) at least as large")
    as_seed(seed)
    config = model.config
    if eos_token_id is None:
        eos = tuple(config.eos_token_ids or ())
    else:
        eos = checked_eos_ids(eos_token_id, config.vocab_size)
    if not stop_at_eos:
        eos = ()
    pad_id = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    eos_ids = np.asarray(eos if eos else (-1,), np.int32)
    mesh = state.mesh if mesh is None else mesh
    weights, cache, logits = model.weights(), state.cache, state.logits
    rope = model.rope() if state.rope is None else state.rope
    lengths, budget = np.asarray(state.prompt_lengths, np.int32), state.budget
    if mesh is not None:
        weights = sharding.shard_weights(weights, mesh)
        cache = sharding.shard_cache(cache, mesh)
        logits, budget = sharding.shard_batch(logits, mesh), sharding.shard_batch(budget, mesh)
        lengths = sharding.shard_batch(np.asarray(state.prompt_lengths, np.int32), mesh)
    out, count, cache = _decode_loop(
        config, decode_program_key(state.method), int(max_new_tokens), float(temperature), float(top_p),
        tuning.current(), weights, rope, cache, logits, lengths, budget, eos_ids, np.int32(pad_id),
        np.uint32(seed), mesh=mesh,
    )
    return sharding.to_host(out), sharding.to_host(count), cache


def generate(
    model: Any,
    input_ids: Any,
    *,
    method: str | Method = "full",
    max_new_tokens: int,
    prompt_lengths: Any = None,
    return_cache: bool = False,
    seed: int = 0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    stop_at_eos: bool = True,
    chunk_size: int | None = None,
    method_args: dict | None = None,
    question_ids: Any = None,
    mesh: Any = None,
    kv_dtype: str | KVQuant | None = None,
) -> GenerationResult:
    """Generates `max_new_tokens` tokens per prompt with the KV cache managed by `method`.

    `input_ids`: `[B, T]` right-padded ids with `prompt_lengths`, or a list of token lists.
    `method`: a registered name (hyperparameters in `method_args`) or a `Method` instance.
    `question_ids`: token lists fed after compression, uncompressed (see `prefill`).
    Greedy when `temperature == 0`, else temperature + nucleus (`top_p`) sampling from `seed`.
    `mesh`: a `jax.sharding.Mesh` (`data`, `model`) to shard the batch, heads and cache over (see
    `kvjax.runtime.sharding`); `shard_model(model, mesh)` first places the weights once.
    `kv_dtype`: the cache's K / V storage format (None: the model dtype; "int8", "fp8", "int4", "kivi2",
    "kivi4"; see `prefill`).
    """
    _check_sampling(temperature, top_p)
    as_seed(seed)
    as_bool(stop_at_eos, "stop_at_eos")
    return_cache = as_bool(return_cache, "return_cache")
    if eos_token_id is not None:
        checked_eos_ids(eos_token_id, model.config.vocab_size)
    state = prefill(
        model, input_ids, method=method, max_new_tokens=max_new_tokens,
        prompt_lengths=prompt_lengths, chunk_size=chunk_size, method_args=method_args,
        question_ids=question_ids, mesh=mesh, kv_dtype=kv_dtype,
    )
    tokens, count, cache = decode(
        model, state, max_new_tokens=max_new_tokens, seed=seed, temperature=temperature,
        top_p=top_p, eos_token_id=eos_token_id, stop_at_eos=stop_at_eos, mesh=mesh,
    )
    return GenerationResult(
        tokens=tokens, num_tokens=count, prompt_lengths=state.prompt_lengths,
        cache=cache if return_cache else None,
    )
