"""One prefill forward shared by every (method, budget) of a sweep.

In a one-shot prefill each layer attends over the whole prompt first and compresses its cache only
afterwards, so what layer `l` hands to layer `l + 1` does not depend on the method. `record` runs
that forward once per batch and keeps every layer's queries, keys and values; `prefill_from` then
replays one method's prefill hooks layer by layer on them (`kvjax.runtime.step.compress_layer`) into a
cache allocated at the method's capacity, appends the question and returns the `PrefillState` that
`generate.prefill` would have returned. Only the compression and the decodes are paid per cell.

Exactness: the replay is deterministic (a cell gives the same bits whether it is replayed alone or
in a sweep, which the eval CLI relies on) and agrees with `generate.prefill` up to float rounding:
the two are different XLA programs, and whether a layer's queries also leave the program changes how
XLA lays out and sums their projection (measured: last-bit differences under the test suite's XLA
flags, none under the default ones on CPU). Kept sets and greedy tokens agree unless two scores tie
within that rounding.

Methods that qualify (`shares_prefill`): one-shot prefill (no `chunk_size`, no `prefill_window()`), no question
before the context (`encodes_question`), no edit of the masks before attending and attention (no
`rewrites_attention`), no mesh. Their hooks see only `(cache, q, step)`, which the replay reproduces, so methods
that score from the prompt's attention inside the hook qualify as well (SnapKV, TOVA, ...). The layer inputs a method
reads (`Method.layer_inputs`) come from the recording where they depend on the prompt (`record(..., layer_inputs=)`
keeps those its cells read, `recorded_inputs`: KVzap's hidden states, H2O's attention log-sum-exp) and from the
weights otherwise (CriticalKV's `W_o`, `forward.block_inputs`). A context-replay method (KVzip) qualifies too: its
uncompressed cache is filled from the recording, its replay rows score it once per recording and method settings
(`replayed_cache`), and each budget / ratio compacts that scored cache (`replay.compact`). `step.attention_lse` (the
prefill attention's row log-sum-exp, which makes H2O's column sums one pass) is there when the recording kept it
(as the sweep records for a cell whose method reads it: H2O's compression 2.3x faster, SmolLM2-135M at 2K on the
2-core VM); without it H2O computes its scores in two passes, the same probabilities up to float rounding. A method
that reads the question as the end of its prompt (`QuestionReader`: Quest) replays a recording made with
`question_in_prompt=True`, and only such a method does: the others would compress the question with the context.

On a model with sliding-window layers the recording attends each with its window and RoPE, and the replay
writes their keys and values into their rings (the method acts on the other layers, as in `generate.prefill`).

Memory: the recording holds every layer's queries, keys and values of the batch,
`L * B * T * (N + 2 K) * H` elements (SmolLM2-135M at 4K tokens, float32: about 0.5 GB per example), plus
`L * B * T * D` with hidden states (SmolLM2-135M: a quarter more), which is why a recording keeps only the layer
inputs it is asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax import tuning
from kvjax.errors import KvjaxError
from kvjax.methods import capabilities as caps
from kvjax.methods.base import LAYER_INPUTS, Method, per_example_budget
from kvjax.models import block
from kvjax.runtime import forward, replay, step
from kvjax.runtime.compile_cache import ensure_compilation_cache
from kvjax.runtime.forward import TRACE_COUNTS
from kvjax.runtime.stages import (
    PrefillState,
    append_question,
    bucket_length,
    cache_capacity,
    cache_layer_capacities,
    concat_rows,
    init_cache,
    pick_last,
    prompt_method,
    resolve_kv_dtype,
    token_batch,
)
from kvjax.validation import as_int

Array = jax.Array


def shares_prefill(method: Method | None, *, chunk_size: int | None = None, mesh: Any = None) -> bool:
    """Whether `prefill_from` reproduces `generate.prefill(..., method=method, chunk_size=chunk_size)`."""
    if method is None or chunk_size is not None or mesh is not None:
        return False
    return (
        method.prefill_window() is None
        and not caps.encodes_question(method)
        and not caps.rewrites_attention(method)
        and not caps.edits_mask_before_attention(method)
    )


#: The older spellings of `record(..., layer_inputs=)`: a keyword of `record` per input.
_RECORD_FLAGS = {"attention_lse": "attention_lse", "hidden": "hidden_states"}


def recorded_inputs(methods: Iterable[Method]) -> frozenset[str]:
    """The layer inputs a recording keeps so that it replays each of `methods`: those they read that depend on the
    prompt (an input of the weights alone is computed at replay)."""
    return frozenset(name for method in methods for name in method.layer_inputs
                     if not LAYER_INPUTS[name].weights_only)


@dataclasses.dataclass
class Recorded:
    """`record`'s output: the padded batch and every layer's queries / keys / values."""

    positions: np.ndarray  # [B, T] int32, -1 = padding
    lengths: np.ndarray  # [B] int32 prompt lengths
    q_tokens: np.ndarray | None  # [B, Q] question ids fed after compression (or None)
    q_lengths: np.ndarray | None
    question_in_prompt: bool  # the question was recorded as the end of each prompt (q_tokens is then None)
    last_hidden: Array  # [B, D] hidden state of each prompt's last token
    qkv: tuple[tuple[Array, Array, Array], ...]  # per layer: [B, T, N, H], [B, T, K, H], [B, T, K, H]
    rope: Any = None  # the RoPE the forward rotated with (`DecoderLM.rope` of the longest prompt)
    tokens: np.ndarray | None = None  # [B, bucket] int32 the prompts as prefilled (a context replay reads them again)
    # The layer inputs kept (`record(..., layer_inputs=)`): per name, per layer (None on a sliding-window layer).
    inputs: dict[str, tuple[Array | None, ...]] = dataclasses.field(default_factory=dict)
    # A context-replay method's scored cache per (method but its amount, context): `prefill_from` fills it.
    replayed: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def bucket(self) -> int:
        return int(self.positions.shape[1])

    @property
    def lse(self) -> tuple[Array | None, ...] | None:
        """Per layer: `[B, K, G, T]` float32 row log-sum-exp of the attention, if recorded (`inputs`)."""
        return self.inputs.get("attention_lse")

    @property
    def hidden(self) -> tuple[Array | None, ...] | None:
        """Per layer: `[B, T, D]` attention input after the norm, if recorded (`inputs`)."""
        return self.inputs.get("hidden")


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _record_layer(config, window, names, tune, lw, rope, x, positions):
    """One layer of the shared forward: its output, its post-RoPE q / k / v, and the layer inputs `names` (what
    `forward.prefill_block` hands a method that reads them; the attention's own as it computes them)."""
    TRACE_COUNTS["shared_prefill"] += 1
    lse = "attention_lse" in names

    def attention(q, k, v):
        out = block.self_attention(q, k, v, positions, sliding_window=window, return_lse=lse)
        attn, attended = (out[0], {"attention_lse": out[1]}) if lse else (out, {})
        return attn, ((q, k, v), attended)

    with tuning.use(tune):
        out, (qkv, attended) = block.decoder_block(config, lw, x, positions, rope, attention)
    return out, (qkv, {**attended, **forward.block_inputs(config, names, lw, x)})


@functools.partial(jax.jit, donate_argnums=(0,))
def _ring_layer(cache, qkv, positions):
    """A sliding-window layer's ring from its recorded keys and values (what `step.prefill_window_layer` leaves)."""
    _, k, v = qkv
    return kvc.ring_append(cache, k, v, positions)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def _compress_layer(config, method, tune, rope, cache, qkv, positions, budget, layer, lw, recorded):
    """One layer's prefill hook on its recording: the method's layer inputs `recorded` (this layer's), the others
    from the layer's weights `lw`."""
    TRACE_COUNTS["shared_compress"] += 1
    q, k, v = qkv
    with tuning.use(tune):
        return step.compress_layer(method, cache, q, k, v, positions, budget, layer=layer, inv_freq=rope[0],
                                   num_layers=config.method_layers, rope_scaling=rope[1],
                                   **forward.block_inputs(config, method.layer_inputs, lw, None), **recorded)


def record(
    model: Any, input_ids: Any, *, prompt_lengths: Any = None, question_ids: Any = None,
    question_in_prompt: bool = False, layer_inputs: Iterable[str] = (), attention_lse: bool = False,
    hidden_states: bool = False,
) -> Recorded:
    """The one forward of a sweep: the prompts (as `generate.prefill` takes them) through every layer.

    `question_in_prompt`: append each question to its prompt before the forward, as `generate.prefill` does
    for a method with `question_in_prompt` (the recording then replays only such methods). `layer_inputs`: the layer
    inputs to keep for the layers without a window (the ones a method compresses), as the forward hands them to a
    method (`recorded_inputs(methods)`: what the methods to replay read; an input of the weights alone needs no
    recording). `attention_lse=True` / `hidden_states=True`: the older spellings of `layer_inputs` with
    `"attention_lse"` (H2O) / `"hidden"` (KVzap and DMS over it: `[B, T, D]` per layer in the model dtype)."""
    ensure_compilation_cache()
    config = model.config
    older = {"attention_lse": attention_lse, "hidden": hidden_states}  # by input, as `_RECORD_FLAGS` names them
    names = set(layer_inputs) | {name for name, flag in older.items() if flag}
    if names - LAYER_INPUTS.keys():
        raise KvjaxError(f"layer_inputs: unknown {sorted(names - LAYER_INPUTS.keys())}; the layer inputs are "
                         f"{sorted(LAYER_INPUTS)}")
    names = tuple(sorted(name for name in names if not LAYER_INPUTS[name].weights_only))
    tokens, lengths = token_batch(input_ids, prompt_lengths)
    q_tokens = q_lengths = None
    if question_ids is not None:
        q_tokens, q_lengths = token_batch(question_ids, None, allow_empty=True)
        if q_tokens.shape[0] != tokens.shape[0]:
            raise KvjaxError(f"question_ids has {q_tokens.shape[0]} rows but the batch has {tokens.shape[0]}")
        if q_tokens.size and (q_tokens.min() < 0 or q_tokens.max() >= config.vocab_size):
            raise KvjaxError(f"question token ids must be in [0, {config.vocab_size})")
        if question_in_prompt:
            tokens, lengths = concat_rows(tokens, lengths, q_tokens, q_lengths)
            q_tokens = q_lengths = None
    question_in_prompt = bool(question_in_prompt and question_ids is not None)
    real = tokens[np.arange(tokens.shape[1])[None] < lengths[:, None]]
    if real.min() < 0 or real.max() >= config.vocab_size:
        raise KvjaxError(f"token ids must be in [0, {config.vocab_size}), got [{real.min()}, {real.max()}]")
    bucket = bucket_length(int(lengths.max()))
    steps = np.arange(bucket)[None]
    width = min(tokens.shape[1], bucket)
    padded = np.zeros((tokens.shape[0], bucket), np.int32)
    padded[:, :width] = np.where(steps[:, :width] < lengths[:, None], tokens[:, :width], 0)
    positions = np.where(steps < lengths[:, None], steps, -1).astype(np.int32)
    total = lengths + (q_lengths if q_lengths is not None else 0)
    weights, rope = model.weights(), model.rope(int(total.max()))
    positions_in = jnp.asarray(positions)
    x = forward.embed(config, block.global_weights(weights), jnp.asarray(padded))
    qkv, inputs = [], {name: [] for name in names}
    tune = tuning.current()
    for i, lw in enumerate(weights["layers"]):
        window = config.layer_window(i)  # a sliding layer's inputs are not kept: no method reads that layer
        x, (layer_qkv, kept) = _record_layer(config, window, names if window is None else (), tune, lw,
                                             block.layer_rope(config, rope, i), x, positions_in)
        qkv.append(layer_qkv)
        for name in names:
            inputs[name].append(kept.get(name))
    # As `generate.prefill` picks it (one shot: every prompt ends in this chunk).
    last_hidden = pick_last(x, jnp.asarray(lengths - 1, jnp.int32), jnp.zeros(x[:, 0].shape, model.dtype))
    return Recorded(positions, lengths, q_tokens, q_lengths, question_in_prompt, last_hidden, tuple(qkv), rope, padded,
                    {name: tuple(per_layer) for name, per_layer in inputs.items()})


def prefill_from(model: Any, rec: Recorded, method: Method, *, max_new_tokens: int,
                 kv_dtype: Any = None) -> PrefillState:
    """`generate.prefill(model, <the recorded prompts>, method=method, kv_dtype=kv_dtype, ...)` from a
    recording (the recorded keys and values are full precision: each method's cache is quantized as it is
    built)."""
    if not shares_prefill(method):
        raise KvjaxError(f"{method.name}: its prefill cannot be replayed from a shared forward (see shares_prefill)")
    if rec.question_in_prompt and not caps.question_in_prompt(method):
        raise KvjaxError(
            f"{method.name}: this recording holds the question inside the prompt (question_in_prompt=True), which "
            "would compress it with the context; record without question_in_prompt for this method"
        )
    if caps.question_in_prompt(method) and rec.q_tokens is not None and int(rec.q_lengths.max()) > 0:
        raise KvjaxError(
            f"{method.name} reads the question as the end of its prompt: record with question_in_prompt=True"
        )
    max_new_tokens = as_int(max_new_tokens, "max_new_tokens", minimum=1)
    config = model.config
    lengths = rec.lengths
    total = lengths + (rec.q_lengths if rec.q_lengths is not None else 0)
    if int(total.max()) + max_new_tokens > config.max_position_embeddings:
        raise KvjaxError(
            f"prompt of {int(total.max())} tokens + {max_new_tokens} new tokens exceeds the model's "
            f"maximum context of {config.max_position_embeddings}"
        )
    method.validate(int(lengths.max()), max_new_tokens, config.max_position_embeddings)
    method.check_model(config)
    for name in sorted(recorded_inputs([method]) - rec.inputs.keys()):
        if LAYER_INPUTS[name].from_attention:  # optional: the hook gets None (H2O then scores in two passes)
            continue
        older = f" (or {_RECORD_FLAGS[name]}=True)" if name in _RECORD_FLAGS else ""
        raise KvjaxError(f"{method.name} reads each layer's {name}, which this recording did not keep: record with "
                         f"layer_inputs={{{name!r}}}{older}")
    batch = lengths.shape[0]
    has_question = _has_question(rec)
    context = _context(rec, max_new_tokens)
    capacity = cache_capacity(method, rec.bucket, max_new_tokens, kv_dtype is not None)
    budget = jnp.asarray(per_example_budget(method, lengths))
    weights = model.weights()
    rope = model.rope() if rec.rope is None else rec.rope
    if caps.replays_context(method):  # KVzip: one scored cache per batch, compacted to each cell's budget
        replay.check(method, config, resolve_kv_dtype(kv_dtype, config.head_dim), None, int(lengths.max()))
        scored = replayed_cache(model, rec, method, context=context)
        cache = replay.compact(method, config.layer_windows, capacity, scored, budget)
    else:
        cache = init_cache(method, config, batch, capacity, model.dtype, kv_dtype, context=context,
                           layer_capacities=cache_layer_capacities(method, rec.bucket, max_new_tokens,
                                                                   config.method_layers))
        cache = _replay_hooks(model, rec, method, cache, budget, rope)
    last_hidden = rec.last_hidden
    if has_question:
        last_hidden, cache, lengths = append_question(
            model, cache, rec.q_tokens, rec.q_lengths, lengths, budget, last_hidden, weights, None, rope
        )
    logits = forward.final_logits(config, weights, last_hidden)
    return PrefillState(cache=cache, logits=logits, prompt_lengths=lengths, budget=budget, method=method, rope=rope,
                        max_new_tokens=max_new_tokens)


def _replay_hooks(model: Any, rec: Recorded, method: Method, cache: Any, budget: Any, rope: Any) -> Any:
    """Every layer's prefill hook of `method` on its recorded q / k / v, into `cache` (a ring per sliding layer)."""
    config, weights = model.config, model.weights()
    recorded = {name: per_layer for name, per_layer in rec.inputs.items() if name in method.layer_inputs}
    positions = jnp.asarray(rec.positions)
    for i, qkv in enumerate(rec.qkv):
        if config.layer_window(i) is not None:
            layer_cache = _ring_layer(cache.layer(i), qkv, positions)
        else:
            layer_cache = _compress_layer(config, method, tuning.current(), block.layer_rope(config, rope, i),
                                          cache.layer(i), qkv, positions, budget, np.int32(config.method_layer(i)),
                                          weights["layers"][i], {name: values[i] for name, values in recorded.items()})
        cache = cache.with_layer(i, layer_cache)
    return cache


def _has_question(rec: Recorded) -> bool:
    return rec.q_tokens is not None and int(rec.q_lengths.max()) > 0


def _context(rec: Recorded, max_new_tokens: int) -> int:
    """The most tokens a replayed sequence holds (prompt bucket + question bucket + new tokens): a ring's size."""
    return rec.bucket + (bucket_length(int(rec.q_lengths.max())) if _has_question(rec) else 0) + max_new_tokens


def _replay_key(method: Method, context: int) -> tuple:
    """What a context replay's scores depend on: the method's settings but its amount, and the context."""
    fields = tuple((f.name, getattr(method, f.name)) for f in dataclasses.fields(method)
                   if f.name not in ("budget", "compression_ratio"))
    return type(method), fields, context


def replayed_cache(model: Any, rec: Recorded, method: Method, *, context: int) -> Any:
    """The recorded prompts' uncompressed cache (every layer's keys and values, as `generate.prefill` holds them
    before a context replay, its `prompt_scorer`'s scores written) with `method`'s replay scores filled in
    (`kvjax.runtime.replay.score`): computed once per recording and method settings, then reused by every budget or
    ratio (`replay_seconds` says what it cost)."""
    key = _replay_key(method, context)
    if key not in rec.replayed:
        start = time.perf_counter()
        config = model.config
        rope = model.rope() if rec.rope is None else rec.rope
        cache = init_cache(method, config, len(rec.lengths), rec.bucket, model.dtype, None, context=context)
        everything = jnp.asarray(rec.lengths)  # the full cache keeps every prompt token
        cache = _replay_hooks(model, rec, prompt_method(method), cache, everything, rope)
        scored = replay.score(config, method, model.weights(), rope, cache, rec.tokens, rec.lengths)
        jax.block_until_ready(scored)
        rec.replayed[key] = (scored, time.perf_counter() - start)
    return rec.replayed[key][0]


def replay_seconds(rec: Recorded, method: Method, *, max_new_tokens: int) -> float:
    """Wall-clock seconds the context replay of `method` on `rec` took (0.0: none ran): what each cell reusing it
    would have paid alone."""
    entry = rec.replayed.get(_replay_key(method, _context(rec, max_new_tokens))) if caps.replays_context(method) \
        else None
    return 0.0 if entry is None else entry[1]
