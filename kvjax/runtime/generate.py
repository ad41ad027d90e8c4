"""Generation with a compressed cache: validated inputs, bucketed prefill, a jitted decode loop.

`generate` = `prefill` (one shot, or chunk by chunk with `chunk_size`) + `decode` (one
`lax.while_loop` over tokens, EOS-aware, the cache donated). Prompts are right-padded to a length
bucket so a whole evaluation compiles a handful of programs; per-example prompt lengths are
first-class (positions of padding are -1 and never enter the cache).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax import methods as kvm
from kvjax import tuning
from kvjax.cache import KVCache, ModelCache
from kvjax.errors import ConfigError, KvjaxError
from kvjax.methods import capabilities as caps
from kvjax.methods.base import CacheSpec, Method, per_example_budget
from kvjax.quant.spec import KVQuant, parse_kv_dtype
from kvjax.runtime import forward, replay, sharding, step
from kvjax.runtime.compile_cache import ensure_compilation_cache
from kvjax.runtime.forward import TRACE_COUNTS, final_logits
from kvjax.validation import as_int, token_ids, token_rows
from kvjax.validation import eos_ids as checked_eos_ids

Array = jax.Array

_KEEP_ALL = kvm.get("full")

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


@dataclasses.dataclass
class PrefillState:
    """What `prefill` hands to `decode`."""

    cache: ModelCache
    logits: Array  # [B, V] float32 logits of each example's last prompt token
    prompt_lengths: np.ndarray
    budget: Array  # [B] int32
    method: Method
    mesh: Any = None  # the jax.sharding.Mesh prefill ran on (decode defaults to it)
    rope: Any = None  # the RoPE prefill rotated with (LongRoPE's factors are picked once); None: model.rope()


def bucket_length(n: int, minimum: int = 16, multiple: int = 1) -> int:
    """Power of two up to 4096, then multiples of 4096; rounded up to `multiple`."""
    b = max(minimum, 1 << (max(n, 1) - 1).bit_length()) if n <= 4096 else -(-n // 4096) * 4096
    return -(-b // multiple) * multiple


def _as_batch(input_ids: Any, prompt_lengths: Any, *, allow_empty: bool = False,
              name: str = "input_ids") -> tuple[np.ndarray, np.ndarray]:
    """Right-padded `[B, T]` int64 tokens and `[B]` lengths from an array or a list of lists (ids checked
    by the shared `kvjax.validation.token_rows`; the vocabulary range is checked on the real tokens later)."""
    tokens, ragged_lengths = token_rows(input_ids, name, allow_empty_rows=allow_empty)
    if ragged_lengths is not None:
        lengths = ragged_lengths
        if prompt_lengths is not None and not np.array_equal(np.asarray(prompt_lengths), lengths):
            raise KvjaxError(f"prompt_lengths {list(prompt_lengths)} disagree with the ragged rows {list(lengths)}")
    elif prompt_lengths is None:
        lengths = np.full(tokens.shape[0], tokens.shape[1])
    else:
        lengths = np.asarray(prompt_lengths).reshape(-1)
        if lengths.dtype == np.bool_ or not np.issubdtype(lengths.dtype, np.integer):
            raise KvjaxError(f"prompt_lengths must be integers, got {lengths.dtype} values {prompt_lengths!r}")
        if lengths.shape[0] != tokens.shape[0]:
            raise KvjaxError(
                f"prompt_lengths has {lengths.shape[0]} entries but input_ids has batch {tokens.shape[0]}"
            )
        if (lengths > tokens.shape[1]).any():
            raise KvjaxError(
                f"prompt_lengths {lengths.tolist()} exceed the padded prompt length {tokens.shape[1]}"
            )
    if not allow_empty and (lengths <= 0).any():
        raise KvjaxError(f"empty prompt: every prompt needs at least one token, got lengths {lengths.tolist()}")
    return tokens, lengths.astype(np.int32)


def _resolve_method(method: str | Method, method_args: dict | None) -> Method:
    if isinstance(method, Method):
        if method_args:
            raise ConfigError("pass hyperparameters either in the Method instance or method_args, not both")
        return method
    if not isinstance(method, str):
        raise ConfigError(f"method must be a registered name or a Method, got {type(method).__name__}")
    if method_args is not None and not isinstance(method_args, dict):
        raise ConfigError(f"method_args must be a dict of hyperparameters, got {type(method_args).__name__}")
    return kvm.get(method, **(method_args or {}))


def cache_capacity(method: Method, bucket: int, max_new_tokens: int, quantized: bool = False) -> int:
    """The slots a prefill of `bucket` tokens allocates: the method's capacity, rounded up to
    `Tuning.cache_slot_multiple` for a method whose decode only appends (and a cache in the model dtype)."""
    capacity = method.capacity(bucket, max_new_tokens)
    multiple = tuning.current().cache_slot_multiple
    if multiple > 1 and method.decode_appends_only and not quantized:
        capacity = -(-capacity // multiple) * multiple
    return capacity


def init_cache(method: Method, config: Any, batch: int, capacity: int, dtype: Any,
               kv_dtype: str | KVQuant | None = None, *, context: int | None = None,
               layer_capacities: tuple[int, ...] | None = None) -> ModelCache:
    """An empty per-layer cache for `method` on a model with `config` (what `prefill` allocates): `capacity` slots
    on the layers without a window, a ring on each sliding-window layer (`step.ring_capacity`: its window, or
    `context`, the most tokens a sequence will hold, when that is smaller); `kv_dtype`: its K / V storage (see
    `prefill`); each managed layer at `capacity` slots, or at its own `layer_capacities`
    (`Method.layer_capacities`)."""
    quant = resolve_kv_dtype(kv_dtype, config.head_dim)
    spec = CacheSpec(
        batch=batch, kv_heads=config.num_kv_heads, capacity=capacity, num_heads=config.num_heads,
        head_dim=config.head_dim, num_layers=config.method_layers, dtype=jnp.dtype(dtype), quant=quant,
        layer_capacities=layer_capacities,
    )
    rings = tuple(None if w is None else step.ring_capacity(w, context) for w in config.layer_windows)
    return step.init_cache(method, spec, rings)


def resolve_kv_dtype(kv_dtype: str | KVQuant | None, head_dim: int) -> KVQuant | None:
    """`kv_dtype=` checked for a model's head_dim (before anything is traced): None for the model dtype."""
    quant = parse_kv_dtype(kv_dtype)
    if quant is not None:
        quant.check_head_dim(head_dim)
    return quant


def _concat_rows(tokens: np.ndarray, lengths: np.ndarray, extra: np.ndarray, extra_lengths: np.ndarray):
    """Right-padded rows `tokens[:lengths] + extra[:extra_lengths]` and their lengths."""
    total = (lengths + extra_lengths).astype(np.int32)
    out = np.zeros((tokens.shape[0], max(1, int(total.max()))), np.int64)
    for i, (n, m) in enumerate(zip(lengths, extra_lengths, strict=True)):
        out[i, :n] = tokens[i, :n]
        out[i, n : n + m] = extra[i, :m]
    return out, total


@jax.jit
def _pick_last(hidden: Array, last_index: Array, last_hidden: Array) -> Array:
    """Keeps each example's hidden state at its last prompt token, wherever that chunk falls."""
    width = hidden.shape[1]
    in_chunk = (last_index >= 0) & (last_index < width)
    picked = jnp.take_along_axis(hidden, jnp.clip(last_index, 0, width - 1)[:, None, None], axis=1)[:, 0]
    return jnp.where(in_chunk[:, None], picked.astype(last_hidden.dtype), last_hidden)


def _prefill_chunks(config: Any, method: Method, weights: dict, rope: tuple, cache: ModelCache, padded: np.ndarray,
                    positions: np.ndarray, lengths: np.ndarray, chunk: int, budget: Any, last_hidden: Any, put: Any,
                    mesh: Any, fresh: bool = False, ring_fresh: bool = False) -> tuple[Array, ModelCache]:
    """Every chunk of a padded prompt through the model: each example's last hidden state and the cache."""
    bucket = padded.shape[1]
    for start in range(0, bucket, chunk):
        hidden, cache = forward.prefill_chunk(
            config, weights, rope, method, cache, put(padded[:, start : start + chunk]),
            put(positions[:, start : start + chunk]), budget, final_chunk=start + chunk >= bucket, fresh=fresh,
            ring_fresh=ring_fresh, mesh=mesh,
        )
        last_hidden = _pick_last(hidden, put(np.asarray(lengths - 1 - start, np.int32)), last_hidden)
    return last_hidden, cache


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
    """
    ensure_compilation_cache()
    config = model.config
    method = _resolve_method(method, method_args)
    quant = resolve_kv_dtype(kv_dtype, config.head_dim)
    tokens, lengths = _as_batch(input_ids, prompt_lengths)
    q_tokens = q_lengths = None
    if question_ids is not None:
        q_tokens, q_lengths = _as_batch(question_ids, None, allow_empty=True, name="question_ids")
        if q_tokens.shape[0] != tokens.shape[0]:
            raise KvjaxError(f"question_ids has {q_tokens.shape[0]} rows but the batch has {tokens.shape[0]}")
        token_ids(q_tokens[np.arange(q_tokens.shape[1])[None] < q_lengths[:, None]], "question_ids",
                  config.vocab_size)
    max_new_tokens = as_int(max_new_tokens, "max_new_tokens", minimum=1)
    longest = int(lengths.max())
    total = lengths + (q_lengths if q_lengths is not None else 0)
    question_first = q_tokens is not None and caps.encodes_question(method) and int(q_lengths.max()) > 0
    if question_first:
        total = total + q_lengths
    check_context(method, int(total.max()) + max_new_tokens, int(total.max()), config.max_position_embeddings)
    if q_tokens is not None and caps.question_in_prompt(method):
        # Retrieval methods read the question as the end of the prompt, window by window.
        tokens, lengths = _concat_rows(tokens, lengths, q_tokens, q_lengths)
        if question_first:  # and, for Q-LLM's question vector, as its start
            tokens, lengths = _concat_rows(q_tokens, q_lengths, tokens, lengths)
        longest = int(lengths.max())
        q_tokens = None
    token_ids(tokens[np.arange(tokens.shape[1])[None] < lengths[:, None]], "input_ids", config.vocab_size)
    if chunk_size is not None and (not isinstance(chunk_size, int | np.integer) or chunk_size <= 0):
        raise KvjaxError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    method.validate(longest, max_new_tokens, config.max_position_embeddings)
    method.check_model(config)
    if chunk_size is not None:  # a chunk past the prompt's bucket is the whole prompt (not a bigger program)
        chunk_size = min(int(chunk_size), bucket_length(longest))
    if chunk_size is None:
        chunk_size = method.prefill_window()

    bucket = bucket_length(longest, multiple=chunk_size or 1)
    chunk = chunk_size or bucket
    batch = tokens.shape[0]
    padded = np.zeros((batch, bucket), np.int32)
    width = min(tokens.shape[1], bucket)
    padded[:, :width] = np.where(np.arange(width)[None] < lengths[:, None], tokens[:, :width], 0)
    positions = np.where(np.arange(bucket)[None] < lengths[:, None], np.arange(bucket)[None], -1).astype(np.int32)

    capacity = cache_capacity(method, bucket, max_new_tokens, quantized=quant is not None)
    q_bucket = bucket_length(int(q_lengths.max())) if q_tokens is not None and int(q_lengths.max()) > 0 else 0
    # A context-replay method (KVzip) scores after an uncompressed prefill: the prompt is held whole until then.
    replays = caps.replays_context(method)
    if replays:
        replay.check(method, config, quant, mesh, longest)
    cache = init_cache(method, config, batch, bucket if replays else capacity, model.dtype, quant,
                       context=bucket + q_bucket + max_new_tokens,
                       layer_capacities=None if replays else method.layer_capacities(bucket, max_new_tokens,
                                                                                     config.method_layers))
    budget = per_example_budget(method, lengths)  # host int32 [B]: the jitted programs take it as is
    weights, rope = model.weights(), model.rope(int(total.max()))
    last_hidden = np.zeros((batch, config.hidden_size), jnp.dtype(model.dtype))
    put = _placer(mesh)
    if mesh is not None:
        weights = sharding.shard_weights(weights, mesh)
        cache = sharding.shard_cache(cache, mesh)
        budget, last_hidden = put(budget), put(last_hidden)
    if question_first:
        cache = _mark_question(config, method, cache, put(np.asarray(q_lengths, np.int32)))
    # One chunk into an empty cache attends over its own keys only (no scan over the empty slots).
    fresh = chunk >= bucket and not question_first and step.attends_own_chunk(method)
    # A sliding-window layer's ring acts as the full cache does, whatever the method.
    ring_fresh = chunk >= bucket and step.attends_own_chunk(_KEEP_ALL)
    last_hidden, cache = _prefill_chunks(config, _KEEP_ALL if replays else method, weights, rope, cache, padded,
                                         positions, lengths, chunk, budget, last_hidden, put, mesh, fresh=fresh,
                                         ring_fresh=ring_fresh)
    if replays:
        cache = replay.run(config, method, weights, rope, cache, padded, lengths, budget, capacity)
    if q_tokens is not None and int(q_lengths.max()) > 0:
        last_hidden, cache, lengths = _prefill_question(
            model, cache, q_tokens, q_lengths, lengths, budget, last_hidden, weights, mesh, rope
        )
    logits = final_logits(config, weights, last_hidden)
    return PrefillState(cache=cache, logits=logits, prompt_lengths=lengths, budget=budget, method=method, mesh=mesh,
                        rope=rope)


def check_context(method: Method, needed: int, prompt: int, max_positions: int) -> None:
    """Refuses sequences past the model window unless the method's attention distance stays within it.

    `needed`: prompt + new tokens; `prompt`: the prompt alone (for the message). The eval CLI calls it for
    every cell of a sweep before the first one runs."""
    reach = caps.max_attended_distance(method)
    if reach is not None and reach >= max_positions:
        raise KvjaxError(f"{method.name}: attends distances up to {reach}, beyond the model's {max_positions}")
    if reach is None and needed > max_positions:
        bounded = ", ".join(m for m in kvm.available() if _bounded(m))
        what = f"prompt of {prompt} tokens + {needed - prompt} new tokens" if needed > prompt else (
            f"a sequence of {needed} tokens (prompt and answer)")  # the eval's context length counts its answers
        raise KvjaxError(
            f"{what} exceeds the model's maximum context of "
            f"{max_positions}; methods whose attention never spans more than the window can go past it: {bounded}"
        )


def _bounded(name: str) -> bool:
    try:
        return caps.max_attended_distance(kvm.get(name)) is not None
    except (ConfigError, TypeError):  # a method that needs hyperparameters to be built
        return False


def _placer(mesh: Any):
    """Host batch-first arrays -> what the jitted programs take: the host arrays themselves without a mesh
    (a jitted call transfers them; an explicit `device_put` compiles a tiny program per shape, ~20 ms each on a
    first call), sharded device arrays (B on the mesh's `data` axis) with one."""
    if mesh is None:
        return np.asarray
    return functools.partial(sharding.shard_batch, mesh=mesh)


def _prefill_question(model, cache, q_tokens, q_lengths, lengths, budget, last_hidden, weights, mesh, rope=None):
    """Appends question tokens after the compressed prompt, keeping all of them (a sliding-window layer's ring was
    sized for them)."""
    config = model.config
    q_bucket = bucket_length(int(q_lengths.max()))
    padded = np.zeros((q_tokens.shape[0], q_bucket), np.int32)
    padded[:, : q_tokens.shape[1]] = q_tokens
    steps = np.arange(q_bucket)[None]
    positions = np.where(steps < q_lengths[:, None], lengths[:, None] + steps, -1).astype(np.int32)
    # The question attends K / V / positions only (the `full` method keeps everything and reads no method state):
    # run it on the bare layers, so the methods whose compressed caches have one shape share these programs,
    # then put the method's fields back, padded as `kvc.extend` pads them. A retrieval mask (`attend`) would
    # change the attention, so such a cache goes through whole; a sliding-window layer's ring is left as it is.
    managed = [w is None for w in config.layer_windows]
    bare = all(layer.attend is None for layer, m in zip(cache.layers, managed, strict=True) if m)
    work = cache
    if bare:
        work = cache.replace(layers=tuple(KVCache(x.k, x.v, x.pos, x.length) if m else x
                                          for x, m in zip(cache.layers, managed, strict=True)))
    work = _extend(config, work, q_bucket)
    put = _placer(mesh)
    if mesh is not None:
        work = sharding.shard_cache(work, mesh)
    rope = model.rope() if rope is None else rope
    last_hidden, work = _prefill_chunks(config, _KEEP_ALL, weights, rope, work, padded, positions, q_lengths,
                                        q_bucket, budget, last_hidden, put, mesh)
    if bare:
        work = cache.replace(layers=tuple(
            new.replace(score=_question_scores(old.score, old.length, q_bucket), state=old.state) if m else new
            for new, old, m in zip(work.layers, cache.layers, managed, strict=True)))
    return last_hidden, work, (lengths + q_lengths).astype(np.int32)


def _decode_program_key(method: Method) -> Method:
    """The method the decode program is compiled for: a method whose decode only appends (no observer, no
    per-head mask, no retrieval, no rewritten attention) decodes exactly as `full` does, whatever it did at
    prefill, so all such methods share one program per cache shape."""
    plain = method.decode_appends_only and not (caps.gathers(method) or caps.rewrites_attention(method))
    return _KEEP_ALL if plain else method


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def _mark_question(config: Any, method: Method, cache: ModelCache, lengths: Array) -> ModelCache:
    """`method.mark_question` on every layer the method manages (the prompt opens with a question of `lengths`
    `[B]` tokens); the sliding-window layers' rings are left alone."""
    layers = tuple(layer if w is not None else method.mark_question(layer, lengths)
                   for layer, w in zip(cache.layers, config.layer_windows, strict=True))
    return cache.replace(layers=layers)


@functools.partial(jax.jit, static_argnums=2)
def _question_scores(score: Array | None, length: Array, extra: int) -> Array | None:
    """A layer's score accumulator after the question: as it was on the slots held before, 0 on the question's
    (what `kvc.append` writes there) and beyond."""
    if score is None:
        return None
    padded = jnp.pad(score, ((0, 0), (0, 0), (0, extra)))
    return jnp.where(jnp.arange(padded.shape[-1]) < length[..., None], padded, 0.0)


@functools.partial(jax.jit, static_argnums=(0, 2))  # no donation: every output buffer is larger
def _extend(config: Any, cache: ModelCache, extra: int) -> ModelCache:
    """Every layer the method manages with `extra` more empty slots (room for the question's tokens); a
    sliding-window layer's ring already has its room (`prefill` sized it for the question)."""
    layers = tuple(layer if w is not None else kvc.extend(layer, extra)
                   for layer, w in zip(cache.layers, config.layer_windows, strict=True))
    return cache.replace(layers=layers)


def _check_sampling(temperature: float, top_p: float) -> None:
    if not isinstance(temperature, int | float) or isinstance(temperature, bool) or not 0 <= temperature < float("inf"):
        raise KvjaxError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not isinstance(top_p, int | float) or not 0.0 < top_p <= 1.0:
        raise KvjaxError(f"top_p must be in (0, 1], got {top_p!r}")


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
            logits, cache = forward.decode_step(config, weights, rope, method, cache, prev, lengths + i - 1, budget)
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

    `mesh`: see `prefill`; defaults to the mesh `state` was prefilled on.
    """
    _check_sampling(temperature, top_p)
    as_int(max_new_tokens, "max_new_tokens", minimum=1)
    as_int(seed, "seed")
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
        config, _decode_program_key(state.method), int(max_new_tokens), float(temperature), float(top_p),
        tuning.current(), weights, rope, cache, logits, lengths, budget, eos_ids, np.int32(pad_id),
        np.uint32(seed & 0xFFFFFFFF), mesh=mesh,
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
    as_int(seed, "seed")
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
