"""Tokenizer of a local Hugging Face model directory (never downloaded, never remote code)."""

from __future__ import annotations

import os
from typing import Any

from kvjax._transformers import import_transformers
from kvjax.errors import CheckpointError
from kvjax.models.presets import resolve_model_dir

__all__ = ["TOKENIZER_FILES", "import_transformers", "load_tokenizer"]

# Any of these makes a directory loadable by AutoTokenizer (fast, sentencepiece or BPE vocab).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "tokenizer_config.json",
)


def load_tokenizer(
    name_or_dir: str | os.PathLike[str], model_dir: str | os.PathLike[str] | None = None
) -> Any:
    """``AutoTokenizer`` of a model directory or preset (resolved like :func:`resolve_model_dir`).

    Loads with ``local_files_only=True`` and ``trust_remote_code=False``; CheckpointError when the
    directory has no tokenizer files (naming the GGUF file, for one converted from a GGUF file without a
    tokenizer) or transformers cannot load them.
    """
    path = resolve_model_dir(name_or_dir, model_dir=model_dir)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        from kvjax.models.gguf import gguf_source

        source = gguf_source(path)
        if source is not None:
            raise CheckpointError(f"GGUF file {source!r} holds no tokenizer (its metadata has no "
                                  "tokenizer.ggml.tokens): kvjax cannot encode text for it")
        raise CheckpointError(
            f"no tokenizer files in {str(path)!r}: expected one of {', '.join(TOKENIZER_FILES)}"
        )
    auto = import_transformers().AutoTokenizer
    try:
        return auto.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed tokenizer.json
        files = ", ".join(f for f in TOKENIZER_FILES if (path / f).is_file())
        raise CheckpointError(
            f"cannot load the tokenizer in {str(path)!r} (from {files}): corrupt or unsupported tokenizer files "
            f"({type(e).__name__}: {e})"
        ) from e
