"""The packaged `kvjax-tiny` model: a real Hugging Face checkpoint, the eval CLI's default model."""

import pathlib

import numpy as np
import pytest

from kvjax.models import presets
from kvjax.models.loader import param_shapes

ASSET = pathlib.Path(presets.__file__).resolve().parent.parent / "assets" / "kvjax-tiny"


def test_packaged_files_and_size():
    names = {p.name for p in ASSET.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in ASSET.iterdir()) < 25 * 2**20
    assert "kvjax-tiny" in presets.available()
    config = presets.preset_config("kvjax-tiny")
    params = sum(int(np.prod(s)) for s in param_shapes(config).values())
    assert config.model_type == "llama" and config.num_kv_heads < config.num_heads  # GQA
    assert 1_000_000 <= params <= 5_000_000


def test_same_logits_as_transformers_llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import kvjax

    tokenizer = transformers.AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    text = "The grass is green. The pass key is 40512. Remember it.\nWhat is the pass key? The pass key is"
    ids = np.asarray([tokenizer.encode(text)])
    assert kvjax.load_tokenizer("kvjax-tiny").encode(text) == ids[0].tolist()
    ours = np.asarray(kvjax.load_model("kvjax-tiny", dtype="float32")(ids)[0])
    hf = transformers.LlamaForCausalLM.from_pretrained(ASSET, torch_dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_eval_cli_defaults_to_kvjax_tiny():
    from cli_inprocess import run_eval  # the CLI's entry point in this process: same exit code and output

    out = run_eval("--method=full", "--task=passkey", "--dry_run")
    assert out.returncode == 0, out.stderr
    assert "kvjax-tiny" in out.stdout + out.stderr
