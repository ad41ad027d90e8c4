"""Qwen3, Gemma 3 (text) and Phi-3 / Phi-4 configs against transformers' own config classes and rotary modules.

Oracles: the config transformers builds from the same dict (layer types, windows, scales), its rotary embedding
buffers (Gemma 3's global and local frequencies, Phi-3's LongRoPE short and long factors and attention factor),
and round trips through `to_hf_dict`. Bad configs get one ConfigError naming the key.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from kvjax.errors import ConfigError
from kvjax.models.config import ModelConfig
from kvjax.models.rope_scaling import rope_frequencies

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

_ARCH = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
         "num_key_value_heads": 2}
_HALF = 8  # head_dim 16
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(_HALF)],
             "long_factor": [2.0 + 0.5 * i for i in range(_HALF)]}

V5 = {
    "qwen3": ("qwen3", {"num_hidden_layers": 3, "head_dim": 24, "attention_bias": True,
                        "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    "qwen3-plain": ("qwen3", {"num_hidden_layers": 2, "tie_word_embeddings": True}),
    "gemma3": ("gemma3_text", {"num_hidden_layers": 7, "head_dim": 24, "sliding_window": 32,
                               "query_pre_attn_scalar": 20, "final_logit_softcapping": 30.0,
                               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                      "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 1e4}}}),
    "gemma3-layer-types": ("gemma3_text", {"num_hidden_layers": 3, "sliding_window": 8,
                                           "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
    "phi3-longrope": ("phi3", {"num_hidden_layers": 2, "max_position_embeddings": 512,
                               "original_max_position_embeddings": 64, "rope_parameters": dict(_LONGROPE)}),
    "phi3-window": ("phi3", {"num_hidden_layers": 2, "sliding_window": 47, "pad_token_id": 0}),
}


def _hf(model_type: str, kwargs: dict[str, Any]) -> Any:
    return transformers.AutoConfig.for_model(model_type, **copy.deepcopy({**_ARCH, **kwargs}))


def _assert_matches_hf(cfg: ModelConfig, hf: Any) -> None:
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads)
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (
        hf.hidden_size, hf.intermediate_size, hf.vocab_size)
    assert cfg.rms_norm_eps == hf.rms_norm_eps and cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.hidden_act == getattr(hf, "hidden_activation", None) or hf.hidden_act
    types = getattr(hf, "layer_types", None) or ["sliding_attention" if hf.sliding_window else "full_attention"] \
        * hf.num_hidden_layers
    if hf.model_type == "qwen3" and not hf.use_sliding_window:
        types = ["full_attention"] * hf.num_hidden_layers
    assert cfg.all_layer_types == tuple(types)
    assert cfg.layer_windows == tuple(hf.sliding_window if t == "sliding_attention" else None for t in types)
    assert cfg.qkv_bias == cfg.o_bias == bool(getattr(hf, "attention_bias", False))
    assert cfg.qk_norm == (hf.model_type in ("qwen3", "gemma3_text"))
    gemma = hf.model_type == "gemma3_text"
    assert cfg.norm_plus_one == cfg.post_norms == cfg.embed_scale == gemma
    if gemma:
        assert cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar
        assert cfg.final_logit_softcapping == hf.final_logit_softcapping
    eos = hf.eos_token_id
    assert cfg.eos_token_ids == (() if eos is None else tuple(np.atleast_1d(eos).tolist()))
    assert (cfg.bos_token_id, cfg.pad_token_id) == (hf.bos_token_id, hf.pad_token_id)


@pytest.mark.parametrize("case", sorted(V5))
def test_parses_as_transformers_builds_it(case: str) -> None:
    hf = _hf(*V5[case])
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    _assert_matches_hf(cfg, hf)
    out = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(out) == cfg
    _assert_matches_hf(cfg, _hf(out.pop("model_type"), {k: v for k, v in out.items() if k != "architectures"}))


# Published configs (transformers v4 layout): Gemma 3 1B's local RoPE base and window pattern, Phi-3's "su".
GEMMA3_1B_V4 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "vocab_size": 262144,
}
PHI3_SU_V4 = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **_ARCH, "num_hidden_layers": 2,
    "max_position_embeddings": 1024, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
    "rope_scaling": {"type": "su", "short_factor": _LONGROPE["short_factor"],
                     "long_factor": _LONGROPE["long_factor"]},
    "sliding_window": 1023, "tie_word_embeddings": False,
}


def test_published_v4_configs() -> None:
    gemma = ModelConfig.from_hf_dict(GEMMA3_1B_V4)
    assert gemma.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    assert gemma.global_layers == (5, 11, 17, 23)
    assert (gemma.rope.theta, gemma.rope_local.theta) == (1e6, 1e4)
    assert gemma.eos_token_ids == (1, 106) and gemma.tie_word_embeddings and gemma.query_scale == 1.0
    phi = ModelConfig.from_hf_dict(PHI3_SU_V4)
    assert phi.rope.rope_type == "longrope" and phi.rope.original_max_position_embeddings == 64
    assert phi.layer_windows == (1023, 1023)
    # "su" is the older spelling of "longrope" (transformers 5 maps it, but then refuses it for want of a key).
    renamed = copy.deepcopy(PHI3_SU_V4)
    renamed["rope_scaling"]["type"] = "longrope"
    assert ModelConfig.from_hf_dict(renamed) == phi
    hf = transformers.Phi3Config(**{k: v for k, v in renamed.items() if k != "model_type"})
    _assert_matches_hf(phi, hf)
    assert phi.rope.short_factor == tuple(hf.rope_parameters["short_factor"])


def test_gemma3_rope_frequencies_match_transformers() -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    hf = _hf(*V5["gemma3"])
    rotary = Gemma3RotaryEmbedding(hf)
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    for local, kind in ((False, "full_attention"), (True, "sliding_attention")):
        inv_freq, scaling = rope_frequencies(cfg, local=local)
        np.testing.assert_allclose(inv_freq, getattr(rotary, f"{kind}_inv_freq").numpy(), rtol=1e-6, atol=0)
        assert scaling == getattr(rotary, f"{kind}_attention_scaling")
    assert not np.allclose(rope_frequencies(cfg)[0], rope_frequencies(cfg, local=True)[0])


@pytest.mark.parametrize("length", [None, 64, 65, 400])
def test_longrope_frequencies_match_transformers(length: int | None) -> None:
    """Short factors up to the pretrained context (64), long ones past it, as transformers picks them for a
    forward whose positions reach `length`; the attention factor from max / original positions."""
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    hf = _hf(*V5["phi3-longrope"])
    want, want_scaling = _compute_longrope_parameters(hf, seq_len=length)
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    inv_freq, scaling = rope_frequencies(cfg, length)
    np.testing.assert_allclose(inv_freq, want.numpy(), rtol=1e-6, atol=0)
    assert scaling == pytest.approx(want_scaling, rel=1e-12) and scaling > 1.0
    short = rope_frequencies(cfg, None)[0]
    assert np.array_equal(inv_freq, short) == (length is None or length <= 64)


BAD = {
    "attention softcap": ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    "window missing": ("gemma3_text", {"num_hidden_layers": 2, "sliding_window": None,
                                       "layer_types": ["sliding_attention", "full_attention"]},
                       "sliding_attention layers [0] but sliding_window is null"),
    "layer_types length": ("gemma3_text", {"num_hidden_layers": 3, "layer_types": ["sliding_attention"]},
                           "layer_types=['sliding_attention'] must list one of"),
    "layer type unknown": ("qwen3", {"num_hidden_layers": 1, "use_sliding_window": True,
                                     "layer_types": ["chunked_attention"]}, "layer_types="),
    "longrope length": ("phi3", {"num_hidden_layers": 1, "rope_parameters": {**_LONGROPE, "short_factor": [1.0]}},
                        "longrope short_factor / long_factor have 1 entries, expected head_dim / 2 = 8"),
    "partial rotary (Phi-4-mini)": ("phi3", {"num_hidden_layers": 1, "partial_rotary_factor": 0.75},
                                    "partial_rotary_factor=0.75"),
    "longrope on qwen3": ("qwen3", {"num_hidden_layers": 1, "rope_parameters": dict(_LONGROPE)},
                          "rope_type='longrope' is not supported"),
    "bidirectional gemma": ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    "unknown family": ("gemma2", {}, "model_type='gemma2' is not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_configs_name_the_key(case: str) -> None:
    model_type, change, needle = BAD[case]
    d = {"model_type": model_type, **_ARCH, **change}
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        ModelConfig.from_hf_dict(d)


def test_family_flags_are_the_familys() -> None:
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen3", **_ARCH, "num_hidden_layers": 1})
    import dataclasses

    with pytest.raises(ConfigError, match="qk_norm=False is fixed by the family"):
        dataclasses.replace(cfg, qk_norm=False)
    with pytest.raises(ConfigError, match="mixes sliding and full layers"):
        ModelConfig.from_hf_dict({"model_type": "mistral", **_ARCH, "num_hidden_layers": 2, "sliding_window": 4,
                                  "layer_types": ["sliding_attention", "full_attention"]})


@pytest.mark.parametrize("model_type", ["mistral", "phi3"])
def test_full_layer_types_under_a_window_are_refused(model_type: str) -> None:
    """transformers' Mistral and Phi-3 read no layer_types: their sliding_window binds every layer. A config listing
    only full_attention layers beside a window was read as full attention (logits off past the window): refused,
    naming both keys. A window as long as the context binds nothing, so there the list agrees."""
    d = {"model_type": model_type, **_ARCH, "num_hidden_layers": 2, "sliding_window": 4,
         "max_position_embeddings": 64, "layer_types": ["full_attention"] * 2}
    assert _hf(model_type, {k: v for k, v in d.items() if k != "model_type"}).sliding_window == 4
    with pytest.raises(ConfigError, match=r"layer_types lists only full_attention layers but sliding_window=4"):
        ModelConfig.from_hf_dict(d)
    assert ModelConfig.from_hf_dict({**d, "max_position_embeddings": 4}).sliding_window is None
