"""Model configuration: read from, and written back to, a Hugging Face ``config.json``.

Both serialisations of RoPE that exist in the wild are read:

* transformers v4: top-level ``rope_theta`` plus an optional ``rope_scaling`` dict whose type is
  under ``type`` (older) or ``rope_type``;
* transformers v5: a ``rope_parameters`` dict holding ``rope_theta``, ``rope_type`` and the scaling
  parameters (this is what ``save_pretrained`` writes in transformers 5).

As in transformers 5, a truthy ``rope_scaling`` takes precedence over ``rope_parameters``, a
top-level ``rope_theta`` fills in a missing ``rope_parameters["rope_theta"]``, and llama3 / yarn get
``original_max_position_embeddings = max_position_embeddings`` when it is absent. Keys missing from
a config take the defaults of the matching transformers 5 config class, so a config parses to the
model transformers would build from it.

``ModelConfig.to_hf_dict`` writes the transformers 5 form (``rope_parameters``).

One ``rope_type`` is kvjax's own: ``freq_factors`` (``freq_factors``: one number per rotary frequency, each base
frequency divided by its factor, as llama.cpp applies its ``rope_freqs`` tensor), which the GGUF import writes for
a Llama file whose factors are not llama3's (:mod:`kvjax.models.gguf`). transformers does not read it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from kvjax.errors import CheckpointError, ConfigError

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "ModelConfig",
    "RopeConfig",
    "check_no_remote_code",
    "read_config_json",
    "read_generation_eos",
]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
#: model_types read through another: a multimodal Gemma 3 checkpoint is read as its text decoder.
WRAPPER_MODEL_TYPES: dict[str, str] = {"gemma3": "gemma3_text"}
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "longrope", "freq_factors")
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
DEFAULT_ROPE_THETA = 10000.0
#: MLP activations of the decoder block (transformers' names).
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Family:
    """What a model_type fixes in the decoder block (the flags `ModelConfig` resolves from it)."""

    qk_norm: bool = False  # per-head RMSNorm on queries and keys before RoPE (Qwen3, Gemma 3)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + weight), in float32 (Gemma)
    post_norms: bool = False  # RMSNorm on the attention output and on the MLP output (Gemma 2 / 3)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the weights' dtype (Gemma)
    activation: str = "silu"
    rope_types: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
    per_layer_windows: bool = False  # layer_types may mix sliding and full layers
    default_theta: float = DEFAULT_ROPE_THETA


FAMILIES: dict[str, Family] = {
    "llama": Family(rope_types=("default", "linear", "llama3", "yarn", "freq_factors")),
    "mistral": Family(),
    "qwen2": Family(per_layer_windows=True),
    "qwen3": Family(qk_norm=True, per_layer_windows=True),
    "gemma3_text": Family(qk_norm=True, norm_plus_one=True, post_norms=True, embed_scale=True,
                          activation="gelu_pytorch_tanh", per_layer_windows=True, default_theta=1_000_000.0),
    "phi3": Family(rope_types=("default", "longrope")),
}

# Defaults of transformers 5's config classes, for keys a config.json omits.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 4096,
    },
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "gemma3_text": {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
    },
    "phi3": {
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "pad_token_id": 32000,
        "sliding_window": None,
    },
}

# Scaling parameters each rope_type uses (besides theta); the others must be None.
_ROPE_FIELDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
    # LongRoPE (Phi-3's "su"): per-frequency factors, the short set up to the pretrained context, the long beyond.
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"),
    # kvjax's own: llama.cpp's per-frequency factors (a Llama GGUF's rope_freqs.weight), each dividing its frequency.
    "freq_factors": ("freq_factors",),
}
_ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("original_max_position_embeddings", "short_factor", "long_factor"),
    "freq_factors": ("freq_factors",),
}
#: rope_type spellings of older configs.
_ROPE_ALIASES = {"su": "longrope"}
_LAYER_TYPE_KEYS = (FULL, SLIDING)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _as_float(value: Any, name: str, *, positive: bool = False) -> float:
    if not _is_number(value) or (positive and value <= 0):
        kind = "a positive number" if positive else "a finite number"
        raise ConfigError(f"{name}={value!r} must be {kind}")
    return float(value)


def _as_int(value: Any, name: str, *, minimum: int = 1) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


def _as_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be true or false")
    return value


def _optional_token(value: Any, name: str) -> int | None:
    return None if value is None else _as_int(value, name, minimum=0)


#: ``auto_map`` entries that name the publisher's own copy of an architecture transformers (and kvjax) implement
#: (Phi-3's repositories keep theirs beside transformers' Phi3): not custom code kvjax would need.
_BUILTIN_AUTO_MAP: dict[str, frozenset[str]] = {
    "phi3": frozenset({"configuration_phi3.Phi3Config", "modeling_phi3.Phi3ForCausalLM"}),
}


def check_no_remote_code(config_dict: Mapping[str, Any]) -> None:
    """Refuse a config that needs ``trust_remote_code`` (has ``auto_map``); kvjax never runs it. An ``auto_map``
    naming only the publisher's copy of a built-in architecture (Phi-3's) is accepted: kvjax runs its own."""
    if not isinstance(config_dict, Mapping):
        raise ConfigError(f"a model config must be a JSON object, got {type(config_dict).__name__}")
    auto_map = config_dict.get("auto_map")
    builtin = _BUILTIN_AUTO_MAP.get(config_dict.get("model_type"))  # type: ignore[arg-type]
    if auto_map and builtin and isinstance(auto_map, Mapping) and set(map(str, auto_map.values())) <= builtin:
        return
    if auto_map:
        raise ConfigError(
            f"config has auto_map={auto_map!r}: this model needs custom code (trust_remote_code), "
            "which kvjax never runs; only the built-in architectures "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} are supported"
        )


def missing_model_error(path: pathlib.Path) -> CheckpointError:
    """The error for a model path that does not exist: a GGUF file when it is named ``*.gguf``, else a directory."""
    what = "GGUF file" if path.suffix.lower() == ".gguf" else "model directory"
    return CheckpointError(f"{what} {str(path)!r} does not exist")


def read_config_json(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``<model_dir>/config.json`` as a dict (CheckpointError if the dir or file is bad)."""
    path = pathlib.Path(model_dir).expanduser()
    if not path.exists():
        raise missing_model_error(path)
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"no config.json in model directory {str(path)!r}: expected a Hugging Face model "
            "directory (config.json + *.safetensors)"
        )
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{str(config_file)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{str(config_file)!r} must hold a JSON object, got {type(data).__name__}"
        )
    return data


GENERATION_CONFIG = "generation_config.json"


def read_generation_eos(model_dir: str | os.PathLike[str]) -> tuple[int, ...] | None:
    """The ``eos_token_id`` of ``<model_dir>/generation_config.json``, or None when the file or the key is absent.

    transformers' ``generate`` stops on these ids, not ``config.json``'s: instruct checkpoints list their end-of-turn
    token there only (Phi-3-mini-instruct's ``<|end|>``, 32007, beside config.json's 32000)."""
    path = pathlib.Path(model_dir).expanduser() / GENERATION_CONFIG
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(path)!r} must hold a JSON object, got {type(data).__name__}")
    try:
        return None if data.get("eos_token_id") is None else _eos_ids(data["eos_token_id"])
    except ConfigError as e:
        raise ConfigError(f"{str(path)!r}: {e}") from e


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, named as in transformers' ``rope_parameters``.

    Parameters a ``rope_type`` does not use are None. Optional yarn parameters left None take
    transformers' defaults (beta_fast 32, beta_slow 1, truncate True, attention_factor from factor).
    """

    theta: float = DEFAULT_ROPE_THETA
    rope_type: str = "default"
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_type={rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        object.__setattr__(self, "theta", _as_float(self.theta, "rope_theta", positive=True))
        used = _ROPE_FIELDS[rope_type]
        for f in dataclasses.fields(self):
            if f.name in ("theta", "rope_type"):
                continue
            value = getattr(self, f.name)
            if value is None:
                if f.name in _ROPE_REQUIRED[rope_type]:
                    raise ConfigError(f"rope_type={rope_type!r} requires {f.name}")
                continue
            if f.name not in used:
                raise ConfigError(
                    f"{f.name}={value!r} is not a parameter of rope_type={rope_type!r}"
                )
            if f.name == "truncate":
                value = _as_bool(value, "truncate")
            elif f.name in ("short_factor", "long_factor", "freq_factors"):
                if not isinstance(value, list | tuple) or not value:
                    raise ConfigError(f"{f.name}={value!r} must be a non-empty list of numbers")
                value = tuple(_as_float(x, f.name, positive=True) for x in value)
            elif f.name == "original_max_position_embeddings":
                value = _as_int(value, f.name)
            elif f.name in ("factor", "attention_factor"):
                value = _as_float(value, f.name, positive=True)
            else:
                value = _as_float(value, f.name)
            object.__setattr__(self, f.name, value)
        if rope_type == "llama3" and self.low_freq_factor == self.high_freq_factor:
            raise ConfigError(
                f"high_freq_factor={self.high_freq_factor!r} must differ from "
                f"low_freq_factor={self.low_freq_factor!r} for rope_type='llama3'"
            )

    @classmethod
    def from_hf(
        cls,
        params: Mapping[str, Any],
        *,
        max_position_embeddings: int,
        rope_theta: Any = None,
        original_max_position_embeddings: Any = None,
        field: str = "rope_parameters",
        supported: tuple[str, ...] = FAMILIES["llama"].rope_types,
        default_theta: float = DEFAULT_ROPE_THETA,
    ) -> RopeConfig:
        """Build from a transformers ``rope_parameters`` / ``rope_scaling`` dict named ``field``.

        ``rope_theta`` and ``original_max_position_embeddings`` are top-level config values, used as
        transformers 5 does (the former when the dict has no theta, the latter in priority).
        ``supported``: the rope types of the model's family; ``default_theta``: its theta when none is given.
        """
        if not isinstance(params, Mapping):
            raise ConfigError(f"{field}={params!r} must be a JSON object")
        rope_type = params.get("rope_type") or params.get("type") or "default"
        rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
        if rope_type not in supported:
            raise ConfigError(
                f"{field}.rope_type={rope_type!r} is not supported; supported: "
                f"{', '.join(supported)}"
            )
        partial = params.get("partial_rotary_factor")
        if partial is not None and partial != 1:
            raise ConfigError(
                f"{field}.partial_rotary_factor={partial!r} is not supported "
                "(kvjax rotates the full head)"
            )
        theta = params.get("rope_theta")
        if theta is None:
            theta = rope_theta if rope_theta is not None else default_theta
        kwargs: dict[str, Any] = {}
        for name in _ROPE_FIELDS[rope_type]:
            if params.get(name) is not None:
                kwargs[name] = params[name]
        if rope_type in ("llama3", "yarn", "longrope"):
            if original_max_position_embeddings is not None:
                kwargs["original_max_position_embeddings"] = original_max_position_embeddings
            kwargs.setdefault("original_max_position_embeddings", max_position_embeddings)
        try:
            return cls(theta=theta, rope_type=rope_type, **kwargs)
        except ConfigError as e:
            raise ConfigError(f"{field}: {e}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers 5 ``rope_parameters`` dict."""
        out: dict[str, Any] = {"rope_theta": self.theta, "rope_type": self.rope_type}
        for name in _ROPE_FIELDS[self.rope_type]:
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value) if isinstance(value, tuple) else value
        return out


def _rope_params_from_dict(d: Mapping[str, Any]) -> tuple[Mapping[str, Any], str, Mapping[str, Any] | None, str]:
    """The RoPE dicts of a config: `(global params, field, sliding layers' params or None, field)`.

    A v4 ``rope_scaling`` wins over the v5 ``rope_parameters``. transformers 5 nests ``rope_parameters`` per layer
    type (``full_attention`` / ``sliding_attention``) for models whose sliding-window layers rotate differently."""
    if d.get("rope_scaling"):
        params, field = d["rope_scaling"], "rope_scaling"
    else:
        params, field = d.get("rope_parameters") or {}, "rope_parameters"
    local, local_field = None, ""
    if isinstance(params, Mapping) and any(k in params for k in _LAYER_TYPE_KEYS):
        nested = params
        first = next(k for k in _LAYER_TYPE_KEYS if nested.get(k) is not None)
        params, field = nested[first], f"{field}.{first}"
        if first == FULL and nested.get(SLIDING) is not None:
            local, local_field = nested[SLIDING], f"{field.rsplit('.', 1)[0]}.{SLIDING}"
    return params, field, local, local_field


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(_as_int(v, "eos_token_id", minimum=0) for v in value)
    return (_as_int(value, "eos_token_id", minimum=0),)


def _layer_types(d: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """`(sliding_window, layer_types)` as transformers builds the attention of each layer from a config."""
    defaults = _HF_DEFAULTS[model_type]

    def get(key: str) -> Any:
        return d.get(key, defaults.get(key))

    window = get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        use = _as_bool(get("use_sliding_window"), "use_sliding_window")
        window = window if use else None
    if window is not None:
        window = _as_int(window, "sliding_window")
    if model_type == "llama":
        return None, (FULL,) * num_layers
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list | tuple) or len(layer_types) != num_layers or any(
                t not in _LAYER_TYPE_KEYS for t in layer_types):
            raise ConfigError(f"layer_types={layer_types!r} must list one of {', '.join(_LAYER_TYPE_KEYS)} per "
                              f"layer ({num_layers} layers)")
        if model_type in ("qwen2", "qwen3") and window is None:
            return None, (FULL,) * num_layers  # use_sliding_window=false: transformers applies no window
        max_pos = _as_int(get("max_position_embeddings"), "max_position_embeddings")
        if (not FAMILIES[model_type].per_layer_windows and window is not None and window < max_pos
                and set(layer_types) == {FULL}):
            raise ConfigError(f"{model_type}: layer_types lists only full_attention layers but "
                              f"sliding_window={window}, which transformers' {ARCHITECTURES[model_type]} (it reads no "
                              "layer_types) applies to every layer: set sliding_window to null for full attention, or "
                              "drop layer_types")
        return window, tuple(layer_types)
    if model_type in ("qwen2", "qwen3"):
        if window is None:
            return None, (FULL,) * num_layers
        first = _as_int(get("max_window_layers"), "max_window_layers", minimum=0)
        return window, tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    if model_type == "gemma3_text":
        pattern = _as_int(get("sliding_window_pattern"), "sliding_window_pattern")
        return window, tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    return window, ((SLIDING if window is not None else FULL),) * num_layers  # mistral, phi3: one window for all


def text_config_dict(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """The dict that describes the text decoder: ``d`` itself, or a multimodal wrapper's ``text_config`` with the
    wrapper's token ids (Gemma 3 4B and larger ship as ``model_type="gemma3"``)."""
    wrapped = WRAPPER_MODEL_TYPES.get(d.get("model_type"))  # type: ignore[arg-type]
    if wrapped is None:
        return d
    text = d.get("text_config") or {}
    if not isinstance(text, Mapping):
        raise ConfigError(f"text_config={text!r} must be a JSON object")
    out = {**text, "model_type": wrapped}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if d.get(key) is not None:
            out[key] = d[key]
    return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder kvjax runs (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text, Phi-3 / Phi-4), in
    kvjax's names: every family is a configuration of the one decoder block (`kvjax.models.block`).

    ``qkv_bias`` / ``o_bias`` / ``mlp_bias``: which projections carry a bias (Qwen2: q, k, v; Llama / Qwen3 /
    Gemma 3 ``attention_bias`` biases q, k, v and o, Llama ``mlp_bias`` the MLP; Mistral, Phi-3: none).
    ``layer_types``: ``"sliding_attention"`` or ``"full_attention"`` per layer (None when every layer is alike:
    all sliding when ``sliding_window`` is set, else all full; a window as long as the context is none); a sliding
    layer attends the last
    ``sliding_window`` positions (a query at p sees keys at p - window + 1 .. p) and rotates with ``rope_local``
    when that is set (Gemma 3's local RoPE base), else with ``rope``.
    The family flags (None: what the model_type has, see `FAMILIES`): ``qk_norm``, ``norm_plus_one`` (RMSNorm
    scales by 1 + weight), ``post_norms`` (norms after attention and after the MLP), ``embed_scale`` (embeddings
    times sqrt(hidden_size)), ``hidden_act``. ``query_pre_attn_scalar``: attention logits scaled by its inverse
    square root instead of head_dim's (Gemma); ``final_logit_softcapping``: logits -> c tanh(logits / c).
    ``multimodal``: the checkpoint is a multimodal model's (Gemma 3 4B+): its text decoder is read, under
    ``language_model.``, and the vision tower is left unread.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    hidden_act: str | None = None
    qk_norm: bool | None = None
    norm_plus_one: bool | None = None
    post_norms: bool | None = None
    embed_scale: bool | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local: RopeConfig | None = None
    multimodal: bool = False

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={self.model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            object.__setattr__(self, name, _as_int(getattr(self, name), name))
        object.__setattr__(
            self, "rms_norm_eps", _as_float(self.rms_norm_eps, "rms_norm_eps", positive=True)
        )
        family = FAMILIES[self.model_type]
        for rope, name in ((self.rope, "rope"), (self.rope_local, "rope_local")):
            if name == "rope_local" and rope is None:
                continue
            if not isinstance(rope, RopeConfig):
                raise ConfigError(f"{name}={rope!r} must be a RopeConfig")
            if rope.rope_type not in family.rope_types:
                raise ConfigError(f"{self.model_type}: rope_type={rope.rope_type!r} is not supported; supported: "
                                  f"{', '.join(family.rope_types)}")
            if rope.rope_type == "longrope":
                for which in (rope.short_factor, rope.long_factor):
                    if len(which) != self.head_dim // 2:
                        raise ConfigError(f"longrope short_factor / long_factor have {len(which)} entries, expected "
                                          f"head_dim / 2 = {self.head_dim // 2}")
            if rope.rope_type == "freq_factors" and len(rope.freq_factors) != self.head_dim // 2:
                raise ConfigError(f"freq_factors has {len(rope.freq_factors)} entries, expected head_dim / 2 = "
                                  f"{self.head_dim // 2}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not divisible by "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        act = family.activation if self.hidden_act is None else self.hidden_act
        if act not in SUPPORTED_ACTIVATIONS:
            allowed = ", ".join(map(repr, SUPPORTED_ACTIVATIONS))
            raise ConfigError(f"hidden_act={act!r} is not supported (only {allowed})")
        object.__setattr__(self, "hidden_act", act)
        for name in ("qk_norm", "norm_plus_one", "post_norms", "embed_scale"):
            want = getattr(family, name)
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, want)
            elif _as_bool(value, name) != want:
                raise ConfigError(f"{self.model_type}: {name}={value} is fixed by the family ({want})")
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "multimodal"):
            _as_bool(getattr(self, name), name)
        for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _as_float(getattr(self, name), name, positive=True))
        if self.sliding_window is not None:
            object.__setattr__(
                self, "sliding_window", _as_int(self.sliding_window, "sliding_window")
            )
        self._resolve_layer_types(family)
        object.__setattr__(self, "eos_token_ids", _eos_ids(self.eos_token_ids))
        object.__setattr__(self, "bos_token_id", _optional_token(self.bos_token_id, "bos_token_id"))
        object.__setattr__(self, "pad_token_id", _optional_token(self.pad_token_id, "pad_token_id"))
        self._check_family()

    def _resolve_layer_types(self, family: Family) -> None:
        """One type per layer (all sliding when only ``sliding_window`` is given); the window and the local RoPE
        dropped when no layer slides, so equal architectures compare equal."""
        types = self.layer_types
        if types is None:
            types = ((SLIDING if self.sliding_window is not None else FULL),) * self.num_layers
        if not isinstance(types, list | tuple) or len(types) != self.num_layers or any(
                t not in _LAYER_TYPE_KEYS for t in types):
            raise ConfigError(f"layer_types={types!r} must list one of {', '.join(_LAYER_TYPE_KEYS)} per layer "
                              f"({self.num_layers} layers)")
        types = tuple(types)
        if self.sliding_window is not None and self.sliding_window >= self.max_position_embeddings:
            types = (FULL,) * self.num_layers  # never narrower than the context (Phi-3.5-mini's 262144): no window
        if SLIDING in types and self.sliding_window is None:
            sliding = [i for i, t in enumerate(types) if t == SLIDING]
            raise ConfigError(f"layer_types has sliding_attention layers {sliding} but sliding_window is null: a "
                              "sliding layer needs its window")
        if not family.per_layer_windows and len(set(types)) > 1:
            raise ConfigError(f"{self.model_type}: layer_types={list(types)} mixes sliding and full layers, which "
                              "this family does not (one sliding_window for every layer)")
        if SLIDING not in types:
            object.__setattr__(self, "sliding_window", None)
            object.__setattr__(self, "rope_local", None)
        if self.rope_local == self.rope:
            object.__setattr__(self, "rope_local", None)
        # Kept only when the layers differ: every layer alike is what sliding_window says alone (and a copy with
        # another num_layers stays valid).
        object.__setattr__(self, "layer_types", types if len(set(types)) > 1 else None)

    def _check_family(self) -> None:
        """Keep the flags within what the family's HF config expresses (to_hf_dict round-trips)."""
        mt = self.model_type
        if mt in ("llama", "qwen3", "gemma3_text"):
            if self.qkv_bias != self.o_bias:
                raise ConfigError(
                    f"{mt}: qkv_bias={self.qkv_bias} and o_bias={self.o_bias} must be equal "
                    "(both come from attention_bias)"
                )
            if mt == "llama" and self.sliding_window is not None:
                raise ConfigError(f"llama: sliding_window={self.sliding_window} is not supported")
            if mt != "llama" and self.mlp_bias:
                raise ConfigError(f"{mt} has no MLP biases; got mlp_bias=True")
        elif mt == "qwen2":
            if not self.qkv_bias or self.o_bias or self.mlp_bias:
                raise ConfigError(
                    f"qwen2 has q/k/v biases only; got qkv_bias={self.qkv_bias}, "
                    f"o_bias={self.o_bias}, mlp_bias={self.mlp_bias}"
                )
        elif self.qkv_bias or self.o_bias or self.mlp_bias:
            raise ConfigError(
                f"{mt} has no biases; got qkv_bias={self.qkv_bias}, o_bias={self.o_bias}, "
                f"mlp_bias={self.mlp_bias}"
            )
        gemma = mt == "gemma3_text"
        if not gemma and (self.query_pre_attn_scalar is not None or self.final_logit_softcapping is not None):
            raise ConfigError(f"{mt}: query_pre_attn_scalar / final_logit_softcapping belong to Gemma")
        if self.rope_local is not None and not gemma:
            raise ConfigError(f"{mt}: a separate RoPE for sliding-window layers (rope_local) belongs to Gemma 3")
        if self.multimodal and not gemma:
            raise ConfigError(f"{mt}: multimodal checkpoints are read for Gemma 3 only")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None: it attends every earlier position)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def all_layer_types(self) -> tuple[str, ...]:
        """`"sliding_attention"` / `"full_attention"` of every layer (`layer_types` is None when all are alike)."""
        return tuple(SLIDING if w is not None else FULL for w in self.layer_windows)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """`layer_window` of every layer."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers without a window: those a compression method acts on."""
        return tuple(i for i, w in enumerate(self.layer_windows) if w is None)

    @property
    def method_layers(self) -> int:
        """How many layers a compression method manages (the global ones; at least 1, so that a model whose every
        layer slides still builds a method's state, which then goes unused)."""
        return max(1, len(self.global_layers))

    def method_layer(self, layer: int) -> int:
        """Layer `layer`'s index among the global layers: the `Step.layer` a method sees (a method treats the
        global layers as its model: PyramidKV's schedule, Quest's dense layers, ActQKV's budget run over them)."""
        return self.global_layers.index(layer)

    @property
    def query_scale(self) -> float:
        """What the queries are multiplied by so that attention's `1 / sqrt(head_dim)` becomes the family's scale
        (`query_pre_attn_scalar ** -0.5`); 1.0 for the others."""
        if self.query_pre_attn_scalar is None or self.query_pre_attn_scalar == self.head_dim:
            return 1.0
        return math.sqrt(self.head_dim / self.query_pre_attn_scalar)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict (transformers v4 or v5 layout)."""
        check_no_remote_code(d)
        supported = ", ".join(SUPPORTED_MODEL_TYPES + tuple(WRAPPER_MODEL_TYPES))
        model_type = d.get("model_type")
        if model_type is None:
            raise ConfigError("config has no model_type; expected one of " + supported)
        if model_type not in SUPPORTED_MODEL_TYPES and model_type not in WRAPPER_MODEL_TYPES:
            raise ConfigError(f"model_type={model_type!r} is not supported; supported: {supported}")
        if d.get("quantization_config"):
            method = d["quantization_config"]
            if isinstance(method, Mapping):
                method = method.get("quant_method", method)
            raise ConfigError(
                f"quantization_config (quant_method={method!r}) is not supported; use an "
                "unquantized bf16/fp16/fp32 checkpoint"
            )
        multimodal = model_type in WRAPPER_MODEL_TYPES
        d = text_config_dict(d)
        model_type = d["model_type"]
        family = FAMILIES[model_type]
        defaults = _HF_DEFAULTS[model_type]

        def get(key: str) -> Any:
            return d.get(key, defaults.get(key))

        num_layers = _as_int(get("num_hidden_layers"), "num_hidden_layers")
        hidden = _as_int(get("hidden_size"), "hidden_size")
        num_heads = _as_int(get("num_attention_heads"), "num_attention_heads")
        kv = get("num_key_value_heads")
        num_kv_heads = num_heads if kv is None else _as_int(kv, "num_key_value_heads")
        head_dim = get("head_dim")
        if head_dim is None:
            if hidden % num_heads:
                raise ConfigError(
                    f"head_dim is missing and hidden_size={hidden} is not divisible by "
                    f"num_attention_heads={num_heads}"
                )
            head_dim = hidden // num_heads
        max_pos = _as_int(get("max_position_embeddings"), "max_position_embeddings")

        params, field, local_params, local_field = _rope_params_from_dict(d)
        for where in (params, local_params, d):
            partial = where.get("partial_rotary_factor") if isinstance(where, Mapping) else None
            if partial not in (None, 1, 1.0):
                raise ConfigError(f"partial_rotary_factor={partial!r} is not supported (kvjax rotates the full head)")
        rope = RopeConfig.from_hf(
            params,
            max_position_embeddings=max_pos,
            rope_theta=d.get("rope_theta"),
            original_max_position_embeddings=get("original_max_position_embeddings"),
            field=field,
            supported=family.rope_types,
            default_theta=family.default_theta,
        )
        rope_local = None
        if local_params is not None:
            rope_local = RopeConfig.from_hf(local_params, max_position_embeddings=max_pos, field=local_field,
                                            supported=family.rope_types, default_theta=DEFAULT_ROPE_THETA)
        elif model_type == "gemma3_text":  # v4 layout: the local base beside the global theta
            theta = _as_float(get("rope_local_base_freq"), "rope_local_base_freq", positive=True)
            rope_local = RopeConfig(theta=theta)

        qkv_bias = o_bias = mlp_bias = False
        if model_type in ("llama", "qwen3", "gemma3_text"):
            qkv_bias = o_bias = _as_bool(d.get("attention_bias", False), "attention_bias")
            if model_type == "llama":
                mlp_bias = _as_bool(d.get("mlp_bias", False), "mlp_bias")
        elif model_type == "qwen2":
            qkv_bias = True
        sliding_window, layer_types = _layer_types(d, model_type, num_layers)

        extra: dict[str, Any] = {}
        if model_type == "gemma3_text":
            if d.get("attn_logit_softcapping") is not None:
                raise ConfigError(f"attn_logit_softcapping={d['attn_logit_softcapping']!r} is not supported "
                                  "(Gemma 3 has none; Gemma 2's capped attention logits are not implemented)")
            if d.get("use_bidirectional_attention"):
                raise ConfigError("use_bidirectional_attention=true is not supported (kvjax decodes causally)")
            extra.update(query_pre_attn_scalar=get("query_pre_attn_scalar"),
                         final_logit_softcapping=d.get("final_logit_softcapping"))
            act = get("hidden_activation")
        else:
            act = d.get("hidden_act", "silu")
        try:
            return cls(
                model_type=model_type,
                vocab_size=get("vocab_size"),
                hidden_size=hidden,
                intermediate_size=get("intermediate_size"),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                rms_norm_eps=get("rms_norm_eps"),
                rope=rope,
                max_position_embeddings=max_pos,
                tie_word_embeddings=_as_bool(get("tie_word_embeddings") or False, "tie_word_embeddings"),
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                mlp_bias=mlp_bias,
                sliding_window=sliding_window,
                bos_token_id=get("bos_token_id"),
                eos_token_ids=_eos_ids(get("eos_token_id")),
                pad_token_id=get("pad_token_id"),
                hidden_act=act,
                layer_types=layer_types,
                rope_local=rope_local,
                multimodal=multimodal,
                **extra,
            )
        except ConfigError as e:
            if multimodal:
                raise ConfigError(f"text_config: {e}") from e
            raise

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``<path>/config.json``; ConfigError messages are prefixed with the file."""
        d = read_config_json(path)
        try:
            return cls.from_hf_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{pathlib.Path(path) / 'config.json'}: {e}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers 5 ``config.json`` dict for this architecture (inverse of from_hf_dict; a multimodal
        checkpoint's text decoder is written as a text-only model)."""
        eos: int | list[int] | None
        if not self.eos_token_ids:
            eos = None
        elif len(self.eos_token_ids) == 1:
            eos = self.eos_token_ids[0]
        else:
            eos = list(self.eos_token_ids)
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": self.rope.to_hf_dict(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
        }
        mt = self.model_type
        if mt in ("llama", "qwen3", "gemma3_text"):
            d["attention_bias"] = self.qkv_bias
        if mt == "llama":
            d["mlp_bias"] = self.mlp_bias
        elif mt in ("mistral", "phi3"):
            d["sliding_window"] = self.sliding_window
            if mt == "phi3" and self.rope.original_max_position_embeddings is not None:
                d["original_max_position_embeddings"] = self.rope.original_max_position_embeddings
        elif mt in ("qwen2", "qwen3"):
            sliding = self.sliding_window is not None
            d["use_sliding_window"] = sliding
            d["sliding_window"] = self.sliding_window
            d["max_window_layers"] = 0 if sliding else self.num_layers
            d["layer_types"] = list(self.all_layer_types)
        else:  # gemma3_text
            d["hidden_activation"] = self.hidden_act
            d["sliding_window"] = self.sliding_window
            d["layer_types"] = list(self.all_layer_types)
            scalar = self.query_pre_attn_scalar or self.head_dim
            d["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar  # an int in HF
            d["final_logit_softcapping"] = self.final_logit_softcapping
            d["attn_logit_softcapping"] = None
            local = self.rope_local or self.rope
            d["rope_parameters"] = {FULL: self.rope.to_hf_dict(), SLIDING: local.to_hf_dict()}
        return d
