"""How many slots fit in a device's memory: the arithmetic of `benchmarks/throughput.py`'s `largest_batch`."""

from __future__ import annotations

from typing import Any

import jax

from kvjax.errors import ConfigError

#: Slots when the device reports no memory limit (CPU) and none was given.
DEFAULT_SLOTS = 8
#: Bytes kept free beside the weights and the slots (XLA's workspace, fragmentation), as throughput.py keeps.
HEADROOM = 1 << 30


def check_fraction(value: Any, name: str = "memory_fraction") -> None:
    """A share of the device's memory the slots may plan for: a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"{name} must be in (0, 1], got {value!r}")


def device_bytes() -> int | None:
    """The first device's memory limit in bytes (None where the backend reports none, as on CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def per_slot_bytes(config: Any, slot_cache_bytes: int) -> int:
    """A slot's cache plus its share of the decode step: float32 logits (sampled twice over) and one token's layer
    activations."""
    return slot_cache_bytes + 3 * config.vocab_size * 4 + 8 * (config.hidden_size + config.intermediate_size) * 4


def prefill_bytes(config: Any, bucket: int, batch: int, slot_cache_bytes: int, held: bool = False,
                  prompt_pass_bytes: int | None = None) -> int:
    """What one prefill holds beside the slots: its prompt pass's cache (`prompt_pass_bytes`, default a slot's; a
    context replay's holds the whole bucket) and a slot's more (the chunk it appends, or the cache a replay compacts
    into), a bucket of activations (hidden states, MLP, float32 attention rows of one head at a time) and, `held`,
    the shared prompt pass the engine keeps (`share_prompts`: one more cache)."""
    activations = bucket * (3 * config.hidden_size + 2 * config.intermediate_size) * 4 + bucket * bucket * 4
    prompt = slot_cache_bytes if prompt_pass_bytes is None else prompt_pass_bytes
    return batch * (prompt + (2 if held else 1) * slot_cache_bytes + activations)


def slots_for_memory(model: Any, slot_cache_bytes: int, *, bucket: int, prefill_batch: int, fraction: float = 0.9,
                     limit: int | None = None, held: bool = False, prompt_pass_bytes: int | None = None) -> int:
    """The most slots whose caches fit in `fraction` of the device's memory beside the weights, the headroom and
    one prefill of the longest bucket (`prompt_pass_bytes`: its prompt pass's cache, `prefill_bytes`; `held`: and the
    prompt pass held for sharing); `DEFAULT_SLOTS` where the device reports no limit."""
    limit = device_bytes() if limit is None else limit
    if limit is None:
        return DEFAULT_SLOTS
    config = model.config
    weights = sum(w.nbytes for w in jax.tree.leaves(model.weights()))
    free = fraction * limit - weights - HEADROOM - prefill_bytes(config, bucket, prefill_batch, slot_cache_bytes, held,
                                                                 prompt_pass_bytes)
    return int(max(1, free // per_slot_bytes(config, slot_cache_bytes)))
