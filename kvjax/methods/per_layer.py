"""`per_layer`: a compression ratio per decoder layer around any scoring method (kvpress's
`PerLayerCompressionPress`; the knob of layer-wise allocation studies such as PyramidKV's).

Layer `l` keeps `max(1, floor(n * (1 - compression_ratios[l])))` of each example's `n` prompt tokens per KV head
(float32 arithmetic, the same on the host, where it sizes the cache, and in the trace), chosen by the base
method's scores and protection (`base`, `base_args`). Memory is freed per layer: each layer's buffers are
allocated at its own budget plus `max_new_tokens` (`Method.layer_capacities`), so a layer that keeps 10 % costs
10 %; each distinct layer size compiles its own prefill program, so the runtime groups the layers, each allocated
at its group's largest size, into the fewest groups that cost at most `Tuning.layer_slack` (5 %) more slots at a
long prompt (`kvjax.runtime.stages.cache_layer_capacities`).

The wrapper takes no `budget` / `compression_ratio` of its own: the ratios are the budget. With chunked prefill
every chunk compresses each layer to its final budget, as `compression_ratio` does for the plain scorers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.registry import register
from kvjax.methods.wrapper import ScorerWrapper

Array = jax.Array


def kept_of(length: Any, ratio: Any) -> Any:
    """`max(1, floor(length * (1 - ratio)))` in float32, identically for host ints and traced arrays."""
    if isinstance(length, int | np.integer):
        return max(1, int(np.floor(np.float32(length) * (np.float32(1.0) - np.float32(ratio)))))
    kept = jnp.floor(length.astype(jnp.float32) * (jnp.float32(1.0) - ratio.astype(jnp.float32)))
    return jnp.maximum(kept.astype(jnp.int32), 1)


@register
@dataclasses.dataclass(frozen=True)
class PerLayer(ScorerWrapper):
    """A compression ratio per layer (`compression_ratios`, one per layer) over a scoring method (`base`,
    `base_args`)."""

    name = "per_layer"

    compression_ratios: Any = ()

    def check_own_hyperparameters(self) -> None:
        if self.budget is not None or self.compression_ratio is not None:
            raise ConfigError(f"{self.name}: give compression_ratios (one per layer), not budget / compression_ratio")
        ratios = tuple(self.compression_ratios) if isinstance(self.compression_ratios, list | tuple) else None
        if not ratios or not all(isinstance(r, int | float) and not isinstance(r, bool) and 0.0 <= r < 1.0
                                 for r in ratios):
            raise ConfigError(f"{self.name}: compression_ratios must be a non-empty list of numbers in [0, 1), one "
                              f"per layer, got {self.compression_ratios!r}")
        object.__setattr__(self, "compression_ratios", tuple(float(r) for r in ratios))

    def inner_budget(self) -> tuple[int | None, float | None]:
        return None, min(self.compression_ratios)

    @property
    def compresses(self) -> bool:
        return True

    def prompt_budget(self, prompt_len: int) -> int:
        """The example's whole length: each layer derives its own budget from it (`layer_budget`)."""
        return prompt_len

    def _check_layers(self, num_layers: int) -> None:
        if len(self.compression_ratios) != num_layers:
            raise ConfigError(f"{self.name}: compression_ratios has {len(self.compression_ratios)} entries but the "
                              f"model has {num_layers} layers")

    def layer_budget(self, cache: KVCache, step: Step) -> Array:
        self._check_layers(step.num_layers)
        ratio = jnp.asarray(self.compression_ratios, jnp.float32)[step.layer]
        return kept_of(step.budget, ratio)

    def max_layer_budget(self, prompt_len: int) -> int:
        return max(kept_of(prompt_len, r) for r in self.compression_ratios)

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...]:
        self._check_layers(num_layers)
        return tuple(kept_of(prompt_len, r) + max_new_tokens for r in self.compression_ratios)
