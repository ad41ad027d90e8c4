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
) -> pathlib.Path | tuple[pathlib.Path, Any]:
    import torch
    import transformers

    config_cls = getattr(transformers, model_cls_name.replace("ForCausalLM", "Config"))
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
