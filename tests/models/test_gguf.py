"""GGUF import: a tiny random Llama written as GGUF (F32 / F16 / Q8_0 / Q4_1) by the `gguf` package.

Oracles: transformers' own GGUF loader on the same file (it de-quantizes and un-permutes with its
own code), the original HF model for lossless types, and transformers' GGUF tokenizer.
"""

from __future__ import annotations

import math
import os
import pathlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")  # transformers' GGUF model loader needs it

from hf_tiny import make_llama, make_qwen3  # noqa: E402

import kvjax  # noqa: E402
from kvjax.errors import CheckpointError  # noqa: E402
from kvjax.models import gguf as kgguf  # noqa: E402

VOCAB = 300
_CORPUS = [
    "The passkey is 71432. Remember it, the grass is green and the sky is blue.",
    "What is the special magic number for quiet-lake mentioned in the provided text?",
    "Once upon a time there was a tiny model that read long documents and kept its cache small.",
] * 20
_TEXTS = ["The passkey is 90210.", "hello  world\nnew line, tabs\tand émojis ☀", "quiet-lake 12345"]
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Gemma 3 (llama.cpp's names): four norms per layer, the pre-MLP one is ffn_norm.
_GEMMA3_GGUF_NAMES = {
    **_GGUF_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _bpe_tokenizer() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (tokens by id) and its merges, trained on a tiny corpus."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    assert [i for _, i in vocab] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _hf_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's layout, written independently: row (h, s*hd/2 + p) moves to (h, 2p + s)."""
    rows, cols = weight.shape
    hd = rows // n_heads
    out = np.empty_like(weight)
    for h in range(n_heads):
        for s in range(2):
            for p in range(hd // 2):
                out[h * hd + 2 * p + s] = weight[h * hd + s * hd // 2 + p]
    return out


# K-quants (gguf has NumPy de-quantizers but no quantizers) and Q8_1 (neither): the byte offsets of each
# block's float16 scales (ggml's block_q4_K: d, dmin, scales, qs; block_q6_K: ql, qh, scales, d).
_RANDOM_BLOCKS = {"Q4_K": {0: 2e-4}, "Q6_K": {208: 2e-5}, "Q8_1": {}}


def _random_blocks(shape: tuple[int, int], kind: str) -> np.ndarray:
    """Random blocks with small float16 scales. Q4_K's are centred as real ones are: each sub-block's 6-bit min
    equals its 6-bit scale (bytes 4-7 repeat bytes 0-3, bytes 8-11 hold one nibble twice) and dmin = 7.5 d, so a
    weight is d * sc * (q - 7.5); with uncentred blocks the residual stream of a deep model grows to thousands."""
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    rng = np.random.default_rng(len(kind) + shape[0] * 7 + shape[1])
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, nbytes), dtype=np.uint8)
    for offset, scale in _RANDOM_BLOCKS[kind].items():
        halves = (scale * rng.uniform(0.5, 1.0, raw.shape[:2])).astype(np.float16)
        raw[..., offset : offset + 2] = halves[..., None].view(np.uint8)
    if kind == "Q4_K":
        raw[..., 2:4] = (raw[..., 0:2].view(np.float16) * np.float16(7.5)).view(np.uint8)
        raw[..., 8:12] = raw[..., 4:8]
        raw[..., 12:16] = (raw[..., 12:16] & 0x0F) * np.uint8(17)
    return raw.reshape(shape[0], -1)


def write_gguf(
    path: pathlib.Path,
    hf_model,
    qtype: str,
    *,
    arch: str = "llama",
    raw_override: dict[str, str] | None = None,
    extra_metadata: dict[str, float | int] | None = None,
    replace_metadata: dict[str, object] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> pathlib.Path:
    """``hf_model`` as a GGUF file: norms F32, matrices ``qtype`` (``raw_override``: name -> type). Llama's Q / K
    rows are permuted as llama.cpp's converter does; Qwen3's and Gemma 3's are stored as they are (rotate-half
    RoPE), and Gemma 3's norm weights as ``1 + w`` (llama.cpp's converter adds the one; its RMSNorm scales by the
    stored weight). ``extra_metadata``: ``{arch}.<key>`` values to add (Gemma 3's local RoPE base, soft-cap);
    ``replace_metadata``: full keys written with this value (a str, a list, a float, an int), replaced or added;
    ``extra_tensors``: more F32 tensors by GGUF name."""
    cfg = hf_model.config
    tokens, merges = _bpe_tokenizer()
    assert len(tokens) == cfg.vocab_size
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    if arch in ("qwen3", "gemma3"):  # llama.cpp's converter writes the config's head_dim
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_freq_base(float(cfg.rope_parameters["full_attention"]["rope_theta"]))
    else:
        w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    for key, value in (extra_metadata or {}).items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<") else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}")
    names = _GEMMA3_GGUF_NAMES if arch == "gemma3" else _GGUF_NAMES
    for name, param in hf_model.state_dict().items():
        arr = param.detach().numpy().astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = _hf_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = _hf_permute(arr, cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)
        if arch == "gemma3" and name == "lm_head.weight":
            continue  # tied: the state dict lists the embedding twice
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            gname = f"blk.{layer}.{names[module]}.weight"
        else:
            gname = names[name]
        kind = "F32" if arr.ndim == 1 else (raw_override or {}).get(gname, qtype)
        if kind in ("Q4_K", "Q6_K") and gname == "token_embd.weight":
            kind = "F16"
        gtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(gname, arr)
        elif kind == "F16":
            w.add_tensor(gname, arr.astype(np.float16))
        elif kind in _RANDOM_BLOCKS:  # no NumPy quantizer: random blocks with small float16 scales
            w.add_tensor(gname, _random_blocks(arr.shape, kind), raw_dtype=gtype)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, gtype), raw_dtype=gtype)
    for gname, arr in (extra_tensors or {}).items():
        w.add_tensor(gname, arr.astype(np.float32))
    for key, value in (replace_metadata or {}).items():
        w.kv_data[0].pop(key, None)
        add = {str: w.add_string, list: w.add_array, float: w.add_float32}.get(type(value), w.add_int32)
        add(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny random Llama (default RoPE, untied) whose weights are exact in float16."""
    tmp = tmp_path_factory.mktemp("hf")
    _, model = make_llama(
        tmp,
        return_model=True,
        vocab_size=VOCAB,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(kgguf.ENV_CACHE_DIR, str(tmp_path / "cache"))


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _hf_from_gguf(path: pathlib.Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_logits_match_transformers_gguf_load(hf_llama, tmp_path, qtype):
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", hf_llama, qtype)
    ids = [int(i) for i in np.random.default_rng(1).integers(3, VOCAB, 24)]
    ours = np.asarray(kvjax.load_model(path)(np.array([ids]))[0][0])
    theirs = _hf_logits(_hf_from_gguf(path), ids)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    original = _hf_logits(hf_llama, ids)
    if qtype in ("F32", "F16"):  # lossless for weights that are exact in float16
        np.testing.assert_allclose(ours, original, atol=1e-4, rtol=0)
    else:  # quantized: close but not equal, so the comparison above is not vacuous
        assert 1e-4 < np.abs(ours - original).max() < 0.5 * np.abs(original).max()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_match_transformers_gguf_load(tmp_path, qtype):
    """K-quant blocks (256 weights) need rows of 256: a wider model, random blocks (no NumPy quantizer)."""
    _, model = make_llama(
        tmp_path, return_model=True, vocab_size=VOCAB, hidden_size=256, intermediate_size=256, head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", model, qtype)
    ids = [int(i) for i in np.random.default_rng(2).integers(3, VOCAB, 16)]
    ours = np.asarray(kvjax.load_model(path)(np.array([ids]))[0][0])
    theirs = _hf_logits(_hf_from_gguf(path), ids)
    assert np.abs(theirs).max() > 0.1  # the random blocks are not all zero
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_tokenizer_round_trip_and_matches_transformers(hf_llama, tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "tiny.gguf", hf_llama, "Q8_0")
    ours = kvjax.load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in _TEXTS:
        ids = ours(text).input_ids
        assert ids == theirs(text).input_ids
        assert ours.decode(ids) == text
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == theirs.apply_chat_template(msgs, tokenize=False)


def test_end_of_turn_and_message_ids_join_eos(tmp_path):
    """llama.cpp stops at the end-of-turn / end-of-message ids the metadata names (Llama 3's <|eot_id|> / <|eom_id|>,
    a chat model's turn end) as at EOS, whatever the architecture: a Qwen3 file's join its stop ids, once each."""
    _, model = make_qwen3(tmp_path, return_model=True, vocab_size=VOCAB)
    stops = {"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 2}  # EOM = EOS: listed once
    path = write_gguf(tmp_path / "qwen3.gguf", model, "F32", arch="qwen3", replace_metadata=stops)
    assert kgguf.gguf_config(path)["eos_token_id"] == [2, 7]


def test_end_of_turn_ends_llama_generation(hf_llama, tmp_path):
    """A Llama file whose end-of-turn id is the third token of transformers' greedy decoding of the original model:
    kvjax generates the same first three tokens and stops there."""
    prompt = np.random.default_rng(7).integers(3, VOCAB, size=(1, 12))
    with torch.no_grad():
        want = hf_llama.generate(torch.as_tensor(prompt), max_new_tokens=3, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, 12:].numpy()
    assert want[2] not in (*want[:2], 2)  # a stop of its own, not EOS
    path = write_gguf(tmp_path / "tiny.gguf", hf_llama, "F32",
                      replace_metadata={"tokenizer.ggml.eot_token_id": int(want[2])})
    out = kvjax.generate(kvjax.load_model(path), prompt, max_new_tokens=6)
    assert int(np.asarray(out.num_tokens)[0]) == 3
    np.testing.assert_array_equal(np.asarray(out.tokens)[0, :3], want)


def test_cache_is_reused_and_atomic(hf_llama, tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "tiny.gguf", hf_llama, "F16")
    first = kgguf.gguf_model_dir(path)
    assert first.parent.parent == tmp_path / "cache"
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no temporary left behind

    def boom(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(kgguf, "convert_gguf", boom)
    assert kgguf.gguf_model_dir(path) == first
    assert kvjax.load_model(path).config.num_layers == 2  # the cached directory loads


def test_cache_dir_precedence(tmp_path, monkeypatch):
    assert kgguf.cache_root(tmp_path / "explicit") == tmp_path / "explicit"
    assert kgguf.cache_root() == tmp_path / "cache"  # $KVJAX_CACHE_DIR (set by the autouse fixture)
    monkeypatch.delenv(kgguf.ENV_CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kgguf.cache_root() == tmp_path / "xdg" / "kvjax"


def test_truncated_and_corrupted_files_give_one_clear_error(hf_llama, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", hf_llama, "Q4_1")
    data = path.read_bytes()
    cases = {
        "truncated_data.gguf": data[: len(data) - 1000],
        "truncated_header.gguf": data[:200],
        "bad_magic.gguf": b"XXXX" + data[4:],
        "bad_counts.gguf": data[:8] + (2**40).to_bytes(8, "little") + data[16:],
    }
    for name, blob in cases.items():
        bad = tmp_path / name
        bad.write_bytes(blob)
        with pytest.raises(CheckpointError, match="corrupted or truncated"):
            kvjax.load_model(bad)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen3_matches_transformers_gguf_load(tmp_path, qtype):
    """A Qwen3 GGUF as llama.cpp writes it (QK-norm tensors, Q / K in HF's order): kvjax's logits against
    transformers' own GGUF load and, lossless, the original model; tokenizer and chat template from the metadata."""
    from transformers import AutoTokenizer

    # head_dim 128 (not hidden / heads): transformers' GGUF reader takes Qwen3's default head_dim, kvjax the
    # file's attention.key_length.
    _, model = make_qwen3(tmp_path, return_model=True, vocab_size=VOCAB, num_attention_heads=4, head_dim=128)
    path = write_gguf(tmp_path / f"qwen3-{qtype}.gguf", model, qtype, arch="qwen3")
    ids = [int(i) for i in np.random.default_rng(3).integers(3, VOCAB, 24)]
    ours_model = kvjax.load_model(path)
    assert ours_model.config.model_type == "qwen3" and ours_model.config.qk_norm
    ours = np.asarray(ours_model(np.array([ids]))[0][0])
    np.testing.assert_allclose(ours, _hf_logits(_hf_from_gguf(path), ids), atol=1e-4, rtol=0)
    original = _hf_logits(model, ids)
    if qtype == "F32":
        np.testing.assert_allclose(ours, original, atol=1e-4, rtol=0)
    else:
        assert 1e-4 < np.abs(ours - original).max() < 0.5 * np.abs(original).max()
        tok = kvjax.load_tokenizer(path)
        theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
        msgs = [{"role": "user", "content": "hi"}]
        assert tok.apply_chat_template(msgs, tokenize=False) == theirs.apply_chat_template(msgs, tokenize=False)
        assert tok(_TEXTS[0]).input_ids == theirs(_TEXTS[0]).input_ids


def test_qwen3_without_qk_norm_is_named(tmp_path):
    _, model = make_qwen3(tmp_path, return_model=True, vocab_size=VOCAB, num_attention_heads=4, head_dim=128)
    state = {k: v for k, v in model.state_dict().items() if "layers.1.self_attn.k_norm" not in k}

    class Partial:  # the model's config with a state dict missing one QK-norm weight
        config = model.config

        @staticmethod
        def state_dict():
            return state

    path = write_gguf(tmp_path / "qwen3.gguf", Partial, "F32", arch="qwen3")
    with pytest.raises(CheckpointError, match=r"qwen3\.gguf.*blk\.1\.attn_k_norm\.weight missing"):
        kvjax.load_model(path)


def test_unsupported_architecture_named(hf_llama, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", hf_llama, "F32", arch="falcon")
    with pytest.raises(CheckpointError, match="architecture 'falcon' is not supported"):
        kvjax.load_model(path)


def test_unsupported_quant_type_named(hf_llama, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", hf_llama, "Q8_0", raw_override={"blk.1.ffn_up.weight": "Q8_1"})
    with pytest.raises(CheckpointError, match=r"quantization type\(s\) Q8_1 not supported.*blk\.1\.ffn_up\.weight"):
        kvjax.load_model(path)


@pytest.mark.parametrize("key,value,match", [
    ("llama.attention.head_count", "four", "llama.attention.head_count='four' is not an integer >= 1"),
    ("llama.attention.head_count", 0, "llama.attention.head_count=0 is not an integer >= 1"),
    ("llama.attention.head_count_kv", 0, "llama.attention.head_count_kv=0 is not an integer >= 1"),
    ("llama.feed_forward_length", [64, 128], r"llama.feed_forward_length differs per layer \(\[64, 128\]\)"),
    ("llama.attention.layer_norm_rms_epsilon", "1e-5", "layer_norm_rms_epsilon='1e-5' is not a finite number"),
])
def test_metadata_of_a_wrong_type_or_value_is_named(hf_llama, tmp_path, key, value, match):
    """A count or a float of the wrong type, or a count of 0, is one CheckpointError naming the key and the value,
    not a ValueError / TypeError / ZeroDivisionError from inside the conversion."""
    path = write_gguf(tmp_path / "tiny.gguf", hf_llama, "F32", replace_metadata={key: value})
    with pytest.raises(CheckpointError, match=match):
        kvjax.load_model(path)


def test_per_layer_metadata_arrays_that_agree_are_read(hf_llama, tmp_path):
    """llama.cpp reads a count also as one entry per layer: arrays whose entries agree load as the scalar file."""
    cfg = hf_llama.config
    layers = cfg.num_hidden_layers
    per_layer = {"llama.attention.head_count": [cfg.num_attention_heads] * layers,
                 "llama.attention.head_count_kv": [cfg.num_key_value_heads] * layers,
                 "llama.feed_forward_length": [cfg.intermediate_size] * layers}
    arrays = write_gguf(tmp_path / "arrays.gguf", hf_llama, "F32", replace_metadata=per_layer)
    ids = np.random.default_rng(3).integers(3, VOCAB, (1, 12))
    np.testing.assert_allclose(np.asarray(kvjax.load_model(arrays)(ids)[0][0]), _hf_logits(hf_llama, ids[0].tolist()),
                               atol=1e-4, rtol=0)


def _rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs.weight` for a llama3 `rope_parameters`, in float32 torch arithmetic as its converter
    works (written from the formula): a frequency's factor is 1 below wavelength context / high, `factor` above
    context / low, and 1 / ((1 - s) / factor + s) between, s = (context / wavelength - low) / (high - low)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    wavelen = 2 * math.pi / freq
    smooth = (context / wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen < context / high, 1.0, torch.where(wavelen > context / low, factor, between))
    return out.numpy().astype(np.float32)


def _llama3_model(tmp_path, rope: dict):
    """A tiny random Llama with `rope` (head_dim 16, 512 positions) and the same weights under default RoPE."""
    from transformers import LlamaForCausalLM

    _, model = make_llama(tmp_path, return_model=True, vocab_size=VOCAB, rope_parameters=rope)
    config = type(model.config).from_dict({**model.config.to_dict(), "rope_parameters": {
        "rope_type": "default", "rope_theta": rope["rope_theta"]}})
    plain = LlamaForCausalLM(config).eval()
    plain.load_state_dict(model.state_dict())
    return model, plain


# llama3 scaling with a short pretrained context (64 positions) so that a 100-token test passes it and all three
# bands occur at head_dim 16; low 1 / high 4 are Meta's values, recovered as llama3.
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope,kind", [(_LLAMA3, "llama3"), ({**_LLAMA3, "high_freq_factor": 8.0}, "freq_factors")])
def test_llama3_rope_factors_match_transformers(tmp_path, rope, kind):
    """A Llama 3.1-style GGUF (rope scaling only as llama.cpp's `rope_freqs.weight`): kvjax's logits over 100
    positions (past the pretrained 64) and its greedy tokens against transformers on the original llama3 model. With
    Meta's band edges the config gets llama3's parameters back; other edges keep the factors (`freq_factors`)."""
    model, plain = _llama3_model(tmp_path, rope)
    factors = _rope_freqs(rope, model.config.head_dim)
    assert 1.0 < factors[1] < rope["factor"] and factors[0] == 1.0 and factors[-1] == rope["factor"]  # three bands
    path = write_gguf(tmp_path / "llama31.gguf", model, "F32", extra_tensors={"rope_freqs.weight": factors})
    ours_model = kvjax.load_model(path)
    got = ours_model.config.rope
    assert got.rope_type == kind
    if kind == "llama3":
        want = {k: v for k, v in rope.items() if k != "rope_type"}
        assert {k: v for k, v in got.to_hf_dict().items() if k != "rope_type"} == want
    else:
        np.testing.assert_array_equal(np.asarray(got.freq_factors, np.float32), factors)
    ids = [int(i) for i in np.random.default_rng(6).integers(3, VOCAB, 100)]
    ours = np.asarray(ours_model(np.array([ids]))[0][0])
    original = _hf_logits(model, ids)
    np.testing.assert_allclose(ours, original, atol=1e-4, rtol=0)
    assert np.abs(_hf_logits(plain, ids) - original).max() > 1e-3  # the scaling matters: 10x the tolerance
    prompt = np.array([ids[:90]])
    with torch.no_grad():
        theirs = model.generate(torch.as_tensor(prompt), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, 90:].numpy()
    np.testing.assert_array_equal(kvjax.generate(ours_model, prompt, max_new_tokens=8, stop_at_eos=False).tokens[0],
                                  theirs)


@pytest.mark.parametrize("factor,head_dim,theta", [(8.0, 128, 500000.0), (32.0, 64, 500000.0)])
def test_meta_llama3_rope_factors_give_transformers_frequencies(tmp_path, factor, head_dim, theta):
    """The factors of Llama 3.1 8B (factor 8, head_dim 128) and Llama 3.2 1B (factor 32, head_dim 64) as llama.cpp
    writes them give back Meta's rope_scaling, and kvjax's frequencies are transformers' for the original config
    (the header only: no weights)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvjax.models.config import ModelConfig
    from kvjax.models.rope_scaling import rope_frequencies

    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    w = gguf.GGUFWriter(str(tmp_path / "meta.gguf"), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 131072), (w.add_embedding_length, 2 * head_dim),
                       (w.add_feed_forward_length, 64), (w.add_head_count, 2), (w.add_head_count_kv, 1),
                       (w.add_rope_dimension_count, head_dim), (w.add_rope_freq_base, theta),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, 8)):
        add(value)
    w.add_tensor("rope_freqs.weight", _rope_freqs(rope, head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = kgguf.gguf_config(tmp_path / "meta.gguf")
    assert config["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    hf = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, max_position_embeddings=131072,
                     rope_parameters=rope)
    want = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0].numpy()
    np.testing.assert_allclose(rope_frequencies(ModelConfig.from_hf_dict(config))[0], want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("factors,match", [
    (np.full(9, 2.0), r"rope_freqs\.weight has shape \[9\], expected \[8\]"),
    (np.full((2, 8), 2.0), r"rope_freqs\.weight has shape \[2, 8\], expected \[8\]"),
    (np.array([1.0] * 7 + [np.nan]), r"rope_freqs\.weight holds nan"),
    (np.array([1.0] * 7 + [-8.0]), r"rope_freqs\.weight holds -8\.0"),
])
def test_malformed_rope_factors_are_refused_by_name(hf_llama, tmp_path, factors, match):
    """A factors tensor that is not head_dim / 2 = 8 positive numbers is one CheckpointError naming the file and the
    tensor."""
    path = write_gguf(tmp_path / "llama31.gguf", hf_llama, "F32", extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(CheckpointError, match=r"llama31\.gguf.*" + match):
        kvjax.load_model(path)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(48, 3)
    np.testing.assert_array_equal(kgguf.unpermute_rotary(_hf_permute(w, 6), 6), w)


def test_import_needs_no_torch(hf_llama, tmp_path):
    """The conversion and both loads run with torch unimportable (a subprocess with torch blocked)."""
    import subprocess
    import sys

    path = write_gguf(tmp_path / "tiny.gguf", hf_llama, "Q4_1")
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvjax\n"
        f"tok = kvjax.load_tokenizer({str(path)!r}); model = kvjax.load_model({str(path)!r})\n"
        "print(len(tok('hello world').input_ids), model.config.num_layers)\n"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), kgguf.ENV_CACHE_DIR: str(tmp_path / "c")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "2"


def _gemma3(tmp_path, **overrides):
    """A tiny Gemma 3 as llama.cpp's GGUF metadata can describe it: six layers (five sliding, then a global one: the
    pattern llama.cpp applies), window 8, local RoPE base 1e4, global 1e6, query_pre_attn_scalar = head_dim and no
    soft-cap (what llama.cpp assumes when the file says nothing). Rows of 256 for the K-quants."""
    from hf_tiny import make_gemma3

    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    kwargs = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=6, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
                  layer_types=["sliding_attention"] * 5 + ["full_attention"], final_logit_softcapping=None,
                  rope_parameters=rope, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    _, model = make_gemma3(tmp_path, return_model=True, **{**kwargs, **overrides})
    return model


# The Gemma 3 270M file's mix: Q5_0 matrices, Q8_0 values and embedding, Q4_K output projections, Q6_K down
# projections, F32 norms.
_Q4_K_M_GEMMA = {"attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_down": "Q6_K"}


@pytest.mark.parametrize("qtype", ["F32", "Q4_K_M"])
def test_gemma3_matches_transformers_gguf_load(tmp_path, qtype):
    """Gemma 3 written as llama.cpp writes it (norms as 1 + w, ffn_norm the pre-MLP norm, two post-norms, no Q/K
    permutation): kvjax's logits against transformers' own GGUF load of the file over 40 tokens (past the window of
    8) and, lossless, against the original model."""
    model = _gemma3(tmp_path)
    override = None
    if qtype == "Q4_K_M":
        override = {f"blk.{i}.{name}.weight": kind for i in range(6) for name, kind in _Q4_K_M_GEMMA.items()}
        override["token_embd.weight"] = "Q8_0"
    path = write_gguf(tmp_path / f"gemma3-{qtype}.gguf", model, "Q5_0" if qtype == "Q4_K_M" else qtype,
                      arch="gemma3", raw_override=override)
    ids = [int(i) for i in np.random.default_rng(4).integers(3, VOCAB, 40)]
    ours_model = kvjax.load_model(path)
    c = ours_model.config
    assert (c.model_type, c.sliding_window, c.query_pre_attn_scalar, c.rope_local.theta, c.rope.theta) == (
        "gemma3_text", 8, 256.0, 10000.0, 1000000.0)
    assert c.all_layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    ours = np.asarray(ours_model(np.array([ids]))[0][0])
    theirs = _hf_logits(_hf_from_gguf(path), ids)
    assert np.abs(theirs).max() > 0.1
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    original = _hf_logits(model, ids)
    if qtype == "F32":  # (1 + w) - 1 in float32 is w to a rounding of 1e-7
        np.testing.assert_allclose(ours, original, atol=1e-4, rtol=0)
    else:  # quantized, so the comparison with transformers above is not vacuous
        assert np.abs(ours - original).max() > 1e-4


def test_gemma3_metadata_overrides_llama_cpp_defaults(tmp_path):
    """The keys newer llama.cpp converters write win over its Gemma 3 defaults: a local RoPE base, a final soft-cap
    and a layer pattern of 3 (two sliding layers, one global) give the original model's logits (F32, lossless);
    transformers' GGUF reader does not read these keys, so the original model is the oracle here."""
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}
    model = _gemma3(tmp_path, layer_types=layer_types, rope_parameters=rope, final_logit_softcapping=5.0)
    path = write_gguf(tmp_path / "gemma3.gguf", model, "F32", arch="gemma3", extra_metadata={
        "rope.freq_base_swa": 500.0, "final_logit_softcapping": 5.0, "attention.sliding_window_pattern": 3})
    ids = [int(i) for i in np.random.default_rng(5).integers(3, VOCAB, 30)]
    ours_model = kvjax.load_model(path)
    assert ours_model.config.all_layer_types == tuple(layer_types)
    ours = np.asarray(ours_model(np.array([ids]))[0][0])
    original = _hf_logits(model, ids)
    assert np.abs(original).max() <= 5.0 + 1e-5  # the soft-cap acts
    np.testing.assert_allclose(ours, original, atol=1e-4, rtol=0)


@pytest.mark.parametrize("key,value,match", [
    ("gemma3.attention.sliding_window_pattern", "six", "sliding_window_pattern='six' is not an integer >= 0"),
    ("gemma3.attention.sliding_window_pattern", -3, "sliding_window_pattern=-3 is not an integer >= 0"),
    ("gemma3.final_logit_softcapping", "thirty", "final_logit_softcapping='thirty' is not a finite number"),
    ("gemma3.rope.freq_base_swa", "ten thousand", "freq_base_swa='ten thousand' is not a finite number"),
])
def test_gemma3_metadata_of_a_wrong_type_or_value_is_named(tmp_path, key, value, match):
    """Gemma 3's own keys go through the same checks as the counts: one CheckpointError naming the key and the
    value (a string was a bare ValueError; a negative layer pattern made a layer list of nonsense)."""
    model = _gemma3(tmp_path, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    path = write_gguf(tmp_path / "gemma3.gguf", model, "F32", arch="gemma3", replace_metadata={key: value})
    with pytest.raises(CheckpointError, match=match):
        kgguf.gguf_config(path)


def test_gemma3_without_its_post_norms_is_named(tmp_path):
    model = _gemma3(tmp_path, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    state = {k: v for k, v in model.state_dict().items() if "layers.1.post_feedforward_layernorm" not in k}

    class Partial:
        config = model.config

        @staticmethod
        def state_dict():
            return state

    path = write_gguf(tmp_path / "gemma3.gguf", Partial, "F32", arch="gemma3")
    with pytest.raises(CheckpointError, match=r"gemma3\.gguf.*blk\.1\.post_ffw_norm\.weight missing"):
        kvjax.load_model(path)
