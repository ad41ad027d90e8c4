"""The method protocol: static hyperparameters plus two pure per-layer cache transforms.

A method is a frozen dataclass. The runtime (or your own model) calls, for every layer:

* `prefill(cache, q, step) -> cache` after a prefill chunk has been appended and has attended. The
  incoming cache has `step.capacity + T` slots (the chunk was appended into extra room); the
  returned cache must have exactly `step.capacity` slots. One-shot methods compress here.
* `decode(cache, q, step) -> cache` after the new token has been appended and before it attends.
  Capacity is unchanged; eviction methods bring `length` back under capacity so the next token fits,
  retrieval methods write `cache.attend`.

`q` holds the layer's post-RoPE queries `[B, T, N, H]` (the whole chunk at prefill, `T = 1` at
decode); `step` carries positions, the layer index, static sizes and the layer inputs the method reads.
Hyperparameters are validated in `__post_init__` (plain Python, before anything is traced).

Layer inputs: what a hook may read of the layer besides its queries and cache (its hidden states, its output
projection, the prefill attention's log-sum-exp) are `Step` fields made with `layer_input` (`LAYER_INPUTS` lists
them). A method declares the ones its hooks read in one class attribute, `layer_inputs = frozenset({"hidden"})`;
the runtime computes and hands exactly those (a wrapper's instance adds its wrapped method's), and the step API
refuses a call that lacks one. The others are None.

Optional, all defaults:

* `init_cache_state(spec)`: the method's own per-layer cache leaves, from every cache dimension
  (`CacheSpec`: batch, KV heads, capacity, query heads, head_dim, dtype, layers). An entry `"shared"`
  (`kvjax.cache.SHARED_STATE`) is a dict of cross-layer leaves, stored once in `ModelCache.shared` (the hook
  of layer `l` sees what layer `l - 1` returned). The one state initialiser: `init_state(batch, kv_heads,
  capacity)` only calls it for a cache known by those three dimensions.
* `prefill_window()`: the prefill chunk size the runtime uses when the caller gives none.
* `check_cache_spec(spec)` / `check_model(config)`: refuse a cache / model the method's learned files do not fit
  (before tracing; the first from `step.init_cache` on every path, the second from `generate` with the model's
  config, for what only the config has, such as KVzap's hidden size).

What only one family needs (in-place eviction, attention observers, per-query-head masks, retrieval's
compact gathering, rewritten attention, reading the question) is an explicit capability mixed into the
method (`kvjax.methods.capabilities`), which the runtime dispatches on.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods import capabilities

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class LayerInput:
    """What the runtime and the step API know of one layer input (a `Step` field made with `layer_input`)."""

    #: What it is, as an error asking for it names it.
    what: str
    #: Also handed at decode (the step API then requires it there too); False: at prefill only.
    at_decode: bool = True
    #: A function of the layer's weights alone, the same for every prompt: a shared-prefill recording does not keep
    #: it (its replay computes it). False: of the tokens, rows `[B, T, ...]` of `q`'s.
    weights_only: bool = False
    #: Computed by the step's own prefill attention where it can (not on a sliding-window layer), never passed by a
    #: caller of `prefill_layer`; a hook gets None where it was not computed. False: the model passes it (the step
    #: API refuses a call without it for a method that reads it).
    from_attention: bool = False


def layer_input(what: str, **kind: bool) -> Any:
    """A `Step` field that is a layer input (None unless the method reads it): `what` and `kind` as in `LayerInput`.
    Adding one here, and how the runtime computes it (`kvjax.runtime.forward.BLOCK_INPUTS`, or the step's attention),
    is all a new input takes: methods name it in `Method.layer_inputs`."""
    return dataclasses.field(default=None, metadata=dict(layer_input=LayerInput(what, **kind)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Step:
    """What a method hook knows besides the cache and the queries.

    positions: `[B, T]` int32 absolute positions of the current queries (-1 = padding).
    budget:    `[B]` int32 tokens to keep per example (resolved from `budget` / `compression_ratio`
               and the example's prompt length; huge for methods without a budget).
    layer:     int32 scalar, index of the current layer (a traced value inside the layer scan).
    inv_freq:  `[H / 2]` float32 RoPE inverse frequencies, for methods that re-rotate keys.
    rope_scaling: the factor RoPE's cos and sin carry (HF's `attention_scaling`: yarn's and LongRoPE's; 1.0 for the
               others), at prefill, for a method that rotates statistics of its own (`expected_attention_stats`).
    capacity, num_layers, final_chunk: static.
    replay_gradient: at a differentiated context replay (KVgrad's), each row's gradient norm `[B, R]`; else None.

    The layer inputs (`LAYER_INPUTS`), each there for a method that names it in `Method.layer_inputs` (else None):

    attention_lse: at prefill, the log-sum-exp of each query row's logits from the prefill attention `[B, K, G, T]`
               float32 (H2O's one-pass column sums); None on a sliding-window layer.
    out_proj:  at prefill, the layer's attention output projection `W_o` `[N, H, D]` (query head, head_dim, model
               dim): CriticalKV's `||W_o v||`.
    hidden:    at prefill and decode, the layer's attention input `[B, T, D]` (the hidden states after the layer's
               input norm, the rows of `q`): KVzap's surrogate.
    """

    positions: Array
    budget: Array
    layer: Array
    inv_freq: Array
    capacity: int = dataclasses.field(metadata=dict(static=True))
    num_layers: int = dataclasses.field(metadata=dict(static=True))
    final_chunk: bool = dataclasses.field(default=True, metadata=dict(static=True))
    rope_scaling: Any = 1.0
    attention_lse: Array | None = layer_input("the prefill attention's row log-sum-exp", at_decode=False,
                                              from_attention=True)
    out_proj: Array | None = layer_input(
        "the layer's output projection (W_o as [query heads, head_dim, model dim])", at_decode=False,
        weights_only=True)
    hidden: Array | None = layer_input(
        "the layer's hidden states (the attention input after the layer's input norm, [B, T, D])")
    #: At a context replay that differentiates its objective (`ContextReplay.replay_objective`): `[B, R]` float32,
    #: each replay row's norm of the objective's gradient with respect to the layer's attention output; else None.
    replay_gradient: Array | None = None


#: Every layer input by name (the `Step` fields made with `layer_input`).
LAYER_INPUTS: dict[str, LayerInput] = {f.name: f.metadata["layer_input"] for f in dataclasses.fields(Step)
                                       if "layer_input" in f.metadata}


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Every static dimension of a model's cache, for `Method.init_cache_state`. `quant`: the K / V storage
    format (`kvjax.quant.KVQuant`, None: the model dtype `dtype`)."""

    batch: int
    kv_heads: int
    capacity: int
    num_heads: int
    head_dim: int
    num_layers: int
    dtype: Any
    quant: Any = None
    #: Slots of each layer where they differ (`Method.layer_capacities`); None: every layer has `capacity`.
    layer_capacities: tuple[int, ...] | None = None


class _DeprecatedInputFlag:
    """A flag of the declaration before `Method.layer_inputs` (`uses_hidden_states`, ...): reading it tells whether the
    method reads its input (`layer_inputs`), with a DeprecationWarning; a subclass that sets it is mapped onto
    `layer_inputs` (`_declared_inputs`)."""

    def __init__(self, name: str) -> None:
        self.input = name

    def __set_name__(self, owner: type, attribute: str) -> None:
        self.attribute = attribute

    def __get__(self, method: Any, owner: type) -> bool:
        warnings.warn(f"Method.{self.attribute} is deprecated: read {self.input!r} in method.layer_inputs",
                      DeprecationWarning, stacklevel=2)
        return self.input in (owner if method is None else method).layer_inputs


def _declared_inputs(cls: type) -> frozenset[str]:
    """`cls.layer_inputs` checked against `LAYER_INPUTS`, with the deprecated flags a class (or a mixin of it) sets
    mapped onto it: True adds the input, False removes it."""
    inputs = cls.layer_inputs
    if isinstance(inputs, str) or not all(isinstance(name, str) for name in inputs):
        raise TypeError(f"{cls.__name__}: layer_inputs must be a set of input names, got {inputs!r}")
    inputs = set(inputs)
    for flag, read in ((f, v) for f, v in vars(Method).items() if isinstance(v, _DeprecatedInputFlag)):
        owner = next(c for c in cls.__mro__ if flag in vars(c))
        declared = vars(owner)[flag]
        if isinstance(declared, _DeprecatedInputFlag):
            continue
        name = read.input
        warnings.warn(f"{owner.__name__}.{flag} is deprecated: declare layer_inputs = frozenset({{{name!r}}})",
                      DeprecationWarning, stacklevel=3)
        (inputs.add if declared else inputs.discard)(name)
        if owner is cls:  # the flag reads the declaration from now on
            delattr(cls, flag)
    unknown = sorted(inputs - LAYER_INPUTS.keys())
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown layer input(s) {unknown} in layer_inputs; the inputs are "
                        f"{sorted(LAYER_INPUTS)}")
    return frozenset(inputs)


@dataclasses.dataclass(frozen=True)
class Method:
    """Base class. Subclasses set `name`, add hyperparameters, and override the hooks."""

    name: ClassVar[str] = "method"
    #: Whether the cache needs the `score` accumulator / the `attend` mask.
    uses_score: ClassVar[bool] = False
    uses_attend: ClassVar[bool] = False
    #: The layer inputs the hooks read (`LAYER_INPUTS`: `"hidden"`, `"out_proj"`, `"attention_lse"`), handed as the
    #: `Step` fields of those names. The one declaration the runtime decides from: it computes only these (a
    #: shared-prefill recording keeps only the ones its cells read), and the step API refuses a call without one.
    layer_inputs: ClassVar[frozenset[str]] = frozenset()
    #: The declaration before `layer_inputs`, one flag per input: still honoured, with a DeprecationWarning.
    uses_attention_lse = _DeprecatedInputFlag("attention_lse")
    uses_out_proj = _DeprecatedInputFlag("out_proj")
    uses_hidden_states = _DeprecatedInputFlag("hidden")

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
        """Whether a decode step only appends the new token: `decode` is the base class default and the
        method neither observes attention nor masks query heads (`kvjax.methods.capabilities`).

        The runtime then writes the token in place into the layer's buffers (`kvc.append_token`) instead of
        running `decode` on the appended layer. Override it with False to force the general path.
        """
        plain = type(self).decode is Method.decode
        return plain and not isinstance(self, capabilities.QueryHeadMask | capabilities.AttentionObserver)

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

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...] | None:
        """Static slots per layer when the layers keep different budgets (a layer that keeps less costs less); None
        (default): every layer has `capacity`. No size may shrink as `prompt_len` or `max_new_tokens` grows. The
        runtime also calls it at a long prompt with no new tokens (`kvjax.runtime.stages.GROUPING_PROMPT`) to group
        the layers into a few sizes (`Tuning.layer_slack`), one prefill program each."""
        return None

    def check_cache_spec(self, spec: CacheSpec) -> None:
        """Raises a clear error when the method cannot run on a cache of these dimensions (a method with per-model
        learned files: DuoAttention's head pattern, Q-Filters). Called by `kvjax.runtime.step.init_cache` (every
        path, a user's own model too) before anything is traced. Default: any cache."""

    def validate(self, prompt_len: int, max_new_tokens: int, max_positions: int) -> None:
        """Raises a clear error for a budget that cannot make sense for this model / prompt."""
        if self.budget is not None and self.budget > max_positions:
            raise ConfigError(
                f"{self.name}: budget={self.budget} exceeds the model's maximum context of "
                f"{max_positions} tokens"
            )

    def check_model(self, config: Any) -> None:
        """Raises a clear error when the method cannot run on the model of `config` (`kvjax.models.ModelConfig`);
        the runtime calls it before anything is traced. Default: any model."""

    # ---- cache extras ------------------------------------------------------------------------
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "init_state" in vars(cls):  # the runtime never calls it: the override would be silently ignored
            raise TypeError(f"{cls.__name__}: override init_cache_state(spec), not init_state (the one state "
                            "initialiser is init_cache_state; spec.batch, spec.kv_heads, spec.capacity)")
        cls.layer_inputs = _declared_inputs(cls)

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Any]:
        """The method's per-layer cache leaves (without `[L]`) plus an optional `"shared"` dict of cross-layer
        leaves (default: none)."""
        return {}

    def init_state(self, batch: int, kv_heads: int, capacity: int) -> dict[str, Any]:
        """`init_cache_state` for a cache known only by its batch, KV heads and capacity (a hand-built one-layer
        cache); a method whose state needs another dimension of `CacheSpec` fails on the missing (None) one."""
        return self.init_cache_state(CacheSpec(batch=batch, kv_heads=kv_heads, capacity=capacity, num_heads=None,
                                               head_dim=None, num_layers=None, dtype=None))

    def prefill_window(self) -> int | None:
        """Prefill chunk size the runtime uses when the caller passes no `chunk_size` (None: one shot)."""
        return None

    # ---- hooks -------------------------------------------------------------------------------
    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Default: keep everything that fits (no compression)."""
        return kvc.truncate(cache, step.capacity)

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Default: keep everything (the capacity was sized for the whole generation)."""
        return cache

    def hyperparameters(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def per_example_budget(method: Method, prompt_lengths: np.ndarray) -> np.ndarray:
    """`[B]` int32 budgets, resolved per example (a ratio applies to each example's own length)."""
    return np.array([method.prompt_budget(int(n)) for n in prompt_lengths], dtype=np.int32)


def last_position(cache: KVCache) -> Array:
    """`[B, K]` the largest stored position of each head (-1 when empty)."""
    return jnp.max(jnp.where(kvc.stored_mask(cache), cache.pos, -1), axis=-1)
