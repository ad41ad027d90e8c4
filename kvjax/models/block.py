"""The one decoder block of every family kvjax runs (Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 3 text,
Phi-3 / Phi-4): one function every path calls, the families being configurations of it (`ModelConfig` flags).

`decoder_block` computes one layer: RMSNorm, the fused q / k / v projection (Qwen2's biases), QK-norm (Qwen3,
Gemma 3), RoPE, the attention the caller passes, the output projection (Gemma: then its post-attention norm), and
the gated MLP (one fused gate / up projection; SwiGLU, or GELU-tanh for Gemma; Gemma: then its post-feedforward
norm), each with its residual. The attention is a callback `attention(q, k, v) -> (out, aux)` over the layer's
post-RoPE queries `[B, T, N, H]`, keys and values `[B, T, K, H]`: a plain causal attention
(`kvjax.models.transformer.forward`), or the runtime's per-layer cache step (`kvjax.runtime.step`), whose `aux` is
the layer's updated cache. The block knows nothing of caches or compression methods. The queries it hands over
carry the family's attention scale relative to `1 / sqrt(head_dim)` (Gemma's `query_pre_attn_scalar`), so every
attention and every method scoring `q . k / sqrt(head_dim)` sees the model's real logits. A callback wrapped in
`PreRope` gets the queries and keys before RoPE and that scale instead, with the layer's `(inv_freq, scaling)` and the
scale, and rotates them itself (the runtime's fused decode step, `kvjax.ops.fused_decode`); the plain callback's path
is unchanged by it.

Weights (`kvjax.models.loader`): a dict with `embed`, `final_norm`, optional `lm_head`, and `layers`, a tuple
with one dict of arrays per decoder layer (`attn_norm`, `qkv`, `o`, `mlp_norm`, `gate_up`, `down`, the optional
biases `qkv_bias` / `o_bias` / `gate_up_bias` / `down_bias`, `q_norm` / `k_norm`, `post_attn_norm` /
`post_mlp_norm`), each layer in buffers of its own.

The input projections are fused, so a layer reads each with one matrix product (at batch-1 decode, one GEMV
kernel instead of three, and two): `qkv` `[D, K, G + 2, H]` (K KV heads, G = N / K query heads per KV head)
holds, per KV head, its G query heads (query head `n = kv * G + g`, the GQA grouping the attention reads, as
Hugging Face's `repeat_kv`), then its key head, then its value head; `qkv_bias` `[K, G + 2, H]` likewise.
`gate_up` `[D, 2, F]` holds the MLP's gate (`[:, 0]`) and up (`[:, 1]`) projections, `gate_up_bias` `[2, F]`.
A `model`-axis shard of `qkv`'s axis 1 holds whole KV-head groups (queries with their keys and values), one of
`gate_up`'s axis 2 the matching columns of gate and up. The split comes after the product, on the activations.
`fuse_qkv` / `split_qkv` and `fuse_gate_up` / `split_gate_up` convert from / to the separate per-head arrays
(`split_*` return views where the layout allows: host-side readers such as tests or model growth).

Every weight product goes through `kvjax.ops.linear` with what surrounds it: the RMSNorm before the q|k|v and gate|up
products (`Norm`), the activation product before the down product, the biases, and the residual add after the o and
down products where nothing comes between (no Gemma post-norm). That is XLA's sequence unless the tuning runs the op's
kernel, which takes them into the product.

RoPE (`Ropes`): the global layers' `(inv_freq, scaling)` and, for a model whose sliding-window layers rotate with
their own base (Gemma 3), theirs; `layer_rope` picks a layer's. A plain `(inv_freq, scaling)` pair serves every
layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import tuning
from kvjax.ops.attention import prefill_attention
from kvjax.ops.linear import linear, tied_logits
from kvjax.ops.norm import rms_norm as ops_rms_norm
from kvjax.ops.norm import rms_norm_xla
from kvjax.rope import apply_rope

Array = jax.Array
Weights = dict[str, Any]
#: `attention(q, k, v) -> (out [B, T, N, H], aux)`.
Attention = Callable[[Array, Array, Array], tuple[Array, Any]]


@dataclasses.dataclass(frozen=True)
class PreRope:
    """An attention callback that rotates the queries and keys itself: `fn(q, k, v, rope, query_scale, qkv=,
    qk_norm=) -> (out, aux)` with `q` `[B, T, N, H]`, `k` `[B, T, K, H]` as the projection left them (biases added;
    before QK-norm, RoPE and the query scale), `rope` the layer's `(inv_freq, scaling)`, `query_scale` the family's
    (`ModelConfig.query_scale`), `qkv=` the same q, k, v in the fused layout `[B, T, K, G + 2, H]`, and `qk_norm=`
    the family's QK-norm `(q_weight, k_weight, eps, plus_one)` or None: the callback applies QK-norm, RoPE and
    the scale in that order, as `qkv` does."""

    fn: Callable[..., tuple[Array, Any]]


class Ropes(NamedTuple):
    """A model's RoPE: `(inv_freq [H / 2], scaling)` of its global layers, then those of its sliding-window layers
    when they differ (None otherwise). `ropes[0]` is what compression methods re-rotate with (they act on the
    global layers)."""

    inv_freq: Array
    scaling: Any
    local_inv_freq: Array | None = None
    local_scaling: Any = None


def layer_rope(config: Any, rope: Any, layer: int) -> tuple[Array, Any]:
    """The `(inv_freq, scaling)` layer `layer` rotates with: the local RoPE on a sliding-window layer of a model
    that has one, else the global one. `rope`: `Ropes` or a plain pair."""
    if len(rope) > 2 and rope[2] is not None and config.layer_window(layer) is not None:
        return rope[2], rope[3]
    return rope[0], rope[1]


class Norm(NamedTuple):
    """An RMSNorm to fuse into the product after it (`kvjax.ops.linear`): its weight and the family's settings."""

    weight: Array
    eps: float
    plus_one: bool


def norm_of(config: Any, weight: Array) -> Norm:
    """The family's RMSNorm with `weight`, to hand to `projections` / `mlp`."""
    return Norm(weight, config.rms_norm_eps, getattr(config, "norm_plus_one", False))


def _norm_args(norm: Norm | None) -> dict[str, Any]:
    return {} if norm is None else dict(norm_weight=norm.weight, eps=norm.eps, plus_one=norm.plus_one)


def norm(config: Any, x: Array, weight: Array, residual: Array | None = None) -> Array:
    """The family's RMSNorm of the hidden states `x` over their last axis (`kvjax.ops.norm.rms_norm`: one Triton
    kernel where the tuning's `auto_pallas` lists `rms_norm`), added to `residual` when given (in the kernel)."""
    return ops_rms_norm(x, weight, config.rms_norm_eps, getattr(config, "norm_plus_one", False), residual=residual)


def head_norm(config: Any, x: Array, weight: Array) -> Array:
    """The family's QK-norm of each head of `x` over head_dim (the XLA path: under a mesh its heads are sharded)."""
    return rms_norm_xla(x, weight, config.rms_norm_eps, getattr(config, "norm_plus_one", False))


def _xp(*arrays: Any) -> Any:
    """numpy for host arrays, jax.numpy otherwise."""
    return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


def fuse_qkv(q: Any, k: Any, v: Any) -> Any:
    """The fused `qkv` `[..., K, G + 2, H]` of queries `[..., N, H]`, keys and values `[..., K, H]` (weights
    `[D, ...]` or biases): each KV head's G query heads, its key, its value."""
    *lead, kv, h = k.shape
    xp = _xp(q, k, v)
    grouped = q.reshape(*lead, kv, q.shape[-2] // kv, h)
    return xp.concatenate([grouped, k[..., None, :], v[..., None, :]], axis=-2)


def split_qkv(qkv: Any) -> tuple[Any, Any, Any]:
    """`(q [..., N, H], k [..., K, H], v [..., K, H])` of a fused `qkv` `[..., K, G + 2, H]` (weight or bias); k and
    v are views, q is one when G is 1 (a copy otherwise, on the host)."""
    *lead, kv, g2, h = qkv.shape
    g = g2 - 2
    return qkv[..., :g, :].reshape(*lead, kv * g, h), qkv[..., g, :], qkv[..., g + 1, :]


def fuse_gate_up(gate: Any, up: Any) -> Any:
    """The fused `gate_up` `[..., 2, F]` of `gate` and `up` `[..., F]` (weights `[D, F]` or biases `[F]`)."""
    return _xp(gate, up).stack([gate, up], axis=-2)


def split_gate_up(gate_up: Any) -> tuple[Any, Any]:
    """`(gate, up)` views `[..., F]` of a fused `gate_up` `[..., 2, F]`."""
    return gate_up[..., 0, :], gate_up[..., 1, :]


#: The separate arrays each fused one is made of (`fuse_layer`).
FUSED: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "qkv_bias": ("q_bias", "k_bias", "v_bias"),
                                     "gate_up": ("gate", "up"), "gate_up_bias": ("gate_bias", "up_bias")}


def fuse_layer(separate: dict[str, Any]) -> dict[str, Any]:
    """A layer's weights with separate q / k / v and gate / up arrays (and biases; leading axes allowed, e.g. a
    stack of layers) in the fused layout: each fused array where its first part was, the other weights as they
    are."""
    parts = {part: fused for fused, names in FUSED.items() for part in names}
    out: dict[str, Any] = {}
    for name, value in separate.items():
        if name not in parts:
            out[name] = value
        elif name == FUSED[parts[name]][0]:
            arrays = [separate[part] for part in FUSED[parts[name]]]
            out[parts[name]] = fuse_qkv(*arrays) if len(arrays) == 3 else fuse_gate_up(*arrays)
    return out


def mlp(lw: Weights, x: Array, activation: str = "silu", *, norm: Norm | None = None,
        residual: Array | None = None) -> Array:
    """Gated MLP (`down(act(gate x) * up x)`) of `[B, T, D]`, of `x` normed first by `norm` when given, added to
    `residual` when given (each fused into the neighbouring product where the tuning runs the `linear` kernel); with
    `tuning.current().mlp_rows` a long input goes through in row slices."""
    rows = tuning.current().mlp_rows
    b, t, d = x.shape
    if rows is None or b * t <= rows or (b * t) % rows:
        return _mlp_rows(lw, x, activation, norm, residual)
    h = x if norm is None else ops_rms_norm(x, norm.weight, norm.eps, norm.plus_one)
    slices = h.reshape(b * t // rows, 1, rows, d)
    out = jax.lax.map(lambda xs: _mlp_rows(lw, xs, activation), slices).reshape(b, t, d)
    return out if residual is None else residual + out


def _mlp_rows(lw: Weights, x: Array, activation: str = "silu", norm: Norm | None = None,
              residual: Array | None = None) -> Array:
    gate_up = linear(x, lw["gate_up"], "btd,dsf->btsf", bias=lw.get("gate_up_bias"), **_norm_args(norm))  # both
    return linear(gate_up, lw["down"], "btf,fd->btd", gated=activation, bias=lw.get("down_bias"), residual=residual)


def projections(config: Any, lw: Weights, h: Array, norm: Norm | None = None) -> tuple[Array, Array, Array]:
    """Queries `[B, T, N, H]`, keys and values `[B, T, K, H]` of the normed input `h` `[B, T, D]` (or of `h` normed
    here by `norm`) before RoPE (biases, QK-norm): one product with the fused `qkv`, split after it."""
    q, k, v = split_qkv(fused_projection(lw, h, norm))
    if "q_norm" in lw:  # QK-norm: each head's query and key normed over head_dim, before RoPE
        q, k = head_norm(config, q, lw["q_norm"]), head_norm(config, k, lw["k_norm"])
    return q, k, v


def fused_projection(lw: Weights, h: Array, norm: Norm | None = None) -> Array:
    """The q|k|v projection `[B, T, K, G + 2, H]` of `h` (normed here by `norm` when given), biases added."""
    return linear(h, lw["qkv"], "btd,dkgh->btkgh", bias=lw.get("qkv_bias"), **_norm_args(norm))


def qkv(config: Any, lw: Weights, h: Array, positions: Array, rope: tuple[Array, Any]) -> tuple[Array, Array, Array]:
    """Post-RoPE queries `[B, T, N, H]`, keys and values `[B, T, K, H]` of the normed input `h` `[B, T, D]`."""
    return rotated(config, *projections(config, lw, h), positions, rope)


def rotated(config: Any, q: Array, k: Array, v: Array, positions: Array,
            rope: tuple[Array, Any]) -> tuple[Array, Array, Array]:
    """`projections`' q and k rotated at `positions` (and q scaled by the family's query scale), v as it is."""
    inv_freq, scaling = rope[0], rope[1]  # a pair, or a `Ropes`' global entries
    q, k = apply_rope(q, positions, inv_freq, scaling), apply_rope(k, positions, inv_freq, scaling)
    scale = getattr(config, "query_scale", 1.0)
    if scale != 1.0:
        q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    return q, k, v


def out_proj(lw: Weights, attn: Array, residual: Array | None = None) -> Array:
    """The attention output `[B, T, N, H]` projected back to `[B, T, D]` (and added to `residual` when given)."""
    return linear(attn, lw["o"], "btnh,nhd->btd", bias=lw.get("o_bias"), residual=residual)


def attention_inputs(config: Any, lw: Weights, x: Array, positions: Array,
                     rope: tuple[Array, Any]) -> tuple[Array, Array, Array]:
    """What a layer's attention reads: post-RoPE q, k, v of the layer input `x` `[B, T, D]` (after its norm)."""
    q, k, v = projections(config, lw, x, norm_of(config, lw["attn_norm"]))
    return rotated(config, q, k, v, positions, rope)


def self_attention(q: Array, k: Array, v: Array, positions: Array, *, sliding_window: int | None = None,
                   return_lse: bool = False) -> Array | tuple[Array, Array]:
    """Causal attention of a chunk over its own keys only (`k`, `v` `[B, T, K, H]`, -1 positions masked): the
    plain forward's attention and a one-shot prefill's (whose cache held nothing before the chunk)."""
    kv_heads = k.shape[2]
    k_pos = jnp.broadcast_to(positions[:, None, :], (positions.shape[0], kv_heads, positions.shape[1]))
    return prefill_attention(
        q, positions, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), k_pos, k_pos >= 0,
        sliding_window=sliding_window, return_lse=return_lse,
    )


def decoder_block(config: Any, lw: Weights, x: Array, positions: Array, rope: tuple[Array, Any],
                  attention: Attention | PreRope, attn_delta: Array | None = None) -> tuple[Array, Any]:
    """One decoder layer on `x` `[B, T, D]` at `positions` `[B, T]` (-1: padding): `(x, aux)` where `aux` is
    what `attention` returned beside its output. `rope`: this layer's `(inv_freq, scaling)` (`layer_rope`).
    `attention`: a plain callback gets post-RoPE q / k, a `PreRope` one the projections before RoPE.
    `attn_delta` `[B, T, D]`: added to the attention's projected output (before Gemma's post-attention norm), so
    that a gradient with respect to it is the gradient with respect to that output (KVgrad's replay)."""
    if isinstance(attention, PreRope):  # q and k before their QK-norm too, with its weights to apply
        fused = fused_projection(lw, x, norm_of(config, lw["attn_norm"]))
        qk_norm = None
        if "q_norm" in lw:
            qk_norm = (lw["q_norm"], lw["k_norm"], config.rms_norm_eps, getattr(config, "norm_plus_one", False))
        attn, aux = attention.fn(*split_qkv(fused), (rope[0], rope[1]), getattr(config, "query_scale", 1.0),
                                 qkv=fused, qk_norm=qk_norm)
    else:
        q, k, v = attention_inputs(config, lw, x, positions, rope)
        attn, aux = attention(q, k, v)
    if "post_attn_norm" in lw:  # Gemma: normed between the product and the residual
        projected = out_proj(lw, attn)
        x = norm(config, projected if attn_delta is None else projected + attn_delta, lw["post_attn_norm"], residual=x)
    else:
        x = out_proj(lw, attn, residual=x if attn_delta is None else x + attn_delta)
    activation = getattr(config, "hidden_act", "silu")
    if "post_mlp_norm" in lw:
        return norm(config, mlp(lw, x, activation, norm=norm_of(config, lw["mlp_norm"])), lw["post_mlp_norm"],
                    residual=x), aux
    return mlp(lw, x, activation, norm=norm_of(config, lw["mlp_norm"]), residual=x), aux


def global_weights(weights: Weights) -> Weights:
    """The weights outside the layers (embedding, final norm, LM head)."""
    return {name: w for name, w in weights.items() if name != "layers"}


def embed(config: Any, weights: Weights, tokens: Array) -> Array:
    """Input embeddings `[..., D]` of `tokens` (Gemma: times `sqrt(hidden_size)` in the weights' dtype)."""
    x = jnp.take(weights["embed"], tokens, axis=0)
    if getattr(config, "embed_scale", False):
        x = x * jnp.asarray(math.sqrt(config.hidden_size), x.dtype)
    return x


def logits(config: Any, weights: Weights, x: Array) -> Array:
    """Logits `[..., V]` float32 of final hidden states `x` (before the final norm): the LM head as one weight
    product with the final norm fused (`kvjax.ops.linear`: the step's largest matrix, one Triton kernel where the
    tuning lists `linear`), a tied head reading the embedding table as it lies."""
    rows = x.reshape(-1, x.shape[-1])
    final = _norm_args(norm_of(config, weights["final_norm"]))
    if config.tie_word_embeddings:
        out = tied_logits(rows, weights["embed"], **final)
    else:
        out = linear(rows, weights["lm_head"], "td,dv->tv", preferred_element_type=jnp.float32, **final)
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    cap = getattr(config, "final_logit_softcapping", None)
    return out if cap is None else cap * jnp.tanh(out / cap)
