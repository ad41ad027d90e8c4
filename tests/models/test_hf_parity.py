"""Logit parity with Hugging Face transformers (PyTorch, CPU, float32) on tiny random checkpoints."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_tiny  # noqa: E402

import kvjax  # noqa: E402

CASES = {
    "llama_gqa_llama3_rope": lambda p: hf_tiny.make_llama(p, return_model=True),
    "llama_biases": lambda p: hf_tiny.make_llama(
        p, attention_bias=True, mlp_bias=True, return_model=True
    ),
    "llama_yarn": lambda p: hf_tiny.make_llama(
        p,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        return_model=True,
    ),
    "llama_linear": lambda p: hf_tiny.make_llama(
        p,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        return_model=True,
    ),
    "qwen2_untied": lambda p: hf_tiny.make_qwen2(p, tied=False, return_model=True),
    "qwen2_tied": lambda p: hf_tiny.make_qwen2(p, tied=True, return_model=True),
    "mistral": lambda p: hf_tiny.make_mistral(p, return_model=True),
    "mistral_sliding_window": lambda p: hf_tiny.make_mistral(
        p, sliding_window=7, return_model=True
    ),
}


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf(tmp_path, case):
    path, hf_model = CASES[case](tmp_path)
    ids = np.random.default_rng(0).integers(3, 128, size=(2, 40))
    model = kvjax.load_model(path, dtype="float32")
    logits, _ = model(ids)
    np.testing.assert_allclose(np.asarray(logits), _hf_logits(hf_model, ids), atol=1e-4, rtol=0)


def test_sharded_checkpoint_loads_to_the_same_logits(tmp_path):
    path = hf_tiny.make_sharded_llama(tmp_path)
    single, hf_model = hf_tiny.make_llama(tmp_path, name="single", return_model=True)
    ids = np.random.default_rng(1).integers(3, 128, size=(1, 17))
    sharded_logits, _ = kvjax.load_model(path, dtype="float32")(ids)
    np.testing.assert_allclose(
        np.asarray(sharded_logits), _hf_logits(hf_model, ids), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_greedy_generation_matches_hf_generate(tmp_path, chunk_size):
    path, hf_model = hf_tiny.make_qwen2(tmp_path, tied=False, return_model=True)
    prompt = np.random.default_rng(2).integers(3, 128, size=(1, 21))
    with torch.no_grad():
        hf_out = hf_model.generate(
            torch.as_tensor(prompt),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, 21:].numpy()
    model = kvjax.load_model(path, dtype="float32")
    out = kvjax.generate(model, prompt, max_new_tokens=10, stop_at_eos=False, chunk_size=chunk_size)
    np.testing.assert_array_equal(out.tokens[0], hf_out)


def test_bf16_load_is_close_to_float32(tmp_path):
    path, hf_model = hf_tiny.make_llama(tmp_path, return_model=True)
    ids = np.random.default_rng(3).integers(3, 128, size=(1, 24))
    logits, _ = kvjax.load_model(path, dtype="bfloat16")(ids)
    ref = _hf_logits(hf_model, ids)
    assert np.max(np.abs(np.asarray(logits) - ref)) < 0.1 * np.max(np.abs(ref)) + 0.05
