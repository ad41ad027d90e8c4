"""Writes kvjax weights back as a standard Hugging Face checkpoint (config.json + model.safetensors).

The loader's transforms (reshape / transpose of each HF tensor into kvjax's layout) are
permutations of elements, so each is inverted exactly by applying it to an index array. kvjax's fused
projections (`qkv`, `gate_up`) are split back into q_proj / k_proj / v_proj and gate_proj / up_proj (Phi-3: joined
into its own qkv_proj / gate_up_proj) by reading each HF tensor's slice of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvjax.models.config import ModelConfig
from kvjax.models.loader import flatten, tensor_plan


def _inverse(transform: Any, hf_shape: tuple[int, ...], value: np.ndarray) -> np.ndarray:
    index = transform(np.arange(int(np.prod(hf_shape))).reshape(hf_shape))
    out = np.empty(int(np.prod(hf_shape)), value.dtype)
    out[np.asarray(index).reshape(-1)] = np.asarray(value).reshape(-1)
    return out.reshape(hf_shape)


def to_hf_tensors(config: ModelConfig, weights: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """HF-named numpy tensors from kvjax weights (the model's pytree or flat keys; float32 or bf16 as given),
    as a text-only checkpoint; kvjax's fused projections are split into HF's tensors (Phi-3's fused ones
    joined back)."""
    flat = flatten(weights)
    tensors: dict[str, np.ndarray] = {}
    for entry in tensor_plan(dataclasses.replace(config, multimodal=False)):
        value = entry.target(np.asarray(flat[entry.key]))
        part = _inverse(entry.transform, entry.part_shape, value)
        if entry.rows is None:
            tensors[entry.hf_name] = np.ascontiguousarray(part)
            continue
        whole = tensors.setdefault(entry.hf_name, np.empty(entry.hf_shape, value.dtype))
        whole[entry.rows[0] : entry.rows[1]] = part
    return tensors


def save_hf(config: ModelConfig, weights: Mapping[str, Any], directory: str | os.PathLike, dtype: Any = np.float32):
    """Saves `config.json` and `model.safetensors` into `directory` (created if missing)."""
    from safetensors.numpy import save_file

    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.astype(dtype) for k, v in to_hf_tensors(config, weights).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf_dict()
    hf["torch_dtype"] = hf["dtype"] = np.dtype(dtype).name
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return path
