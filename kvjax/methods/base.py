"""The method protocol: static hyperparameters plus two pure per-layer cache transforms.

A method is a frozen dataclass. The runtime (or your own model) calls, for every layer:

* `prefill(cache, q, step) -> cache` after a prefill chunk has been appended and has attended. The
  incoming cache has `step.capacity + T` slots (the chunk was appended into extra room); the
  returned cache must have exactly `step.capacity` slots. One-shot methods compress here.
* `decode(cache, q, step) -> cache` after the new token has been appended and before it attends.
  Capacity is unchanged; eviction methods bring `length` back under capacity so the next token fits,
  retrieval methods write `cache.attend`.

`q` holds the layer's post-RoPE queries `[B, T, N, H]` (the whole chunk at prefill, `T = 1` at
decode); `step` carries positions, the layer index and static sizes. Hyperparameters are validated
in `__post_init__` (plain Python, before anything is traced).

Optional extras, all no-ops by default (retrieval methods such as InfLLM / ActQKV use them):

* `before_prefill_attention(cache, q, step)`: after a prefill chunk was appended and **before** it
  attends; a retrieval method writes `cache.attend` from the chunk's own queries here.
* `init_cache_state(spec)`: like `init_state` but sees every cache dimension (`CacheSpec`: query
  heads, head_dim, dtype, layers). An entry `"shared"` (`kvjax.cache.SHARED_STATE`) is a dict of
  cross-layer leaves without the `[L]` axis, carried through the layer scan (the hook of layer `l`
  sees what layer `l - 1` returned).
* `prefill_window()`: the prefill chunk size the runtime uses when the caller gives none.
* `question_in_prompt`: the runtime prefills `question_ids` through this method as the end of the
  prompt (instead of appending them uncompressed with `full`).
* `encodes_question` + `mark_question(cache, lengths)`: the runtime also puts `question_ids` before
  the context (question + context + question, the layout of Q-LLM's prompts) and tells the method
  each example's question length `[B]` before the prefill, so it can read the question span `[0, q)`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Step:
    """What a method hook knows besides the cache and the queries.

    positions: `[B, T]` int32 absolute positions of the current queries (-1 = padding).
    budget:    `[B]` int32 tokens to keep per example (resolved from `budget` / `compression_ratio`
               and the example's prompt length; huge for methods without a budget).
    layer:     int32 scalar, index of the current layer (a traced value inside the layer scan).
    inv_freq:  `[H / 2]` float32 RoPE inverse frequencies, for methods that re-rotate keys.
    capacity, num_layers, final_chunk: static.
    attention_lse: in `prefill` of a method with `uses_attention_lse`, the log-sum-exp of each query row's
               logits from the prefill attention `[B, K, G, T]` float32 (else None).
    """

    positions: Array
    budget: Array
    layer: Array
    inv_freq: Array
    capacity: int = dataclasses.field(metadata=dict(static=True))
    num_layers: int = dataclasses.field(metadata=dict(static=True))
    final_chunk: bool = dataclasses.field(default=True, metadata=dict(static=True))
    attention_lse: Array | None = None


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Every static dimension of a model's cache, for `Method.init_cache_state`."""

    batch: int
    kv_heads: int
    capacity: int
    num_heads: int
    head_dim: int
    num_layers: int
    dtype: Any


@dataclasses.dataclass(frozen=True)
class Method:
    """Base class. Subclasses set `name`, add hyperparameters, and override the hooks."""

    name: ClassVar[str] = "method"
    #: Whether the cache needs the `score` accumulator / the `attend` mask.
    uses_score: ClassVar[bool] = False
    uses_attend: ClassVar[bool] = False
    #: Whether `observe` wants the decode step's attention probabilities (H2O-style accumulators).
    observes_attention: ClassVar[bool] = False
    #: Whether `prefill` wants the prefill attention's row log-sum-exp as `step.attention_lse` (given on
    #: models without a sliding window, where the attention's mask is the cache's causal validity).
    uses_attention_lse: ClassVar[bool] = False
    #: Whether `question_ids` go through this method's hooks as the end of the prompt (retrieval
    #: methods) instead of being appended uncompressed after the compressed context.
    question_in_prompt: ClassVar[bool] = False
    #: Whether the question also opens the prompt and `mark_question` gets its lengths (see module doc).
    encodes_question: ClassVar[bool] = False

    budget: int | None = None
    compression_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and self.compression_ratio is not None:
            raise ConfigError(
                f"{self.name}: give either budget or compression_ratio, not both "
                f"(got budget={self.budget}, compression_ratio={self.compression_ratio})"
            )
        if self.budget is not None and (not isinstance(self.budget, int | np.integer) or self.budget <= 0):
            raise ConfigError(f"{self.name}: budget must be a positive integer, got {self.budget!r}")
        if self.compression_ratio is not None and not (0.0 <= self.compression_ratio < 1.0):
            raise ConfigError(
                f"{self.name}: compression_ratio must be in [0, 1), got {self.compression_ratio!r}"
            )

    @property
    def decode_appends_only(self) -> bool:
        """Whether a decode step only appends the new token: `decode` and `query_mask` are the base
        class defaults and `observes_attention` is off.

        The model then writes the token straight into its stacked cache (`kvc.append_token_in_layer`)
        instead of copying each layer out and back. Override it with False to force the general path
        (slice the layer, `append`, `decode`, write the layer back).
        """
        cls = type(self)
        return cls.decode is Method.decode and cls.query_mask is Method.query_mask and not self.observes_attention

    @property
    def decode_evicts_in_place(self) -> bool:
        """Whether a decode step appends the new token and then removes at most one slot per head with
        `kvc.evict`, at the slot `decode_eviction` picks from positions and lengths alone (StreamingLLM).

        The model then appends and evicts in place in its stacked cache (`kvc.evict_in_layer`), as for
        `decode_appends_only`. Subclasses that say True keep `decode` equal to append + that eviction.
        """
        return False

    @property
    def decode_gathers(self) -> bool:
        """Whether a decode step attends only the slots `decode_slots` lists (the retrieval methods).

        The model then writes the new token in place, gathers the listed keys / values from its stacked
        cache, attends over that compact `[B, K, W]` set (W static, independent of the context), and writes
        back only the layer's `state` and `attend`. Equal to the general path (`decode`, a masked attention
        over the whole cache, `observe`) up to float summation order; `general_decode_path` forces the latter.
        """
        return False

    @property
    def decode_dense_layers(self) -> int:
        """With `decode_gathers`: the first this many layers attend their whole cache through `decode` and
        the masked attention instead (Quest's dense layers); their K / V are still written in place."""
        return 0

    def decode_dense(self, cache: KVCache, q: Array, step: Step, take: Any) -> KVCache:
        """`decode` in one of the `decode_dense_layers` (known dense there: a method may skip its selection);
        `take` as in `decode_slots`."""
        return self.decode(cache, q, step)

    def decode_slots(self, cache: KVCache, q: Array, step: Step, take: Any) -> tuple[KVCache, Array, Array]:
        """For `decode_gathers`: (the layer with `state` / `attend` advanced as `decode` would, slots
        `[B, K, W]` int32 in `[0, C)`, `[B, K, W]` bool which of them to attend). The new token is already
        appended. `take(slots)` reads `(k, v, pos)` at `[B, K, S]` slots of this layer from the stacked
        cache (cheaper than indexing `cache.k`, which may be a copy of the layer)."""
        raise NotImplementedError(f"{self.name}: no compact decode")

    def slot_keys(self, k: Array, pos: Array, q: Array, step: Step) -> Array:
        """For `decode_gathers`: the keys the attention scores, from the gathered `k` `[B, K, W, H]` at
        `pos` `[B, K, W]` (InfLLM's positions re-rotate far keys). Default: as stored."""
        return k

    def observe_slots(
        self, cache: KVCache, weights: Array, slots: Array, pos: Array, ok: Array, step: Step
    ) -> KVCache:
        """For `decode_gathers` with `observes_attention`: `observe` from the compact attention's float32
        probabilities `[B, K, G, W]` over `slots` (holding positions `pos`; `ok`: attended), all `[B, K, W]`."""
        return cache

    def decode_eviction(self, cache: KVCache, step: Step) -> tuple[Array, Array]:
        """(`[B, K]` slot, `[B, K]` bool whether to evict) after the new token was appended; only
        `pos`, `length` and the capacity of `cache` may be read. Used when `decode_evicts_in_place`."""
        raise NotImplementedError(f"{self.name}: no in-place decode eviction")

    # ---- budgets (static, before tracing) -------------------------------------------------
    @property
    def compresses(self) -> bool:
        return self.budget is not None or self.compression_ratio is not None

    def prompt_budget(self, prompt_len: int) -> int:
        """Tokens kept of a prompt of `prompt_len` tokens (the whole prompt when no budget)."""
        if self.budget is not None:
            return min(self.budget, prompt_len)
        if self.compression_ratio is not None:
            return max(1, int(math.floor(prompt_len * (1.0 - self.compression_ratio))))
        return prompt_len

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Static cache capacity for prompts up to `prompt_len` and `max_new_tokens` new tokens.

        Default: the prompt budget, then growing by one slot per generated token.
        """
        return self.prompt_budget(prompt_len) + max_new_tokens

    def validate(self, prompt_len: int, max_new_tokens: int, max_positions: int) -> None:
        """Raises a clear error for a budget that cannot make sense for this model / prompt."""
        if self.budget is not None and self.budget > max_positions:
            raise ConfigError(
                f"{self.name}: budget={self.budget} exceeds the model's maximum context of "
                f"{max_positions} tokens"
            )

    # ---- cache extras ------------------------------------------------------------------------
    def init_state(self, batch: int, kv_heads: int, capacity: int) -> dict[str, Array]:
        """Method-specific per-layer cache leaves (without the `[L]` axis)."""
        return {}

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Any]:
        """Per-layer leaves (without `[L]`) plus an optional `"shared"` dict of cross-layer leaves.

        Default: `init_state(batch, kv_heads, capacity)`. Override when the leaves need the query
        heads, head_dim, dtype or number of layers.
        """
        return self.init_state(spec.batch, spec.kv_heads, spec.capacity)

    def prefill_window(self) -> int | None:
        """Prefill chunk size the runtime uses when the caller passes no `chunk_size` (None: one shot)."""
        return None

    # ---- hooks -------------------------------------------------------------------------------
    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Default: keep everything that fits (no compression)."""
        return kvc.truncate(cache, step.capacity)

    def before_prefill_attention(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """After a prefill chunk was appended, before it attends (`capacity + T` slots). Default: no-op."""
        return cache

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Default: keep everything (the capacity was sized for the whole generation)."""
        return cache

    def mark_question(self, cache: KVCache, lengths: Array) -> KVCache:
        """Only when `encodes_question`: the prompt opens with a question of `lengths` `[B]` tokens (one layer's
        cache, before the prefill; the runtime marks every layer). Default: no-op."""
        return cache

    # ---- positions and attention ---------------------------------------------------------------
    def max_attended_distance(self) -> int | None:
        """The largest query-key RoPE distance attention ever sees (None: up to the whole sequence).

        A bound below the model's `max_position_embeddings` lets the runtime take prompts longer than
        the model window (InfLLM's positional scheme)."""
        return None

    @property
    def rewrites_attention(self) -> bool:
        """Whether prefill attention is `self.prefill_attention` and decode attends `self.decode_keys`."""
        return False

    def prefill_attention(self, cache: KVCache, q: Array, step: Step) -> tuple[Array, KVCache]:
        """Only when `rewrites_attention`: the chunk's attention output `[B, T, N, H]` and the cache."""
        raise NotImplementedError(f"{self.name}: prefill_attention is only called when rewrites_attention")

    def decode_keys(self, cache: KVCache, q: Array, step: Step) -> Array:
        """The keys the decode query attends (`[B, K, C, H]`); default the stored post-RoPE keys."""
        return cache.k

    def query_mask(self, cache: KVCache, num_query_heads: int) -> Array | None:
        """Optional `[B, K, G, C]` per-query-head visibility for decode attention (None: every query
        head of a group sees the same slots). SAGE-KV's per-query-head layout uses it."""
        return None

    def observe(self, cache: KVCache, weights: Array, step: Step) -> KVCache:
        """After a decode step attended: `weights` `[B, K, G, C]` float32 probabilities per slot.

        Called only when `observes_attention` is True.
        """
        return cache

    def hyperparameters(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def per_example_budget(method: Method, prompt_lengths: np.ndarray) -> np.ndarray:
    """`[B]` int32 budgets, resolved per example (a ratio applies to each example's own length)."""
    return np.array([method.prompt_budget(int(n)) for n in prompt_lengths], dtype=np.int32)


def last_position(cache: KVCache) -> Array:
    """`[B, K]` the largest stored position of each head (-1 when empty)."""
    return jnp.max(jnp.where(kvc.stored_mask(cache), cache.pos, -1), axis=-1)
