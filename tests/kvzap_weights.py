"""Generated KVzap checkpoints in the published layout (what `KVzapModel.save_pretrained` writes: `config.json` and
`model.safetensors` with `layers.{l}.weight` / `.bias`, or `layers.{l}.0.*` and `layers.{l}.2.*` for the MLP).

`python tests/kvzap_weights.py` rewrites the fixture the method tables use (`FIXTURE`: 2 layers of the tiny model,
hidden size 64, 2 KV heads, an 8-wide MLP)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "kvzap" / "tiny-mlp"


def kvzap_tensors(layers: int, input_dim: int, output_dim: int, hidden_dim: int | None, seed: int = 0) -> dict:
    """Random float32 tensors of a KVzap checkpoint, `[out, in]` as torch's Linear stores them."""
    rng = np.random.default_rng(seed)

    def linear(prefix: str, fan_in: int, fan_out: int) -> dict:
        return {f"{prefix}.weight": (rng.normal(size=(fan_out, fan_in)) / np.sqrt(fan_in)).astype(np.float32),
                f"{prefix}.bias": rng.normal(size=(fan_out,)).astype(np.float32) * 0.1}

    out: dict = {}
    for i in range(layers):
        if hidden_dim is None:
            out.update(linear(f"layers.{i}", input_dim, output_dim))
        else:
            out.update(linear(f"layers.{i}.0", input_dim, hidden_dim))
            out.update(linear(f"layers.{i}.2", hidden_dim, output_dim))
    return out


def write_kvzap(folder: pathlib.Path, layers: int, input_dim: int, output_dim: int, hidden_dim: int | None = 8,
                seed: int = 0) -> dict:
    """Writes a checkpoint into `folder`; returns its tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = kvzap_tensors(layers, input_dim, output_dim, hidden_dim, seed)
    config = dict(model_type="kvzap", input_dim=input_dim, output_dim=output_dim, n_modules=layers,
                  hidden_dim=hidden_dim, architectures=["KVzapModel"])
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


if __name__ == "__main__":
    write_kvzap(FIXTURE, layers=2, input_dim=64, output_dim=2, hidden_dim=8, seed=0)
