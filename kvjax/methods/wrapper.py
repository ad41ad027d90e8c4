"""`Wrapper`: the one base of every method built around a scoring method (`adakv`, `block`, `chunk`, `criticaladakv`,
`criticalkv`, `chunkkv`, `per_layer`, `key_rerotation`, `decoding`, `dms`, `lukv`, ...).

A wrapper declares `base` (the name of its default scoring method) and `base_args` (the base's hyperparameters)
as its own fields (so each keeps its field order, repr and hash). `Wrapper` checks the wrapper's other
hyperparameters first (`check_own_hyperparameters`), builds the wrapped method (`inner`, with the budget
`inner_budget()` gives; `check_base` refuses a base the wrapper cannot use) and forwards everything the wrapped
method needs from the runtime and the model: its layer inputs (a wrapper instance's `layer_inputs` are its class's
own declaration and its wrapped method's, set once when it is built), its cache fields (`uses_score`), its cache
state (`init_cache_state`), its checks (`check_model`, `check_cache_spec`, `validate`) and its prefill chunk size
(`prefill_window`). The wrapper owns the selection;
it starts from `kvjax.methods.scorer.score_layer` over itself or its `inner`.

`ScorerWrapper` is a wrapper that is itself a scoring method (`criticalkv`, `chunkkv`, `per_layer`,
`key_rerotation`): the scoring parts (`before_scoring`, `layer_budget`, `protected`, `scores`,
`max_layer_budget`) and the per-layer sizes (`layer_capacities`) go to the wrapped method unless the wrapper
overrides them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Method, Step
from kvjax.methods.registry import get, method_class
from kvjax.methods.scorer import ScoringMethod

Array = jax.Array

__all__ = ["ScorerWrapper", "Wrapper", "build_inner", "check_self_contained_base"]


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


def check_self_contained_base(name: str, inner: ScoringMethod, part: str) -> None:
    """Refuses a base that cannot score `part` of the prompt on its own (`chunk`, `block`): one that reads a layer
    input (attention sums, hidden states), keeps statistics across the prompt, or compresses as the prompt is read."""
    reads = sorted(inner.layer_inputs)
    keeps_state = type(inner).before_scoring is not ScoringMethod.before_scoring or inner.uses_score
    if reads or keeps_state:
        why = f"reads {', '.join(reads)}" if reads else "keeps statistics across the prompt"
        raise ConfigError(f"{name}: base {inner.name} {why}, which {part} does not have")
    if inner.prefill_window() is not None:
        raise ConfigError(f"{name}: base {inner.name} compresses as the prompt is read (a prefill window of "
                          f"{inner.prefill_window()}); {part} is scored with all its queries at once")


def _from_inner(flag: str) -> property:
    """The wrapped method's class flag `flag` (what the runtime must give the hooks), read through `inner`."""
    return property(lambda self: getattr(self.inner, flag), doc=f"The wrapped method's `{flag}`.")


@dataclasses.dataclass(frozen=True)
class Wrapper(Method):
    """A method around a scoring method built from its `base` and `base_args` fields (declared by the subclass,
    with its own default base). See the module docstring for what is forwarded."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_own_hyperparameters()
        args, inner = build_inner(self.name, self.base, self.base_args, *self.inner_budget())
        self.check_base(inner)
        object.__setattr__(self, "base_args", args)
        object.__setattr__(self, "_inner", inner)
        # What the runtime hands the hooks: the wrapper's own inputs (criticalkv: W_o) and everything its base reads.
        object.__setattr__(self, "layer_inputs", type(self).layer_inputs | inner.layer_inputs)

    def check_own_hyperparameters(self) -> None:
        """Raises a ConfigError for a bad hyperparameter of the wrapper itself; runs before the base is built, so
        the wrapper's own mistake is the one named (default: nothing to check)."""

    def inner_budget(self) -> tuple[int | None, float | None]:
        """`(budget, compression_ratio)` the wrapped method is built with (default: the wrapper's own)."""
        return self.budget, self.compression_ratio

    def check_base(self, inner: ScoringMethod) -> None:
        """Raises a ConfigError when the wrapper cannot run over `inner` (default: any scoring method)."""

    @property
    def inner(self) -> ScoringMethod:
        """The wrapped scoring method (built from `base` and `base_args`)."""
        return self._inner  # type: ignore[attr-defined]

    # ---- what the wrapped method needs (a subclass that needs more sets the flag to True itself) ----------------
    uses_score = _from_inner("uses_score")

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


@dataclasses.dataclass(frozen=True)
class ScorerWrapper(Wrapper, ScoringMethod):
    """A wrapper that is itself a scoring method (`base`, `base_args`): its scoring parts are the wrapped method's
    unless it overrides them (its selection, its budgets, what it does to the kept cache)."""

    base: str = "snapkv"
    base_args: Any = ()

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

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...] | None:
        """The wrapped method's per-layer sizes (`pyramidkv`'s, `knorm`'s skipped layers): a wrapper that keeps the
        wrapped method's layer budgets (no `layer_budget`, `max_layer_budget` or `capacity` of its own) keeps at
        most what it does in each layer."""
        own = type(self)
        if (own.layer_budget is not ScorerWrapper.layer_budget or own.max_layer_budget is not
                ScorerWrapper.max_layer_budget or own.capacity is not ScoringMethod.capacity):
            return None
        return self.inner.layer_capacities(prompt_len, max_new_tokens, num_layers)
