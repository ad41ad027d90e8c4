"""Tiny random Hugging Face checkpoints for tests (torch + transformers, seeded, float32).

Every builder saves with ``save_pretrained(safe_serialization=True)`` into a fresh directory under
``tmp_path`` and returns its path, or ``(path, model)`` with ``return_model=True``. Norm weights
and all biases are random (HF initialises them to ones / zeros), so parity tests see them.
torch and transformers are imported lazily: importing this module needs neither.
"""

from __future__ import annotations

import pathlib
from typing import Any

TINY_ARCH: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# llama3 scaling with a short original context so all three bands (kept, smoothed, slowed) occur
# for head_dim 16.
TINY_LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _randomize(model: Any, seed: int) -> None:
    """Random norm weights (around 1) and biases: HF initialises them to constants."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))


def _build(
    tmp_path: pathlib.Path,
    name: str,
    model_cls_name: str,
    config_kwargs: dict[str, Any],
    *,
    seed: int,
    return_model: bool,
    max_shard_size: str | None = None,
    config_cls_name: str | None = None,
) -> pathlib.Path | tuple[pathlib.Path, Any]:
    import torch
    import transformers

    config_cls = getattr(transformers, config_cls_name or model_cls_name.replace("ForCausalLM", "Config"))
    config = config_cls(**config_kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config).to(torch.float32).eval()
    _randomize(model, seed)
    path = pathlib.Path(tmp_path) / name
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return (path, model) if return_model else path


def make_llama(
    tmp_path: pathlib.Path,
    *,
    name: str = "llama",
    seed: int = 0,
    return_model: bool = False,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> pathlib.Path | tuple[pathlib.Path, Any]:
    """Tiny Llama: llama3 RoPE scaling, untied, biases only with ``attention_bias``/``mlp_bias``."""
    kwargs = {**TINY_ARCH, "rope_parameters": dict(TINY_LLAMA3_ROPE), "tie_word_embeddings": False}
    kwargs.update(overrides)
    return _build(
        tmp_path,
        name,
        "LlamaForCausalLM",
        kwargs,
        seed=seed,
        return_model=return_model,
        max_shard_size=max_shard_size,
    )


def make_qwen2(
    tmp_path: pathlib.Path,
    tied: bool,
    *,
    name: str | None = None,
    seed: int = 0,
    return_model: bool = False,
    **overrides: Any,
) -> pathlib.Path | tuple[pathlib.Path, Any]:
    """Tiny Qwen2 (q/k/v biases, RoPE theta 1e6), tied or untied embeddings."""
    kwargs = {
        **TINY_ARCH,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": tied,
    }
    kwargs.update(overrides)
    name = name or ("qwen2_tied" if tied else "qwen2")
    return _build(tmp_path, name, "Qwen2ForCausalLM", kwargs, seed=seed, return_model=return_model)


def make_mistral(
    tmp_path: pathlib.Path,
    *,
    name: str = "mistral",
    seed: int = 0,
    return_model: bool = False,
    **overrides: Any,
) -> pathlib.Path | tuple[pathlib.Path, Any]:
    """Tiny Mistral (no sliding window unless ``sliding_window=`` is given, like v0.2+)."""
    kwargs = {
        **TINY_ARCH,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_window": None,
        "tie_word_embeddings": False,
    }
    kwargs.update(overrides)
    return _build(
        tmp_path, name, "MistralForCausalLM", kwargs, seed=seed, return_model=return_model
    )


def make_qwen3(
    tmp_path: pathlib.Path, *, name: str = "qwen3", seed: int = 0, return_model: bool = False,
    max_shard_size: str | None = None, **overrides: Any,
) -> pathlib.Path | tuple[pathlib.Path, Any]:
    """Tiny Qwen3 (QK-norm, no biases): 6 query heads over 2 KV heads of dimension 20 (not hidden / heads), untied."""
    kwargs = {**TINY_ARCH, "num_attention_heads": 6, "head_dim": 20,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False}
    kwargs.update(overrides)
    return _build(tmp_path, name, "Qwen3ForCausalLM", kwargs, seed=seed, return_model=return_model,
                  max_shard_size=max_shard_size)


#: A tiny Gemma 3 text model: local layers of window 6 (their RoPE base 10000) and a global layer (base 1e6,
#: linear scaling x2), GQA 4:1, head_dim 24, query_pre_attn_scalar 20 and a final logit soft-cap.
TINY_GEMMA3: dict[str, Any] = {
    **TINY_ARCH,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 24,
    "sliding_window": 6,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 20,
    "final_logit_softcapping": 30.0,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


def make_gemma3(
    tmp_path: pathlib.Path, *, name: str = "gemma3", seed: int = 0, return_model: bool = False, **overrides: Any,
) -> pathlib.Path | tuple[pathlib.Path, Any]:
    """Tiny Gemma 3 text model (`Gemma3ForCausalLM`, tied embeddings), see `TINY_GEMMA3`."""
    kwargs = {**TINY_GEMMA3, **overrides}
    return _build(tmp_path, name, "Gemma3ForCausalLM", kwargs, seed=seed, return_model=return_model,
                  config_cls_name="Gemma3TextConfig")


def make_gemma3_multimodal(
    tmp_path: pathlib.Path, *, name: str = "gemma3_mm", seed: int = 0, return_model: bool = False,
) -> pathlib.Path | tuple[pathlib.Path, Any]:
    """Tiny Gemma 3 as the 4B-27B checkpoints ship (`Gemma3ForConditionalGeneration`: the text decoder under
    `language_model.`, a one-layer SigLIP vision tower and the projector beside it)."""
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    # transformers' multimodal forward applies no final_logit_softcapping (the released Gemma 3 configs have none).
    text = {**TINY_GEMMA3, "final_logit_softcapping": None}
    kwargs = {"text_config": text, "vision_config": vision, "mm_tokens_per_image": 4}
    return _build(tmp_path, name, "Gemma3ForConditionalGeneration", kwargs, seed=seed, return_model=return_model,
                  config_cls_name="Gemma3Config")


def make_phi3(
    tmp_path: pathlib.Path, *, name: str = "phi3", seed: int = 0, return_model: bool = False, **overrides: Any,
) -> pathlib.Path | tuple[pathlib.Path, Any]:
    """Tiny Phi-3 (fused qkv and gate_up projections): LongRoPE with a 32-token pretrained context extended to 512
    (short factors up to 32 tokens, long ones beyond), head_dim 16, GQA 2:1."""
    half = TINY_ARCH["head_dim"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(half)], "long_factor": [1.5 + 0.4 * i for i in range(half)]}
    kwargs = {**TINY_ARCH, "original_max_position_embeddings": 32, "rope_parameters": rope,
              "tie_word_embeddings": False}
    kwargs.update(overrides)
    return _build(tmp_path, name, "Phi3ForCausalLM", kwargs, seed=seed, return_model=return_model)


def make_sharded_llama(
    tmp_path: pathlib.Path, *, name: str = "llama_sharded", **overrides: Any
) -> pathlib.Path:
    """Tiny Llama saved as several shards + ``model.safetensors.index.json``."""
    path = make_llama(tmp_path, name=name, max_shard_size="100KB", **overrides)
    assert isinstance(path, pathlib.Path)
    if not (path / "model.safetensors.index.json").is_file():
        raise AssertionError(f"save_pretrained wrote no shard index in {path}")
    return path


def torch_state(model: Any) -> dict[str, Any]:
    """The model's ``state_dict`` as float32 numpy arrays, keyed by HF tensor name."""
    return {k: v.detach().to("cpu").float().numpy() for k, v in model.state_dict().items()}
