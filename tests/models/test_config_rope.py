"""ModelConfig parsing (transformers v4 and v5 layouts), round trips, and RoPE frequencies vs HF."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import numpy as np
import pytest

from kvjax.errors import CheckpointError, ConfigError
from kvjax.models.config import ModelConfig, RopeConfig
from kvjax.models.rope_scaling import rope_frequencies

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

_ARCH = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

# Configs as published on the Hub (transformers v4 layout: rope_theta + rope_scaling).
LLAMA31_V4 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
QWEN25_V4 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL01_V4 = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}


def _hf_config(d: dict[str, Any]) -> Any:
    kwargs = {k: v for k, v in d.items() if k not in ("model_type", "architectures")}
    return transformers.AutoConfig.for_model(d["model_type"], **copy.deepcopy(kwargs))


def _hf_sliding_window(hf: Any) -> int | None:
    if hf.model_type == "mistral":
        return hf.sliding_window
    if hf.model_type == "qwen2" and "sliding_attention" in hf.layer_types:
        return hf.sliding_window
    return None


def _assert_matches_hf(cfg: ModelConfig, hf: Any) -> None:
    """Every ModelConfig field equals what transformers builds the model from."""
    assert cfg.model_type == hf.model_type
    assert cfg.vocab_size == hf.vocab_size
    assert cfg.hidden_size == hf.hidden_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_layers == hf.num_hidden_layers
    assert cfg.num_heads == hf.num_attention_heads
    assert cfg.num_kv_heads == hf.num_key_value_heads
    assert cfg.head_dim == (
        getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    )
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.hidden_act == hf.hidden_act
    rp = hf.rope_parameters
    assert cfg.rope.rope_type == rp["rope_type"]
    assert cfg.rope.theta == rp["rope_theta"]
    for name in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        if cfg.rope.rope_type != "default" and rp.get(name) is not None:
            assert getattr(cfg.rope, name) == rp[name], name
    if hf.model_type == "llama":
        assert cfg.qkv_bias == cfg.o_bias == hf.attention_bias
        assert cfg.mlp_bias == hf.mlp_bias
    else:
        assert cfg.qkv_bias == (hf.model_type == "qwen2")
        assert not cfg.o_bias and not cfg.mlp_bias
    assert cfg.sliding_window == _hf_sliding_window(hf)
    eos = hf.eos_token_id
    assert cfg.eos_token_ids == (() if eos is None else tuple(np.atleast_1d(eos).tolist()))
    assert cfg.bos_token_id == hf.bos_token_id
    assert cfg.pad_token_id == hf.pad_token_id


HF_V5_CASES = {
    "llama-default": ("llama", {}),
    "llama-llama3-biases": (
        "llama",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
            "eos_token_id": [5, 6],
            "head_dim": 32,
        },
    ),
    "llama-linear": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "qwen2-tied-yarn": (
        "qwen2",
        {
            "tie_word_embeddings": True,
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
                "rope_theta": 1000000.0,
            },
        },
    ),
    "qwen2-all-sliding": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0},
    ),
    "qwen2-window-unused": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2},
    ),
    "mistral-window": ("mistral", {"sliding_window": 256}),
    "mistral-no-window": ("mistral", {"sliding_window": None, "pad_token_id": 0}),
}


@pytest.mark.parametrize("case", sorted(HF_V5_CASES))
def test_parses_transformers5_configs(case: str, tmp_path: Any) -> None:
    model_type, extra = HF_V5_CASES[case]
    hf = _hf_config({"model_type": model_type, **_ARCH, **extra})
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    _assert_matches_hf(cfg, hf)
    # What save_pretrained writes in transformers 5 parses to the same config.
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written
    assert ModelConfig.from_dir(tmp_path) == cfg


@pytest.mark.parametrize(
    "hub", [LLAMA31_V4, QWEN25_V4, MISTRAL01_V4], ids=["llama3.1", "qwen2.5", "mistral0.1"]
)
def test_parses_transformers4_hub_configs(hub: dict[str, Any]) -> None:
    cfg = ModelConfig.from_hf_dict(hub)
    _assert_matches_hf(cfg, _hf_config(hub))


def test_hub_config_values() -> None:
    llama = ModelConfig.from_hf_dict(LLAMA31_V4)
    assert llama.rope == RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert llama.eos_token_ids == (128001, 128008, 128009)
    assert llama.group_size == 4 and llama.head_dim == 128
    qwen = ModelConfig.from_hf_dict(QWEN25_V4)
    assert qwen.rope == RopeConfig(theta=1e6)
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
    assert qwen.sliding_window is None  # use_sliding_window is false
    assert qwen.group_size == 7 and qwen.head_dim == 64
    mistral = ModelConfig.from_hf_dict(MISTRAL01_V4)
    assert mistral.sliding_window == 4096 and mistral.rope.theta == 10000.0


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"type": "linear", "factor": 2.0},
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "yarn", "type": "yarn", "factor": 2.0, "beta_fast": 16.0},
    ],
)
def test_v4_rope_scaling_type_key(rope_scaling: dict[str, Any]) -> None:
    d = {"model_type": "qwen2", **_ARCH, "rope_theta": 50000.0, "rope_scaling": rope_scaling}
    d["max_position_embeddings"] = 4096
    cfg = ModelConfig.from_hf_dict(d)
    _assert_matches_hf(cfg, _hf_config(d))
    assert cfg.rope.theta == 50000.0


def test_missing_keys_take_transformers_defaults() -> None:
    for model_type in ("llama", "mistral", "qwen2"):
        cfg = ModelConfig.from_hf_dict({"model_type": model_type})
        _assert_matches_hf(cfg, _hf_config({"model_type": model_type}))


def test_nested_per_layer_type_rope() -> None:
    rope = {"rope_type": "default", "rope_theta": 1e6}
    d = {"model_type": "qwen2", **_ARCH, "rope_parameters": {"full_attention": rope}}
    assert ModelConfig.from_hf_dict(d).rope == RopeConfig(theta=1e6)


ROUND_TRIP_DICTS = [
    LLAMA31_V4,
    QWEN25_V4,
    MISTRAL01_V4,
    *[{"model_type": mt, **_ARCH, **extra} for mt, extra in HF_V5_CASES.values()],
    {
        "model_type": "qwen2",
        **_ARCH,
        "max_position_embeddings": 8192,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
            "attention_factor": 1.1,
        },
    },
]


@pytest.mark.parametrize("d", ROUND_TRIP_DICTS, ids=lambda d: d["model_type"])
def test_to_hf_dict_round_trips(d: dict[str, Any]) -> None:
    cfg = ModelConfig.from_hf_dict(d)
    out = cfg.to_hf_dict()
    json.dumps(out)  # writable as config.json
    assert ModelConfig.from_hf_dict(out) == cfg
    # transformers builds the same architecture from what we write.
    hf = _hf_config(out)
    _assert_matches_hf(cfg, hf)
    assert ModelConfig.from_hf_dict(hf.to_dict()) == cfg


def test_model_config_is_hashable_and_frozen() -> None:
    cfg = ModelConfig.from_hf_dict(LLAMA31_V4)
    assert hash(cfg) == hash(ModelConfig.from_hf_dict(copy.deepcopy(LLAMA31_V4)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3  # type: ignore[misc]


BAD_CONFIGS = {
    "unsupported model_type": ({"model_type": "gemma"}, "model_type='gemma'"),
    "missing model_type": ({"model_type": None}, "model_type"),
    "remote code": (
        {"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}},
        "auto_map",
    ),
    "dynamic rope": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    "longrope": (
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
            }
        },
        "rope_parameters.rope_type='longrope'",
    ),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "kv heads": ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    "partial rotary": (
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
        "partial_rotary_factor",
    ),
    "quantized": ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    "llama3 missing key": (
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        "low_freq_factor",
    ),
    "linear without factor": ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    # kvjax's own rope type (a Llama GGUF's per-frequency factors): one factor per rotary frequency, llama only.
    "freq_factors length": ({"rope_scaling": {"rope_type": "freq_factors", "freq_factors": [1.0] * 9}},
                            "freq_factors has 9 entries, expected head_dim / 2 = 8"),
    "freq_factors zero": ({"rope_scaling": {"rope_type": "freq_factors", "freq_factors": [0.0] * 8}},
                          "freq_factors"),
    "freq_factors on qwen2": ({"model_type": "qwen2", "rope_scaling": {"rope_type": "freq_factors",
                                                                        "freq_factors": [1.0] * 8}},
                              "rope_type='freq_factors' is not supported"),
    "bad vocab": ({"vocab_size": "many"}, "vocab_size"),
    "bad eps": ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    "no head_dim": ({"hidden_size": 66, "head_dim": None}, "head_dim"),
    "odd head_dim": ({"head_dim": 15}, "head_dim=15"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_configs_name_the_field(case: str) -> None:
    change, needle = BAD_CONFIGS[case]
    d = {"model_type": "llama", **_ARCH, **change}
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("(", r"\(")) as e:
        ModelConfig.from_hf_dict(d)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_sliding_window_on_some_layers(model_type: str) -> None:
    """A window on only some layers (from max_window_layers, or as layer_types lists them) is each layer's own,
    as transformers builds the attention of each layer."""
    d = {
        "model_type": model_type,
        **_ARCH,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 1,
    }
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.all_layer_types == tuple(_hf_config(d).layer_types) == ("full_attention", "sliding_attention")
    assert cfg.layer_windows == (None, 8) and cfg.global_layers == (0,)
    d["layer_types"] = ["sliding_attention", "full_attention"]
    assert ModelConfig.from_hf_dict(d).layer_windows == (8, None)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_family_flags_validated() -> None:
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen2", **_ARCH})
    with pytest.raises(ConfigError, match="o_bias"):
        dataclasses.replace(cfg, o_bias=True)
    llama = ModelConfig.from_hf_dict({"model_type": "llama", **_ARCH})
    with pytest.raises(ConfigError, match="attention_bias"):
        dataclasses.replace(llama, qkv_bias=True)
    with pytest.raises(ConfigError, match="not a parameter of rope_type='default'"):
        RopeConfig(theta=1e4, factor=2.0)


def test_from_dir_errors(tmp_path: Any) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"config\.json.*model_type='gpt2'"):
        ModelConfig.from_dir(tmp_path)


# ---- RoPE frequencies against transformers' rotary embedding modules ----

ROPE_CASES = {
    "default-llama3-8b": ("llama", 128, 8192, {"rope_type": "default", "rope_theta": 500000.0}),
    "default-qwen-theta1e6": ("qwen2", 64, 32768, {"rope_type": "default", "rope_theta": 1e6}),
    "linear": ("llama", 64, 4096, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "llama3.1": (
        "llama",
        128,
        131072,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
    ),
    "llama3.2": (
        "llama",
        64,
        131072,
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
    ),
    "llama3-tiny": (
        "llama",
        16,
        512,
        {
            "rope_theta": 10000.0,
            **{
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "yarn-qwen": (
        "qwen2",
        128,
        131072,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
            "rope_theta": 1e6,
        },
    ),
    "yarn-mscale-beta-notruncate": (
        "llama",
        64,
        16384,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
            "rope_theta": 10000.0,
        },
    ),
    "yarn-attention-factor": (
        "mistral",
        32,
        8192,
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 4096,
            "attention_factor": 1.25,
            "rope_theta": 1e6,
        },
    ),
    "yarn-factor-from-lengths": (
        "llama",
        64,
        16384,
        {
            "rope_type": "yarn",
            "factor": None,
            "original_max_position_embeddings": 2048,
            "rope_theta": 10000.0,
        },
    ),
}

_ROTARY = {
    "llama": "transformers.models.llama.modeling_llama.LlamaRotaryEmbedding",
    "qwen2": "transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding",
    "mistral": "transformers.models.mistral.modeling_mistral.MistralRotaryEmbedding",
}


def _rotary_cls(model_type: str) -> Any:
    import importlib

    module, name = _ROTARY[model_type].rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_frequencies_match_transformers(case: str) -> None:
    model_type, head_dim, max_pos, rope = ROPE_CASES[case]
    d = {
        "model_type": model_type,
        "vocab_size": 32,
        "hidden_size": 4 * head_dim,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "max_position_embeddings": max_pos,
        "rope_parameters": dict(rope),
    }
    hf_rotary = _rotary_cls(model_type)(_hf_config(d))
    want = hf_rotary.inv_freq.numpy()
    cfg = ModelConfig.from_hf_dict(d)
    inv_freq, scaling = rope_frequencies(cfg)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == (head_dim // 2,)
    np.testing.assert_allclose(inv_freq, want, rtol=1e-6, atol=0)
    assert scaling == pytest.approx(hf_rotary.attention_scaling, rel=1e-12)
    if rope["rope_type"] == "yarn":
        assert scaling != 1.0
    if case == "yarn-attention-factor":
        assert scaling == 1.25
    # Same frequencies through the transformers 4 spelling of the config.
    v4 = {k: v for k, v in d.items() if k != "rope_parameters"}
    v4["rope_theta"] = rope["rope_theta"]
    if rope["rope_type"] != "default":
        v4["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    np.testing.assert_array_equal(rope_frequencies(ModelConfig.from_hf_dict(v4))[0], inv_freq)


def test_llama3_scaling_bands() -> None:
    """All three llama3 regimes occur in the tiny test config: kept, smoothed and slowed down."""
    _, head_dim, max_pos, rope = ROPE_CASES["llama3-tiny"]
    d = {"model_type": "llama", **_ARCH, "head_dim": head_dim, "max_position_embeddings": max_pos}
    scaled, _ = rope_frequencies(ModelConfig.from_hf_dict({**d, "rope_parameters": rope}))
    plain, _ = rope_frequencies(
        ModelConfig.from_hf_dict({**d, "rope_parameters": {"rope_theta": 10000.0}})
    )
    ratio = plain / scaled
    assert np.isclose(ratio, 1.0).any()
    assert np.isclose(ratio, 8.0).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()
