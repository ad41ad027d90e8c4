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


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_sentencepiece_bos_matches_transformers(tmp_path, add_bos):
    """A sentencepiece ('llama') vocabulary adds BOS unless tokenizer.ggml.add_bos_token says otherwise (older files
    have no flag; llama.cpp and transformers then add it): the ids of kvjax's tokenizer are transformers' own."""
    from transformers import AutoTokenizer

    def write(w, tokens: list[str]) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([-float(i) for i in range(len(tokens))])
        w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<") else gguf.TokenType.NORMAL for t in tokens])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        if add_bos is not None:
            w.add_add_bos_token(add_bos)

    path = write_tiny_gguf(tmp_path / "spm.gguf", tokenizer=write)
    ours = kvjax.load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ("ab c", "hello world", ""):
        assert ours.encode(text) == theirs.encode(text)
    assert (ours.encode("ab")[0] == 1) == (add_bos is not False)


def test_a_gguf_file_not_named_gguf_loads_as_the_same_file_named_so(tmp_path):
    """A GGUF file is known by its magic bytes, whatever its name (an Ollama blob has no extension; before: 'model
    path ... is not a directory'): its tokenizer and logits are those of the same bytes named *.gguf."""
    import shutil

    import numpy as np

    named = write_tiny_gguf(tmp_path / "tiny.gguf")
    blob = tmp_path / "sha256-0123abcd"
    shutil.copyfile(named, blob)
    text = "ab c zz"
    assert kvjax.load_tokenizer(blob).encode(text) == kvjax.load_tokenizer(named).encode(text)
    ids = np.array([[1, 5, 7, 30]])
    np.testing.assert_array_equal(np.asarray(kvjax.load_model(blob)(ids)[0]),
                                  np.asarray(kvjax.load_model(named)(ids)[0]))
    other = tmp_path / "notes.bin"
    other.write_bytes(b"GGUX" + bytes(60))
    with pytest.raises(CheckpointError, match="is not a directory"):
        kvjax.load_tokenizer(other)
