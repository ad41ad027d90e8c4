"""The multi-context strategy protocol and its registry.

A strategy is a frozen dataclass of static hyperparameters with

* `validate(info, config)`: host-side checks, raising `ConfigError` before anything is traced;
* `scalars(info)`: host-side integers the plan needs (exact integer arithmetic, not traced floats);
* `build(config, weights, rope, req) -> Assembled`: pure and jittable; turns the request's stored
  per-document caches into the context cache the query is prefilled on. Selection logic lives in
  small pure functions of each strategy's module; recomputation goes through
  `kvjax.rag.recompute.run_rows`.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, ClassVar

import jax

from kvjax.cache import ModelCache
from kvjax.errors import ConfigError
from kvjax.validation import check_hyperparameters

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Assembled:
    """The context cache a strategy built, and what it cost.

    cache: one `KVCache` per layer (a `ModelCache`), as the query prefill and the decode loop take it.
    kept `[L]`: context tokens in each layer's cache. recomputed `[L]`: tokens whose fresh K/V were
    written at each layer. selected: distinct context tokens the strategy chose to recompute (the
    paper's "recomputation ratio" numerator). details: strategy diagnostics (arrays).
    """

    cache: ModelCache
    kept: Array
    recomputed: Array
    selected: Array
    details: dict[str, Array]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Base class; subclasses set `name` and implement `build`."""

    name: ClassVar[str] = "strategy"
    #: Whether `build` needs SamKV's per-document statistics (`prefill_documents(analyze=True)`).
    needs_stats: ClassVar[bool] = False

    def validate(self, info: Any, config: Any) -> None:
        """Host-side checks of the hyperparameters against one request and model."""

    def scalars(self, info: Any) -> dict[str, int]:
        """Host-computed integers passed to `build` as `req.scalars`."""
        return {}

    def build(self, config: Any, weights: dict, rope: tuple, req: Any) -> Assembled:
        raise NotImplementedError

    def hyperparameters(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: makes `cls` available as `kvjax.rag.get_strategy(cls.name)`."""
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    return sorted(_REGISTRY)


def get_strategy(name: str | Strategy, **hyperparameters: Any) -> Strategy:
    """A strategy instance from its name and hyperparameters (or the instance itself)."""
    if isinstance(name, Strategy):
        if hyperparameters:
            raise ConfigError("pass hyperparameters either in the Strategy instance or strategy_args, not both")
        return name
    if not isinstance(name, str) or name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown RAG strategy {name!r}.{hint} Available: {', '.join(available())}")
    cls = _REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(hyperparameters) - fields)
    if unknown:
        raise ConfigError(f"{name}: unknown hyperparameters {unknown}; valid: {sorted(fields)}")
    check_hyperparameters(cls, hyperparameters, name)
    return cls(**hyperparameters)
