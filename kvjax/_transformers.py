"""The one place kvjax imports transformers (a leaf: it imports nothing of kvjax)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["import_transformers"]


def import_transformers() -> Any:
    """`import transformers` without its "PyTorch was not found" advisory on the terminal: kvjax only uses its
    tokenizers, which need no PyTorch (the advisory is skipped while TRANSFORMERS_NO_ADVISORY_WARNINGS is set)."""
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    previous = os.environ.get(key)
    os.environ[key] = "1"
    try:
        import transformers
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous
    return transformers
