"""`fastkvzip`: Fast KVzip, "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV Eviction" (Kim, Han and
Yun, 2026, arXiv 2601.17668; kvpress 0.5.5's `FastKVzipPress`).

KVzip's scores (the attention a pair gets when the model repeats its context) are predicted instead of measured: a
small gate per layer, trained on KVzip's scores, reads the layer's attention input `h` (the hidden state after the
layer's input norm) of each token and gives each of its KV pairs an importance in (0, 1); no second pass runs. The
gate is a "sink attention" with `G` query groups of dimension `d` (16) per KV head `k`:

    q_g = RMSNorm_q(W_q h + c)_{k, g}    s = RMSNorm_k(W_k h)_k    (each over its d dims, eps 1e-6, learned weight)
    logit_g = s . q_g / sqrt(d) + b_{k, g}        base_{j, g} = z_{k, j} . q_g / sqrt(d)    (j < S learned sinks z)
    score = mean_g 1 / (1 + sum_j exp(base_{j, g} - logit_g))

(computed as `sigmoid(logit_g - logsumexp_j base_{j, g})`, the same value without overflow). The first `n_sink`
positions and a recent window keep score 1: the window is the prompt's last `max(1, int(n * window_ratio))` tokens
for a prompt of `n < 32000` tokens, else its last `window_size` (kvpress's rule, `int` of the float64 product as
kvpress takes it). Then, as KVzip (kvpress's default `layerwise=False`), the pairs of every layer and KV head of an
example compete in one ranking and the example keeps its best `budget * kv_heads * layers`; `layerwise=True` gives
every layer the same total (`budget * kv_heads`, still shared by its heads). With `compression_ratio` the count is
kvpress's (`ratio_count="pairs"`): of the example's `m = layers * kv_heads * n` pairs it prunes `int(m * ratio)`
(`layerwise`: `int(kv_heads * n * ratio)` per layer); `ratio_count="per_head"` keeps kvjax's per-example budget,
`floor(n * (1 - ratio))` per KV head and layer (as `kvzip`), up to `layers * kv_heads` pairs fewer. A head is capped at
`ceil(budget * max_head_share)` slots, the compressed cache's static per-head capacity, so the cache is allocated at
that size (kvpress masks pairs of a full-length cache and is uncapped: a large `max_head_share` matches it). Equal
scores go to the lower layer, head and position (kvpress: `torch.topk`'s order); they happen in the first layer, whose
gate sees each token's embedding alone. Not built: the paper's chunked prefill that evicts after every chunk and its
decode-time gating every 128 tokens (kvpress, whose press this is, scores the prefill once).

Runtime: the method has the `ContextReplay` capability with no replay rows. The prompt is prefilled uncompressed
(chunked or not) through its `prompt_scorer`, `GateScores`, which keeps every token and writes each new token's gate
scores into `cache.score` (a token's score depends on its own hidden state alone, so chunking changes nothing);
`replay_compress` then sets the sinks' and the window's scores to 1 and compacts every layer at once. Through the
plain per-layer step API (no cross-layer stage) `prefill` scores the chunk and keeps the layer's own best
`budget * kv_heads` (the window then ends at the last token the layer has seen).

Memory: the compressed cache is allocated at `min(ceil(budget * max_head_share), prompt) + max_new_tokens` slots per
KV head and layer (heads hold different numbers of pairs, summing to the budget per example); the prefill holds the
whole prompt's cache until every layer is scored, as KVzip's does, plus the gate's `[B, T, K, S, G]` float32 sink
logits of one chunk and one layer.

The gates are never downloaded (kvpress fetches `Jang-Hyun/Fast-KVzip` and unpickles a torch file): `gates=` names a
local directory (or its file) holding `model.safetensors` with, for each managed layer `l` (in order; on a model with
sliding-window layers, its global layers'), the gate's state-dict entries under `layers.{l}.`:

* `q_proj.weight` `[K * G * d, D]`, `q_proj.bias` `[K * G * d]`, `k_proj.weight` `[K * d, D]` (torch's `[out, in]`),
* `q_norm.weight` `[d]`, `k_norm.weight` `[d]`,
* `k_base` `[K, 1, S, d]` (the learned sink keys), `b` `[K, 1, G]` (the logit bias).

`K`, `G`, `d`, `S` are read from the shapes (as kvpress reads its state dict); `D` must be the model's hidden size,
`K` its KV heads and the layers its managed layers (`check_model`). Tensors in F32, F16, BF16 or F64 are read from
the file's header and raw data (nothing unpickled). The published gates are pickled torch files: kvjax does not read
them. Whoever trusts one converts it once, outside kvjax, to safetensors under the names above (its `"module"` entry
is the list of layer state dicts); `write_gates` writes numpy arrays in the same layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Method, Step
from kvjax.methods.capabilities import ContextReplay
from kvjax.methods.common import head_cap, keep_masks, read_safetensors, write_entry_scores
from kvjax.methods.registry import register
from kvjax.validation import check_bool, check_choice, check_int, check_number, check_ratio

Array = jax.Array

#: Key of the gates in the cache's cross-layer state.
GATES = "fastkvzip"
GATES_FILE = "model.safetensors"
#: kvpress's switch between the ratio window and `window_size`: prompts of at least this many tokens.
LONG_CONTEXT = 32000
#: The gates' RMSNorm epsilon (Qwen3's RMSNorm default, which the published gates use).
NORM_EPS = 1e-6
_PARTS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "q_norm.weight", "k_norm.weight", "k_base", "b")


@dataclasses.dataclass(frozen=True)
class Gates:
    """Every managed layer's gate, stacked and float32: `q_w` `[L, D, K * G * d]`, `q_b` `[L, K * G * d]`, `k_w`
    `[L, D, K * d]` (`[in, out]`), `q_norm` / `k_norm` `[L, d]`, `k_base` `[L, K, S, d]`, `b` `[L, K, G]`."""

    path: str
    arrays: dict[str, np.ndarray] = dataclasses.field(repr=False)

    @property
    def num_layers(self) -> int:
        return self.arrays["k_base"].shape[0]

    @property
    def input_dim(self) -> int:
        return self.arrays["q_w"].shape[1]

    @property
    def kv_heads(self) -> int:
        return self.arrays["k_base"].shape[1]


@functools.lru_cache(maxsize=4)
def load_gates(path: str) -> Gates:
    """The gates at `path` (a directory with `model.safetensors`, or the file): every tensor of every layer there,
    shapes consistent across layers, nothing else."""
    where = pathlib.Path(path).expanduser()
    file = where if where.is_file() else where / GATES_FILE
    if not file.is_file():
        raise ConfigError(f"fastkvzip: no Fast KVzip gates at {path!r}: expected a directory with {GATES_FILE} "
                          "(the gates' state dicts as layers.{l}.q_proj.weight, ...; see kvjax.methods.fastkvzip)")
    tensors = read_safetensors(file, "fastkvzip")
    layers = sorted({int(name.split(".")[1]) for name in tensors
                     if name.startswith("layers.") and name.split(".")[1].isdigit()})
    n = len(layers)
    want = {f"layers.{i}.{part}" for i in range(n) for part in _PARTS}
    missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want)
    if n == 0 or missing or extra:
        raise ConfigError(f"fastkvzip: {str(file)!r} is not a Fast KVzip gate file of {n} layers: missing "
                          f"{missing[:4]}, unexpected {extra[:4]}")
    first = {part: tensors[f"layers.0.{part}"].shape for part in _PARTS}
    d = first["q_norm.weight"][0] if len(first["q_norm.weight"]) == 1 else 0
    k_base, bias = first["k_base"], first["b"]
    heads = k_base[0] if len(k_base) == 4 else 0
    groups = bias[2] if len(bias) == 3 else 0
    dim = first["q_proj.weight"][1] if len(first["q_proj.weight"]) == 2 else 0
    sinks = k_base[2] if len(k_base) == 4 else 0
    shapes = {"q_proj.weight": (heads * groups * d, dim), "q_proj.bias": (heads * groups * d,),
              "k_proj.weight": (heads * d, dim), "q_norm.weight": (d,), "k_norm.weight": (d,),
              "k_base": (heads, 1, sinks, d), "b": (heads, 1, groups)}
    for i in range(n):
        for part, shape in shapes.items():
            got = tensors[f"layers.{i}.{part}"].shape
            if got != shape or min(shape) <= 0:
                raise ConfigError(f"fastkvzip: tensor 'layers.{i}.{part}' of {str(file)!r} has shape {got}, expected "
                                  f"{shape} (K={heads} KV heads, G={groups} groups, d={d}, S={sinks} sinks, "
                                  f"D={dim}, from layers.0)")

    def stack(part: str, transpose: bool = False) -> np.ndarray:
        return np.stack([tensors[f"layers.{i}.{part}"].T if transpose else tensors[f"layers.{i}.{part}"]
                         for i in range(n)]).astype(np.float32)

    arrays = dict(q_w=stack("q_proj.weight", True), q_b=stack("q_proj.bias"), k_w=stack("k_proj.weight", True),
                  q_norm=stack("q_norm.weight"), k_norm=stack("k_norm.weight"), k_base=stack("k_base")[:, :, 0],
                  b=stack("b")[:, :, 0])
    return Gates(str(file), arrays)


def write_gates(folder: Any, tensors: dict[str, np.ndarray]) -> pathlib.Path:
    """Writes gate tensors (named as in the module docstring) as `folder/model.safetensors`; returns `folder`."""
    from safetensors.numpy import save_file

    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()}, str(out / GATES_FILE))
    return out


def seeded_gates(layers: int, hidden_size: int, kv_heads: int, groups: int = 2, dim: int = 16, sinks: int = 16,
                 seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded float32 gates in the published shapes (for tests and benchmarks; torch's `[out, in]` layout): normal
    projections, norm weights near 1, a non-zero bias and sink keys, so the scores spread over (0, 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(layers):
        out.update({
            f"layers.{i}.q_proj.weight": rng.normal(size=(kv_heads * groups * dim, hidden_size)) / np.sqrt(hidden_size),
            f"layers.{i}.q_proj.bias": rng.normal(size=kv_heads * groups * dim) * 0.1,
            f"layers.{i}.k_proj.weight": rng.normal(size=(kv_heads * dim, hidden_size)) / np.sqrt(hidden_size),
            f"layers.{i}.q_norm.weight": 1.0 + 0.3 * rng.normal(size=dim),
            f"layers.{i}.k_norm.weight": 1.0 + 0.3 * rng.normal(size=dim),
            f"layers.{i}.k_base": rng.normal(size=(kv_heads, 1, sinks, dim)) * 0.5,
            f"layers.{i}.b": rng.normal(size=(kv_heads, 1, groups)),
        })
    return {name: value.astype(np.float32) for name, value in out.items()}


def _rms_norm(x: Array, weight: Array) -> Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS) * weight


def gate_scores(gates: dict[str, Array], layer: Array, hidden: Array, source: str = "the gates") -> Array:
    """`[B, T, K]` float32 gate scores of the attention inputs `hidden` `[B, T, D]` through layer `layer`'s gate;
    ConfigError naming `source` (the gate directory) for hidden states of another size (a model's own `hidden=`,
    which `check_model` never saw), where the einsum would fail with a shape error."""
    if hidden.shape[-1] != gates["q_w"].shape[1]:
        raise ConfigError(f"fastkvzip: {source} read hidden states of size {gates['q_w'].shape[1]}, but hidden= has "
                          f"size {hidden.shape[-1]} (shape {tuple(hidden.shape)}); use gates trained for this model")
    h = hidden.astype(jnp.float32)
    batch, rows, _ = h.shape
    k_base = gates["k_base"][layer]  # [K, S, d]
    heads, _, d = k_base.shape
    exact = jax.lax.Precision.HIGHEST  # tiny matmuls: no reduced-precision passes on accelerators
    q = jnp.einsum("btd,de->bte", h, gates["q_w"][layer], precision=exact) + gates["q_b"][layer]
    q = _rms_norm(q.reshape(batch, rows, heads, -1, d), gates["q_norm"][layer])  # [B, T, K, G, d]
    k = jnp.einsum("btd,de->bte", h, gates["k_w"][layer], precision=exact)
    k = _rms_norm(k.reshape(batch, rows, heads, d), gates["k_norm"][layer])  # [B, T, K, d]
    scale = math.sqrt(d)
    logit = jnp.einsum("btkd,btkgd->btkg", k, q, precision=exact) / scale + gates["b"][layer]
    base = jnp.einsum("ksd,btkgd->btksg", k_base, q, precision=exact) / scale  # [B, T, K, S, G]
    score = jax.nn.sigmoid(logit - jax.scipy.special.logsumexp(base, axis=3))
    return jnp.mean(score, axis=-1)


@functools.lru_cache(maxsize=16)
def kept_pairs(ratio: float, pairs_per_token: int, longest: int) -> np.ndarray:
    """`[longest + 1]` int32: the pairs a prompt of `n` tokens keeps under kvpress's count, `m - int(m * ratio)` for
    its `m = pairs_per_token * n` pairs (the float64 product, as kvpress's Python takes it)."""
    m = np.arange(longest + 1, dtype=np.int64) * pairs_per_token
    return (m - (m * float(ratio)).astype(np.int64)).astype(np.int32)


@functools.lru_cache(maxsize=8)
def window_steps(ratio: float) -> np.ndarray:
    """The prompt lengths `n < LONG_CONTEXT` at which `int(n * ratio)` (kvpress's float64 product) grows, each
    repeated by its growth: the window of `n` tokens is `max(1, #steps <= n)`, exact whatever the float rounding."""
    n = np.arange(LONG_CONTEXT, dtype=np.int64)
    grown = (n * float(ratio)).astype(np.int64)
    return np.repeat(n, np.diff(grown, prepend=0)).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class GateScores(Method):
    """Fast KVzip's prompt pass (`FastKVzip.prompt_scorer`): keeps every token and writes each new token's gate
    scores into `cache.score` (the gates are the cache's cross-layer state)."""

    name = "fastkvzip_gates"
    uses_score = True
    layer_inputs = frozenset({"hidden"})

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        new = gate_scores(cache.state[kvc.SHARED_STATE][GATES], step.layer, step.hidden)
        return kvc.truncate(write_entry_scores(cache, new, step.positions), step.capacity)


@register
@dataclasses.dataclass(frozen=True)
class FastKVzip(Method, ContextReplay):
    """Gate-predicted KVzip scores (see the module docstring): `gates` (local directory), `n_sink` (4),
    `window_size` (4096, prompts of 32000 tokens or more), `window_ratio` (0.02), `layerwise` (False: one ranking
    over all layers), `max_head_share` (2.0, per-head cap in units of the budget), `ratio_count` ("pairs": a
    `compression_ratio` prunes kvpress's `int(ratio * pairs)`; "per_head": kvjax's per-head budget)."""

    name = "fastkvzip"
    uses_score = True
    layer_inputs = frozenset({"hidden"})

    gates: str = ""
    n_sink: int = 4
    window_size: int = 4096
    window_ratio: float = 0.02
    layerwise: bool = False
    max_head_share: float = 2.0
    ratio_count: str = "pairs"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.compresses:
            raise ConfigError(f"{self.name}: needs budget= (tokens) or compression_ratio=")
        check_int(self.name, "n_sink", self.n_sink, 0)
        check_int(self.name, "window_size", self.window_size, 1)
        check_ratio(self.name, "window_ratio", self.window_ratio)
        check_bool(self.name, "layerwise", self.layerwise)
        check_choice(self.name, "ratio_count", self.ratio_count, ("pairs", "per_head"))
        check_number(self.name, "max_head_share", self.max_head_share, 1)
        if not isinstance(self.gates, str) or not self.gates:
            raise ConfigError(f"{self.name}: gates= must name a local directory of Fast KVzip gates "
                              f"({GATES_FILE}); nothing is downloaded")
        load_gates(self.gates)

    @property
    def loaded(self) -> Gates:
        return load_gates(self.gates)

    # ---- the model and the cache ----------------------------------------------------------------------------
    def check_model(self, config: Any) -> None:
        g = self.loaded
        layers = f"{config.num_layers} layers"
        if config.method_layers != config.num_layers:  # sliding-window layers: the gates are the global layers'
            layers = f"{config.method_layers} global layers of {config.num_layers}"
        wrong = [f"{what} {mine} (model: {theirs})" for what, mine, theirs in (
            ("layers", g.num_layers, config.method_layers), ("input size", g.input_dim, config.hidden_size),
            ("KV heads", g.kv_heads, config.num_kv_heads)) if mine != theirs]
        if wrong:
            raise ConfigError(f"fastkvzip: the gates {g.path!r} were not trained for the {config.model_type} model "
                              f"with {layers}, hidden size {config.hidden_size}, {config.num_kv_heads} KV heads: "
                              f"{', '.join(wrong)}")

    def check_cache_spec(self, spec: Any) -> None:
        g = self.loaded
        if (spec.num_layers is not None and g.num_layers != spec.num_layers) or g.kv_heads != spec.kv_heads:
            raise ConfigError(f"fastkvzip: the gates {g.path!r} have {g.num_layers} layers x {g.kv_heads} KV heads; "
                              f"the cache has {spec.num_layers} layers x {spec.kv_heads} KV heads")

    def init_cache_state(self, spec: Any) -> dict[str, Any]:
        self.check_cache_spec(spec)
        return {kvc.SHARED_STATE: {GATES: dict(self.loaded.arrays)}}

    # ---- sizes ----------------------------------------------------------------------------------------------
    def head_capacity(self, prompt_len: int) -> int:
        """Static per-head slots for the prompt: `min(ceil(budget * max_head_share), prompt_len)`."""
        return min(head_cap(self.prompt_budget(prompt_len), self.max_head_share), prompt_len)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.head_capacity(prompt_len) + max_new_tokens

    # ---- the scores -----------------------------------------------------------------------------------------
    def window(self, length: Array) -> Array:
        """`[B]` int32 recent tokens kept for prompts of `length` `[B]` tokens (kvpress's rule)."""
        steps = jnp.asarray(window_steps(self.window_ratio))
        short = jnp.maximum(1, jnp.sum(steps[None, :] <= length[:, None], axis=-1, dtype=jnp.int32))
        return jnp.where(length < LONG_CONTEXT, short, self.window_size).astype(jnp.int32)

    def ranked(self, cache: KVCache, length: Array) -> Array:
        """`[B, K, C]` the layer's gate scores with the sinks and the window of prompts of `length` `[B]` at 1."""
        start = (length - self.window(length))[:, None, None]
        kept = (cache.pos < self.n_sink) | (cache.pos >= start)
        return jnp.where(kvc.stored_mask(cache) & kept, 1.0, cache.score.astype(jnp.float32))

    def total(self, length: Array, pairs_per_token: int, longest: int) -> Array | None:
        """`[B]` pairs kept of prompts of `length` `[B]` tokens (at most `longest`) under kvpress's count
        (`ratio_count="pairs"` with a `compression_ratio`); None: the budget's count."""
        if self.compression_ratio is None or self.ratio_count != "pairs":
            return None
        table = jnp.asarray(kept_pairs(float(self.compression_ratio), pairs_per_token, longest))
        return table[jnp.clip(length, 0, longest)]

    def _keep(self, layers: tuple[KVCache, ...], budget: Array, cap: Array, layerwise: bool) -> tuple[Array, ...]:
        length = jnp.max(jnp.where(kvc.stored_mask(layers[0]), layers[0].pos, -1), axis=(1, 2)) + 1  # [B]
        heads, longest = layers[0].pos.shape[1], max(x.capacity for x in layers)
        total = self.total(length, heads * (1 if layerwise else len(layers)), longest)
        return keep_masks(tuple(self.ranked(x, length) for x in layers), tuple(kvc.stored_mask(x) for x in layers),
                          tuple(x.pos for x in layers), budget, cap, self.n_sink, layerwise, total)

    # ---- the cross-layer stage (ContextReplay without rows) -------------------------------------------------
    def prompt_scorer(self) -> GateScores:
        return GateScores()

    def replay_width(self, context: int) -> int:
        return 0

    def replay_rows(self, tokens: Any, lengths: Any) -> list:
        return []

    def replay_scores(self, cache: KVCache, q: Array, k: Array, positions: Array, span: Array, step: Any) -> KVCache:
        """Never called by the runtime (no replay rows); a row scores nothing."""
        return cache

    def replay_compress(self, layers: tuple[KVCache, ...], budget: Array, capacity: int) -> tuple[KVCache, ...]:
        keep = self._keep(layers, budget, head_cap(budget, self.max_head_share), self.layerwise)
        return tuple(kvc.keep_where(x, m, capacity) for x, m in zip(layers, keep, strict=True))

    # ---- the plain step API (no cross-layer stage) ----------------------------------------------------------
    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """The chunk's gate scores, then this layer keeps its `budget * kv_heads` best (heads share it; the window
        ends at the layer's last token)."""
        new = gate_scores(cache.state[kvc.SHARED_STATE][GATES], step.layer, step.hidden, repr(self.gates))
        cache = write_entry_scores(cache, new, step.positions)
        cap = jnp.minimum(head_cap(step.budget, self.max_head_share), step.capacity)
        return kvc.keep_where(cache, self._keep((cache,), step.budget, cap, True)[0], step.capacity)


__all__ = ["FastKVzip", "GateScores", "Gates", "gate_scores", "kept_pairs", "load_gates", "seeded_gates",
           "window_steps", "write_gates"]
