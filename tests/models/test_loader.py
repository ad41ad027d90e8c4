"""Safetensors loading (values, layout, shards, dtypes, every error case), presets, tokenizer."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import shutil
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from kvjax.errors import CheckpointError, ConfigError
from kvjax.models import presets
from kvjax.models.config import ModelConfig
from kvjax.models.loader import flatten, hf_tensor_names, layer_shapes, load_checkpoint, load_params, nest, param_shapes
from kvjax.models.presets import available, preset_config, resolve_model_dir
from kvjax.models.tokenizer import load_tokenizer

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_tiny  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[pathlib.Path, Any]]:
    """One tiny checkpoint per family / variant, built once for the module."""
    root = tmp_path_factory.mktemp("hf")
    out: dict[str, tuple[pathlib.Path, Any]] = {
        "llama": hf_tiny.make_llama(root, return_model=True),
        "llama_bias": hf_tiny.make_llama(
            root, name="llama_bias", return_model=True, attention_bias=True, mlp_bias=True
        ),
        "qwen2": hf_tiny.make_qwen2(root, tied=False, return_model=True),
        "qwen2_tied": hf_tiny.make_qwen2(root, tied=True, return_model=True),
        "mistral": hf_tiny.make_mistral(root, return_model=True),
    }
    out["llama_sharded"] = (hf_tiny.make_sharded_llama(root), None)
    return out


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def _as_preset(path: pathlib.Path, preset: str) -> pathlib.Path:
    """``path`` with the preset's config.json (its sizes): resolution reads the config only, and refuses a
    directory of another size under a preset's name."""
    (path / "config.json").write_text(json.dumps(presets.PRESETS[preset].config))
    return path


def _rewrite(path: pathlib.Path, edit: Any) -> None:
    """Load a safetensors file as numpy, let ``edit`` change the dict, save it back."""
    tensors = safetensors.numpy.load_file(str(path))
    edit(tensors)
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("variant", ["llama", "llama_bias", "qwen2", "qwen2_tied", "mistral"])
def test_params_equal_torch_weights(tiny: dict[str, Any], variant: str) -> None:
    path, model = tiny[variant]
    config, params = load_checkpoint(path)
    sd = hf_tiny.torch_state(model)
    shapes = param_shapes(config)
    assert list(params) == list(shapes)
    for key, arr in params.items():
        assert arr.shape == shapes[key], key
        assert arr.dtype == np.float32, key

    n, k, h, d = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    np.testing.assert_array_equal(params["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["final_norm"], sd["model.norm.weight"])
    if config.tie_word_embeddings:
        assert "lm_head" not in params
    else:
        np.testing.assert_array_equal(params["lm_head"], sd["lm_head.weight"].T)

    rng = np.random.default_rng(0)
    x = rng.standard_normal(d).astype(np.float32)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        np.testing.assert_array_equal(
            params[f"layers.{i}.attn_norm"], sd[p + "input_layernorm.weight"]
        )
        np.testing.assert_array_equal(
            params[f"layers.{i}.mlp_norm"], sd[p + "post_attention_layernorm.weight"]
        )
        # Projections mean the same maps as torch's Linear layers (checked by applying them). The fused qkv
        # [D, K, G + 2, H] holds per KV head its G query heads (head kv * G + g), its key, its value.
        g = n // k
        fused = params[f"layers.{i}.qkv"]
        assert fused.shape == (d, k, g + 2, h)
        parts = {"q": fused[:, :, :g].reshape(d, n, h), "k": fused[:, :, g], "v": fused[:, :, g + 1]}
        for name, heads in (("q", n), ("k", k), ("v", k)):
            w = sd[p + f"self_attn.{name}_proj.weight"]
            got = np.einsum("d,dnh->nh", x, parts[name])
            np.testing.assert_allclose(got, (w @ x).reshape(heads, h), rtol=1e-5, atol=1e-6)
            if config.qkv_bias:
                bias = sd[p + f"self_attn.{name}_proj.bias"]
                assert np.abs(bias).max() > 0  # hf_tiny randomises biases
                fb = params[f"layers.{i}.qkv_bias"]
                got_bias = {"q": fb[:, :g].reshape(n, h), "k": fb[:, g], "v": fb[:, g + 1]}[name]
                np.testing.assert_array_equal(got_bias, bias.reshape(heads, h))
        a = rng.standard_normal((n, h)).astype(np.float32)
        w_o = sd[p + "self_attn.o_proj.weight"]
        np.testing.assert_allclose(
            np.einsum("nh,nhd->d", a, params[f"layers.{i}.o"]),
            w_o @ a.reshape(-1),
            rtol=1e-5,
            atol=1e-6,
        )
        gate_up = params[f"layers.{i}.gate_up"]  # [D, 2, F]: gate, then up
        mlp = {"gate": gate_up[:, 0], "up": gate_up[:, 1], "down": params[f"layers.{i}.down"]}
        for j, name in enumerate(("gate", "up", "down")):
            w = sd[p + f"mlp.{name}_proj.weight"]
            np.testing.assert_array_equal(mlp[name], w.T)
            if config.mlp_bias:
                got_bias = params[f"layers.{i}.down_bias"] if name == "down" else params[f"layers.{i}.gate_up_bias"][j]
                np.testing.assert_array_equal(got_bias, sd[p + f"mlp.{name}_proj.bias"])
        if config.o_bias:
            np.testing.assert_array_equal(
                params[f"layers.{i}.o_bias"], sd[p + "self_attn.o_proj.bias"]
            )


def test_bias_flags_per_family(tiny: dict[str, Any]) -> None:
    loaded = {v: load_checkpoint(tiny[v][0]) for v in ("llama", "llama_bias", "qwen2")}
    keys = {v: set(params) for v, (_, params) in loaded.items()}
    for v, (config, _) in loaded.items():  # every layer carries its own copy of each parameter
        assert {k.split(".", 2)[1] for k in keys[v] if k.startswith("layers.")} == {
            str(i) for i in range(config.num_layers)}
    layer_keys = {v: {k.split(".", 2)[2] for k in keys[v] if k.startswith("layers.")} for v in keys}
    bias_keys = {"qkv_bias"}
    mlp_bias_keys = {"gate_up_bias", "down_bias"}
    for v in layer_keys:  # one fused layout: no separate q / k / v or gate / up arrays
        assert {"qkv", "gate_up"} <= layer_keys[v]
        assert not layer_keys[v] & {"q", "k", "v", "gate", "up", "q_bias", "k_bias", "v_bias", "gate_bias", "up_bias"}
    assert not layer_keys["llama"] & (bias_keys | mlp_bias_keys | {"o_bias"})
    assert bias_keys | mlp_bias_keys | {"o_bias"} <= layer_keys["llama_bias"]
    assert bias_keys <= layer_keys["qwen2"] and "o_bias" not in layer_keys["qwen2"]


def test_nest_gives_one_dict_per_layer_and_flatten_inverts_it(tiny: dict[str, Any]) -> None:
    config, params = load_checkpoint(tiny["llama_bias"][0])
    nested = nest(params)
    assert set(nested) == {"embed", "final_norm", "lm_head", "layers"}
    assert len(nested["layers"]) == config.num_layers
    for i, layer in enumerate(nested["layers"]):
        assert {name: a.shape for name, a in layer.items()} == layer_shapes(config)
        for name, a in layer.items():
            assert a is params[f"layers.{i}.{name}"]  # the arrays are not copied
    flat = flatten(nested)
    assert sorted(flat) == sorted(params) and all(flat[k] is params[k] for k in params)
    assert flatten(params) == params


def test_sharded_index_loads(tiny: dict[str, Any]) -> None:
    path = tiny["llama_sharded"][0]
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 1 and "model.safetensors" not in shards
    _, sharded = load_checkpoint(path)
    _, single = load_checkpoint(tiny["llama"][0])  # same seed, same weights
    assert list(sharded) == list(single)
    for key in single:
        np.testing.assert_array_equal(sharded[key], single[key], err_msg=key)


def test_unindexed_safetensors_files_load(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["llama_sharded"][0], tmp_path / "m")
    (path / "model.safetensors.index.json").unlink()
    _, params = load_checkpoint(path)
    np.testing.assert_array_equal(params["embed"], load_checkpoint(tiny["llama"][0])[1]["embed"])


def test_unsharded_save_over_a_sharded_checkpoint_loads_what_transformers_loads(tmp_path: pathlib.Path) -> None:
    """`save_pretrained` unsharded into a sharded checkpoint's directory deletes the shards but leaves the index.
    transformers reads model.safetensors before the index, and so must kvjax (it refused the directory, the index
    naming deleted shards)."""
    import torch
    import transformers

    path, model = hf_tiny.make_llama(tmp_path, name="resaved", return_model=True, max_shard_size="100KB")
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    model.save_pretrained(path)
    assert (path / "model.safetensors.index.json").is_file() and not list(path.glob("model-*-of-*.safetensors"))
    want = hf_tiny.torch_state(transformers.AutoModelForCausalLM.from_pretrained(path))
    _, params = load_checkpoint(path)
    np.testing.assert_array_equal(params["embed"], want["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["lm_head"], want["lm_head.weight"].T)


def test_bf16_stays_bf16_unless_dtype_given(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["qwen2"][0], tmp_path / "bf16")

    def to_bf16(tensors: dict[str, np.ndarray]) -> None:
        for name in tensors:
            tensors[name] = tensors[name].astype(ml_dtypes.bfloat16)

    _rewrite(path / "model.safetensors", to_bf16)
    config, params = load_checkpoint(path)
    assert all(a.dtype == ml_dtypes.bfloat16 for a in params.values())
    as_f32 = load_params(path, config, dtype=np.float32)
    assert all(a.dtype == np.float32 for a in as_f32.values())
    for key in params:
        np.testing.assert_array_equal(as_f32[key], params[key].astype(np.float32))
    _, from_f32 = load_checkpoint(tiny["qwen2"][0], dtype="bfloat16")
    assert from_f32["layers.0.qkv"].dtype == ml_dtypes.bfloat16
    with pytest.raises(ConfigError, match="int32"):
        load_params(path, config, dtype=np.int32)


def test_inv_freq_buffers_ignored(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["mistral"][0], tmp_path / "m")

    def add(tensors: dict[str, np.ndarray]) -> None:
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    _rewrite(path / "model.safetensors", add)
    load_checkpoint(path)


def test_tied_checkpoint_with_equal_lm_head(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["qwen2_tied"][0], tmp_path / "equal")
    _rewrite(
        path / "model.safetensors",
        lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].copy()),
    )
    _, params = load_checkpoint(path)
    assert "lm_head" not in params

    path = _copy(tiny["qwen2_tied"][0], tmp_path / "differs")
    _rewrite(
        path / "model.safetensors",
        lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"] + 1.0),
    )
    with pytest.raises(CheckpointError, match=r"unused tensor 'lm_head\.weight'.*differs"):
        load_checkpoint(path)


# ---- error cases: each names the tensor / file ----


def test_missing_directory(tmp_path: pathlib.Path) -> None:
    config = ModelConfig.from_hf_dict({"model_type": "llama", **hf_tiny.TINY_ARCH})
    with pytest.raises(CheckpointError, match="nope.*does not exist"):
        load_params(tmp_path / "nope", config)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize("name", ["{tmp}/m.gguf", "{tmp}/M.GGUF", "m.gguf"])
@pytest.mark.parametrize("load", [resolve_model_dir, load_tokenizer, load_checkpoint, ModelConfig.from_dir])
def test_missing_gguf_file_is_named_a_gguf_file(tmp_path: pathlib.Path, monkeypatch: Any, name: str, load: Any) -> None:
    """A path named *.gguf that does not exist is a missing GGUF file, not a missing model directory nor an unknown
    preset, whichever entry point reads it (absolute, or a bare name in the working directory)."""
    monkeypatch.chdir(tmp_path)
    name = name.format(tmp=tmp_path)
    with pytest.raises(CheckpointError, match=f"^GGUF file '{re.escape(name)}' does not exist$"):
        load(name)


def test_no_config_json(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["llama"][0], tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(path)


def test_remote_code_refused(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["llama"][0], tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.Custom"}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="auto_map"):
        load_checkpoint(path)


@pytest.mark.parametrize("pickled", ["pytorch_model.bin", "consolidated.00.pth", "model.pt"])
def test_pickled_only_refused(tiny: dict[str, Any], tmp_path: pathlib.Path, pickled: str) -> None:
    path = tmp_path / "m"
    path.mkdir()
    shutil.copy(tiny["llama"][0] / "config.json", path)
    (path / pickled).write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert pickled in str(e.value) and "never unpickles" in str(e.value)
    assert "safetensors" in str(e.value)


def test_no_weights_at_all(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m"
    path.mkdir()
    shutil.copy(tiny["llama"][0] / "config.json", path)
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_checkpoint(path)


def test_missing_tensor_named(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["llama"][0], tmp_path / "m")
    old, new = "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.upproj.weight"
    _rewrite(path / "model.safetensors", lambda t: t.__setitem__(new, t.pop(old)))
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight.*model\.safetensors",
    ):
        load_checkpoint(path)


def test_unused_tensor_named(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["llama"][0], tmp_path / "m")
    extra = "model.layers.0.self_attn.q_norm.weight"
    _rewrite(path / "model.safetensors", lambda t: t.__setitem__(extra, np.ones(16, np.float32)))
    with pytest.raises(CheckpointError, match=f"unused tensor.*{re.escape(extra)}"):
        load_checkpoint(path)


def test_config_with_more_layers_than_checkpoint(tiny: dict[str, Any]) -> None:
    config = ModelConfig.from_dir(tiny["llama"][0])
    bigger = dataclasses.replace(config, num_layers=3)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.input_layernorm\.weight"):
        load_params(tiny["llama"][0], bigger)


def test_shape_mismatch_named(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["qwen2"][0], tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(
        path / "model.safetensors", lambda t: t.__setitem__(name, np.zeros((16, 64), np.float32))
    )
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert name in msg and "(16, 64)" in msg and "(32, 64)" in msg and "model.safetensors" in msg


def test_non_float_tensor_named(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["mistral"][0], tmp_path / "m")
    name = "model.norm.weight"
    _rewrite(path / "model.safetensors", lambda t: t.__setitem__(name, np.ones(64, np.int32)))
    with pytest.raises(CheckpointError, match=f"{re.escape(name)}.*I32"):
        load_checkpoint(path)


@pytest.mark.parametrize("keep", [0.5, -16])
def test_truncated_file_named(tiny: dict[str, Any], tmp_path: pathlib.Path, keep: float) -> None:
    path = _copy(tiny["llama"][0], tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    cut = int(len(data) * keep) if keep > 0 else len(data) + int(keep)
    (path / "model.safetensors").write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupt or truncated"):
        load_checkpoint(path)


def test_garbage_file_named(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["llama"][0], tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"definitely not safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_checkpoint(path)


def test_deleted_shard_named(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["llama_sharded"][0], tmp_path / "m")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"index\.json.*{shard.name}"):
        load_checkpoint(path)


def test_index_errors(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["llama_sharded"][0], tmp_path / "bad_json")
    (path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json.*not valid JSON"):
        load_checkpoint(path)

    path = _copy(tiny["llama_sharded"][0], tmp_path / "wrong_shard")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    weight_map = index["weight_map"]
    name = "model.norm.weight"
    other = next(s for s in sorted(set(weight_map.values())) if s != weight_map[name])
    weight_map[name] = other
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"model\.norm\.weight.*{other}.*does not contain"):
        load_checkpoint(path)


def test_hf_tensor_names_cover_checkpoint(tiny: dict[str, Any]) -> None:
    for variant in ("llama", "qwen2", "qwen2_tied", "llama_bias"):
        path = tiny[variant][0]
        names = set(safetensors.numpy.load_file(str(path / "model.safetensors")))
        assert set(hf_tensor_names(ModelConfig.from_dir(path))) == names


# ---- presets ----

# Public parameter counts of the Hugging Face checkpoints (embedding and lm_head included).
PARAM_COUNTS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "mistral-7b": 7_241_732_096,
}


@pytest.mark.parametrize("name", sorted(PARAM_COUNTS))
def test_preset_architectures(name: str) -> None:
    assert name in available()
    config = preset_config(name)
    total = sum(math.prod(s) for s in param_shapes(config).values())
    assert total == PARAM_COUNTS[name]
    assert config == ModelConfig.from_hf_dict(config.to_hf_dict())
    assert config.sliding_window is None
    if name.startswith("llama-3."):
        assert config.rope.rope_type == "llama3"
    if name.startswith("qwen2.5"):
        assert config.rope.theta == 1e6 and config.qkv_bias
        assert config.tie_word_embeddings == (
            name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b")
        )


# Parameter counts the model cards give (Gemma 3 1B, Qwen3 4B / 8B, Phi-3 mini / medium, Phi-4; the Phi-3.5-mini
# architecture is Phi-3-mini's with LongRoPE).
FAMILY_PARAM_COUNTS = {
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "gemma-3-1b": 999_885_952,
    "phi-3-mini-4k": 3_821_079_552,
    "phi-3-medium-4k": 13_960_238_080,
    "phi-3.5-mini": 3_821_079_552,
    "phi-4": 14_659_507_200,
}


@pytest.mark.parametrize("name", [n for n in sorted(presets.PRESETS) if n.split("-")[0] in ("qwen3", "gemma", "phi")])
def test_new_family_presets(name: str) -> None:
    """Every Qwen3, Gemma 3 and Phi preset parses, round-trips, and has its family's shape; counts where the model
    card gives one (the Gemma 3 4B+ counts there include the vision tower, which kvjax does not load)."""
    config = preset_config(name)
    text = dataclasses.replace(config, multimodal=False)  # to_hf_dict writes the text decoder alone
    assert name in available() and text == ModelConfig.from_hf_dict(config.to_hf_dict())
    if name in FAMILY_PARAM_COUNTS:
        assert sum(math.prod(s) for s in param_shapes(config).values()) == FAMILY_PARAM_COUNTS[name]
    if name.startswith("qwen3"):
        assert config.qk_norm and config.head_dim == 128 and config.num_kv_heads == 8 and config.sliding_window is None
        assert config.tie_word_embeddings == (name != "qwen3-8b")
    elif name.startswith("gemma"):
        assert config.global_layers == tuple(range(5, config.num_layers, 6))
        assert config.layer_window(0) == (512 if name == "gemma-3-1b" else 1024)
        assert (config.rope.theta, config.rope_local.theta) == (1e6, 1e4) and config.eos_token_ids == (1, 106)
        assert config.multimodal == (name != "gemma-3-1b")
        assert config.rope.rope_type == ("default" if name == "gemma-3-1b" else "linear")
        assert config.query_scale == (math.sqrt(128 / 168) if name == "gemma-3-27b" else 1.0)
    else:
        window = {"phi-3-mini-4k": 2047, "phi-3-medium-4k": 2047}.get(name)
        assert config.layer_windows == (window,) * config.num_layers  # Phi-3.5's 262144 is no window at 128K
        assert config.rope.rope_type == ("longrope" if name == "phi-3.5-mini" else "default")


def test_multimodal_preset_directory_is_checked_by_its_text_config(tmp_path: pathlib.Path) -> None:
    """A Gemma 3 4B directory is the preset's when its text_config has the preset's sizes."""
    path = tmp_path / "gemma-3-4b"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(presets.PRESETS["gemma-3-4b"].config))
    assert resolve_model_dir("gemma-3-4b", model_dir=tmp_path) == path
    other = json.loads(json.dumps(presets.PRESETS["gemma-3-4b"].config))
    other["text_config"]["hidden_size"] = 3840
    (path / "config.json").write_text(json.dumps(other))
    with pytest.raises(ConfigError, match=r"preset 'gemma-3-4b'.*another size.*hidden_size=3840"):
        resolve_model_dir("gemma-3-4b", model_dir=tmp_path)


def test_preset_lookup_spellings() -> None:
    assert preset_config("Qwen2.5-7B") == preset_config("qwen2.5-7b")
    assert preset_config("Qwen/Qwen2.5-7B-Instruct") == preset_config("qwen2.5-7b")
    with pytest.raises(ConfigError, match="qwen2.5-7b"):
        preset_config("gpt-5")


def test_resolve_model_dir(
    tiny: dict[str, Any], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(presets.ENV_MODEL_DIR, raising=False)
    src = tiny["qwen2"][0]
    # An existing directory wins, whatever its name.
    assert resolve_model_dir(str(src)) == src
    # model_dir holding a config.json is the model itself, when it is the preset's size.
    with pytest.raises(ConfigError, match=r"preset 'qwen2.5-7b'.*another size.*hidden_size"):
        resolve_model_dir("qwen2.5-7b", model_dir=src)
    sized = _as_preset(_copy(src, tmp_path / "sized"), "qwen2.5-7b")
    assert resolve_model_dir("qwen2.5-7b", model_dir=sized) == sized
    # model_dir/<preset name>, then model_dir/<repo basename>.
    root = tmp_path / "models"
    by_name = _as_preset(_copy(src, root / "qwen2.5-0.5b"), "qwen2.5-0.5b")
    assert resolve_model_dir("qwen2.5-0.5b", model_dir=root) == by_name
    by_repo = _as_preset(_copy(src, root / "Qwen2.5-1.5B-Instruct"), "qwen2.5-1.5b")
    assert resolve_model_dir("qwen2.5-1.5b", model_dir=root) == by_repo
    # $KVJAX_MODEL_DIR.
    monkeypatch.setenv(presets.ENV_MODEL_DIR, str(root))
    assert resolve_model_dir("qwen2.5-0.5b") == by_name
    # A plain non-preset name under the roots.
    custom = _copy(src, root / "my-finetune")
    assert resolve_model_dir("my-finetune") == custom
    # Known preset without weights: says where it looked and how to fix it.
    with pytest.raises(CheckpointError) as e:
        resolve_model_dir("llama-3.1-8b", model_dir=tmp_path / "elsewhere")
    msg = str(e.value)
    assert "elsewhere" in msg and str(root) in msg and "KVJAX_MODEL_DIR" in msg
    assert "meta-llama/Llama-3.1-8B-Instruct" in msg and "--model_dir" in msg
    monkeypatch.delenv(presets.ENV_MODEL_DIR)
    with pytest.raises(CheckpointError, match="KVJAX_MODEL_DIR is unset"):
        resolve_model_dir("mistral-7b")
    # Unknown name: ConfigError listing the presets; a missing path: CheckpointError.
    with pytest.raises(ConfigError, match=r"unknown model 'nonesuch'.*qwen2\.5-7b"):
        resolve_model_dir("nonesuch")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "missing"))


def test_kvjax_tiny_hook(
    tiny: dict[str, Any], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(presets, "_TINY_DIR", tmp_path / "assets" / "kvjax-tiny")
    assert "kvjax-tiny" not in available()
    with pytest.raises(CheckpointError, match="not packaged"):
        resolve_model_dir("kvjax-tiny")
    packaged = _copy(tiny["llama"][0], tmp_path / "assets" / "kvjax-tiny")
    assert "kvjax-tiny" in available()
    assert resolve_model_dir("kvjax-tiny") == packaged
    assert preset_config("kvjax-tiny") == ModelConfig.from_dir(packaged)


# ---- tokenizer ----


def _save_tiny_tokenizer(path: pathlib.Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)


def test_load_tokenizer(tiny: dict[str, Any], tmp_path: pathlib.Path) -> None:
    path = _copy(tiny["llama"][0], tmp_path / "m")
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        load_tokenizer(path)
    _save_tiny_tokenizer(path)
    tok = load_tokenizer(str(path))
    assert tok("hello world", add_special_tokens=False)["input_ids"] == [3, 4]
    assert load_tokenizer("llama-3.1-8b", model_dir=_as_preset(path, "llama-3.1-8b")).eos_token == "</s>"


def test_loading_holds_no_second_copy_of_the_fused_projections(tmp_path: pathlib.Path) -> None:
    """q / k / v (and gate / up) stream into their slices of one preallocated fused array per layer: the host
    peak while loading (numpy and Python allocations, tracemalloc) exceeds the returned weights by about one HF
    tensor being read, not by the unfused arrays (a loader that built q, k, v, gate, up first and fused them
    after would hold ~4 MB more here), and the result holds no unfused array."""
    import gc
    import tracemalloc

    from tiny import tiny_config

    from kvjax.models.export import save_hf
    from kvjax.models.model import DecoderLM

    config = tiny_config(hidden_size=256, intermediate_size=1024, num_heads=8, num_kv_heads=2, head_dim=64,
                         vocab_size=128)
    save_hf(config, DecoderLM.random(config, seed=0).weights(), tmp_path / "ckpt")
    gc.collect()
    tracemalloc.start()
    try:
        params = load_params(tmp_path / "ckpt", config)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    loaded = sum(a.nbytes for a in params.values())
    largest = config.intermediate_size * config.hidden_size * 4  # gate_proj / up_proj / down_proj, float32
    fused = sum(params[f"layers.0.{name}"].nbytes for name in ("qkv", "gate_up"))  # one layer's: 2.75 MB
    print(f"loaded {loaded / 2**20:.2f} MB, peak {peak / 2**20:.2f} MB, one layer's fused {fused / 2**20:.2f} MB")
    assert peak - loaded < 1.5 * largest < fused
    assert {name.rsplit(".", 1)[1] for name in params if name.startswith("layers.")} == set(layer_shapes(config))


@pytest.mark.parametrize("variant", ["llama_bias", "qwen2"])
def test_export_splits_the_fused_projections_back_into_the_checkpoint(tiny: dict[str, Any], variant: str) -> None:
    """Loading fuses q / k / v (and their biases) and gate / up; `to_hf_tensors` splits them back: the checkpoint's
    own tensors, bit for bit."""
    from kvjax.models.export import to_hf_tensors

    path, _ = tiny[variant]
    config, params = load_checkpoint(path)
    original = safetensors.numpy.load_file(str(path / "model.safetensors"))
    exported = to_hf_tensors(config, params)
    assert set(exported) == set(original) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    for name, tensor in exported.items():
        np.testing.assert_array_equal(tensor, original[name], err_msg=name)
