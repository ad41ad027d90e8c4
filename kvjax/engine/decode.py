"""The engine's decode call: `steps` tokens for every live slot in one jitted, donated program.

Each step samples every active slot's next token from its pending logits (greedy at temperature 0, else temperature
+ nucleus from the request's own seed, its sample index and the token's index, so a draw never depends on the other
slots), records it and its log-probability, ends the slots that hit a stop id or their limit, and runs the token of
every slot still active through the model (`forward.decode_step`); a slot that is not active keeps its cache as it
was (`step.decode_layer`'s `active`). The loop stops early once no slot is active. At the end each slot's kept-token
counts are read from its cache: a slot that finished mid-call was frozen from its last token on, so they are its
counts at its end.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import tuning
from kvjax.cache import ModelCache
from kvjax.engine.slots import Slots, kept_counts
from kvjax.methods.base import Method
from kvjax.runtime import forward, sharding

Array = jax.Array

#: Traces of the engine's programs (tests assert a job compiles a bounded number).
TRACE_COUNTS = forward.TRACE_COUNTS


def sample(slots: Slots, sampling: bool) -> Array:
    """`[S]` int32 next tokens: argmax where a slot's temperature is 0; with `sampling`, elsewhere a draw from its
    logits / temperature restricted to its nucleus (`nucleus`: the most likely tokens whose probability reaches
    `top_p`, the distribution `kvjax.generate` samples, ties at the nucleus' edge kept), keyed by (seed, tokens
    generated so far) and, for a sample index i > 0, i folded in after them (sample 0 draws as a request of one
    sample does). The draw is over the vocabulary in its own order, so the vocabulary is sorted only in a step where
    some live slot samples with `top_p` < 1 (a slot with `top_p` = 1 draws the same either way)."""
    greedy = jnp.argmax(slots.logits, axis=-1).astype(jnp.int32)
    if not sampling:
        return greedy
    sampled = slots.temperature > 0
    temperature = jnp.where(sampled, slots.temperature, 1.0)
    logits = slots.logits / temperature[:, None]
    needs_sort = jnp.any(slots.active & sampled & (slots.top_p < 1.0))
    logits = jax.lax.cond(needs_sort, lambda x: nucleus(x, slots.top_p), lambda x: x, logits)
    keys = jax.vmap(_draw_key)(slots.seed, slots.count, slots.sample)
    drawn = jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
    return jnp.where(sampled, drawn, greedy)


def nucleus(logits: Array, top_p: Array) -> Array:
    """`logits` `[S, V]` with every token outside its row's nucleus at -inf: the nucleus is the most likely tokens
    whose probability (softmax of the row) reaches `top_p` `[S]`, found over the sorted row, and every token whose
    logit ties the least likely of them (a tie has no order to break it by); a row with `top_p` >= 1 is unchanged."""
    ranked = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
    kept = jnp.sum(before < top_p[:, None], axis=-1)  # >= 1: the first token has none before it
    threshold = jnp.take_along_axis(ranked, (kept - 1)[:, None], axis=-1)
    keep = (logits >= threshold) | (top_p[:, None] >= 1.0)
    return jnp.where(keep, logits, -jnp.inf)


def _draw_key(seed: Array, count: Array, sample: Array) -> Array:
    key = jax.random.fold_in(jax.random.key(seed), count)
    data = jnp.where(sample > 0, jax.random.key_data(jax.random.fold_in(key, sample)), jax.random.key_data(key))
    return jax.random.wrap_key_data(data)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), static_argnames=("mesh",), donate_argnums=(7, 8))
def decode_call(config: Any, method: Method, steps: int, sampling: bool, tune: tuning.Tuning, weights: dict,
                rope: Any, cache: ModelCache, slots: Slots, mesh: Any = None):
    """Up to `steps` tokens per active slot: `(cache, slots, tokens [S, steps] (-1: none), log-probabilities
    [S, steps], kept prompt tokens [S], kept generated tokens [S])`."""
    TRACE_COUNTS["engine_decode"] += 1
    batch = slots.active.shape[0]
    tokens = jnp.full((batch, steps), -1, jnp.int32)
    logprobs = jnp.zeros((batch, steps), jnp.float32)

    def cond(carry):
        j, _, slots, _, _ = carry
        return (j < steps) & jnp.any(slots.active)

    def body(carry):
        j, cache, slots, tokens, logprobs = carry
        token = sample(slots, sampling)
        logprob = jnp.take_along_axis(jax.nn.log_softmax(slots.logits, axis=-1), token[:, None], axis=-1)[:, 0]
        emit = slots.active
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, jnp.where(emit, token, -1), j, axis=1)
        logprobs = jax.lax.dynamic_update_index_in_dim(logprobs, jnp.where(emit, logprob, 0.0), j, axis=1)
        count = slots.count + emit.astype(jnp.int32)
        stopped = jnp.any(token[:, None] == slots.stop, axis=-1) | (count >= slots.max_new)
        active = emit & ~stopped
        with sharding.kernel_mesh(mesh), tuning.use(tune):
            logits, cache = forward.decode_step(config, weights, rope, method, cache, token,
                                                slots.lengths + count - 1, slots.budget, active=active)
        if mesh is not None:
            cache = sharding.constrain_cache(cache, mesh)
        slots = slots.replace(logits=logits, count=count, active=active)
        return j + 1, cache, slots, tokens, logprobs

    _, cache, slots, tokens, logprobs = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, slots, tokens, logprobs))
    kept, generated = kept_counts(cache, slots.lengths, slots.count)
    return cache, slots, tokens, logprobs, kept, generated
