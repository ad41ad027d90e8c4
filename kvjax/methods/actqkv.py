"""`actqkv`: activation-aware probe query and dynamic KV cut-off (Xiao et al., 2025, arXiv 2502.13542).

Q-LLM's block retrieval (`kvjax.methods.qllm`) with two changes (spec `shared/specs/actqkv.md`):

* Stage 1, activation-aware probe query (APQ, spec 2.2, Eq. 7-9). Per layer, running statistics of
  every (global) query vector seen so far: mean `z` and unbiased variance `s2` over windows `1..t`
  (Eq. 8, the current window included; Chan's parallel update, float32). The activation bias of a
  query is `phi_j = (q_j - z)^2 / s2` (Eq. 7, elementwise; `s2 + stats_eps * mean(s2)`, floored at
  1e-12), its weight `w_j = ||phi_j||_1 / sum_j' ||phi_j'||_1` and the probe `sum_j w_j q_j` (Eq. 9;
  uniform weights when every `phi` is 0). At decode the probe is the token's query.
* Stage 2, dynamic cut-off (DCM, spec 2.4, Eq. 11-12), at decode only. Layer by layer, the normalised
  entropy `Theta` of the softmax of its block scores gets the share
  `Theta_l / (Theta_l + sum_{j > l} mean Theta_j)` of the blocks still unassigned of the step's total
  `L * topk`; `mean Theta_j` is layer j's running mean over its last `dcm_history` decode steps of
  this sequence (uniform split while a later layer has none). Rounded to nearest and clamped to
  `[min(n, dcm_min, remaining), min(n, dcm_max_factor * topk)]` (the paper has no floor: `dcm_min=0`),
  so `sum_l B^l <= L * topk`. The history holds decode-step entropies only (Eq. 12's historical Theta;
  prefill windows score with the question term, on another scale). The remaining budget and the
  history are cross-layer state (`state["shared"]`), carried through the layer scan.

Options for the official code's variants ([CODE] in the spec): `stats="shared"` (one set of
statistics for all layers, an EMA over windows capped at `stats_cap`, uniform weights during the
first `stats_warmup` calls), `dcm_numerator="history"` (the layer's smoothed Theta in the numerator),
`dcm_min=32` (the code's floor, here still bounded by the remaining budget), `dcm_max_factor=None`
(the paper: no cap), `question_decode`.

Defaults reproduce the official Qwen2.5-7B-Instruct configuration (64 sinks, 512 local, windows of
256, blocks of 64, 23 blocks per layer = 1472 retrieved tokens, 4 representative tokens, question
weight 4, DCM cap 2k) except the floor (none, as in the paper); `ActQKV.preset("llama-3-8b")` is the paper's
main Llama-3-8B-Instruct configuration (blocks of 32, 46 per layer).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Step
from kvjax.methods.block_memory import normalized_entropy
from kvjax.methods.qllm import QLLM
from kvjax.methods.registry import register
from kvjax.validation import check_choice, check_int, check_number

Array = jax.Array

PROBES = ("activation", "mean")
STATS = ("layer", "shared")
NUMERATORS = ("current", "history")

#: The official configurations (spec section 3); `ActQKV.preset(name, **overrides)`.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": dict(n_init=64, n_local=512, window=256, block_size=64, topk=23, repr_topk=4),
    "llama-3-8b": dict(n_init=64, n_local=512, window=256, block_size=32, topk=46, repr_topk=4),
}

_VAR_FLOOR = 1e-12


# ---- Stage 1 -------------------------------------------------------------------------------------


def chan_merge(n_a: Array, mean_a: Array, m2_a: Array, x: Array, valid: Array) -> tuple[Array, Array, Array]:
    """Running (count, mean, M2) `[B]`, `[B, d]`, `[B, d]` updated with the valid rows of `x` `[B, T, d]`.

    Chan et al.'s parallel update; padded rows change nothing (Eq. 8 with true token counts).
    """
    vf = valid.astype(jnp.float32)
    n_b = jnp.sum(vf, axis=1)
    mean_b = jnp.sum(x * vf[..., None], axis=1) / jnp.maximum(n_b, 1.0)[:, None]
    m2_b = jnp.sum(jnp.square((x - mean_b[:, None]) * vf[..., None]), axis=1)
    n = n_a + n_b
    delta = mean_b - mean_a
    frac = n_b / jnp.maximum(n, 1.0)
    mean = mean_a + delta * frac[:, None]
    m2 = m2_a + m2_b + jnp.square(delta) * (n_a * frac)[:, None]
    return n, mean, m2


def activation_weights(x: Array, valid: Array, mean: Array, var: Array, rel_eps: float = 0.01) -> Array:
    """Eq. 7 + 9: `w_j = ||phi_j||_1 / sum ||phi||_1` with `phi = (x - mean)^2 / var` -> `[B, T]`.

    The variance gets `rel_eps * mean(var)` added and a floor of 1e-12; padded rows get 0; when
    every `phi` is 0 (or not finite) the weights fall back to uniform over the valid rows.
    """
    den = jnp.maximum(var + rel_eps * jnp.mean(var, axis=-1, keepdims=True), _VAR_FLOOR)
    phi = jnp.square(x - mean[:, None]) / den[:, None]
    vf = valid.astype(jnp.float32)
    l1 = jnp.sum(phi, axis=-1) * vf
    total = jnp.sum(l1, axis=-1, keepdims=True)
    uniform = vf / jnp.maximum(jnp.sum(vf, axis=-1, keepdims=True), 1.0)
    good = (total > 0) & jnp.isfinite(total)
    return jnp.where(good, l1 / jnp.where(good, total, 1.0), uniform)


def weighted_probe(x: Array, w: Array) -> Array:
    """Eq. 9: `Q_probe = sum_j w_j q_j` -> `[B, d]`."""
    return jnp.einsum("bt,btd->bd", w, x)


def ema_merge(n_a: Array, mean_a: Array, var_a: Array, x: Array, valid: Array, cap: int):
    """[CODE] shared statistics: the window's mean / variance merged as one sample against at most
    `cap` earlier ones (an EMA of rate ~1/(cap + 1)); windows without valid rows change nothing."""
    vf = valid.astype(jnp.float32)
    n_b = jnp.sum(vf, axis=1)
    mean_w = jnp.sum(x * vf[..., None], axis=1) / jnp.maximum(n_b, 1.0)[:, None]
    var_w = jnp.sum(jnp.square((x - mean_w[:, None]) * vf[..., None]), axis=1) / jnp.maximum(n_b - 1.0, 1.0)[:, None]
    w = jnp.minimum(n_a, float(cap))[:, None]
    mean = (w * mean_a + mean_w) / (w + 1.0)
    var = (w * var_a + var_w) / (w + 1.0) + w * jnp.square(mean_w - mean_a) / jnp.square(w + 1.0)
    upd = n_b > 0
    return (
        jnp.where(upd, jnp.minimum(n_a, float(cap)) + 1.0, n_a),
        jnp.where(upd[:, None], mean, mean_a),
        jnp.where(upd[:, None], var, var_a),
    )


# ---- Stage 2 -------------------------------------------------------------------------------------


def dcm_layer_budget(numerator: Array, later_sum: Array, cold: Array, remaining: Array, n: Array, layer: Array,
                     num_layers: int, k_min: int, k_max: int | None) -> Array:
    """Eq. 12 for one layer: `round(Theta / (Theta + sum later means) * remaining)`, clamped -> `[B]` int32.

    `cold` (a later layer without history) or a zero denominator: the uniform share
    `1 / (L - layer)`. Clamp: `[min(n, k_min, remaining), min(n, k_max)]` (`k_max` None: `n`); the
    share is at most 1, so a layer never takes more than `remaining` and the layers sum to at most
    the total.
    """
    uniform = 1.0 / (num_layers - layer).astype(jnp.float32)
    denom = numerator + later_sum
    share = jnp.where(cold | (denom <= 0), uniform, numerator / jnp.where(denom > 0, denom, 1.0))
    raw = jnp.round(share * remaining.astype(jnp.float32)).astype(jnp.int32)
    lo = jnp.minimum(jnp.minimum(n, k_min), jnp.maximum(remaining, 0))
    hi = n if k_max is None else jnp.minimum(n, k_max)
    return jnp.minimum(jnp.maximum(raw, lo), hi).astype(jnp.int32)


def record_entropy(hist: Array, count: Array, layer: Array, theta: Array, where: Array) -> tuple[Array, Array]:
    """Appends `theta` `[B]` to layer `layer`'s ring buffer in `hist` `[B, L, W]` where `where` `[B]`."""
    num_layers, window = hist.shape[1:]
    own = jnp.arange(num_layers) == layer  # [L]
    slot = jnp.take(count, layer, axis=1) % window  # [B]
    hit = where[:, None, None] & own[None, :, None] & (jnp.arange(window)[None, None, :] == slot[:, None, None])
    hist = jnp.where(hit, theta[:, None, None], hist)
    return hist, count + (where[:, None] & own[None, :]).astype(jnp.int32)


def history_means(hist: Array, count: Array) -> Array:
    """Mean of each layer's recorded values `[B, L]` (0 where none)."""
    filled = jnp.minimum(count, hist.shape[-1])
    mask = jnp.arange(hist.shape[-1]) < filled[..., None]
    return jnp.sum(jnp.where(mask, hist, 0.0), axis=-1) / jnp.maximum(filled, 1).astype(jnp.float32)


@register
@dataclasses.dataclass(frozen=True)
class ActQKV(QLLM):
    """Q-LLM retrieval + activation-aware probe (Eq. 7-9) + dynamic cut-off (Eq. 11-12)."""

    name = "actqkv"

    probe: str = "activation"
    stats: str = "layer"
    stats_eps: float = 0.01
    stats_cap: int = 1000
    stats_warmup: int = 1001
    dcm: bool = True
    dcm_min: int = 0
    dcm_max_factor: float | None = 2.0
    dcm_history: int = 100
    dcm_numerator: str = "current"
    dcm_warmup: int = 1

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ActQKV:
        """An official configuration (`PRESETS`) with `overrides`."""
        if name not in PRESETS:
            raise ConfigError(f"actqkv: unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return cls(**{**PRESETS[name], **overrides})

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        check_choice(n, "probe", self.probe, tuple(PROBES))
        check_choice(n, "stats", self.stats, tuple(STATS))
        check_choice(n, "dcm_numerator", self.dcm_numerator, tuple(NUMERATORS))
        check_number(n, "stats_eps", self.stats_eps, 0)
        check_int(n, "stats_cap", self.stats_cap, 1)
        check_int(n, "stats_warmup", self.stats_warmup, 0)
        check_int(n, "dcm_history", self.dcm_history, 1)
        check_int(n, "dcm_warmup", self.dcm_warmup, 1)
        check_int(n, "dcm_min", self.dcm_min, 0)
        check_number(n, "dcm_max_factor", self.dcm_max_factor, 1, optional=True)

    # ---- sizes ---------------------------------------------------------------------------------------
    @property
    def block_floor(self) -> int:
        """Per-layer DCM floor (blocks): `dcm_min` (default 0, the paper; never above the remaining budget)."""
        return self.dcm_min

    @property
    def block_cap(self) -> int | None:
        """Per-layer DCM cap (blocks): `ceil(dcm_max_factor * topk)`, None without a cap."""
        if self.dcm_max_factor is None:
            return None
        return max(self.retrieved_blocks, math.ceil(self.dcm_max_factor * self.retrieved_blocks))

    def extra_state(self, spec: CacheSpec) -> dict[str, Any]:
        state = super().extra_state(spec)
        b, d = spec.batch, spec.num_heads * spec.head_dim
        shared: dict[str, Any] = {}
        if self.probe == "activation":
            stats = {
                "st_n": jnp.zeros((b,), jnp.float32),
                "st_mean": jnp.zeros((b, d), jnp.float32),
                "st_m2": jnp.zeros((b, d), jnp.float32),  # M2 per layer; the variance in shared mode
            }
            if self.stats == "layer":
                state.update(stats)
            else:
                shared.update(stats, st_calls=jnp.zeros((b,), jnp.int32))
        if self.dcm:
            shared.update(
                remaining=jnp.zeros((b,), jnp.int32),
                ent_hist=jnp.zeros((b, spec.num_layers, self.dcm_history), jnp.float32),
                ent_count=jnp.zeros((b, spec.num_layers), jnp.int32),
            )
        if shared:
            state["shared"] = shared
        return state

    # ---- Stage 1 -------------------------------------------------------------------------------------
    def prefill_probe(self, x: Array, valid: Array, state: dict, step: Step) -> tuple[Array, dict]:
        if self.probe == "mean":
            return super().prefill_probe(x, valid, state, step)
        if self.stats == "layer":
            n, mean, m2 = chan_merge(state["st_n"], state["st_mean"], state["st_m2"], x, valid)
            var = m2 / jnp.maximum(n - 1.0, 1.0)[:, None]
            w = activation_weights(x, valid, mean, var, self.stats_eps)
            state = {**state, "st_n": n, "st_mean": mean, "st_m2": m2}
            return weighted_probe(x, w), state
        shared = dict(state["shared"])
        n, mean, var = ema_merge(shared["st_n"], shared["st_mean"], shared["st_m2"], x, valid, self.stats_cap)
        calls = shared["st_calls"] + jnp.any(valid, axis=-1).astype(jnp.int32)
        vf = valid.astype(jnp.float32)
        uniform = vf / jnp.maximum(jnp.sum(vf, axis=-1, keepdims=True), 1.0)
        w = jnp.where((calls <= self.stats_warmup)[:, None], uniform,
                      activation_weights(x, valid, mean, var, self.stats_eps))
        shared.update(st_n=n, st_mean=mean, st_m2=var, st_calls=calls)
        return weighted_probe(x, w), {**state, "shared": shared}

    # ---- Stage 2 -------------------------------------------------------------------------------------
    def decode_budget(self, scores: Array, ok: Array, state: dict, step: Step) -> tuple[Array, int, dict]:
        if not self.dcm:
            return super().decode_budget(scores, ok, state, step)
        num_layers = step.num_layers
        nb_max = scores.shape[-1]
        shared = dict(state["shared"])
        theta, n = normalized_entropy(scores, ok)
        layer = step.layer
        remaining = jnp.where(layer == 0, num_layers * self.retrieved_blocks, shared["remaining"])
        hist, count = shared["ent_hist"], shared["ent_count"]
        if self.dcm_numerator == "history":
            hist, count = record_entropy(hist, count, layer, theta, n >= 2)
        means = history_means(hist, count)
        numerator = theta if self.dcm_numerator == "current" else jnp.take(means, layer, axis=1)
        later = jnp.arange(num_layers) > layer
        later_sum = jnp.sum(jnp.where(later[None], means, 0.0), axis=-1)
        cold = jnp.any(later[None] & (count < self.dcm_warmup), axis=-1)
        cap = self.block_cap
        budget = dcm_layer_budget(numerator, later_sum, cold, remaining, n, layer, num_layers,
                                  self.block_floor, cap)
        if self.dcm_numerator == "current":
            hist, count = record_entropy(hist, count, layer, theta, n >= 2)
        shared.update(remaining=remaining - budget, ent_hist=hist, ent_count=count)
        k_max = nb_max if cap is None else min(cap, nb_max)
        return budget, k_max, {**state, "shared": shared}
