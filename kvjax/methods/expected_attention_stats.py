"""`expected_attention_stats`: Expected Attention with query statistics measured offline (kvpress's
`ExpectedAttentionStatsPress`).

`expected_attention` models the future queries as a Gaussian fitted to the prompt's own pre-RoPE queries. Here
the Gaussian is fitted once per model, on calibration text, and read from a file: per layer and query head the
mean `mu` and covariance `Sigma` of the pre-RoPE queries (the first `n_sink` positions of each text left out;
covariance divided by the count minus one). The scoring is the same: `R` the RoPE rotation averaged over the next
`n_future_positions` positions after the tokens seen, `softmax_i(R mu . k_i / sqrt(d) + k_i^T R Sigma R^T k_i /
(2 d))` averaged over the GQA group, times `||v_i||` (`use_vnorm`), the first `n_sink` keys kept. The prompt's queries
play no part, so the score of a pair depends only on its key and value (and the tokens seen): chunked prefill
needs no running state, and `chunk` / `block` may use it as their base.

Statistics are never downloaded: `stats=` names a local directory in the layout kvpress's `ExpectedAttentionStats`
saves (`save_pretrained`; kvpress reads `alessiodevoto/exp_att_stats_<model>_<dataset>_<samples>_<length>_<n_sink>`
from the hub): `model.safetensors` with `query_mean` `[L, N, H]` and `query_cov` `[L, N, H, H]` (read raw, never
unpickled) and `config.json` (`num_layers`, `num_heads`, `head_dim`, and how they were measured). `L` must be the
layers the method acts on (on a model with sliding-window layers, its global layers; `kvjax.calibrate
--method=expected_attention_stats` writes such a file for a model kvjax runs), `N` the query heads, `H` the head size:
`check_model` names the file and the model otherwise. The statistics travel as the cache's cross-layer state
(`state["shared"]`, indexed by `step.layer`), so every layer shares one compiled program.

Defaults are kvpress 0.5.5's (`n_future_positions=512`, `n_sink=4`, `use_covariance=True`, `use_vnorm=True`,
`epsilon=0`). The averaged rotation carries the factor RoPE's cos and sin carry (`step.rope_scaling`: yarn's and
LongRoPE's attention factor, as HF's rotary embedding gives kvpress), which the prompt's own queries carry in
`expected_attention`. Departure (no flag): the statistics and the rotation are float32 (kvpress casts the file's
statistics to the model's dtype).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Step
from kvjax.methods.common import future_rotation, read_safetensors
from kvjax.methods.expected_attention import ExpectedAttention
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod

Array = jax.Array

#: Key of the statistics in the cross-layer state; the file names of the saved layout.
STATS = "expected_attention_stats"
STATS_FILE, CONFIG_FILE = "model.safetensors", "config.json"


@dataclasses.dataclass(frozen=True)
class QueryStatistics:
    """A statistics file: `mean` `[L, N, H]`, `cov` `[L, N, H, H]` float32, and its `config.json`."""

    path: str
    mean: np.ndarray
    cov: np.ndarray
    config: dict

    @property
    def shape(self) -> tuple[int, int, int]:
        """`(layers, query heads, head size)`."""
        return self.mean.shape  # type: ignore[return-value]


@functools.lru_cache(maxsize=4)
def load_statistics(path: str) -> QueryStatistics:
    """The statistics at `path` (their directory, or its `model.safetensors`), checked: the two tensors, of
    matching shapes, finite, and a `config.json` beside them that agrees."""
    where = pathlib.Path(path).expanduser()
    folder = where.parent if where.is_file() else where
    file = where if where.is_file() else where / STATS_FILE
    if not folder.is_dir() or not file.is_file():
        raise ConfigError(f"{STATS}: no query statistics at {path!r}: expected a directory with {CONFIG_FILE} and "
                          f"{STATS_FILE} (kvpress's ExpectedAttentionStats layout; make one with python -m "
                          "kvjax.calibrate --method=expected_attention_stats)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{STATS}: cannot read {str(folder / CONFIG_FILE)!r}: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{STATS}: {str(folder / CONFIG_FILE)!r} is not a JSON object")
    tensors = read_safetensors(file, STATS)
    if sorted(tensors) != ["query_cov", "query_mean"]:
        raise ConfigError(f"{STATS}: {str(file)!r} holds {sorted(tensors)}; expected exactly query_mean and "
                          "query_cov")
    mean, cov = tensors["query_mean"], tensors["query_cov"]
    if mean.ndim != 3 or cov.shape != (*mean.shape, mean.shape[-1]):
        raise ConfigError(f"{STATS}: {str(file)!r} has query_mean {mean.shape} and query_cov {cov.shape}; expected "
                          "[L, N, H] and [L, N, H, H]")
    for name, dim in zip(("num_layers", "num_heads", "head_dim"), mean.shape, strict=True):
        if name in config and config[name] != dim:
            raise ConfigError(f"{STATS}: {str(folder / CONFIG_FILE)!r} says {name}={config[name]!r}, but the "
                              f"tensors have {dim}")
    if not (np.isfinite(mean).all() and np.isfinite(cov).all()):
        raise ConfigError(f"{STATS}: {str(file)!r} holds a NaN or an infinity")
    return QueryStatistics(str(folder), mean, cov, config)


def write_statistics(folder: pathlib.Path, mean: np.ndarray, cov: np.ndarray, *, model_name: str = "",
                     dataset_name: str = "", num_samples: int = 0, sample_seq_len: int = 0, n_sink: int = 4,
                     **extra: Any) -> pathlib.Path:
    """Saves `mean` `[L, N, H]` and `cov` `[L, N, H, H]` in kvpress's `ExpectedAttentionStats` layout (every field its
    `from_pretrained` needs: how the statistics were measured, and `extra`, in `config.json`); returns the
    directory."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    layers, heads, size = mean.shape
    save_file({"query_mean": np.ascontiguousarray(mean, np.float32),
               "query_cov": np.ascontiguousarray(cov, np.float32)}, str(folder / STATS_FILE))
    config = {"num_layers": layers, "num_heads": heads, "head_dim": size, "dataset_name": dataset_name,
              "model_name": model_name, "num_samples": num_samples, "sample_seq_len": sample_seq_len,
              "n_sink": n_sink, **extra}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return folder


@register
@dataclasses.dataclass(frozen=True)
class ExpectedAttentionStats(ExpectedAttention):
    """Expected Attention with the query mean and covariance of a local statistics file (`stats`, required)
    instead of the prompt's; `expected_attention`'s other hyperparameters and defaults."""

    name = "expected_attention_stats"

    stats: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.stats, str) or not self.stats:
            raise ConfigError(f"{self.name}: stats= must name a local directory of query statistics "
                              f"({STATS_FILE} and {CONFIG_FILE}); nothing is downloaded")
        load_statistics(self.stats)

    @property
    def statistics(self) -> QueryStatistics:
        return load_statistics(self.stats)

    def check_model(self, config: Any) -> None:
        layers, heads, size = self.statistics.shape
        want = (config.method_layers, config.num_heads, config.head_dim)
        if (layers, heads, size) != want:
            which = f"{config.method_layers} layers" if config.method_layers == config.num_layers else (
                f"{config.method_layers} global layers of {config.num_layers}")
            raise ConfigError(f"{self.name}: {self.statistics.path!r} holds statistics of {layers} layers x {heads} "
                              f"query heads x head size {size}; the {config.model_type} model has {which} x "
                              f"{config.num_heads} query heads x head size {config.head_dim}: use statistics "
                              "measured on this model (python -m kvjax.calibrate --method=expected_attention_stats)")

    def check_cache_spec(self, spec: CacheSpec) -> None:
        layers, heads, size = self.statistics.shape
        if (layers, heads, size) != (spec.num_layers, spec.num_heads, spec.head_dim):
            raise ConfigError(f"{self.name}: {self.statistics.path!r} holds statistics of {layers} layers x {heads} "
                              f"query heads x head size {size}; the cache has {spec.num_layers} layers x "
                              f"{spec.num_heads} query heads x head size {spec.head_dim}")

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Any]:
        s = self.statistics
        leaves = {"mean": s.mean} if not self.use_covariance else {"mean": s.mean, "cov": s.cov}
        return {"shared": {STATS: leaves}}

    #: The statistics are the file's: nothing to observe (and so a self-contained base for `chunk` / `block`).
    before_scoring = ScoringMethod.before_scoring

    def future_statistics(self, cache: KVCache, step: Step) -> tuple[Array, Array | None]:
        stats = cache.state[kvc.SHARED_STATE][STATS]
        rotation = future_rotation(cache, step, self.n_future_positions) * jnp.float32(step.rope_scaling)
        mean = jnp.einsum("bij,nj->bni", rotation, stats["mean"][step.layer])
        if not self.use_covariance:
            return mean, None
        return mean, jnp.einsum("bij,njk,blk->bnil", rotation, stats["cov"][step.layer], rotation)


__all__ = ["ExpectedAttentionStats", "QueryStatistics", "load_statistics", "write_statistics"]
