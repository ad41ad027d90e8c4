"""The decoder block shared by Llama 2/3/3.x, Mistral and Qwen2/2.5: one function every path calls.

`decoder_block` computes one layer: RMSNorm, q / k / v projections (Qwen2's biases), RoPE, the attention
the caller passes, the output projection and the SwiGLU MLP, each with its residual. The attention is a
callback `attention(q, k, v) -> (out, aux)` over the layer's post-RoPE queries `[B, T, N, H]`, keys and
values `[B, T, K, H]`: a plain causal attention (`kvjax.models.transformer.forward`), or the runtime's
per-layer cache step (`kvjax.runtime.step`), whose `aux` is the layer's updated cache. The block knows
nothing of caches or compression methods.

Weights (`kvjax.models.loader`): a dict with `embed`, `final_norm`, optional `lm_head`, and `layers`, a tuple
with one dict of arrays per decoder layer (`attn_norm`, `q`, `k`, `v`, `o`, `mlp_norm`, `gate`, `up`, `down`
and the optional biases), each layer in buffers of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import tuning
from kvjax.ops.attention import prefill_attention
from kvjax.rope import apply_rope

Array = jax.Array
Weights = dict[str, Any]
#: `attention(q, k, v) -> (out [B, T, N, H], aux)`.
Attention = Callable[[Array, Array, Array], tuple[Array, Any]]

def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """RMSNorm as Hugging Face Llama: statistics in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def mlp(lw: Weights, x: Array) -> Array:
    """SwiGLU MLP of `[B, T, D]`; with `tuning.current().mlp_rows` a long input goes through in row slices."""
    rows = tuning.current().mlp_rows
    b, t, d = x.shape
    if rows is None or b * t <= rows or (b * t) % rows:
        return _mlp_rows(lw, x)
    slices = x.reshape(b * t // rows, 1, rows, d)
    return jax.lax.map(lambda xs: _mlp_rows(lw, xs), slices).reshape(b, t, d)


def _mlp_rows(lw: Weights, x: Array) -> Array:
    gate = jnp.einsum("btd,df->btf", x, lw["gate"])
    up = jnp.einsum("btd,df->btf", x, lw["up"])
    if "gate_bias" in lw:
        gate, up = gate + lw["gate_bias"], up + lw["up_bias"]
    out = jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, lw["down"])
    return out + lw["down_bias"] if "down_bias" in lw else out


def qkv(lw: Weights, h: Array, positions: Array, rope: tuple[Array, float]) -> tuple[Array, Array, Array]:
    """Post-RoPE queries `[B, T, N, H]`, keys and values `[B, T, K, H]` of the normed input `h` `[B, T, D]`."""
    q = jnp.einsum("btd,dnh->btnh", h, lw["q"])
    k = jnp.einsum("btd,dkh->btkh", h, lw["k"])
    v = jnp.einsum("btd,dkh->btkh", h, lw["v"])
    if "q_bias" in lw:
        q, k, v = q + lw["q_bias"], k + lw["k_bias"], v + lw["v_bias"]
    inv_freq, scaling = rope
    return apply_rope(q, positions, inv_freq, scaling), apply_rope(k, positions, inv_freq, scaling), v


def out_proj(lw: Weights, attn: Array) -> Array:
    """The attention output `[B, T, N, H]` projected back to `[B, T, D]`."""
    out = jnp.einsum("btnh,nhd->btd", attn, lw["o"])
    return out + lw["o_bias"] if "o_bias" in lw else out


def attention_inputs(config: Any, lw: Weights, x: Array, positions: Array,
                     rope: tuple[Array, float]) -> tuple[Array, Array, Array]:
    """What a layer's attention reads: post-RoPE q, k, v of the layer input `x` `[B, T, D]` (after its norm)."""
    return qkv(lw, rms_norm(x, lw["attn_norm"], config.rms_norm_eps), positions, rope)


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


def decoder_block(config: Any, lw: Weights, x: Array, positions: Array, rope: tuple[Array, float],
                  attention: Attention) -> tuple[Array, Any]:
    """One decoder layer on `x` `[B, T, D]` at `positions` `[B, T]` (-1: padding): `(x, aux)` where `aux` is
    what `attention` returned beside its output."""
    q, k, v = attention_inputs(config, lw, x, positions, rope)
    attn, aux = attention(q, k, v)
    x = x + out_proj(lw, attn)
    x = x + mlp(lw, rms_norm(x, lw["mlp_norm"], config.rms_norm_eps))
    return x, aux


def global_weights(weights: Weights) -> Weights:
    """The weights outside the layers (embedding, final norm, LM head)."""
    return {name: w for name, w in weights.items() if name != "layers"}


def embed(weights: Weights, tokens: Array) -> Array:
    """Input embeddings `[..., D]` of `tokens`."""
    return jnp.take(weights["embed"], tokens, axis=0)


def logits(config: Any, weights: Weights, x: Array) -> Array:
    """Logits `[..., V]` float32 of final hidden states `x` (before the final norm)."""
    x = rms_norm(x, weights["final_norm"], config.rms_norm_eps)
    head = weights["embed"].T if config.tie_word_embeddings else weights["lm_head"]
    return jnp.einsum("...d,dv->...v", x, head, preferred_element_type=jnp.float32)
