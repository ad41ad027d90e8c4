"""`duo_attention`: DuoAttention, "Efficient Long-Context LLM Inference with Retrieval and Streaming Heads"
(Xiao et al., 2024; kvpress's `DuoAttentionPress`).

Only some KV heads need the whole context (retrieval heads); the others attend the first tokens and a recent window
alone (streaming heads). The paper learns a gate per KV head offline and publishes it: a pattern directory holding
`full_attention_heads.tsv` (one row per layer, one tab-separated score per KV head) and `config.json` (the training
run's arguments, among them `sink_size`, `recent_size` and `model_name`). Scores are clipped to [0, 1] when read.

Which heads stream: `head_compression_ratio` (kvpress's rule) makes the `round(L * K * ratio)` lowest-scoring heads
streaming heads (ties: lower layer, then lower head); `threshold` (the official code's rule) makes every head
scoring below it a streaming head. `compression_ratio=` is taken as the head ratio, as kvpress's evaluation does for
this press, so a leaderboard sweep over `--compression_ratio` sweeps the head ratio. The paper's default for GQA
models is half the heads (0.5).

A streaming head keeps positions `< sink_size` and the last `recent_size` tokens after prefill and evicts its oldest
non-sink token at every decode step (constant memory, as in the paper; kvpress only compresses the prefill).
Retrieval heads keep everything. The cache stores what each head keeps (per-head lengths), never a mask; a layer
with no retrieval head is allocated at `sink_size + recent_size + 1` slots (`layer_capacities`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Method, Step, last_position
from kvjax.methods.capabilities import InPlaceEviction
from kvjax.methods.common import oldest_slot
from kvjax.methods.registry import register
from kvjax.validation import check_int, check_number, check_ratio

Array = jax.Array

HEADS_FILE = "full_attention_heads.tsv"
CONFIG_FILE = "config.json"
#: The paper's share of streaming heads for GQA models (half the heads keep the full cache).
DEFAULT_HEAD_RATIO = 0.5


@dataclasses.dataclass(frozen=True)
class AttentionPattern:
    """A DuoAttention pattern read from disk: `scores` `[layers, kv_heads]` float64 in [0, 1]."""

    directory: pathlib.Path
    scores: np.ndarray
    sink_size: int
    recent_size: int
    model_name: str | None


def load_attention_pattern(path: str | pathlib.Path) -> AttentionPattern:
    """Reads an official pattern directory (`full_attention_heads.tsv` + `config.json`); ConfigError naming the file
    for anything missing or malformed."""
    directory = pathlib.Path(path).expanduser()
    heads, config = directory / HEADS_FILE, directory / CONFIG_FILE
    for file in (heads, config):
        if not file.is_file():
            raise ConfigError(
                f"duo_attention: no {file.name} at {str(file)!r}; patterns= must name a DuoAttention pattern "
                f"directory holding {HEADS_FILE} and {CONFIG_FILE} (the official attn_patterns/<model>/<run> layout)"
            )
    try:
        scores = np.loadtxt(heads, dtype=np.float64, delimiter="\t", ndmin=2)
    except ValueError as e:
        raise ConfigError(f"duo_attention: {str(heads)!r} is not a tab-separated table of numbers: {e}") from e
    if scores.size == 0 or not np.isfinite(scores).all():
        raise ConfigError(f"duo_attention: {str(heads)!r} must hold finite scores, one row per layer")
    try:
        meta = json.loads(config.read_text())
    except (ValueError, OSError) as e:
        raise ConfigError(f"duo_attention: cannot read {str(config)!r} as JSON: {e}") from e
    sizes = {}
    for key in ("sink_size", "recent_size"):
        value = meta.get(key) if isinstance(meta, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"duo_attention: {str(config)!r} must give {key} as an integer >= 0, got {value!r}")
        sizes[key] = value
    name = meta.get("model_name")
    return AttentionPattern(directory, np.clip(scores, 0.0, 1.0), sizes["sink_size"], sizes["recent_size"],
                            name if isinstance(name, str) else None)


def write_attention_pattern(directory: str | pathlib.Path, scores: np.ndarray, *, sink_size: int, recent_size: int,
                            model_name: str | None = None) -> pathlib.Path:
    """Writes `scores` `[layers, kv_heads]` as an official pattern directory (for tests and benchmarks)."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    np.savetxt(out / HEADS_FILE, np.asarray(scores, np.float64).reshape(len(scores), -1), delimiter="\t")
    meta = {"model_name": model_name, "sink_size": int(sink_size), "recent_size": int(recent_size)}
    (out / CONFIG_FILE).write_text(json.dumps(meta))
    return out


def streaming_heads(scores: np.ndarray, head_ratio: float | None = None, threshold: float | None = None) -> np.ndarray:
    """`[layers, kv_heads]` bool: the streaming heads, by ratio (lowest scores) or by threshold (below it)."""
    if threshold is not None:
        return scores < threshold
    count = round(scores.size * float(head_ratio or 0.0))
    mask = np.zeros(scores.size, bool)
    mask[np.argsort(scores, axis=None, kind="stable")[:count]] = True
    return mask.reshape(scores.shape)


def model_basename(name: str) -> str:
    """`org/Model-Name` or `models/Model-Name` -> `model-name` (how pattern files and model names are compared)."""
    return name.rstrip("/").split("/")[-1].lower()


@register
@dataclasses.dataclass(frozen=True)
class DuoAttention(Method, InPlaceEviction):
    """Retrieval heads keep everything, streaming heads sinks + a recent window. `patterns`: the pattern directory
    (required); `head_compression_ratio` (or `compression_ratio`; default 0.5) or `threshold`; `sink_size` /
    `recent_size` (None: the pattern's); `model` (checked against the pattern's `model_name` when given)."""

    name = "duo_attention"

    patterns: str | None = None
    head_compression_ratio: float | None = None
    threshold: float | None = None
    sink_size: int | None = None
    recent_size: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget is not None:
            raise ConfigError(f"{self.name}: keeps whole heads, not a token budget; give head_compression_ratio= "
                              f"(or compression_ratio=) instead of budget={self.budget}")
        ways = ("head_compression_ratio", "compression_ratio", "threshold")
        chosen = [k for k in ways if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ConfigError(f"{self.name}: give one of head_compression_ratio, compression_ratio, threshold "
                              f"(got {', '.join(chosen)})")
        ratio = self.head_compression_ratio
        check_ratio(self.name, "head_compression_ratio", ratio, optional=True)
        check_number(self.name, "threshold", self.threshold, optional=True)
        for key in ("sink_size", "recent_size"):
            if getattr(self, key) is not None:
                check_int(self.name, key, getattr(self, key), 1 if key == "recent_size" else 0)
        if not isinstance(self.patterns, str | pathlib.Path) or not str(self.patterns):
            raise ConfigError(f"{self.name}: needs patterns= (a DuoAttention pattern directory holding {HEADS_FILE} "
                              f"and {CONFIG_FILE})")
        pattern = load_attention_pattern(self.patterns)
        if self.model is not None and pattern.model_name is not None \
                and model_basename(self.model) != model_basename(pattern.model_name):
            raise ConfigError(f"{self.name}: the pattern {str(pattern.directory / CONFIG_FILE)!r} was trained for "
                              f"{pattern.model_name!r}, not for the model {self.model!r}")
        if self.recent_size is None and pattern.recent_size < 1:
            raise ConfigError(f"{self.name}: {str(pattern.directory / CONFIG_FILE)!r} gives recent_size=0; "
                              "streaming heads need a recent window (pass recent_size=)")
        head_ratio = None if self.threshold is not None else (
            self.head_compression_ratio if self.head_compression_ratio is not None
            else self.compression_ratio if self.compression_ratio is not None else DEFAULT_HEAD_RATIO)
        object.__setattr__(self, "_pattern", pattern)
        object.__setattr__(self, "_streaming", streaming_heads(pattern.scores, head_ratio, self.threshold))

    # ---- what the pattern fixes ---------------------------------------------------------------------
    @property
    def pattern(self) -> AttentionPattern:
        return self._pattern  # type: ignore[attr-defined]

    @property
    def streaming(self) -> np.ndarray:
        """`[layers, kv_heads]` bool: the streaming heads."""
        return self._streaming  # type: ignore[attr-defined]

    @property
    def sinks(self) -> int:
        return self.pattern.sink_size if self.sink_size is None else self.sink_size

    @property
    def recent(self) -> int:
        return self.pattern.recent_size if self.recent_size is None else self.recent_size

    def _mismatch(self, what: str) -> ConfigError:
        layers, heads = self.pattern.scores.shape
        model = f"the model {self.model!r}" if self.model else "the model"
        return ConfigError(f"{self.name}: the pattern {str(self.pattern.directory / HEADS_FILE)!r} has {layers} layers "
                           f"x {heads} KV heads but {model} has {what}")

    def check_cache_spec(self, spec: CacheSpec) -> None:
        if self.pattern.scores.shape != (spec.num_layers, spec.kv_heads):
            raise self._mismatch(f"{spec.num_layers} layers x {spec.kv_heads} KV heads")

    # ---- budgets ------------------------------------------------------------------------------------
    def prompt_budget(self, prompt_len: int) -> int:
        return prompt_len  # retrieval heads keep the whole prompt; there is no token budget

    def _layer_capacity(self, layer: int, prompt_len: int, max_new_tokens: int) -> int:
        if not self.streaming[layer].all():
            return prompt_len + max_new_tokens
        # One slot for the token that arrives before the oldest one is evicted.
        return min(self.sinks + self.recent, prompt_len + max_new_tokens) + 1

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return max(self._layer_capacity(i, prompt_len, max_new_tokens) for i in range(len(self.streaming)))

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...] | None:
        if num_layers != len(self.streaming):
            raise self._mismatch(f"{num_layers} layers")
        return tuple(self._layer_capacity(i, prompt_len, max_new_tokens) for i in range(num_layers))

    # ---- hooks --------------------------------------------------------------------------------------
    def _streaming_here(self, step: Step) -> Array:
        return jnp.asarray(self.streaming)[step.layer]  # [K]

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        newest = last_position(cache)[..., None]
        window = (cache.pos < self.sinks) | (cache.pos > newest - self.recent)
        keep = window | ~self._streaming_here(step)[None, :, None]
        return kvc.keep_where(cache, keep, step.capacity)

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        oldest, over = self.decode_eviction(cache, step)
        return kvc.evict(cache, oldest, where=over)

    def decode_eviction(self, cache: KVCache, step: Step) -> tuple[Array, Array]:
        """The oldest non-sink token of each streaming head holding more than sinks + window."""
        over = self._streaming_here(step)[None] & (cache.length > self.sinks + self.recent)
        return oldest_slot(cache, kvc.stored_mask(cache) & (cache.pos >= self.sinks)), over


__all__ = ["AttentionPattern", "DuoAttention", "load_attention_pattern", "streaming_heads", "write_attention_pattern"]
