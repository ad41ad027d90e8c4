"""The `implementation=` argument every public op takes ("auto" | "xla" | "pallas")."""

from __future__ import annotations

from kvjax.errors import ConfigError

IMPLEMENTATIONS = ("auto", "xla", "pallas")


def resolve(op: str, implementation: str) -> str:
    """The implementation to run for `op`; today only the XLA reference exists.

    "auto" picks XLA everywhere until a Pallas kernel is tested and measured faster on a backend;
    "pallas" raises until the kernel for `op` lands (kvjax.pallas).
    """
    if implementation in ("auto", "xla"):
        return "xla"
    if implementation == "pallas":
        raise ConfigError(
            f"{op}: implementation='pallas' is not available yet (no Pallas kernel for this op); "
            "use implementation='auto' or 'xla'"
        )
    raise ConfigError(
        f"{op}: implementation must be one of {', '.join(map(repr, IMPLEMENTATIONS))}, "
        f"got {implementation!r}"
    )
