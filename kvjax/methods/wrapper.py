"""What the wrappers over a scoring method share (`criticalkv`, `per_layer`, `rerotate`, ...): building the wrapped
method from `base` and `base_args`, and checking their hyperparameters."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.registry import get, method_class
from kvjax.methods.scorer import ScoringMethod

Array = jax.Array


def build_inner(name: str, base: Any, base_args: Any, budget: int | None,
                compression_ratio: float | None) -> tuple[tuple, ScoringMethod]:
    """`(base_args as a sorted tuple of pairs, the wrapped scoring method)`; the budget is the wrapper's own."""
    args = tuple(sorted(base_args.items())) if isinstance(base_args, dict) else base_args
    if not isinstance(args, tuple) or not all(isinstance(a, tuple) and len(a) == 2 for a in args):
        raise ConfigError(f"{name}: base_args must be a dict of the base's hyperparameters, got {base_args!r}")
    if not isinstance(base, str) or not issubclass(method_class(base), ScoringMethod):
        raise ConfigError(f"{name}: base must name a scoring method (e.g. snapkv, knorm, expected_attention), "
                          f"got {base!r}")
    given = dict(args)
    for clash in ("budget", "compression_ratio"):
        if clash in given:
            raise ConfigError(f"{name}: pass {clash} to {name} itself, not in base_args")
    return args, get(base, budget=budget, compression_ratio=compression_ratio, **given)


def check_ratio(name: str, field: str, value: Any) -> None:
    """Raises a ConfigError naming `field` unless `value` is a number in [0, 1]."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name}: {field} must be in [0, 1], got {value!r}")


class ForwardsToInner:
    """For a method built around another one (`_inner`, from `build_inner`) that it calls for scores: the inner
    method's input needs (attention lse, hidden states, W_o) and its model checks, forwarded."""

    @property
    def inner(self) -> ScoringMethod:
        return self._inner  # type: ignore[attr-defined]

    @property
    def uses_attention_lse(self) -> bool:
        return self.inner.uses_attention_lse

    @property
    def uses_hidden_states(self) -> bool:
        return self.inner.uses_hidden_states

    @property
    def uses_out_proj(self) -> bool:
        return self.inner.uses_out_proj

    def check_model(self, config: Any) -> None:
        self.inner.check_model(config)

    def check_cache_spec(self, spec: Any) -> None:
        self.inner.check_cache_spec(spec)

    def validate(self, prompt_len: int, max_new_tokens: int, max_positions: int) -> None:
        super().validate(prompt_len, max_new_tokens, max_positions)  # type: ignore[misc]
        self.inner.validate(prompt_len, max_new_tokens, max_positions)


@dataclasses.dataclass(frozen=True)
class ScorerWrapper(ScoringMethod):
    """A scoring method around another (`base`, `base_args`): every part of the protocol goes to the wrapped
    method unless the wrapper overrides it (its selection, its budgets, what it does to the kept cache)."""

    base: str = "snapkv"
    base_args: Any = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        args, inner = build_inner(self.name, self.base, self.base_args, *self.inner_budget())
        object.__setattr__(self, "base_args", args)
        object.__setattr__(self, "_inner", inner)

    def inner_budget(self) -> tuple[int | None, float | None]:
        """`(budget, compression_ratio)` the wrapped method is built with (default: the wrapper's own)."""
        return self.budget, self.compression_ratio

    @property
    def inner(self) -> ScoringMethod:
        """The wrapped scoring method (built from `base` and `base_args`)."""
        return self._inner  # type: ignore[attr-defined]

    @property
    def uses_attention_lse(self) -> bool:  # type: ignore[override]
        return self.inner.uses_attention_lse

    def init_cache_state(self, spec: Any) -> dict[str, Any]:
        return self.inner.init_cache_state(spec)

    def check_cache_spec(self, spec: Any) -> None:
        self.inner.check_cache_spec(spec)

    def check_model(self, config: Any) -> None:
        self.inner.check_model(config)

    def validate(self, prompt_len: int, max_new_tokens: int, max_positions: int) -> None:
        super().validate(prompt_len, max_new_tokens, max_positions)
        self.inner.validate(prompt_len, max_new_tokens, max_positions)

    def prefill_window(self) -> int | None:
        return self.inner.prefill_window()

    def before_scoring(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        return self.inner.before_scoring(cache, q, step)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        return self.inner.scores(cache, q, step, protect)

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array | None:
        return self.inner.protected(cache, budget, step)

    def layer_budget(self, cache: KVCache, step: Step) -> Array:
        return self.inner.layer_budget(cache, step)

    def max_layer_budget(self, prompt_len: int) -> int:
        return self.inner.max_layer_budget(prompt_len)

    def inner_prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """The selection of `ScoringMethod.prefill` with this wrapper's budgets and the base's scores."""
        return ScoringMethod.prefill(self, cache, q, step)
