"""`decoding`: decode-time compression with any scoring method (kvpress's `DecodingPress`): every
`compression_interval` generated tokens (512) the cache is compressed back to `target_size` pairs (2048) by the
base's scores, the generic form of what H2O and LagKV do while decoding. Defaults are kvpress 0.5.5's; the base
defaults to `knorm` (kvpress has none).

Scoring queries. kvpress buffers the hidden states of the last `hidden_states_buffer_size` (256) decode steps and
hands them to the scorer; kvjax's scorers read post-RoPE queries, so the wrapper keeps a ring of the last
`query_buffer_size` (256, at most the interval; 0 means the newest only) decode queries and their positions per layer
and gives them to the base as the step's queries (SnapKV's observation window is their last `window_size`).
A scorer that reads hidden states (`kvzap`) scores each token when it enters instead, so it needs no buffer.

Timing. kvpress compresses right after the interval-th decode token attended; kvjax's decode hook runs after the
next token is appended and before it attends, so the compression happens there, over every pair but the new token,
which is kept (it is the pair kvpress appends after compressing). The tokens the next queries see are the same.
The base's protected slots (SnapKV's window, sinks) stay protected. Prefill: with `budget` / `compression_ratio`
the base also compresses the prompt (kvpress's prefill-and-decoding combination), else the prompt is kept whole,
as `DecodingPress` alone does.

Capacity: the prompt's (budget) plus at most `compression_interval + 1` tokens over `max(prompt, target_size)`,
never more than the prompt plus the new tokens: a long generation runs in a bounded cache. Over a base with per-layer
sizes (`pyramidkv`) each layer takes that bound over its own prompt part (`layer_capacities`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.common import new_slots
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.methods.wrapper import Wrapper
from kvjax.ops.gather import keep_top
from kvjax.validation import check_int

Array = jax.Array

STEPS, SINCE = "decoding_steps", "decoding_since"
QUERIES, QUERY_POS = "decoding_queries", "decoding_query_pos"


@register
@dataclasses.dataclass(frozen=True)
class Decoding(Wrapper):
    """Compress back to `target_size` (2048) every `compression_interval` (512) decode tokens with `base`'s scores
    ("knorm", `base_args`), scored by the last `query_buffer_size` (256) decode queries."""

    name = "decoding"

    base: str = "knorm"
    base_args: Any = ()
    compression_interval: int = 512
    target_size: int = 2048
    query_buffer_size: int = 256

    def check_own_hyperparameters(self) -> None:
        check_int(self.name, "compression_interval", self.compression_interval, 1)
        check_int(self.name, "target_size", self.target_size, 1)
        check_int(self.name, "query_buffer_size", self.query_buffer_size, 0)

    def inner_budget(self) -> tuple[int | None, float | None]:
        """The base compresses the prompt with the wrapper's budget, else keeps it whole."""
        return self.budget, (self.compression_ratio if self.compresses else 0.0)

    def check_base(self, inner: ScoringMethod) -> None:
        if not inner.decode_appends_only:
            raise ConfigError(f"{self.name}: base {self.base!r} decodes on its own (it observes or evicts while "
                              "decoding); choose a one-shot scorer such as knorm, snapkv or kvzap")

    @property
    def buffer(self) -> int:
        """Decode queries kept for scoring (the ring's length)."""
        return max(1, min(self.query_buffer_size, self.compression_interval))

    def targets(self, seen: Array) -> Array:
        """The pairs a compression keeps `[B]` (besides the new token), given the tokens seen so far `[B]`
        (kvpress's `_resolve_target_size`): `target_size`."""
        return jnp.full_like(seen, self.target_size)

    def largest_target(self, total: int) -> int:
        """The most `targets` gives over a sequence of `total` tokens."""
        return self.target_size

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self._bound(self.inner.max_layer_budget(prompt_len), prompt_len + max_new_tokens, max_new_tokens)

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...] | None:
        """Over a base with per-layer sizes (`pyramidkv`), each layer's bound over what its prefill keeps."""
        kept = self.inner.layer_capacities(prompt_len, 0, num_layers)
        total = prompt_len + max_new_tokens
        return None if kept is None else tuple(self._bound(k, total, max_new_tokens) for k in kept)

    def _bound(self, kept: int, total: int, max_new_tokens: int) -> int:
        """Slots of a layer whose prefill keeps at most `kept`: it grows by a token a step and is compressed back to
        its target every `compression_interval` tokens."""
        return min(kept + max_new_tokens, max(kept, self.largest_target(total)) + self.compression_interval + 1)

    def init_cache_state(self, spec: Any) -> dict[str, Any]:
        state = dict(self.inner.init_cache_state(spec))
        w = self.buffer
        state[STEPS] = np.zeros((spec.batch,), np.int32)
        state[SINCE] = np.zeros((spec.batch,), np.int32)
        state[QUERIES] = np.zeros((spec.batch, w, spec.num_heads, spec.head_dim), np.float32)
        state[QUERY_POS] = np.full((spec.batch, w), -1, np.int32)
        return state

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        return self.inner.prefill(cache, q, step)

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        if "hidden" in self.inner.layer_inputs:  # a scorer of entering tokens (kvzap) scores the new one now
            cache = self.inner.before_scoring(cache, q, step)
        done = cache.state[STEPS]  # [B] decode tokens before this one
        since = cache.state[SINCE]  # [B] of them since the last compression
        real = step.positions[:, 0] >= 0
        # kvpress decides after the token before this one attended, having seen as many tokens as this one's position;
        # it compresses every `compression_interval` tokens, and on every token while its target is one pair
        target = self.targets(jnp.maximum(step.positions[:, 0], 0))
        due = real & (done > 0) & ((since >= self.compression_interval) | (target <= 1))
        cache = jax.lax.cond(jnp.any(due), lambda c: self.compress(c, due, target, step), lambda c: c, cache)
        w = self.buffer
        at = done % w
        hit = (jnp.arange(w)[None] == at[:, None]) & real[:, None]  # [B, W]
        state = dict(cache.state)
        state[QUERIES] = jnp.where(hit[..., None, None], q.astype(jnp.float32), state[QUERIES])
        state[QUERY_POS] = jnp.where(hit, step.positions, state[QUERY_POS])
        state[STEPS] = done + real.astype(jnp.int32)
        state[SINCE] = jnp.where(due, 0, since) + real.astype(jnp.int32)
        return cache.replace(state=state)

    def compress(self, cache: KVCache, due: Array, target: Array, step: Step) -> KVCache:
        """Every pair but the new token down to `target` `[B]` by the base's scores where `due` `[B]`."""
        done = cache.state[STEPS]
        order = (done[:, None] + jnp.arange(self.buffer)[None]) % self.buffer  # oldest query first
        queries = jnp.take_along_axis(cache.state[QUERIES], order[..., None, None], axis=1)
        positions = jnp.take_along_axis(cache.state[QUERY_POS], order, axis=1)
        stored = kvc.stored_mask(cache)
        length = jnp.max(cache.length, axis=-1)
        budget = jnp.where(due, jnp.minimum(target + 1, length), length).astype(jnp.int32)
        scoring = dataclasses.replace(step, positions=positions, budget=budget)
        newest = new_slots(cache, step.positions)
        inner_protect = self.inner.protected(cache, budget, scoring)
        protect = newest if inner_protect is None else newest | (inner_protect & stored)
        scores = self.inner.scores(cache, queries, scoring, protect)
        return keep_top(cache, scores, budget, capacity=cache.capacity, protect=protect)


__all__ = ["Decoding"]
