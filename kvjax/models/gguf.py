"""Import a GGUF file (llama.cpp's format) as a Hugging Face safetensors directory kvjax loads.

:func:`gguf_model_dir` reads the tensors and metadata with the ``gguf`` package, de-quantizes with
its NumPy routines (no torch), renames llama.cpp's tensors to Hugging Face's, undoes the Q/K row
permutation llama.cpp's converter applies to Llama (it stores each head's rotary pairs interleaved; HF keeps
the two halves apart; Qwen3 is stored in HF's rotate-half order, with its QK-norm weights ``attn_q_norm`` /
``attn_k_norm``), writes ``config.json`` from the metadata and the tokenizer transformers builds
from the GGUF vocabulary. The directory is cached under :func:`cache_root` (``$KVJAX_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvjax``, else ``~/.cache/kvjax``) and written atomically, so the second load reads
safetensors only. :func:`kvjax.load_model` and :func:`kvjax.load_tokenizer` accept a ``.gguf`` path.

A conversion writes into a hidden temporary directory named after its host and process,
``.<name>.tmp-<host>-<pid>-<random>``, renamed into place when complete and removed if it fails; the
next conversion removes the ones a killed process left (its pid no longer alive on this host). A cache
directory that cannot be written is one ``CheckpointError`` naming ``KVJAX_CACHE_DIR``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import socket
import tempfile
import time
from typing import Any

import numpy as np

from kvjax.errors import CheckpointError

__all__ = [
    "ENV_CACHE_DIR",
    "SUPPORTED_ARCHS",
    "SUPPORTED_TYPES",
    "cache_root",
    "convert_gguf",
    "gguf_config",
    "gguf_model_dir",
    "unpermute_rotary",
]

ENV_CACHE_DIR = "KVJAX_CACHE_DIR"
SUPPORTED_ARCHS = ("llama", "qwen3")
# The Hugging Face architecture each llama.cpp architecture converts to.
_HF_ARCH = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM")}
# Tensor types de-quantized by the gguf package's NumPy routines that kvjax accepts.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
# Bumped whenever the converted layout changes, so stale cache entries are never reused.
_FORMAT_VERSION = 2
_DONE = "kvjax_gguf.json"
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# GGUF tokenizer keys -> the names transformers' GGUF tokenizer builders read.
_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.precompiled_charsmap": "precompiled_charsmap",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}
_SPECIAL = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Converted models: ``cache_dir``, else ``$KVJAX_CACHE_DIR``, ``$XDG_CACHE_HOME/kvjax``, ``~/.cache/kvjax``."""
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    if os.environ.get(ENV_CACHE_DIR):
        return pathlib.Path(os.environ[ENV_CACHE_DIR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache") / "kvjax"


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", socket.gethostname()) or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: A leftover without a pid in its name (written before they carried one) is removed once this old.
_UNNAMED_STALE_S = 3600.0


def remove_stale_temp_dirs(parent: pathlib.Path) -> list[pathlib.Path]:
    """Removes the conversions' temporary directories under ``parent`` that a dead process of this host left
    (kill -9 during a conversion); returns them."""
    removed = []
    host = _host_tag()
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = re.fullmatch(r"\..+\.tmp-(?:(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-)?.*", entry.name)
        if m is None or not entry.is_dir():
            continue
        if m.group("pid") is not None:
            stale = m.group("host") == host and not _pid_alive(int(m.group("pid")))
        else:
            try:
                stale = time.time() - entry.stat().st_mtime > _UNNAMED_STALE_S
            except OSError:
                stale = False
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _cache_error(root: pathlib.Path, err: OSError) -> CheckpointError:
    value = os.environ.get(ENV_CACHE_DIR)
    if value:
        return CheckpointError(f"{ENV_CACHE_DIR}={value} cannot hold converted models ({err.strerror or err}): point "
                               "it at a writable directory")
    return CheckpointError(f"the model cache {str(root)!r} cannot be written ({err.strerror or err}): set "
                           f"{ENV_CACHE_DIR} to a writable directory")


def unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """HF row order of a Q or K projection ``[n_heads * head_dim, D]`` stored by llama.cpp.

    llama.cpp keeps each head's rotary pair ``(i, i + head_dim/2)`` in adjacent rows ``(2i, 2i+1)``;
    HF's ``rotate_half`` wants the first halves of all pairs, then the second halves.
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    per_head = weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def _open(path: pathlib.Path) -> Any:
    try:
        import gguf
    except ImportError as e:
        raise CheckpointError(
            "reading a GGUF file needs the gguf package: pip install gguf (or pip install 'kvjax[gguf]')"
        ) from e
    try:
        reader = gguf.GGUFReader(str(path))
        for t in reader.tensors:
            if int(t.data.nbytes) != int(t.n_bytes):
                raise ValueError(f"tensor {t.name!r} has {t.data.nbytes} of its {t.n_bytes} bytes")
    except CheckpointError:
        raise
    except Exception as e:  # the reader fails in many ways (struct, memmap, reshape) on a damaged file
        raise CheckpointError(
            f"cannot read GGUF file {str(path)!r}: it is corrupted or truncated ({type(e).__name__}: {e})"
        ) from e
    return reader


def _field_value(field: Any) -> Any:
    """A metadata field as a Python value (scalar, string or list), for any gguf version."""
    import gguf

    def scalar(part: np.ndarray, vtype: Any) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


def _metadata(reader: Any) -> dict[str, Any]:
    return {name: _field_value(field) for name, field in reader.fields.items()}


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight"
    return None


def _check(path: pathlib.Path, meta: dict[str, Any], reader: Any) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(
            f"GGUF file {str(path)!r}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    bad_types = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TYPES))
    if bad_types:
        which = [t.name for t in reader.tensors if t.tensor_type.name in bad_types]
        raise CheckpointError(
            f"GGUF file {str(path)!r}: quantization type(s) {', '.join(bad_types)} not supported (tensors "
            f"{', '.join(which[:5])}{' ...' if len(which) > 5 else ''}); supported: {', '.join(SUPPORTED_TYPES)}"
        )
    unknown = [t.name for t in reader.tensors if _hf_name(t.name) is None]
    if unknown:
        raise CheckpointError(f"GGUF file {str(path)!r}: unsupported tensor(s) {', '.join(unknown[:10])}")
    names = {t.name for t in reader.tensors}
    blocks = {int(m.group(1)) for m in map(_BLOCK_RE.fullmatch, names) if m}
    wanted = [f"blk.{i}.{n}.weight" for i in sorted(blocks) for n in ("attn_q_norm", "attn_k_norm")]
    if arch == "qwen3" and any(n not in names for n in wanted):
        missing = [n for n in wanted if n not in names]
        raise CheckpointError(f"GGUF file {str(path)!r}: Qwen3's QK-norm weight(s) {', '.join(missing[:4])} missing")
    if arch != "qwen3" and any(n in names for n in wanted):
        raise CheckpointError(f"GGUF file {str(path)!r}: QK-norm weights in a {arch!r} file")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"GGUF file {str(path)!r}: RoPE scaling {scaling!r} is not supported")
    return arch


def _config(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata has no {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rotary = int(get("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise CheckpointError(f"GGUF partial rotary embedding ({rotary} of {head_dim} dims) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens else 0))
    model_type, architecture = _HF_ARCH[arch]
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        # Stored as float32: its shortest decimal (1e-05, not 9.99999974e-06) is the value the model was given.
        "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _tensors(reader: Any, config: dict[str, Any]) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # ggml lists the fastest axis first
        weight = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        permuted = config["model_type"] == "llama"  # llama.cpp's "normal" RoPE; Qwen3's is HF's NEOX order
        if permuted and t.name.endswith(".attn_q.weight"):
            weight = unpermute_rotary(weight, config["num_attention_heads"])
        elif permuted and t.name.endswith(".attn_k.weight"):
            weight = unpermute_rotary(weight, config["num_key_value_heads"])
        out[_hf_name(t.name)] = np.ascontiguousarray(weight)
    return out


def _tokenizer(meta: dict[str, Any], arch: str) -> Any | None:
    """A ``PreTrainedTokenizerFast`` from the GGUF vocabulary (transformers' builders; no torch)."""
    if "tokenizer.ggml.tokens" not in meta:
        return None
    from kvjax._transformers import import_transformers

    import_transformers()  # first import without its "PyTorch was not found" advisory
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers < 5.x kept the builders in integrations.ggml
        from transformers.integrations.ggml import convert_gguf_tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = {name: meta[key] for key, name in _TOKENIZER_KEYS.items() if key in meta}
    try:
        backend, extra = convert_gguf_tokenizer(arch, spec)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"cannot build the tokenizer from the GGUF metadata: {e}") from e
    kwargs: dict[str, Any] = dict(extra)
    tokens = spec["tokens"]
    for name, key in _SPECIAL.items():
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            kwargs[name] = tokens[token_id]
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in meta:
            kwargs[flag] = bool(meta[f"tokenizer.ggml.{flag}"])
    if "tokenizer.chat_template" in meta:
        kwargs["chat_template"] = meta["tokenizer.chat_template"]
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def gguf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of a GGUF file, read from its header (nothing converted)."""
    path = pathlib.Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    reader = _open(path)
    meta = _metadata(reader)
    return _config(meta, _check(path, meta, reader), {t.name for t in reader.tensors})


def convert_gguf(path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> pathlib.Path:
    """Writes ``out_dir`` (config.json, model.safetensors, tokenizer files) from a GGUF file, atomically."""
    from safetensors.numpy import save_file

    path, out = pathlib.Path(path), pathlib.Path(out_dir)
    reader = _open(path)
    meta = _metadata(reader)
    arch = _check(path, meta, reader)
    config = _config(meta, arch, {t.name for t in reader.tensors})
    tokenizer = _tokenizer(meta, arch)
    tensors = _tensors(reader, config)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(out.parent)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{_host_tag()}-{os.getpid()}-"))
    except OSError as e:
        raise _cache_error(out.parent, e) from None
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        stat = path.stat()
        done = {"source": str(path), "size": stat.st_size, "format_version": _FORMAT_VERSION}
        (tmp / _DONE).write_text(json.dumps(done, indent=2) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / _DONE).is_file():  # not a concurrent writer finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_model_dir(
    path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """The cached HF directory converted from a GGUF file, converting it on first use.

    The cache key is the file's resolved path, size and modification time (and the converter's
    format version); an entry is used only once complete (its marker file is written last).
    """
    src = pathlib.Path(path).expanduser().resolve()
    if not src.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    stat = src.stat()
    key = hashlib.sha256(f"{_FORMAT_VERSION}\0{src}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    out = cache_root(cache_dir) / "gguf" / f"{src.stem}-{key[:16]}"
    try:
        if (out / _DONE).is_file():
            return out
    except OSError as e:  # e.g. a cache "directory" that is a file, or unreadable
        raise _cache_error(out.parent, e) from None
    return convert_gguf(src, out)
