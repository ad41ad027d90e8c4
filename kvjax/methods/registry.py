"""Name -> method class registry."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from kvjax.errors import ConfigError
from kvjax.methods.base import Method
from kvjax.validation import check_hyperparameters

_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: makes `cls` available as `kvjax.methods.get(cls.name)`."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """Names of every registered method, sorted."""
    return sorted(_REGISTRY)


def method_class(name: str) -> type[Method]:
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown method {name!r}.{hint} Available: {', '.join(available())}")
    return _REGISTRY[name]


def get(name: str, **hyperparameters: Any) -> Method:
    """Builds method `name` with the given hyperparameters (validated before any tracing)."""
    cls = method_class(name)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(hyperparameters) - fields)
    if unknown:
        raise ConfigError(
            f"method {name!r} has no hyperparameter(s) {', '.join(unknown)}; "
            f"it takes: {', '.join(sorted(fields))}"
        )
    check_hyperparameters(cls, hyperparameters, name)
    return cls(**hyperparameters)
