"""The README's library example and the RAG example of docs/library.md run as written, against a tiny local HF
model directory."""

import pathlib
import re

import pytest

pytest.importorskip("torch")

import hf_tiny  # noqa: E402

from kvjax.models.char_tokenizer import save_char_tokenizer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LIBRARY = ROOT / "docs" / "library.md"  # the method table and the RAG example, moved off the front page


def _blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def hf_tiny_layers(model_dir: pathlib.Path) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


def test_readme_examples_run(tmp_path):
    model_dir = hf_tiny.make_llama(tmp_path, name="tiny", max_position_embeddings=2048)
    save_char_tokenizer(model_dir)
    usage = next(b for b in _blocks(README) if "kvjax.generate(" in b)
    rag_block = next(b for b in _blocks(LIBRARY) if "rag.answer(" in b)
    usage = usage.replace("/models/Qwen2.5-7B-Instruct", str(model_dir)).replace('"bfloat16"', '"float32"')
    usage = usage.replace('{"budget": 1024}', '{"budget": 8}').replace("max_new_tokens=64", "max_new_tokens=4")
    scope: dict = {}
    exec(compile(usage, "README:usage", "exec"), scope)
    assert scope["layer"].pos.shape[0] == 2 and len(scope["out"].cache.layers) == hf_tiny_layers(model_dir)
    rag_code = rag_block.replace("/caches/wiki", str(tmp_path / "cache"))
    rag_code = rag_code.replace("max_new_tokens=32", "max_new_tokens=3")
    scope.update(passages=["Paris is in France. ", "The pass key is 42. "], question="What is the pass key?")
    exec(compile(rag_code, "README:rag", "exec"), scope)
    assert scope["result"].report is not None
