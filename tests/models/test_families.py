"""Qwen3, Gemma 3 (text) and Phi-3 / Phi-4 against transformers (PyTorch, CPU, float32) on tiny random checkpoints
saved with transformers' own classes, and the sliding-window layers' rings (Gemma 3's local layers, Mistral,
Phi-3 with a window).

Oracles: transformers' logits (to 1e-4) and its greedy `generate` (token for token, past the window too);
the exact bytes and kept positions a ring of the window must hold; transformers' loader errors are not used:
a bad checkpoint must give one kvjax error naming the file and the key.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402

import kvjax  # noqa: E402
from kvjax import cache as kvc  # noqa: E402
from kvjax.errors import CheckpointError, ConfigError  # noqa: E402


def _mistral_window(p, **kw):
    return hf_tiny.make_mistral(p, name="mistral_window", sliding_window=7, **kw)


def _phi3_window(p, **kw):  # Phi-3-mini-4k's shape: default RoPE and a window on every layer
    return hf_tiny.make_phi3(p, name="phi3_window", sliding_window=9, rope_parameters={"rope_theta": 10000.0}, **kw)


def _qwen3_sharded(p, **kw):
    path = hf_tiny.make_qwen3(p, name="qwen3_sharded", max_shard_size="60KB", **kw)
    assert (pathlib.Path(path[0] if isinstance(path, tuple) else path) / "model.safetensors.index.json").is_file()
    return path


MAKERS = {
    "qwen3": hf_tiny.make_qwen3,
    "qwen3_sharded": _qwen3_sharded,
    "gemma3": hf_tiny.make_gemma3,
    "gemma3_multimodal": hf_tiny.make_gemma3_multimodal,
    "phi3_longrope": hf_tiny.make_phi3,
    "phi3_window": _phi3_window,
    "mistral_window": _mistral_window,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each tiny checkpoint once per module: `{name: (path, transformers model)}`."""
    tmp = tmp_path_factory.mktemp("families")
    return {name: make(tmp, return_model=True) for name, make in MAKERS.items()}


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("case", sorted(MAKERS))
def test_logits_match_hf(checkpoints, case):
    """Batch of 2; 24 tokens (inside Phi-3's pretrained 32: LongRoPE's short factors) and 40 (past it: the long
    ones), both longer than every window."""
    path, hf_model = checkpoints[case]
    model = kvjax.load_model(path, dtype="float32")
    for length in (24, 40):
        ids = np.random.default_rng(length).integers(3, 128, size=(2, length))
        logits, _ = model(ids)
        np.testing.assert_allclose(np.asarray(logits), _hf_logits(hf_model, ids), atol=1e-4, rtol=0)


def _hf_generate(hf_model, prompt: np.ndarray, new: int) -> np.ndarray:
    with torch.no_grad():
        out = hf_model.generate(torch.as_tensor(prompt), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    return out[0, prompt.shape[1]:].numpy()


# (prompt, new tokens): a prompt inside the window decoding past it, and one longer than the window.
GENERATE = {
    "qwen3": [(21, 10)],
    "gemma3": [(21, 10)],
    "phi3_longrope": [(21, 10), (40, 6)],  # short factors throughout; long ones throughout (prompt past 32)
    "phi3_window": [(21, 10)],
    "mistral_window": [(5, 12), (21, 10)],
}


@pytest.mark.parametrize("case", sorted(GENERATE))
def test_greedy_generation_matches_hf_generate(checkpoints, case):
    path, hf_model = checkpoints[case]
    model = kvjax.load_model(path, dtype="float32")
    for length, new in GENERATE[case]:
        prompt = np.random.default_rng(length).integers(3, 128, size=(1, length))
        want = _hf_generate(hf_model, prompt, new)
        for chunk in (None, 8) if case == "gemma3" else (None,):  # chunks of 8 across the window of 6
            out = kvjax.generate(model, prompt, max_new_tokens=new, stop_at_eos=False, chunk_size=chunk)
            np.testing.assert_array_equal(out.tokens[0], want, err_msg=f"{case} prompt {length} chunk {chunk}")


def test_generation_stops_on_generation_config_eos_as_hf_generate(checkpoints, tmp_path):
    """Phi-3-mini-instruct's config.json ends at 32000 (`<|endoftext|>`); its generation_config.json adds `<|end|>`
    (32007), the token that closes an assistant turn. transformers' `generate` stops on the latter list: so must
    kvjax, or a chat answer runs on past its turn. Here a token the tiny model emits mid-generation stands in."""
    path = _copy(checkpoints["phi3_longrope"][0], tmp_path / "m")
    prompt = np.random.default_rng(12).integers(3, 128, size=(1, 12))
    free = kvjax.generate(kvjax.load_model(path, dtype="float32"), prompt, max_new_tokens=10,
                          stop_at_eos=False).tokens[0]
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, int(free[4])]
    (path / "generation_config.json").write_text(json.dumps(generation))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    with torch.no_grad():  # transformers reads generation_config.json itself
        want = hf_model.generate(torch.as_tensor(prompt), max_new_tokens=10, do_sample=False)[0, 12:].numpy()
    assert len(want) < 10  # it stopped
    out = kvjax.generate(kvjax.load_model(path, dtype="float32"), prompt, max_new_tokens=10)
    assert out.num_tokens[0] == len(want)
    np.testing.assert_array_equal(out.tokens[0, : len(want)], want)


def _nbytes(batch: int, kv_heads: int, head_dim: int, capacities: list[int]) -> int:
    """K and V (float32), positions (int32) per slot, and a length per head, of each layer."""
    per_slot = batch * kv_heads * (2 * head_dim * 4 + 4)
    return sum(per_slot * c + batch * kv_heads * 4 for c in capacities)


def test_gemma3_local_layers_hold_a_ring_of_their_window(checkpoints):
    """Local layers (window 6) are allocated at the window, the global layer at prompt bucket + new tokens;
    `cache.nbytes` is exactly that. After a prompt longer than the window a ring holds its last 6 positions; after
    decoding past EOS (a finished row stores nothing more), the last 6 positions written (the latest token attends
    itself and the 5 before it)."""
    path, _ = checkpoints["gemma3"]
    model = kvjax.load_model(path, dtype="float32")
    config = model.config
    assert config.layer_windows == (6, 6, None)
    prompts = [np.random.default_rng(1).integers(3, 128, n).tolist() for n in (21, 9)]
    state = kvjax.prefill(model, prompts, max_new_tokens=10)
    capacities = [layer.capacity for layer in state.cache.layers]
    assert capacities == [6, 6, 32 + 10]
    assert state.cache.nbytes == _nbytes(2, config.num_kv_heads, config.head_dim, capacities)
    assert state.cache.nbytes < _nbytes(2, config.num_kv_heads, config.head_dim, [42, 42, 42])
    kept = kvc.positions_kept(state.cache)
    for layer in (0, 1):
        assert kept[layer] == [[list(range(15, 21))], [list(range(3, 9))]]
    assert kept[2] == [[list(range(21))], [list(range(9))]]
    tokens, _, cache = kvjax.decode(model, state, max_new_tokens=10, stop_at_eos=False)
    kept = kvc.positions_kept(cache)
    assert kept[0] == kept[1] == [[list(range(24, 30))], [list(range(12, 18))]]
    assert kept[2] == [[list(range(30))], [list(range(18))]]


# ---- bad checkpoints: one error naming the file and the key ----

def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: pathlib.Path, change) -> None:
    d = json.loads((path / "config.json").read_text())
    change(d)
    (path / "config.json").write_text(json.dumps(d))


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_unknown_model_type_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints["qwen3"][0], tmp_path / "m")
    _edit_config(path, lambda d: d.update(model_type="gemma2"))
    with pytest.raises(ConfigError) as e:
        kvjax.load_model(path)
    msg = _one_line(e)
    assert str(path / "config.json") in msg and "model_type='gemma2' is not supported" in msg


def test_missing_qk_norm_weight_is_named(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = _copy(checkpoints["qwen3"][0], tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        kvjax.load_model(path)
    msg = _one_line(e)
    assert "'model.layers.1.self_attn.k_norm.weight'" in msg and "model.safetensors" in msg and str(path) in msg


def test_layer_types_and_sliding_window_mismatch_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints["gemma3"][0], tmp_path / "m")
    _edit_config(path, lambda d: d.update(sliding_window=None))
    with pytest.raises(ConfigError) as e:
        kvjax.load_model(path)
    msg = _one_line(e)
    assert str(path / "config.json") in msg and "layer_types" in msg and "sliding_window is null" in msg
    _edit_config(path, lambda d: d.update(sliding_window=6, layer_types=["full_attention"]))
    with pytest.raises(ConfigError, match=r"layer_types=\['full_attention'\] must list one of .* \(3 layers\)"):
        kvjax.load_model(path)


def test_fused_projection_shape_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints["phi3_longrope"][0], tmp_path / "m")
    _edit_config(path, lambda d: d.update(num_key_value_heads=4))
    with pytest.raises(CheckpointError) as e:
        kvjax.load_model(path)
    msg = _one_line(e)
    assert "'model.layers.0.self_attn.qkv_proj.weight'" in msg and "model.safetensors" in msg
    assert "(128, 64)" in msg and "(192, 64)" in msg  # found [(4 + 2 * 2) * 16, D], expected (4 + 2 * 4) * 16


def test_multimodal_checkpoint_reads_the_text_decoder_only(checkpoints):
    """Gemma 3 4B+ ship as `Gemma3ForConditionalGeneration`: the vision tower and projector are left unread, and
    the text decoder's tensors are all used (none left over, none missing)."""
    path, _ = checkpoints["gemma3_multimodal"]
    model = kvjax.load_model(path, dtype="float32")
    assert model.config.multimodal and model.config.model_type == "gemma3_text"
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert any(n.startswith("vision_tower.") for n in names)
    text = [n for n in names if n.startswith("language_model.")]
    assert len(text) == len(set(kvjax.models.loader.hf_tensor_names(model.config)))


def test_phi3_fused_tensors_map_into_the_fused_layout_and_back(checkpoints):
    """Phi-3's own qkv_proj [(N + 2K) H, D] / gate_up_proj [2F, D] go straight into kvjax's qkv / gate_up (query
    head n = kv * G + g of the KV head's group, then its key and value) and export gives them back bit for bit."""
    import safetensors.numpy

    from kvjax.models.export import to_hf_tensors
    from kvjax.models.loader import load_checkpoint

    path = pathlib.Path(checkpoints["phi3_longrope"][0])
    config, params = load_checkpoint(path)
    original = safetensors.numpy.load_file(str(path / "model.safetensors"))
    n, k, h, f = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    g = n // k
    qkv_proj, gate_up_proj = (original[f"model.layers.1.{name}.weight"] for name in ("self_attn.qkv_proj",
                                                                                        "mlp.gate_up_proj"))
    fused = params["layers.1.qkv"]
    np.testing.assert_array_equal(fused[:, :, :g].reshape(-1, n * h).T, qkv_proj[: n * h])
    np.testing.assert_array_equal(fused[:, :, g].reshape(-1, k * h).T, qkv_proj[n * h: (n + k) * h])
    np.testing.assert_array_equal(fused[:, :, g + 1].reshape(-1, k * h).T, qkv_proj[(n + k) * h:])
    np.testing.assert_array_equal(params["layers.1.gate_up"][:, 0].T, gate_up_proj[:f])
    np.testing.assert_array_equal(params["layers.1.gate_up"][:, 1].T, gate_up_proj[f:])
    exported = to_hf_tensors(config, params)
    for name, tensor in exported.items():
        np.testing.assert_array_equal(tensor, original[name], err_msg=name)
