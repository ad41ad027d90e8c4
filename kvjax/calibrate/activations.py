"""What the calibrations read from a model: calibration prompts from kvjax's own synthetic tasks, and a plain
forward (no cache, no compression) that hands each layer's attention inputs to a visitor.

The forward is kvjax's decoder block (`kvjax.models.block.decoder_block`), run layer by layer so nothing is held
for more than one layer: per layer the visitor gets a `LayerActivations` (the normed attention input `hidden`,
the pre-RoPE queries / keys after biases and QK-norm, the post-RoPE queries / keys the attention reads, the
values, and the output projection). One jitted program serves every layer of a model (the weights are its
arguments), so a calibration compiles once per prompt length.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import tuning
from kvjax.models import block

Array = jax.Array

#: The synthetic tasks calibration prompts come from (RULER-like haystacks with needles, variable tracking,
#: frequent words), cycled over the samples.
CALIBRATION_TASKS = ("ruler/niah_single_2", "ruler/niah_multikey_1", "ruler/niah_multivalue", "ruler/vt",
                     "ruler/fwe", "ruler/niah_multikey_2")


@dataclasses.dataclass(frozen=True)
class LayerActivations:
    """One layer's attention inputs for one prompt of `T` tokens (batch axis dropped), float32 numpy.

    `hidden` `[T, D]`: the attention input (after the layer's input norm); `q_pre` `[T, N, H]` / `k_pre`
    `[T, K, H]`: queries / keys before RoPE (after biases and QK-norm); `q` / `k`: after RoPE (queries carry the
    family's attention scale, as the block hands them to attention); `v` `[T, K, H]`; `o` `[N, H, D]`: the output
    projection."""

    layer: int
    hidden: np.ndarray
    q_pre: np.ndarray
    k_pre: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray


Visitor = Callable[[LayerActivations], None]


def pre_rope(config: Any, lw: dict, h: Array) -> tuple[Array, Array]:
    """Queries `[B, T, N, H]` and keys `[B, T, K, H]` of the normed input `h` before RoPE (biases, QK-norm): the
    block's own fused projection."""
    q, k, _ = block.projections(config, lw, h)
    return q, k


def _layer(config: Any, window: int | None, lw: dict, x: Array, positions: Array, rope: tuple) -> tuple[Array, tuple]:
    h = block.norm(config, x, lw["attn_norm"])
    q_pre, k_pre = pre_rope(config, lw, h)
    seen = {}

    def attend(q: Array, k: Array, v: Array) -> tuple[Array, None]:
        seen.update(q=q, k=k, v=v)
        return block.self_attention(q, k, v, positions, sliding_window=window), None

    x, _ = block.decoder_block(config, lw, x, positions, rope, attend)
    f32 = [a.astype(jnp.float32)[0] for a in (h, q_pre, k_pre, seen["q"], seen["k"], seen["v"])]
    return x, tuple(f32)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jit_layer(config: Any, tune: tuning.Tuning, window: int | None, lw: dict, x: Array, positions: Array,
               rope: tuple) -> tuple:
    """`_layer` compiled per (config, tuning, the layer's window): a later `tuning.override` compiles its own
    program."""
    with tuning.use(tune):
        return _layer(config, window, lw, x, positions, rope)


_jit_embed = jax.jit(block.embed, static_argnums=(0,))


def run_layers(model: Any, tokens: Sequence[int], visit: Visitor) -> None:
    """The plain forward of `model` (a `DecoderLM`) over one prompt, each layer with its window and RoPE; `visit` gets
    every layer's activations."""
    ids = jnp.asarray(np.asarray(tokens, np.int32)[None])
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    weights = model.weights()
    rope = model.rope(ids.shape[1])
    x = _jit_embed(model.config, block.global_weights(weights), ids)
    tune = tuning.current()
    for i, lw in enumerate(weights["layers"]):
        x, (h, q_pre, k_pre, q, k, v) = _jit_layer(model.config, tune, model.config.layer_window(i), lw, x,
                                                   positions, block.layer_rope(model.config, rope, i))
        visit(LayerActivations(i, *(np.asarray(a) for a in (h, q_pre, k_pre, q, k, v)),
                               np.asarray(lw["o"], np.float32)))


def calibration_texts(tokenizer: Any, samples: int, context_length: int, seed: int,
                      tasks: Sequence[str] = CALIBRATION_TASKS) -> list[str]:
    """`samples` prompts of about `context_length` tokens from kvjax's synthetic tasks (seeded, so the same
    arguments give the same texts), the tasks taking turns."""
    from kvjax import tasks as registry
    from kvjax.tasks.base import full_prompt

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    per_task = [samples // len(tasks) + (i < samples % len(tasks)) for i in range(len(tasks))]
    drawn = []
    for name, n in zip(tasks, per_task, strict=True):
        if n:
            task = registry.get(name, tokenizer=tokenizer)
            drawn.append([full_prompt(s) for s in task.samples(count_tokens=count, context_length=context_length,
                                                                num_samples=n, seed=seed)])
    return [texts[i] for i in range(max(per_task)) for texts in drawn if i < len(texts)]


def calibration_tokens(tokenizer: Any, samples: int, context_length: int, seed: int, *,
                       special_tokens: bool = True) -> list[list[int]]:
    """The calibration prompts as token ids cut to `context_length` (texts are drawn a quarter longer, so nearly
    every prompt has exactly that many tokens and one compiled program serves them all); `special_tokens`: the
    tokenizer's own (a BOS) first."""
    longer = context_length + context_length // 4 + 128
    return [list(tokenizer.encode(text, add_special_tokens=special_tokens))[:context_length]
            for text in calibration_texts(tokenizer, samples, longer, seed)]


__all__ = ["CALIBRATION_TASKS", "LayerActivations", "calibration_texts", "calibration_tokens", "pre_rope",
           "run_layers"]
