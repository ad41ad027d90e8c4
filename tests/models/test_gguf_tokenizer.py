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


def _metadata(model: str, merges: list[str] | None = None):
    def write(w, tokens: list[str]) -> None:
        w.add_tokenizer_model(model)
        w.add_token_list(tokens)
        if merges is not None:
            w.add_token_merges(merges)
    return write


@pytest.mark.parametrize("model, merges, match", [
    ("llama", None, r"'llama' tokenizer has neither tokenizer\.ggml\.merges nor tokenizer\.ggml\.scores"),
    ("gpt2", None, r"'gpt2' tokenizer has neither tokenizer\.ggml\.merges nor tokenizer\.ggml\.scores"),
    ("t5", None, r"'t5' tokenizer needs tokenizer\.ggml\.scores"),
    ("gpt2", ["ab"], r"tokenizer\.ggml\.merges\[0\] = 'ab' is not two tokens"),
    ("gpt2", ["a b", "q zz"], r"cannot build its tokenizer: .*zz"),
    ("bert", ["a b"], r"cannot build its tokenizer: .*'bert'"),
])
def test_tokenizer_metadata_that_cannot_make_a_tokenizer_is_named(tmp_path, model, merges, match):
    """One CheckpointError, on one line, naming the file and what its metadata lacks (not a KeyError's 'scores',
    nor a raw error from the tokenizers library)."""
    path = write_tiny_gguf(tmp_path / "broken.gguf", tokenizer=_metadata(model, merges))
    for load in (kvjax.load_tokenizer, kgguf.gguf_model_dir):
        with pytest.raises(CheckpointError, match=match) as err:
            load(path)
        assert str(err.value).startswith(f"GGUF file {str(path)!r}: ") and "\n" not in str(err.value)
