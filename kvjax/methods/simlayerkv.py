"""`simlayerkv`: SimLayerKV, "A Simple Framework for Layer-Level KV Cache Reduction" (Zhang et al., 2024,
arXiv 2410.13846; kvpress's `SimLayerKVPress`).

Some layers of a long-context model are *lazy*: they attend almost only to the first tokens (attention sinks) and
the most recent ones, whatever the input, so the rest of their cache does little. SimLayerKV finds them per input
and trims only those: a lazy layer keeps its first `n_initial` and its last tokens, every other layer keeps the
whole prompt. It is a whole-layer decision, not a token ranking: there is no budget.

Per layer, after the prompt has been prefilled (kvpress's prefill form of the paper's decode-time rule), with `n`
prompt tokens at positions `0 .. n - 1`:

1. The last `n_last` prompt tokens (kvpress: 1, standing in for the first generated token of the official
   SimLayerKV-decode) attend the prompt, causal softmax over every key (float32): `a_i = softmax(q_i K^T / sqrt(d))`.
2. Their attention is averaged over every query head and those rows, and summed over the initial and the recent
   positions, the window's own keys left out of the sum (not out of the softmax):
   `s = mean_{heads, i} [ sum_{j < n_initial} a_i[j] + sum_{n - n_last - n_recent <= j < n - n_last} a_i[j] ]`.
3. The layer is lazy when `s > lazy_threshold`. A lazy layer keeps positions `j < n_initial` and the last
   `n_recent - n_last` positions, `j >= n - n_recent + n_last`, so that once the first generated token is
   appended it holds `n_initial + n_recent` tokens (kvpress's slice, which matches the official code's
   `4 + 1024` after the first decode step). A prompt of `n <= n_initial + n_recent + n_last` tokens is never
   trimmed, and `lazy_threshold = 1` turns the method off (the sum of probabilities cannot exceed 1).

Defaults are kvpress's: `lazy_threshold = 1.0` (no layer is ever lazy: pick one per model family; kvpress
recommends 0.9 for Llama 3, 0.65 for Llama 2, 0.8 for Mistral, 0.85 for Qwen), `n_last = 1`, `n_recent = 1024`,
`n_initial = 4` (the official code's 4 sinks and 1024 recent tokens). The official code (SimLayerKV-decode) decides
at the first decode step from the new token's own attention (its key counted among the recent ones), once, and then
trims; kvpress, and kvjax with it, decide at the end of the prefill from the last prompt token, so the first
generated token already sees the trimmed layer.

Where kvjax differs from kvpress:

* Per example: kvpress averages the attention over the batch too, so a whole batch shares one decision per layer;
  kvjax decides per example (and per example tests the minimum length), so a batch equals a loop over its
  examples and a prompt's cache never depends on its neighbours.
* Memory: which layers are lazy depends on the input, and kvjax's caches have static shapes, so every layer is
  allocated for the whole prompt plus the new tokens, as `full` is. A lazy layer's kept tokens are compacted to the
  front of its slots with the shorter per-head `length`, so decode attention reads `n_initial + n_recent` tokens
  there, not `n`; the allocation itself is not smaller (kvpress's `DynamicCache` does free the tensors). Nothing is
  evicted during decoding (as in kvpress and the official code, a lazy layer grows by one token per step); a
  lazy layer could hold a ring of `n_initial + n_recent` like DuoAttention's streaming heads, but that would still
  not shrink the static allocation, so kvjax does not offer it.
* Chunked prefill: the decision is taken in the chunk holding the example's last prompt token, from that chunk's
  last `n_last` rows (fewer if the prompt ends within the first `n_last - 1` rows of a chunk; with the default
  `n_last = 1` it is exact); earlier chunks keep everything.
* `n_recent` must exceed `n_last`: kvpress slices `keys[..., -(n_recent - n_last):]`, which for `n_recent <= n_last`
  silently keeps (almost) the whole prompt.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Method, Step
from kvjax.methods.registry import register
from kvjax.ops.scoring import window_scores
from kvjax.validation import check_int, check_ratio

Array = jax.Array


def prompt_ends_here(step: Step) -> tuple[Array, Array]:
    """`([B] bool, [B] int32)`: whether each example's prompt ends in this prefill chunk, and its length `n` (the
    chunk's largest position + 1). The step's budget of a method without one is the prompt's length
    (`Method.prompt_budget`), which finds a prompt that ends on a chunk's last row."""
    pos = step.positions
    rows = jnp.any(pos >= 0, axis=1)
    n = jnp.max(pos, axis=1) + 1
    ends = jnp.bool_(step.final_chunk) | (pos[:, -1] < 0) | jnp.any(pos == (step.budget - 1)[:, None], axis=1)
    return rows & ends, n.astype(jnp.int32)


@register
@dataclasses.dataclass(frozen=True)
class SimLayerKV(Method):
    """Lazy layers (the last `n_last` prompt tokens put more than `lazy_threshold` of their attention on the first
    `n_initial` and the last `n_recent` tokens) keep only those; other layers keep everything. kvpress's defaults:
    `lazy_threshold` 1.0 (off), `n_last` 1, `n_recent` 1024, `n_initial` 4."""

    name = "simlayerkv"

    lazy_threshold: float = 1.0
    n_last: int = 1
    n_recent: int = 1024
    n_initial: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget is not None or self.compression_ratio is not None:
            raise ConfigError(f"{self.name}: trims whole layers by a threshold, not to a token budget; give "
                              f"lazy_threshold= instead of budget={self.budget!r} / "
                              f"compression_ratio={self.compression_ratio!r}")
        check_ratio(self.name, "lazy_threshold", self.lazy_threshold)
        check_int(self.name, "n_last", self.n_last, 1)
        check_int(self.name, "n_initial", self.n_initial, 0)
        check_int(self.name, "n_recent", self.n_recent, 1)
        if self.n_recent <= self.n_last:
            raise ConfigError(f"{self.name}: n_recent={self.n_recent} must exceed n_last={self.n_last} (a lazy layer "
                              "keeps the last n_recent - n_last prompt tokens)")

    @property
    def min_length(self) -> int:
        """Prompts of at most this many tokens are never trimmed (kvpress's `n_initial + n_recent + n_last`)."""
        return self.n_initial + self.n_recent + self.n_last

    def laziness(self, cache: KVCache, q: Array, step: Step, n: Array) -> Array:
        """`[B]` float32: the attention of each example's last `n_last` rows, averaged over query heads and rows, on
        the first `n_initial` and the `n_recent` positions before the window."""
        stored = kvc.stored_mask(cache)
        probs = window_scores(q, step.positions, kvc.keys(cache), cache.pos, stored, window=self.n_last,
                              row_reduce="mean", group_reduce="mean")  # [B, K, C]: each GQA group's mean
        end = (n - self.n_last)[:, None, None]
        region = stored & ((cache.pos < self.n_initial) | ((cache.pos >= end - self.n_recent) & (cache.pos < end)))
        return jnp.mean(jnp.sum(jnp.where(region, probs, 0.0), axis=-1), axis=-1)

    def lazy(self, cache: KVCache, q: Array, step: Step) -> Array:
        """`[B]` bool: the examples for which this layer is lazy (decided in the chunk where the prompt ends)."""
        ends, n = prompt_ends_here(step)
        long_enough = n > self.min_length
        return ends & long_enough & (self.laziness(cache, q, step, n) > self.lazy_threshold)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        if self.lazy_threshold >= 1.0:  # kvpress's switch: never lazy
            return kvc.truncate(cache, step.capacity)
        _, n = prompt_ends_here(step)
        lazy = self.lazy(cache, q, step)[:, None, None]
        window = (cache.pos < self.n_initial) | (cache.pos >= (n - self.n_recent + self.n_last)[:, None, None])
        return kvc.keep_where(cache, ~lazy | window, step.capacity)


__all__ = ["SimLayerKV", "prompt_ends_here"]
