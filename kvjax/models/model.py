"""`DecoderLM`: the Flax NNX module users hold, and `load_model`.

The module is a container of `nnx.Param` weights plus a static config; all maths lives in pure
functions (`kvjax.models.transformer`) that the runtime jits over `model.weights()`, the functional
`nnx.split` / `merge` pattern without re-walking the object graph on every decode step. No cache or
mode is stored on the module.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import tuning
from kvjax.errors import CheckpointError, ConfigError, KvjaxError
from kvjax.models import block, transformer
from kvjax.models.block import Ropes
from kvjax.models.config import ModelConfig, read_config_json, read_generation_eos, text_config_dict
from kvjax.models.loader import (
    LAYER_PREFIX,
    check_no_remote_code,
    flatten,
    load_params,
    nest,
    param_shapes,
    separate_layer_shapes,
)
from kvjax.models.presets import resolve_model_dir
from kvjax.models.rope_scaling import longrope_uses_long, rope_frequencies
from kvjax.validation import token_ids, token_rows

Array = jax.Array
#: config.json keys that fix the weights' shapes: a checkpoint without them is refused, not defaulted.
REQUIRED_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads")

WRAPPED_REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers")

_DTYPES = {
    "float32": jnp.float32, "fp32": jnp.float32, "f32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "fp16": jnp.float16, "f16": jnp.float16,
}


def resolve_dtype(dtype: Any) -> Any:
    """Accepts a jnp dtype or one of the names float32 / bfloat16 / float16."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))}")
        return _DTYPES[dtype]
    return jnp.dtype(dtype).type if not isinstance(dtype, type) else dtype


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jit_forward(config: ModelConfig, tune: tuning.Tuning, weights: dict, rope: tuple, tokens: Array,
                 positions: Array):
    with tuning.use(tune):
        return transformer.forward(config, weights, rope, tokens, positions)


def _forward(config: ModelConfig, weights: dict, rope: tuple, tokens: Array, positions: Array) -> Array:
    return _jit_forward(config, tuning.current(), weights, rope, tokens, positions)


class DecoderLM(nnx.Module):
    """A decoder of any supported family (`kvjax.models.config.SUPPORTED_MODEL_TYPES`); `logits, _ = model(ids)`.

    Weights are stored per decoder layer from the moment they load (`layers`: one `nnx.Dict` per layer), the
    layout every inference path runs on: no stacked copy exists."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, Any], dtype: Any = None):
        """`weights`: flat `kvjax.models.loader.param_shapes` keys, or the nested pytree `weights()` returns."""
        weights = flatten(weights)
        expected = param_shapes(config)
        missing = sorted(set(expected) - set(weights))
        extra = sorted(set(weights) - set(expected))
        if missing or extra:
            raise CheckpointError(f"weights do not match the config: missing {missing}, unexpected {extra}")
        for name, shape in expected.items():
            if tuple(weights[name].shape) != tuple(shape):
                raise CheckpointError(
                    f"weight {name!r} has shape {tuple(weights[name].shape)}, expected {tuple(shape)}"
                )
        dtype = resolve_dtype(dtype)
        self.config = config
        nested = nest(weights)

        def params(group: Mapping[str, Any]) -> nnx.Dict:
            return nnx.Dict({k: nnx.Param(jnp.asarray(v, dtype=dtype or v.dtype)) for k, v in group.items()})

        self.params = params({k: v for k, v in nested.items() if k != "layers"})
        self.layers = nnx.List([params(layer) for layer in nested["layers"]])
        inv_freq, scaling = rope_frequencies(config)
        self.inv_freq = nnx.Variable(jnp.asarray(inv_freq, jnp.float32))
        self.rope_scaling = float(scaling)
        # LongRoPE's long factors (past the pretrained context); the sliding layers' own RoPE (Gemma 3).
        long_freq = None
        if config.rope.rope_type == "longrope":
            long_freq, _ = rope_frequencies(config, config.rope.original_max_position_embeddings + 1)
        self.long_inv_freq = nnx.data(None if long_freq is None else jnp.asarray(long_freq, jnp.float32))
        local_freq, local_scaling = rope_frequencies(config, local=True) if config.rope_local else (None, None)
        self.local_inv_freq = nnx.data(None if local_freq is None else jnp.asarray(local_freq, jnp.float32))
        self.local_rope_scaling = None if local_scaling is None else float(local_scaling)

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, dtype: Any = jnp.float32, scale: float = 0.02):
        """Random weights (benchmarks, tests); norms start at one (Gemma's `1 + weight` norms at zero). Each layer
        parameter is drawn for all layers at once (`[L, ...]`, then split), q / k / v and gate / up apart and then
        fused, so a seed gives the same weights whatever the storage layout."""
        rng = np.random.default_rng(seed)

        def draw(name: str, shape: tuple[int, ...]) -> np.ndarray:
            if name.endswith("norm"):
                return (np.zeros if config.norm_plus_one else np.ones)(shape, np.float32)
            return (rng.standard_normal(shape) * scale).astype(np.float32)

        shapes = param_shapes(config)
        weights = {"embed": draw("embed", shapes["embed"])}
        # Drawn unfused, then fused (`block.fuse_layer`): a seed gives the weights it gave before the fusion.
        separate = {name: draw(name, (config.num_layers, *shape))
                    for name, shape in separate_layer_shapes(config).items()}
        for name, stack in block.fuse_layer(separate).items():
            weights.update({f"{LAYER_PREFIX}{i}.{name}": stack[i] for i in range(config.num_layers)})
        for name in ("final_norm", "lm_head"):
            if name in shapes:
                weights[name] = draw(name, shapes[name])
        return cls(config, weights, dtype=dtype)

    @property
    def dtype(self) -> Any:
        return self.params["embed"][...].dtype

    def weights(self) -> dict[str, Any]:
        """The weights as a plain pytree (global arrays plus `layers`, a tuple of per-layer dicts), for the
        jitted pure functions (`kvjax.models.block`). The arrays are the module's own, not copies."""
        out: dict[str, Any] = {k: v[...] for k, v in self.params.items()}
        out["layers"] = tuple({k: v[...] for k, v in layer.items()} for layer in self.layers)
        return out

    def rope(self, length: int | None = None) -> Ropes:
        """The RoPE the runtime rotates with (`kvjax.models.block.Ropes`): the global layers' frequencies and
        scaling, and the sliding layers' where they differ. `length`: the longest sequence it will rotate, which
        picks LongRoPE's long factors past the pretrained context (as transformers does for a forward call whose
        positions go past it); None: the short ones."""
        inv_freq = self.inv_freq[...]
        if self.long_inv_freq is not None and longrope_uses_long(self.config.rope, length):
            inv_freq = self.long_inv_freq
        if self.local_inv_freq is None:
            return Ropes(inv_freq, self.rope_scaling)
        return Ropes(inv_freq, self.rope_scaling, self.local_inv_freq, self.local_rope_scaling)

    def _forward_traced(self, tokens: Array, positions: Any) -> Array:
        """The forward under the caller's jit: only the dtype of traced ids can be checked."""
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise KvjaxError(f"input_ids must hold integer token ids, got dtype {tokens.dtype}")
        tokens = tokens[None] if tokens.ndim == 1 else tokens
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        # Traced positions cannot pick LongRoPE's factors: the sequence's static length does.
        return _forward(self.config, self.weights(), self.rope(tokens.shape[1]), tokens.astype(jnp.int32),
                        jnp.broadcast_to(jnp.asarray(positions, jnp.int32), tokens.shape))

    def __call__(self, input_ids: Any, positions: Any = None) -> tuple[Array, None]:
        """Full-sequence logits `[B, T, V]` (float32), plain causal forward without compression."""
        if isinstance(input_ids, jax.core.Tracer) or isinstance(positions, jax.core.Tracer):
            return self._forward_traced(jnp.asarray(input_ids), positions), None  # values cannot be checked
        ids, ragged = token_rows(input_ids, "input_ids", self.config.vocab_size)
        if ragged is not None and (ragged != ids.shape[1]).any():
            raise KvjaxError(f"input_ids rows have different lengths {ragged.tolist()}: pad them to one length")
        tokens = jnp.asarray(ids, jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        else:
            positions = token_ids(positions, "positions")
            try:
                positions = np.broadcast_to(positions, tokens.shape)
            except ValueError as e:
                raise KvjaxError(f"positions has shape {positions.shape}, input_ids {tuple(tokens.shape)}") from e
        length = int(np.max(positions)) + 1 if np.size(positions) else 0
        return _forward(self.config, self.weights(), self.rope(length), tokens, jnp.asarray(positions, jnp.int32)), None


def load_model(
    name_or_dir: str | os.PathLike,
    dtype: Any = None,
    *,
    model_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
) -> DecoderLM:
    """Loads a local Hugging Face directory (or a preset name resolved to one) into a `DecoderLM`.

    Only `config.json` + `*.safetensors` are read (and `generation_config.json`'s `eos_token_id`, which then
    replaces config.json's as the ids generation stops on, as in transformers); nothing is downloaded; pickled
    checkpoints and remote code are refused.
    """
    if trust_remote_code:
        raise ConfigError("kvjax never runs remote code: the trust_remote_code option is not supported")
    path = resolve_model_dir(str(name_or_dir), model_dir=model_dir)
    raw = read_config_json(path)
    check_no_remote_code(raw)
    try:
        text = text_config_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{str(path / 'config.json')!r}: {e}") from e
    # A multimodal wrapper's text_config lists only what differs from transformers' defaults (Gemma 3 4B+ rely
    # on them), so only its sizes are required there.
    required = REQUIRED_KEYS if text is raw else WRAPPED_REQUIRED_KEYS
    missing = [k for k in required if k not in text]
    if missing:  # transformers' defaults for these would only surface later as a weight-shape mismatch
        where = "" if text is raw else " (text_config)"
        raise CheckpointError(f"{str(path / 'config.json')!r}{where} has no {', '.join(missing)}: a checkpoint's "
                              "config.json must give its architecture")
    try:
        config = ModelConfig.from_hf_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{str(path / 'config.json')!r}: {e}") from e
    eos = read_generation_eos(path)  # what transformers' generate stops on, when the checkpoint gives it
    if eos is not None and eos != config.eos_token_ids:
        config = dataclasses.replace(config, eos_token_ids=eos)
    np_dtype = None if dtype is None else np.dtype(resolve_dtype(dtype))
    weights = load_params(path, config, dtype=np_dtype)
    return DecoderLM(config, weights, dtype=dtype)
