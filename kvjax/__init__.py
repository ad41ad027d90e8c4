"""kvjax: KV-cache compression for long-context LLM inference in JAX.

    import kvjax
    model = kvjax.load_model("path/to/hf-model", dtype="bfloat16")
    tok = kvjax.load_tokenizer("path/to/hf-model")
    out = kvjax.generate(model, [tok.encode("...")], method="streaming_llm",
                         method_args={"budget": 256}, max_new_tokens=32)

Heavy submodules (models, runtime) load on first use, so `import kvjax.cache` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvjax.errors import CheckpointError, ConfigError, KvjaxError

__version__ = "0.1.0"

_LAZY = {
    "cache": ("kvjax.cache", None),
    "methods": ("kvjax.methods", None),
    "DecoderLM": ("kvjax.models.model", "DecoderLM"),
    "load_model": ("kvjax.models.model", "load_model"),
    "load_tokenizer": ("kvjax.models.tokenizer", "load_tokenizer"),
    "GenerationResult": ("kvjax.runtime.generate", "GenerationResult"),
    "generate": ("kvjax.runtime.generate", "generate"),
    "prefill": ("kvjax.runtime.generate", "prefill"),
    "decode": ("kvjax.runtime.generate", "decode"),
    "CompressedContext": ("kvjax.runtime.contexts", "CompressedContext"),
    "compress_context": ("kvjax.runtime.contexts", "compress_context"),
    "ask": ("kvjax.runtime.contexts", "ask"),
    "save_context": ("kvjax.runtime.context_file", "save_context"),
    "load_context": ("kvjax.runtime.context_file", "load_context"),
}

__all__ = ["CheckpointError", "ConfigError", "KvjaxError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kvjax' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
