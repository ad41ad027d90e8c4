"""The tokenizer kvjax builds from a GGUF file's metadata: what it adds to a prompt matches transformers' own GGUF
tokenizer, and a file whose tokenizer metadata is missing or incomplete is one error naming the file."""

from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf")

from gguf_tiny import write_tiny_gguf  # noqa: E402

import kvjax  # noqa: E402
from kvjax.errors import CheckpointError  # noqa: E402
from kvjax.models import gguf as kgguf  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(kgguf.ENV_CACHE_DIR, str(tmp_path / "cache"))


def test_a_gguf_without_a_tokenizer_is_named(tmp_path):
    """No tokenizer.ggml.* metadata at all: the error names the GGUF file, not the cache directory it became."""
    path = write_tiny_gguf(tmp_path / "bare.gguf", tokenizer=None)
    with pytest.raises(CheckpointError, match=r"'.*bare\.gguf' holds no tokenizer .*tokenizer\.ggml\.tokens"):
        kvjax.load_tokenizer(path)
