"""`full`: no compression, the reference every method is measured against."""

from __future__ import annotations

import dataclasses

from kvjax.errors import ConfigError
from kvjax.methods.base import Method
from kvjax.methods.registry import register


@register
@dataclasses.dataclass(frozen=True)
class Full(Method):
    """Keeps every token; capacity = prompt + generated tokens."""

    name = "full"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compresses:
            raise ConfigError("full: takes no budget or compression_ratio (it keeps every token)")
