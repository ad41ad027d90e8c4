"""Start a run from a trained model, grown to a larger architecture without changing its function.

New layers and new attention heads get random input projections and zero output projections
(`o`, and `down` for the MLP), so the grown model computes exactly what the trained one did and
training moves on from there instead of from scratch. Query heads are added per KV group so GQA's
head-to-group mapping of the old heads is kept.
"""

from __future__ import annotations

import numpy as np

from kvjax.errors import ConfigError
from kvjax.models import block
from kvjax.models.config import ModelConfig
from kvjax.models.loader import flatten, nest


def layer_order(old_layers: int, new_layers: int) -> list[int | None]:
    """Old layer index per new layer, with the `new - old` identity layers spread between them."""
    if new_layers < old_layers:
        raise ConfigError(f"cannot shrink {old_layers} layers to {new_layers}")
    extra = new_layers - old_layers
    after = sorted({max(1, round((i + 1) * old_layers / (extra + 1))) for i in range(extra)})
    while len(after) < extra:  # more new layers than gaps: the rest go at the end
        after.append(old_layers)
    order: list[int | None] = []
    for old in range(old_layers):
        order.append(old)
        order += [None] * after.count(old + 1)
    return order


def grow(weights: dict, old: ModelConfig, new: ModelConfig, seed: int = 0, scale: float = 0.02) -> dict:
    """`weights` of `old` (nested as `DecoderLM.weights()` returns them, or flat ``layers.{i}.<name>`` keys)
    embedded in the larger `new` architecture (same function, see module doc): host float32 arrays, nested
    (`kvjax.models.loader.nest`), one dict per layer."""
    if old.qkv_bias or old.o_bias or old.mlp_bias:
        raise ConfigError("growing a model with biases is not supported")
    same = ("vocab_size", "hidden_size", "head_dim", "rms_norm_eps", "rope", "tie_word_embeddings")
    for name in same:
        if getattr(old, name) != getattr(new, name):
            raise ConfigError(f"cannot grow across {name}: {getattr(old, name)} -> {getattr(new, name)}")
    if new.num_kv_heads < old.num_kv_heads or new.intermediate_size < old.intermediate_size:
        raise ConfigError("growing keeps or adds KV heads and MLP width, never removes them")
    old_group, new_group = old.num_heads // old.num_kv_heads, new.num_heads // new.num_kv_heads
    if new_group < old_group:
        raise ConfigError(f"query heads per KV head cannot shrink ({old_group} -> {new_group})")
    rng = np.random.default_rng(seed)
    old_weights = nest({k: np.asarray(v, np.float32) for k, v in flatten(weights).items()})
    d, hd, f = new.hidden_size, new.head_dim, new.intermediate_size

    def rand(*shape):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    # Query head slots of the grown model that hold an old head: old group g, member j -> g * new_group + j.
    q_slots = [g * new_group + j for g in range(old.num_kv_heads) for j in range(old_group)]
    layers = []
    for source in layer_order(old.num_layers, new.num_layers):
        q, k, v = rand(d, new.num_heads, hd), rand(d, new.num_kv_heads, hd), rand(d, new.num_kv_heads, hd)
        o = np.zeros((new.num_heads, hd, d), np.float32)
        gate, up = rand(d, f), rand(d, f)
        down = np.zeros((f, d), np.float32)
        attn_norm, mlp_norm = np.ones(d, np.float32), np.ones(d, np.float32)
        if source is not None:
            lw = old_weights["layers"][source]
            old_q, old_k, old_v = block.split_qkv(lw["qkv"])
            old_gate, old_up = block.split_gate_up(lw["gate_up"])
            q[:, q_slots] = old_q
            o[q_slots] = lw["o"]
            k[:, : old.num_kv_heads] = old_k
            v[:, : old.num_kv_heads] = old_v
            gate[:, : old.intermediate_size] = old_gate
            up[:, : old.intermediate_size] = old_up
            down[: old.intermediate_size] = lw["down"]
            attn_norm, mlp_norm = lw["attn_norm"].copy(), lw["mlp_norm"].copy()
        layers.append(dict(attn_norm=attn_norm, mlp_norm=mlp_norm, qkv=block.fuse_qkv(q, k, v), o=o,
                           gate_up=block.fuse_gate_up(gate, up), down=down))
    return {**{k: w for k, w in old_weights.items() if k != "layers"}, "layers": tuple(layers)}
