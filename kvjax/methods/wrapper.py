"""What the wrappers over a scoring method share (`criticalkv`, `per_layer`, `rerotate`, ...): building the wrapped
method from `base` and `base_args`, and checking their hyperparameters."""

from __future__ import annotations

from typing import Any

from kvjax.errors import ConfigError
from kvjax.methods.registry import get, method_class
from kvjax.methods.scorer import ScoringMethod


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
