"""`lukv`: LU-KV, "Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV Cache Eviction"
(Tang et al., 2026, arXiv 2602.08585; kvpress's `LUKVPress`), as a wrapper around any scoring method (`base`,
default Expected Attention with `epsilon = 2e-2`).

A score is not an equally good proxy of future use in every head: some heads rank tokens by their instantaneous
contribution, others by their long-horizon utility. LU-KV sets how many tokens each layer and KV head keeps by the
marginal utility of keeping them, solved offline (a convex-hull relaxation and a greedy solver over profiled
contexts, per model and scorer) and published as a *budget curve*: an array `P` `[99, layers, kv_heads]` of per-head
prune ratios, row `t` for a global compression ratio of `(t + 1) / 100`. Online, with `n` prompt tokens and the
global ratio `r` (kvpress's arithmetic, float32):

1. Row `t = clamp(round(100 r) - 1, 0, 98)`; per layer `l` and head `h`, the keep rate `a_h = clamp(1 - P[t, l, h],
   0, 1)` and the ideal count `x_h = a_h n`.
2. The layer keeps `T = clamp(round(sum_h x_h), K, K n)` tokens in all (`K` KV heads): each head first gets
   `floor(x_h)`, and the `T - sum_h floor(x_h)` left go one each to the heads with the largest fractional parts
   `x_h - floor(x_h)` (ties: the lower head); each count is then clamped to `[1, n]`.
3. The first `sink` (4) and the last `window` (1) positions score above every other slot, ties to the lower
   position, and count in the head's keep; the base's own protected slots (Expected Attention's `n_sink`) rank next
   (kvpress's scorers give them their maximum score). Each head keeps its `k_h` best slots, ties to the lower
   position (kvpress's stable descending sort).

`compression_ratio = 0` keeps everything (kvpress's switch). kvjax takes the global ratio only (`compression_ratio`,
the curve's index), not a token `budget`.

The curve is a model- and scorer-specific artifact: kvjax reads it from a local NumPy `.npy` file (`curve=`;
`np.load(..., allow_pickle=False)`, never a pickle), checks it is a finite float array of shape
`[99, layers, kv_heads]` with prune ratios in `[0, 1]` (kvpress clamps the keep rates instead), and checks its layers
and KV heads against the model's cache. The official curves (github.com/baidu-baige/LU-KV,
`evaluation/curve_data/`) are plain `.npy` files of that shape.

Memory: kvpress masks the pruned keys inside a full-length cache (no memory saved). kvjax stores what each head
keeps (per-head `length`) and allocates each layer at its own size (`layer_capacities`): the largest head count the
curve allows at the prompt length, `max_h min(N, floor(a_h N) + 1)`, plus `max_new_tokens`. Heads of a layer share
its buffers, so a head keeping less than its layer's largest head leaves slots unused (attention reads only its
`length`); the cache costs `sum_l max_h k_{l,h}` per example and KV head instead of `L n`. The runtime groups the
layers into a few sizes (at most `Tuning.layer_slack`, 5 %, more slots at a long prompt), one prefill program each.

Chunked prefill: every chunk keeps at most each head's final count `k_h(n)` (as `compression_ratio` does for the
plain scorers), so the last chunk's selection is the one-shot one with the base's statistics of the whole prompt.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Step
from kvjax.methods.registry import register
from kvjax.methods.scorer import score_layer
from kvjax.methods.wrapper import Wrapper
from kvjax.ops.gather import keep_top
from kvjax.ops.select import protect_regions
from kvjax.validation import check_int

Array = jax.Array

#: Rows of a budget curve: global compression ratios 1 % .. 99 %.
CURVE_ROWS = 99
#: The base LU-KV's published curves were computed for (kvpress's default press) and its arguments.
DEFAULT_BASE = "expected_attention"
DEFAULT_BASE_ARGS = (("epsilon", 2e-2),)


def load_budget_curve(path: str | pathlib.Path) -> np.ndarray:
    """Reads a budget curve `.npy` (`[99, layers, kv_heads]` prune ratios in [0, 1]) as float32; ConfigError naming
    the file for anything missing, pickled or malformed."""
    file = pathlib.Path(path).expanduser()
    want = f"[{CURVE_ROWS}, layers, kv_heads]"
    if not file.is_file():
        raise ConfigError(f"lukv: no budget curve at {str(file)!r}; curve= must name a .npy file of prune ratios "
                          f"{want}")
    try:
        curve = np.load(file, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ConfigError(f"lukv: cannot read {str(file)!r} as a .npy array (pickled, corrupt or not .npy?): "
                          f"{e}") from e
    if not isinstance(curve, np.ndarray) or curve.dtype.kind != "f":
        kind = getattr(curve, "dtype", type(curve).__name__)
        raise ConfigError(f"lukv: {str(file)!r} must hold float prune ratios {want}, got {kind}")
    if curve.ndim != 3 or curve.shape[0] != CURVE_ROWS or 0 in curve.shape:
        raise ConfigError(f"lukv: {str(file)!r} must have shape {want}, got {list(curve.shape)}")
    if not np.isfinite(curve).all():
        raise ConfigError(f"lukv: {str(file)!r} must hold finite prune ratios in [0, 1], got NaN or inf")
    if curve.min() < 0.0 or curve.max() > 1.0:
        raise ConfigError(f"lukv: {str(file)!r} must hold finite prune ratios in [0, 1], got values from "
                          f"{float(curve.min())} to {float(curve.max())}")
    return curve.astype(np.float32)


def write_budget_curve(path: str | pathlib.Path, curve: np.ndarray) -> pathlib.Path:
    """Writes `curve` `[99, layers, kv_heads]` as a `.npy` file (for tests and benchmarks)."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, np.ascontiguousarray(curve), allow_pickle=False)
    return out


def seeded_curve(layers: int, kv_heads: int, seed: int = 0) -> np.ndarray:
    """A made-up budget curve `[99, layers, kv_heads]` of prune ratios (float64), for tests and benchmarks: row `t`
    keeps `(1 - (t + 1) / 100) * w` of a head, `w` a seeded permutation of evenly spaced weights in [0.3, 1.7] of mean
    about 1 (clipped to keep at most everything), so heads and layers keep different shares."""
    w = np.random.default_rng(seed).permutation(layers * kv_heads).reshape(layers, kv_heads)
    w = 0.3 + 1.4 * (w + 0.5) / (layers * kv_heads)
    keep = (1.0 - (np.arange(CURVE_ROWS) + 1.0) / 100.0)[:, None, None] * w[None]
    return 1.0 - np.clip(keep, 0.0, 1.0)


def curve_row(compression_ratio: float) -> int:
    """The curve's row for a global ratio: `clamp(round(100 r) - 1, 0, 98)` (Python's round, as kvpress)."""
    return max(0, min(CURVE_ROWS - 1, int(round(compression_ratio * 100)) - 1))


def head_keep_counts(prune: Array, n: Array) -> Array:
    """`[B, K]` int32 tokens each KV head keeps, for one layer's prune ratios `[K]` and prompt lengths `[B]`: the
    layer's rounded total shared by largest remainders (ties: the lower head), each clamped to `[1, n]`."""
    heads = prune.shape[-1]
    rate = jnp.clip(jnp.float32(1.0) - prune.astype(jnp.float32), 0.0, 1.0)
    n = n.astype(jnp.int32)[:, None]
    ideal = rate[None, :] * n.astype(jnp.float32)  # [B, K]
    total = jnp.round(jnp.sum(ideal, axis=-1, keepdims=True)).astype(jnp.int32)
    total = jnp.clip(total, heads, heads * n)
    floor = jnp.floor(ideal).astype(jnp.int32)
    left = total - jnp.sum(floor, axis=-1, keepdims=True)
    frac = ideal - floor.astype(jnp.float32)
    # each head's rank by fractional part, descending, ties to the lower head
    idx = jnp.arange(heads)
    ahead = (frac[:, None, :] > frac[:, :, None]) | ((frac[:, None, :] == frac[:, :, None])
                                                     & (idx[None, :] < idx[:, None])[None])
    rank = jnp.sum(ahead, axis=-1)
    counts = floor + (rank < left).astype(jnp.int32)
    return jnp.clip(counts, 1, n)


@register
@dataclasses.dataclass(frozen=True)
class LUKV(Wrapper):
    """Per-layer, per-KV-head keep counts from a published budget curve (`curve`: a `.npy` `[99, layers, kv_heads]`
    of prune ratios) at `compression_ratio`, over a scoring method (`base`, default "expected_attention" with
    `base_args` {"epsilon": 0.02}); the first `sink` (4) and last `window` (1) tokens rank first."""

    name = "lukv"

    base: str = DEFAULT_BASE
    curve: str | None = None
    sink: int = 4
    window: int = 1
    base_args: Any = None

    def check_own_hyperparameters(self) -> None:
        if self.budget is not None:
            raise ConfigError(f"{self.name}: the budget curve is indexed by the global compression ratio; give "
                              f"compression_ratio= instead of budget={self.budget!r}")
        if self.compression_ratio is None:
            raise ConfigError(f"{self.name}: needs compression_ratio= (the budget curve's row)")
        check_int(self.name, "sink", self.sink, 0)
        check_int(self.name, "window", self.window, 0)
        if not isinstance(self.curve, str | pathlib.Path) or not str(self.curve):
            raise ConfigError(f"{self.name}: needs curve= (a .npy budget curve of prune ratios "
                              f"[{CURVE_ROWS}, layers, kv_heads])")
        object.__setattr__(self, "_curve", load_budget_curve(self.curve))
        if self.base_args is None:  # the base's published-curve arguments for the default base, none for another
            object.__setattr__(self, "base_args", DEFAULT_BASE_ARGS if self.base == DEFAULT_BASE else ())

    def inner_budget(self) -> tuple[int | None, float | None]:
        return None, self.compression_ratio

    @property
    def budget_curve(self) -> np.ndarray:
        """`[99, layers, kv_heads]` float32 prune ratios."""
        return self._curve  # type: ignore[attr-defined]

    @property
    def prune_ratios(self) -> np.ndarray:
        """`[layers, kv_heads]` float32: the curve's row for `compression_ratio`."""
        return self.budget_curve[curve_row(self.compression_ratio)]

    def _mismatch(self, layers: int, heads: int) -> ConfigError:
        _, have_layers, have_heads = self.budget_curve.shape
        return ConfigError(f"{self.name}: the budget curve {str(self.curve)!r} has shape "
                           f"[{CURVE_ROWS}, {have_layers}, {have_heads}] but the model needs [{CURVE_ROWS}, {layers}, "
                           f"{heads}] ({layers} layers x {heads} KV heads)")

    def check_cache_spec(self, spec: CacheSpec) -> None:
        super().check_cache_spec(spec)
        if self.budget_curve.shape[1:] != (spec.num_layers, spec.kv_heads):
            raise self._mismatch(spec.num_layers, spec.kv_heads)

    # ---- budgets ------------------------------------------------------------------------------------
    def prompt_budget(self, prompt_len: int) -> int:
        """The example's whole length: each layer and head derives its own count from it (`head_keep_counts`)."""
        return prompt_len

    def layer_keep_bounds(self, prompt_len: int) -> tuple[int, ...]:
        """Per layer, the most prompt tokens a head keeps for any prompt of at most `prompt_len` tokens:
        `max_h min(N, floor(a_h N) + 1)` (float32, monotone in `n`); the whole prompt at ratio 0."""
        if self.compression_ratio <= 0.0:
            return (prompt_len,) * self.budget_curve.shape[1]
        rate = np.clip(np.float32(1.0) - self.prune_ratios, np.float32(0.0), np.float32(1.0))
        floor = np.floor(rate * np.float32(prompt_len)).astype(np.int64)
        return tuple(int(v) for v in np.minimum(prompt_len, floor + 1).max(axis=-1))

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...]:
        if self.budget_curve.shape[1] != num_layers:
            raise self._mismatch(num_layers, self.budget_curve.shape[2])
        return tuple(b + max_new_tokens for b in self.layer_keep_bounds(prompt_len))

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return max(self.layer_keep_bounds(prompt_len)) + max_new_tokens

    # ---- selection ------------------------------------------------------------------------------------
    def head_counts(self, step: Step) -> Array:
        """`[B, K]` int32 prompt tokens each head of this layer keeps (`step.budget` is each prompt's length)."""
        prune = jnp.asarray(self.prune_ratios)[step.layer]
        return head_keep_counts(prune, step.budget)

    def ranking(self, cache: KVCache, scores: Array, protect: Array | None) -> Array:
        """`[B, K, C]` float32: the base's scores, its protected slots above them and the sinks and window above
        all (ties among those go to the lower position in the selection)."""
        ours = protect_regions(cache, sink=self.sink, recent=self.window, last=False)
        ranked = scores.astype(jnp.float32)
        if protect is not None:
            ranked = jnp.where(protect, jnp.finfo(jnp.float32).max, ranked)
        return jnp.where(ours, jnp.inf, ranked)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        if self.compression_ratio <= 0.0:  # kvpress's switch: nothing pruned
            return kvc.truncate(cache, step.capacity)
        scored = score_layer(self.inner, cache, q, step)
        return keep_top(scored.cache, self.ranking(scored.cache, scored.scores, scored.protect),
                        self.head_counts(step), capacity=step.capacity)


__all__ = ["LUKV", "curve_row", "head_keep_counts", "load_budget_curve", "seeded_curve", "write_budget_curve"]
