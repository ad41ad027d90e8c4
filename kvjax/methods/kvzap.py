"""`kvzap`: "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning" (Jeblick and Jegou, 2026, arXiv 2601.07891;
kvpress's `KVzapPress`). A small network per layer reads the layer's hidden states and predicts, for
every token and KV head, the importance KVzip+ would give the pair (from the attention it receives when the model
repeats its context); the pairs with the lowest predicted scores are pruned. It works at prefill and at decode,
because a token's score depends on its own hidden state only. Its published use is under DMS's threshold (`dms` with
`base="kvzap"`), which keeps every pair scoring above a threshold; alone (this class) it keeps the top `budget`
predicted scores, as kvpress's `KVzapPress` does.

The surrogate of layer `l` maps the attention input `h` (the hidden state after the layer's input norm, what
kvpress's hook sees) to one score per KV head: `W2 gelu(W1 h + b1) + b2` (`model_type="mlp"`) or `W h + b`
(`"linear"`); GELU is the exact (erf) one. The scores are computed once, when a token enters the cache (prefill
chunk or decode step), in float32, and kept with the token in `cache.score`, so chunked prefill, DMS's decode
eviction and `decoding`'s periodic compression read them without the hidden states of earlier tokens.

Weights are never downloaded: `weights=` names a local copy of the published checkpoint (kvpress loads
`nvidia/KVzap-{mlp,linear}-<model>` from the hub), the directory `save_pretrained` writes:

* `config.json`: `{"model_type": "kvzap", "input_dim": D, "output_dim": K, "n_modules": L, "hidden_dim": M}`
  (`hidden_dim` null or absent: the linear surrogate);
* `model.safetensors`: `layers.{l}.weight` `[K, D]`, `layers.{l}.bias` `[K]` (linear) or `layers.{l}.0.weight`
  `[M, D]`, `layers.{l}.0.bias`, `layers.{l}.2.weight` `[K, M]`, `layers.{l}.2.bias` (MLP), for `l < L`.

The file is parsed here (header + raw little-endian data: F32, F16, BF16, F64), never unpickled. `D` must be the
model's hidden size, `K` its KV heads and `L` its layers: `check_model` raises one error naming the file and the
model before anything is traced. The weights travel as the cache's cross-layer state (`state["shared"]`, stacked
`[L, ...]`, indexed by `step.layer`), so they are program inputs, not constants, and every layer shares one
compiled program. On a model with sliding-window layers the surrogates are those of its global layers, in order
(`n_modules` = `ModelConfig.method_layers`, what `kvjax.calibrate --method=kvzap` writes for such a model): the
method acts on the global layers only.
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
from kvjax.methods.base import Step
from kvjax.methods.common import read_safetensors, write_entry_scores
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.validation import check_choice

Array = jax.Array

#: Keys of the surrogate's weights in the cross-layer state.
WEIGHTS = "kvzap"
WEIGHTS_FILE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class KVzapWeights:
    """The surrogates of every layer, stacked: `w1` `[L, D, M]`, `b1` `[L, M]`, `w2` `[L, M, K]`, `b2` `[L, K]`
    (MLP), or `w1` `[L, D, K]`, `b1` `[L, K]` and no second layer (linear); float32, `[in, out]` layout."""

    path: str
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray | None
    b2: np.ndarray | None

    @property
    def num_layers(self) -> int:
        return self.w1.shape[0]

    @property
    def input_dim(self) -> int:
        return self.w1.shape[1]

    @property
    def output_dim(self) -> int:
        return (self.w1 if self.w2 is None else self.w2).shape[-1]

    @property
    def model_type(self) -> str:
        return "linear" if self.w2 is None else "mlp"


def _config(folder: pathlib.Path) -> dict:
    file = folder / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"kvzap: cannot read {str(file)!r} (the KVzap checkpoint's config.json): {e}") from e
    for field in ("input_dim", "output_dim", "n_modules"):
        if not isinstance(config.get(field), int) or config[field] <= 0:
            raise ConfigError(f"kvzap: {str(file)!r} has no positive integer {field!r} (got {config.get(field)!r})")
    hidden = config.get("hidden_dim")
    if hidden is not None and (not isinstance(hidden, int) or hidden <= 0):
        raise ConfigError(f"kvzap: {str(file)!r} has hidden_dim={hidden!r}; expected a positive integer or null")
    if config.get("model_type", "kvzap") != "kvzap":
        raise ConfigError(f"kvzap: {str(file)!r} is a {config.get('model_type')!r} config, not a KVzap checkpoint")
    return config


@functools.lru_cache(maxsize=4)
def load_weights(path: str) -> KVzapWeights:
    """The KVzap checkpoint at `path` (its directory, or its `model.safetensors`): config and tensors checked
    against each other, every tensor used."""
    where = pathlib.Path(path).expanduser()
    folder = where.parent if where.is_file() else where
    file = where if where.is_file() else where / WEIGHTS_FILE
    if not folder.is_dir() or not file.is_file():
        raise ConfigError(f"kvzap: no KVzap checkpoint at {path!r}: expected a directory with config.json and "
                          f"{WEIGHTS_FILE} (a local copy of nvidia/KVzap-<mlp|linear>-<model>)")
    config = _config(folder)
    tensors = read_safetensors(file, "kvzap")
    d, k, n, m = config["input_dim"], config["output_dim"], config["n_modules"], config.get("hidden_dim")
    if m is None:
        shapes = {"weight": (k, d), "bias": (k,)}
    else:
        shapes = {"0.weight": (m, d), "0.bias": (m,), "2.weight": (k, m), "2.bias": (k,)}
    want = {f"layers.{i}.{name}": shape for i in range(n) for name, shape in shapes.items()}
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise ConfigError(f"kvzap: {str(file)!r} does not match its config.json ({n} {'linear' if m is None else 'mlp'}"
                          f" modules): missing {missing[:4]}, unexpected {extra[:4]}")
    for name, shape in want.items():
        if tensors[name].shape != shape:
            raise ConfigError(f"kvzap: tensor {name!r} of {str(file)!r} has shape {tensors[name].shape}, expected "
                              f"{shape} from config.json")

    def stack(name: str, transpose: bool) -> np.ndarray:
        arrays = [tensors[f"layers.{i}.{name}"] for i in range(n)]
        return np.stack([a.T if transpose else a for a in arrays])

    if m is None:
        return KVzapWeights(str(file), stack("weight", True), stack("bias", False), None, None)
    return KVzapWeights(str(file), stack("0.weight", True), stack("0.bias", False), stack("2.weight", True),
                        stack("2.bias", False))


def surrogate_scores(weights: dict[str, Array], layer: Array, hidden: Array, source: str = "the surrogates") -> Array:
    """`[B, T, K]` float32 predicted scores of `hidden` `[B, T, D]` through layer `layer`'s surrogate; ConfigError
    naming `source` (the checkpoint) for hidden states of another size (a model's own `hidden=`, which `check_model`
    never saw), where the einsum would fail with a shape error."""
    if hidden.shape[-1] != weights["w1"].shape[1]:
        raise ConfigError(f"kvzap: {source} read hidden states of size {weights['w1'].shape[1]}, but hidden= has size "
                          f"{hidden.shape[-1]} (shape {tuple(hidden.shape)}); use a KVzap checkpoint made for this "
                          "model (python -m kvjax.calibrate --method=kvzap)")
    h = hidden.astype(jnp.float32)
    out = jnp.einsum("btd,dm->btm", h, weights["w1"][layer]) + weights["b1"][layer]
    if "w2" in weights:
        out = jax.nn.gelu(out, approximate=False)
        out = jnp.einsum("btm,mk->btk", out, weights["w2"][layer]) + weights["b2"][layer]
    return out


@register
@dataclasses.dataclass(frozen=True)
class KVzap(ScoringMethod):
    """A per-layer surrogate (`weights`: local checkpoint path, `model_type` "mlp" or "linear", checked against
    the file) predicts each pair's score from the hidden states; keep the top `budget`."""

    name = "kvzap"
    uses_score = True
    layer_inputs = frozenset({"hidden"})

    weights: str = ""
    model_type: str = "mlp"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.name, "model_type", self.model_type, ("mlp", "linear"))
        if not isinstance(self.weights, str) or not self.weights:
            raise ConfigError(f"{self.name}: weights= must name a local KVzap checkpoint (a directory with "
                              "config.json and model.safetensors); nothing is downloaded")
        loaded = load_weights(self.weights)
        if loaded.model_type != self.model_type:
            raise ConfigError(f"{self.name}: {loaded.path!r} holds a {loaded.model_type} surrogate, but "
                              f"model_type={self.model_type!r}")

    @property
    def surrogate(self) -> KVzapWeights:
        return load_weights(self.weights)

    def check_model(self, config: Any) -> None:
        check_surrogate(self.surrogate, config)

    def init_cache_state(self, spec: Any) -> dict[str, Any]:
        w = self.surrogate
        if w.num_layers != spec.num_layers or w.output_dim != spec.kv_heads:
            raise ConfigError(f"kvzap: {w.path!r} has {w.num_layers} layers x {w.output_dim} KV heads; the cache has "
                              f"{spec.num_layers} layers x {spec.kv_heads} KV heads")
        leaves = {"w1": w.w1, "b1": w.b1} if w.w2 is None else {"w1": w.w1, "b1": w.b1, "w2": w.w2, "b2": w.b2}
        return {"shared": {WEIGHTS: leaves}}

    def before_scoring(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Scores the tokens of this step (their hidden states) into `cache.score`. Alone, decode only appends (the
        scores of generated tokens are never read); `dms` and `decoding` call this at every decode step."""
        weights = cache.state[kvc.SHARED_STATE][WEIGHTS]
        new = surrogate_scores(weights, step.layer, step.hidden, repr(self.weights))
        return write_entry_scores(cache, new, step.positions)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        return jnp.where(kvc.stored_mask(cache), cache.score, 0.0)


def check_surrogate(w: KVzapWeights, config: Any) -> None:
    """One error naming the file and the model when the surrogate does not fit the model of `config`."""
    layers = f"{config.num_layers} layers"
    if config.method_layers != config.num_layers:  # sliding-window layers: the surrogates are the global layers'
        layers = f"{config.method_layers} global layers of {config.num_layers}"
    model = (f"the {config.model_type} model with {layers}, hidden size {config.hidden_size}, "
             f"{config.num_kv_heads} KV heads")
    wrong = [f"{what} {mine} (model: {theirs})" for what, mine, theirs in (
        ("n_modules", w.num_layers, config.method_layers), ("input_dim", w.input_dim, config.hidden_size),
        ("output_dim", w.output_dim, config.num_kv_heads)) if mine != theirs]
    if wrong:
        raise ConfigError(f"kvzap: {w.path!r} was not trained for {model}: {', '.join(wrong)}; use the KVzap "
                          "checkpoint published for this model, or calibrate one (python -m kvjax.calibrate "
                          "--method=kvzap)")


__all__ = ["KVzap", "KVzapWeights", "check_surrogate", "load_weights", "read_safetensors", "surrogate_scores",
           "write_entry_scores"]
