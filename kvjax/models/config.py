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
]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
DEFAULT_ROPE_THETA = 10000.0

# Defaults of transformers 5's Llama/Mistral/Qwen2 config classes, for keys a config.json omits.
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
}
_ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
_LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")


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


def check_no_remote_code(config_dict: Mapping[str, Any]) -> None:
    """Refuse a config that needs ``trust_remote_code`` (has ``auto_map``); kvjax never runs it."""
    if not isinstance(config_dict, Mapping):
        raise ConfigError(f"a model config must be a JSON object, got {type(config_dict).__name__}")
    auto_map = config_dict.get("auto_map")
    if auto_map:
        raise ConfigError(
            f"config has auto_map={auto_map!r}: this model needs custom code (trust_remote_code), "
            "which kvjax never runs; only the built-in architectures "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} are supported"
        )


def read_config_json(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``<model_dir>/config.json`` as a dict (CheckpointError if the dir or file is bad)."""
    path = pathlib.Path(model_dir).expanduser()
    if not path.exists():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
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
    ) -> RopeConfig:
        """Build from a transformers ``rope_parameters`` / ``rope_scaling`` dict named ``field``.

        ``rope_theta`` and ``original_max_position_embeddings`` are top-level config values, used as
        transformers 5 does (the former when the dict has no theta, the latter in priority).
        """
        if not isinstance(params, Mapping):
            raise ConfigError(f"{field}={params!r} must be a JSON object")
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"{field}.rope_type={rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        partial = params.get("partial_rotary_factor")
        if partial is not None and partial != 1:
            raise ConfigError(
                f"{field}.partial_rotary_factor={partial!r} is not supported "
                "(kvjax rotates the full head)"
            )
        theta = params.get("rope_theta")
        if theta is None:
            theta = rope_theta if rope_theta is not None else DEFAULT_ROPE_THETA
        kwargs: dict[str, Any] = {}
        for name in _ROPE_FIELDS[rope_type]:
            if params.get(name) is not None:
                kwargs[name] = params[name]
        if rope_type in ("llama3", "yarn"):
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
                out[name] = value
        return out


def _rope_params_from_dict(d: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """Pick the RoPE dict of a config (v4 ``rope_scaling`` wins over v5 ``rope_parameters``)."""
    if d.get("rope_scaling"):
        params, field = d["rope_scaling"], "rope_scaling"
    else:
        params, field = d.get("rope_parameters") or {}, "rope_parameters"
    if isinstance(params, Mapping) and any(k in params for k in _LAYER_TYPE_KEYS):
        # Nested per layer type (transformers 5): kvjax needs one RoPE shared by every layer.
        nested = [params[k] for k in _LAYER_TYPE_KEYS if params.get(k) is not None]
        if any(p != nested[0] for p in nested[1:]):
            raise ConfigError(f"{field} differs between layer types {list(params)}; not supported")
        params, field = nested[0], f"{field}.{next(k for k in _LAYER_TYPE_KEYS if k in params)}"
    return params, field


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(_as_int(v, "eos_token_id", minimum=0) for v in value)
    return (_as_int(value, "eos_token_id", minimum=0),)


def _qwen2_sliding_window(d: Mapping[str, Any], num_layers: int) -> int | None:
    """The window Qwen2 applies, or None; refuses windows on only some of the layers."""
    defaults = _HF_DEFAULTS["qwen2"]
    use = _as_bool(
        d.get("use_sliding_window", defaults["use_sliding_window"]), "use_sliding_window"
    )
    window = d.get("sliding_window", defaults["sliding_window"]) if use else None
    if window is None:
        return None
    window = _as_int(window, "sliding_window")
    layer_types = d.get("layer_types")
    if layer_types is None:
        max_window_layers = d.get("max_window_layers", defaults["max_window_layers"])
        max_window_layers = _as_int(max_window_layers, "max_window_layers", minimum=0)
        sliding = [i >= max_window_layers for i in range(num_layers)]
        where = f"max_window_layers={max_window_layers}"
    else:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ConfigError(
                f"layer_types={layer_types!r} must list one type per layer ({num_layers} layers)"
            )
        sliding = [t == "sliding_attention" for t in layer_types]
        where = "layer_types"
    if all(sliding):
        return window
    if not any(sliding):
        return None
    raise ConfigError(
        f"use_sliding_window=true with a sliding window on only some layers ({where}) is not "
        "supported; kvjax applies one attention window to every layer"
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama / Mistral / Qwen2 decoder, in kvjax's names.

    ``qkv_bias`` / ``o_bias`` / ``mlp_bias``: which projections carry a bias (Qwen2: q, k, v; Llama:
    ``attention_bias`` biases q, k, v and o, ``mlp_bias`` the MLP; Mistral: none).
    ``sliding_window``: attention window applied to every layer, or None.
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
    hidden_act: str = "silu"

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
        if not isinstance(self.rope, RopeConfig):
            raise ConfigError(f"rope={self.rope!r} must be a RopeConfig")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not divisible by "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias"):
            _as_bool(getattr(self, name), name)
        if self.sliding_window is not None:
            object.__setattr__(
                self, "sliding_window", _as_int(self.sliding_window, "sliding_window")
            )
        object.__setattr__(self, "eos_token_ids", _eos_ids(self.eos_token_ids))
        object.__setattr__(self, "bos_token_id", _optional_token(self.bos_token_id, "bos_token_id"))
        object.__setattr__(self, "pad_token_id", _optional_token(self.pad_token_id, "pad_token_id"))
        self._check_family()

    def _check_family(self) -> None:
        """Keep the flags within what the family's HF config expresses (to_hf_dict round-trips)."""
        mt = self.model_type
        if mt == "llama":
            if self.qkv_bias != self.o_bias:
                raise ConfigError(
                    f"llama: qkv_bias={self.qkv_bias} and o_bias={self.o_bias} must be equal "
                    "(both come from attention_bias)"
                )
            if self.sliding_window is not None:
                raise ConfigError(f"llama: sliding_window={self.sliding_window} is not supported")
        elif mt == "qwen2":
            if not self.qkv_bias or self.o_bias or self.mlp_bias:
                raise ConfigError(
                    f"qwen2 has q/k/v biases only; got qkv_bias={self.qkv_bias}, "
                    f"o_bias={self.o_bias}, mlp_bias={self.mlp_bias}"
                )
        elif self.qkv_bias or self.o_bias or self.mlp_bias:
            raise ConfigError(
                f"mistral has no biases; got qkv_bias={self.qkv_bias}, o_bias={self.o_bias}, "
                f"mlp_bias={self.mlp_bias}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict (transformers v4 or v5 layout)."""
        check_no_remote_code(d)
        model_type = d.get("model_type")
        if model_type is None:
            raise ConfigError(
                "config has no model_type; expected one of " + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if d.get("quantization_config"):
            method = d["quantization_config"]
            if isinstance(method, Mapping):
                method = method.get("quant_method", method)
            raise ConfigError(
                f"quantization_config (quant_method={method!r}) is not supported; use an "
                "unquantized bf16/fp16/fp32 checkpoint"
            )
        defaults = _HF_DEFAULTS[model_type]

        def get(key: str) -> Any:
            return d.get(key, defaults.get(key))

        num_layers = _as_int(get("num_hidden_layers"), "num_hidden_layers")
        hidden = _as_int(get("hidden_size"), "hidden_size")
        num_heads = _as_int(get("num_attention_heads"), "num_attention_heads")
        kv = get("num_key_value_heads")
        num_kv_heads = num_heads if kv is None else _as_int(kv, "num_key_value_heads")
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % num_heads:
                raise ConfigError(
                    f"head_dim is missing and hidden_size={hidden} is not divisible by "
                    f"num_attention_heads={num_heads}"
                )
            head_dim = hidden // num_heads
        max_pos = _as_int(get("max_position_embeddings"), "max_position_embeddings")

        params, field = _rope_params_from_dict(d)
        rope = RopeConfig.from_hf(
            params,
            max_position_embeddings=max_pos,
            rope_theta=d.get("rope_theta"),
            original_max_position_embeddings=d.get("original_max_position_embeddings"),
            field=field,
        )
        if d.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise ConfigError(
                f"partial_rotary_factor={d['partial_rotary_factor']!r} is not supported "
                "(kvjax rotates the full head)"
            )

        qkv_bias = o_bias = mlp_bias = False
        sliding_window: int | None = None
        if model_type == "llama":
            qkv_bias = o_bias = _as_bool(d.get("attention_bias", False), "attention_bias")
            mlp_bias = _as_bool(d.get("mlp_bias", False), "mlp_bias")
        elif model_type == "qwen2":
            qkv_bias = True
            sliding_window = _qwen2_sliding_window(d, num_layers)
        else:
            sw = get("sliding_window")
            sliding_window = None if sw is None else _as_int(sw, "sliding_window")

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
            tie_word_embeddings=_as_bool(
                d.get("tie_word_embeddings", False), "tie_word_embeddings"
            ),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=sliding_window,
            bos_token_id=get("bos_token_id"),
            eos_token_ids=_eos_ids(get("eos_token_id")),
            pad_token_id=d.get("pad_token_id"),
            hidden_act=d.get("hidden_act", "silu"),
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``<path>/config.json``; ConfigError messages are prefixed with the file."""
        d = read_config_json(path)
        try:
            return cls.from_hf_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{pathlib.Path(path) / 'config.json'}: {e}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers 5 ``config.json`` dict for this architecture (inverse of from_hf_dict)."""
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
        if self.model_type == "llama":
            d["attention_bias"] = self.qkv_bias
            d["mlp_bias"] = self.mlp_bias
        elif self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        else:
            sliding = self.sliding_window is not None
            d["use_sliding_window"] = sliding
            d["sliding_window"] = self.sliding_window
            d["max_window_layers"] = 0 if sliding else self.num_layers
            kind = "sliding_attention" if sliding else "full_attention"
            d["layer_types"] = [kind] * self.num_layers
        return d
