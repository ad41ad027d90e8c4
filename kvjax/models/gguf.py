"""Import a GGUF file (llama.cpp's format) as a Hugging Face safetensors directory kvjax loads.

:func:`gguf_model_dir` reads the file with kvjax's own reader (:mod:`kvjax.models.gguf_file`) and de-quantizer
(:mod:`kvjax.models.gguf_quants`: F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, Q2_K-Q6_K; no ``gguf`` package, no
torch), renames llama.cpp's tensors to Hugging Face's and writes ``config.json`` from the metadata, with the
tokenizer transformers builds from the GGUF vocabulary. Per architecture:

* ``llama``: the Q / K rows are un-permuted (llama.cpp's converter interleaves each head's rotary pairs; HF keeps
  the two halves apart). Llama 3.1 and later carry their rope scaling as the tensor ``rope_freqs.weight`` (one
  factor per rotary frequency, dividing it; no ``rope.scaling.*`` metadata): it becomes ``rope_scaling`` llama3 with
  ``factor`` the largest factor, ``low_freq_factor`` 1, ``high_freq_factor`` 4 and
  ``original_max_position_embeddings`` 8192 or the one the smoothed band gives, when these give every factor to
  float32 rounding (their smoothing coefficients within 1e-5), so RoPE is transformers' for the original
  checkpoint; else kvjax's ``freq_factors`` with the factors themselves (what llama.cpp computes). A factor tensor
  that is not ``[head_dim / 2]`` positive numbers is refused;
* ``qwen3``: stored in HF's rotate-half order, with QK-norm weights ``attn_q_norm`` / ``attn_k_norm``;
* ``gemma3`` (the text decoder): rotate-half order too; llama.cpp's converter stores every RMSNorm weight as
  ``1 + w`` (llama.cpp multiplies by it as is), so ``w`` is written back (kvjax, like HF, scales by ``1 + w``).
  ``ffn_norm`` is the pre-MLP norm, ``post_attention_norm`` / ``post_ffw_norm`` the two post-norms. The metadata
  gives the window (``attention.sliding_window``) and, when present, the local RoPE base (``rope.freq_base_swa``),
  the layer pattern (``attention.sliding_window_pattern``) and the soft-caps; where absent, llama.cpp's values for
  the architecture apply: a local base of 10000, one global layer in six, ``query_pre_attn_scalar`` the head size
  (hidden / heads on the 62-layer 27B), no soft-cap. ``<end_of_turn>`` ends generation beside EOS, as in llama.cpp.

Whatever the architecture, the end-of-turn and end-of-message tokens the metadata names
(``tokenizer.ggml.eot_token_id``, ``tokenizer.ggml.eom_token_id``: Llama 3's ``<|eot_id|>`` / ``<|eom_id|>``, a
chat model's turn end) end generation beside EOS, as llama.cpp stops at each.

Tensors are de-quantized a bounded number of rows at a time straight into float32 and streamed into
``model.safetensors``, so a conversion holds one chunk, not the model, in memory. The space a conversion needs is
known before it writes (:func:`conversion_bytes`) and checked against the disk: too little space, or a write that
runs out of it, is one ``CheckpointError`` stating the megabytes needed.

The directory is cached under :func:`cache_root` (``$KVJAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvjax``, else
``~/.cache/kvjax``) and written atomically, so the second load reads safetensors only. A conversion writes into a
hidden temporary directory named after its host and process, ``.<name>.tmp-<host>-<pid>-<random>``, renamed into
place when complete and removed if it fails; the next conversion removes the ones a killed process left (its pid
no longer alive on this host). A cache directory that cannot be written is one ``CheckpointError`` naming
``KVJAX_CACHE_DIR``; a cached entry whose files no longer match what was written (truncated, deleted, not JSON)
is one ``CheckpointError`` saying which directory to delete to reconvert. :func:`kvjax.load_model` and
:func:`kvjax.load_tokenizer` accept a ``.gguf`` path, or a file named otherwise that starts with the GGUF magic
(an Ollama blob).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvjax._process import pid_alive
from kvjax.errors import CheckpointError
from kvjax.models.gguf_file import GgufFile, GgufFormatError, GgufTensor, read_gguf
from kvjax.models.gguf_quants import DEQUANTIZERS, dequantize_rows
from kvjax.models.safetensors_stream import PlannedTensor, planned_bytes, write_safetensors

__all__ = [
    "ENV_CACHE_DIR",
    "SUPPORTED_ARCHS",
    "SUPPORTED_TYPES",
    "cache_root",
    "conversion_bytes",
    "convert_gguf",
    "gguf_config",
    "gguf_model_dir",
    "gguf_source",
    "unpermute_rotary",
]

ENV_CACHE_DIR = "KVJAX_CACHE_DIR"
SUPPORTED_ARCHS = ("llama", "qwen3", "gemma3")
# The Hugging Face architecture each llama.cpp architecture converts to.
_HF_ARCH = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
            "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}
# Tensor types kvjax's de-quantizers read.
SUPPORTED_TYPES = tuple(DEQUANTIZERS)
# Bumped whenever the converted layout changes, so stale cache entries are never reused.
_FORMAT_VERSION = 4
_DONE = "kvjax_gguf.json"
_WEIGHTS = "model.safetensors"
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
# Gemma 3: four norms per layer; llama.cpp's ffn_norm is the pre-MLP norm there.
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# llama.cpp's per-frequency RoPE factors (Llama 3.1+'s rope scaling, written as a tensor): read into the config.
_ROPE_FACTORS = "rope_freqs.weight"
# llama3's band edges and pretrained context as every Meta Llama 3.1 - 3.3 config sets them (and llama.cpp's
# converter assumes them where a config is silent); the file holds only the factors they give.
_LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR, _LLAMA3_CONTEXT = 1.0, 4.0, 8192
# How far a file's smoothing coefficients may lie from llama3's: the converter's float32 arithmetic moves them by
# about 1e-6; a context one larger or smaller moves each by more than 1e-5 (for contexts below 33,000).
_LLAMA3_SMOOTH_TOLERANCE = 1e-5
# llama.cpp's values for Gemma 3 where its GGUF metadata is silent.
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_PATTERN = 6
_GEMMA3_EOT = "<end_of_turn>"
# The ids that end generation in llama.cpp, in the order the converted config lists them.
_STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
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
_MERGES = "tokenizer.ggml.merges"
_SPECIAL = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


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
            stale = m.group("host") == host and not pid_alive(int(m.group("pid")))
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


def _mb(n: int) -> str:
    """Bytes as decimal megabytes and as the binary ones `df -h` / `du -h` print."""
    return f"{n / 1e6:,.0f} MB ({n / 2**20:,.0f} MiB)"


def space_error(what: str, where: pathlib.Path, need: int, cause: str) -> CheckpointError:
    """One line for a cache write that ran out of room: what needs how many megabytes where, and the way out."""
    try:
        free = f"{shutil.disk_usage(where).free / 1e6:,.0f} MB free"
    except OSError:
        free = "free space unknown"
    return CheckpointError(f"{what} needs {_mb(need)} in the model cache {str(where)!r} ({free}; {cause}): free "
                           f"some space there or set {ENV_CACHE_DIR} to a directory on a disk with room")


def is_out_of_space(err: BaseException) -> bool:
    """A write refused for want of room (ENOSPC, a quota, a file-size limit), also when a Rust library reports it."""
    if isinstance(err, OSError) and err.errno in _NO_SPACE:
        return True
    text = str(err)
    return any(f"(os error {code})" in text for code in _NO_SPACE) or "No space left on device" in text


def unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """HF row order of a Q or K projection ``[n_heads * head_dim, D]`` stored by llama.cpp.

    llama.cpp keeps each head's rotary pair ``(i, i + head_dim/2)`` in adjacent rows ``(2i, 2i+1)``;
    HF's ``rotate_half`` wants the first halves of all pairs, then the second halves.
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    per_head = weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def _open(path: pathlib.Path) -> GgufFile:
    try:
        return read_gguf(path)
    except (GgufFormatError, OSError, ValueError) as e:
        raise CheckpointError(
            f"cannot read GGUF file {str(path)!r}: it is corrupted or truncated ({type(e).__name__}: {e})"
        ) from e


def _block_names(arch: str) -> dict[str, str]:
    return _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES


def _hf_name(name: str, arch: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    names = _block_names(arch)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.weight"
    return None


def _check(path: pathlib.Path, meta: dict[str, Any], gguf: GgufFile) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(
            f"GGUF file {str(path)!r}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    bad_types = sorted({t.type_name for t in gguf.tensors} - set(SUPPORTED_TYPES))
    if bad_types:
        which = [t.name for t in gguf.tensors if t.type_name in bad_types]
        raise CheckpointError(
            f"GGUF file {str(path)!r}: quantization type(s) {', '.join(bad_types)} not supported (tensors "
            f"{', '.join(which[:5])}{' ...' if len(which) > 5 else ''}); supported: {', '.join(SUPPORTED_TYPES)}"
        )
    unknown = [t.name for t in gguf.tensors
               if _hf_name(t.name, arch) is None and not (arch == "llama" and t.name == _ROPE_FACTORS)]
    if unknown:
        raise CheckpointError(f"GGUF file {str(path)!r}: unsupported tensor(s) {', '.join(unknown[:10])}")
    names = {t.name for t in gguf.tensors}
    blocks = sorted({int(m.group(1)) for m in map(_BLOCK_RE.fullmatch, names) if m})
    wanted = [f"blk.{i}.{n}.weight" for i in blocks for n in ("attn_q_norm", "attn_k_norm")]
    if arch == "gemma3":
        wanted += [f"blk.{i}.{n}.weight" for i in blocks for n in ("post_attention_norm", "post_ffw_norm")]
    if arch in ("qwen3", "gemma3") and any(n not in names for n in wanted):
        missing = [n for n in wanted if n not in names]
        raise CheckpointError(f"GGUF file {str(path)!r}: {arch} weight(s) {', '.join(missing[:4])} missing")
    if arch == "llama" and any(n in names for n in wanted):
        raise CheckpointError(f"GGUF file {str(path)!r}: QK-norm weights in a {arch!r} file")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") and not (arch == "gemma3" and scaling == "linear"):
        raise CheckpointError(f"GGUF file {str(path)!r}: RoPE scaling {scaling!r} is not supported")
    return arch


def _as_count(key: str, value: Any, least: int = 1) -> int:
    """A metadata count as an int of at least ``least``: an integer, or a per-layer array whose entries agree
    (llama.cpp reads either); anything else is one ``CheckpointError`` naming the key and the value."""
    if isinstance(value, list) and value and all(v == value[0] for v in value):
        value = value[0]
    if isinstance(value, list):
        raise CheckpointError(f"GGUF metadata {key} differs per layer ({value!r}); kvjax supports one value for "
                              "every layer")
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise CheckpointError(f"GGUF metadata {key}={value!r} is not an integer >= {least}")
    return value


def _as_number(key: str, value: Any) -> float:
    """A metadata float (an integer accepted), else one ``CheckpointError`` naming the key and the value."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
        raise CheckpointError(f"GGUF metadata {key}={value!r} is not a finite number")
    return float(value)


def _float32_decimal(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.99999974e-06): the value the model was given."""
    return float(str(np.float32(value)))


def _gemma3_config(meta: dict[str, Any], get: Callable[..., Any], hidden: int, heads: int, head_dim: int,
                   layers: int) -> dict[str, Any]:
    """Gemma 3's fields beyond Llama's, from the metadata or llama.cpp's values for the architecture."""
    pattern = meta.get("gemma3.attention.sliding_window_pattern", _GEMMA3_PATTERN)
    if isinstance(pattern, list):  # one flag per layer (true: sliding), as newer llama.cpp converters write
        if len(pattern) != layers:
            raise CheckpointError(f"GGUF gemma3.attention.sliding_window_pattern lists {len(pattern)} layers of "
                                  f"{layers}")
        sliding = [bool(p) for p in pattern]
    else:  # every pattern-th layer is global, as llama.cpp's set_swa_pattern
        pattern = _as_count("gemma3.attention.sliding_window_pattern", pattern, 0)
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    theta = _as_number("gemma3.rope.freq_base", get("rope.freq_base", 1000000.0))
    global_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if meta.get("gemma3.rope.scaling.type") == "linear":
        global_rope = {**global_rope, "rope_type": "linear", "factor": _as_number("gemma3.rope.scaling.factor",
                                                                                 get("rope.scaling.factor"))}
    local_base = _as_number("gemma3.rope.freq_base_swa", meta.get("gemma3.rope.freq_base_swa",
                                                                   _GEMMA3_LOCAL_ROPE_BASE))
    # llama.cpp scales Gemma 3's queries by 1/sqrt(head size), except on the 27B (62 layers): 1/sqrt(hidden / heads)
    scalar = hidden // heads if layers == 62 else head_dim
    softcap = meta.get("gemma3.final_logit_softcapping")
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": _as_count("gemma3.attention.sliding_window", get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {"full_attention": global_rope,
                            "sliding_attention": {"rope_type": "default", "rope_theta": local_base}},
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": None if softcap is None else _float32_decimal(
            _as_number("gemma3.final_logit_softcapping", softcap)),
        "attn_logit_softcapping": meta.get("gemma3.attn_logit_softcapping"),  # refused by ModelConfig if set
    }


def _eos_ids(meta: dict[str, Any], arch: str, tokens: list[str] | None) -> int | list[int] | None:
    """The config's ``eos_token_id``: EOS, end-of-turn and end-of-message as the metadata names them, and Gemma 3's
    ``<end_of_turn>`` (llama.cpp stops at each); one id as an int, None without any."""
    ids = [meta[key] for key in _STOP_KEYS if meta.get(key) is not None]
    if arch == "gemma3" and tokens and _GEMMA3_EOT in tokens:
        ids.append(tokens.index(_GEMMA3_EOT))
    ids = list(dict.fromkeys(ids))
    return ids if len(ids) > 1 else (ids[0] if ids else None)


def _config(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata has no {arch}.{key}")
        return value

    def count(key: str, default: Any = None) -> int:
        return _as_count(f"{arch}.{key}", get(key, default))

    def number(key: str, default: Any = None) -> float:
        return _as_number(f"{arch}.{key}", get(key, default))

    hidden, heads = count("embedding_length"), count("attention.head_count")
    head_dim = count("attention.key_length", hidden // heads)
    rotary = count("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise CheckpointError(f"GGUF partial rotary embedding ({rotary} of {head_dim} dims) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = _as_count(f"{arch}.vocab_size", meta.get(f"{arch}.vocab_size", len(tokens) if tokens else 0), 0)
    layers = count("block_count")
    model_type, architecture = _HF_ARCH[arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": count("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": count("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": count("context_length"),
        "rms_norm_eps": _float32_decimal(number("attention.layer_norm_rms_epsilon")),
        "rope_theta": number("rope.freq_base", 10000.0),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta, arch, tokens),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        for key in ("hidden_act", "rope_theta", "rope_scaling", "mlp_bias"):
            del config[key]
        config.update(_gemma3_config(meta, get, hidden, heads, head_dim, layers))
    return config


def _rope_factors(path: pathlib.Path, gguf: GgufFile, head_dim: int) -> np.ndarray | None:
    """The file's ``rope_freqs.weight`` (float32, one factor per rotary frequency), or None; one ``CheckpointError``
    naming the file and the tensor when it is not ``[head_dim / 2]`` positive numbers."""
    t = next((t for t in gguf.tensors if t.name == _ROPE_FACTORS), None)
    if t is None:
        return None
    if tuple(t.shape) != (head_dim // 2,):
        raise CheckpointError(f"GGUF file {str(path)!r}: {_ROPE_FACTORS} has shape {list(t.shape)}, expected "
                              f"[{head_dim // 2}] (one RoPE factor per rotary frequency: head_dim / 2)")
    factors = np.concatenate([rows.reshape(-1) for _, rows in
                              dequantize_rows(gguf.raw_rows(t), t.type_name, t.shape[-1], np.float32)])
    if not (np.isfinite(factors) & (factors > 0)).all():
        bad = factors[~(np.isfinite(factors) & (factors > 0))][0]
        raise CheckpointError(f"GGUF file {str(path)!r}: {_ROPE_FACTORS} holds {float(bad)!r}; RoPE factors are "
                              "positive numbers")
    return factors


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """transformers' llama3 ``rope_scaling`` whose factors are ``factors`` to float32 rounding, or None.

    llama3 keeps the frequencies whose wavelength is below ``context / high``, divides those above ``context / low``
    by ``factor`` and smooths between: a frequency's factor is ``1 / ((1 - s) / factor + s)`` with ``s`` the
    smoothing coefficient ``(context / wavelength - low) / (high - low)`` clipped to [0, 1]."""
    f = factors.astype(np.float64)
    factor = float(f.max())
    if factor <= 1.0:
        return None
    low, high = _LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * np.pi * np.float64(theta) ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor)
    contexts = [_LLAMA3_CONTEXT]
    medium = np.flatnonzero((f > 1.0) & (f < factor))
    if medium.size:  # the smoothed band gives the context: context / wavelength = low + s (high - low)
        i = medium[0]
        contexts.append(round(float(wavelen[i] * (low + smooth[i] * (high - low)))))
    for context in dict.fromkeys(c for c in contexts if c >= 1):
        expected = np.clip((context / wavelen - low) / (high - low), 0.0, 1.0)
        if np.abs(smooth - expected).max() <= _LLAMA3_SMOOTH_TOLERANCE:
            return {"rope_type": "llama3", "factor": _float32_decimal(factor), "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": context}
    return None


def _factors_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The converted ``rope_scaling`` of a file's RoPE factors: none when all are 1, llama3's parameters when they
    give the factors, else the factors themselves (kvjax's ``freq_factors``: what llama.cpp computes)."""
    if (factors == 1).all():
        return None
    llama3 = _llama3_scaling(factors, theta, head_dim)
    if llama3 is not None:
        return llama3
    return {"rope_type": "freq_factors", "freq_factors": [_float32_decimal(x) for x in factors]}


def _planned(gguf: GgufFile, config: dict[str, Any], arch: str) -> list[PlannedTensor]:
    """Every weight as HF names and lays it out, de-quantized in bounded row chunks when written (the RoPE factors
    are in the config)."""
    out = []
    for t in gguf.tensors:
        if t.name == _ROPE_FACTORS:
            continue
        transform: Callable[[np.ndarray], np.ndarray] | None = None
        align = 1
        if arch == "llama" and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = config["num_attention_heads" if ".attn_q." in t.name else "num_key_value_heads"]
            align = t.shape[0] // heads  # whole heads per chunk: the permutation stays inside a head

            def transform(rows: np.ndarray, head_dim: int = align) -> np.ndarray:
                return unpermute_rotary(rows, rows.shape[0] // head_dim)
        elif arch == "gemma3" and t.name.endswith("norm.weight"):
            def transform(rows: np.ndarray) -> np.ndarray:
                return rows - np.float32(1.0)  # llama.cpp stored 1 + w
        out.append(PlannedTensor(_hf_name(t.name, arch), t.shape, np.dtype(np.float32),
                                 _chunks(gguf, t, transform, align)))
    return out


def _chunks(gguf: GgufFile, t: GgufTensor, transform: Callable[[np.ndarray], np.ndarray] | None,
            align: int) -> Callable[[], Iterator[np.ndarray]]:
    def chunks() -> Iterator[np.ndarray]:
        row_length = t.shape[-1] if t.shape else 1
        for _, rows in dequantize_rows(gguf.raw_rows(t), t.type_name, row_length, np.float32, align_rows=align):
            rows = rows if transform is None else transform(rows)
            yield rows.reshape(-1) if len(t.shape) <= 1 else rows
    return chunks


def _tokenizer_problem(meta: dict[str, Any], err: Exception) -> str:
    """What a tokenizer builder's error says is wrong with the metadata, in GGUF terms and on one line."""
    if isinstance(err, KeyError) and err.args:
        key = next((k for k, name in _TOKENIZER_KEYS.items() if name == err.args[0]), str(err.args[0]))
        model = meta.get("tokenizer.ggml.model")
        if key == "tokenizer.ggml.scores" and _MERGES not in meta and model != "t5":
            return f"its {model!r} tokenizer has neither {_MERGES} nor {key} (it needs one of them)"
        return f"its {model!r} tokenizer needs {key}, which the metadata lacks"
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def _tokenizer(path: pathlib.Path, meta: dict[str, Any], arch: str) -> Any | None:
    """A ``PreTrainedTokenizerFast`` from the GGUF vocabulary (transformers' builders; no torch); None without one,
    one ``CheckpointError`` naming the file when its metadata cannot make one."""
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
    bad = next(((i, m) for i, m in enumerate(meta.get(_MERGES, ())) if not isinstance(m, str) or
                m.count(" ") != 1), None)
    if bad is not None:
        raise CheckpointError(f"GGUF file {str(path)!r}: {_MERGES}[{bad[0]}] = {bad[1]!r} is not two tokens "
                              "separated by one space")
    try:
        backend, extra = convert_gguf_tokenizer(arch, spec)
    except Exception as e:  # noqa: BLE001 - tokenizers (Rust) reports a bad merge as a bare Exception or TypeError
        raise CheckpointError(f"GGUF file {str(path)!r}: cannot build its tokenizer: "
                              f"{_tokenizer_problem(meta, e)}") from None
    kwargs: dict[str, Any] = dict(extra)
    tokens = spec["tokens"]
    for name, key in _SPECIAL.items():
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            kwargs[name] = tokens[token_id]
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in meta:
            kwargs[flag] = bool(meta[f"tokenizer.ggml.{flag}"])
    if meta.get("tokenizer.ggml.model") == "llama":  # older files have no flag: llama.cpp then adds BOS to SPM text
        kwargs.setdefault("add_bos_token", True)
    if "tokenizer.chat_template" in meta:
        kwargs["chat_template"] = meta["tokenizer.chat_template"]
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def gguf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of a GGUF file, read from its header (nothing converted)."""
    path = pathlib.Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    return _prepare(path)[0]


def _prepare(path: pathlib.Path) -> tuple[dict[str, Any], list[PlannedTensor], dict[str, Any], str]:
    """`(config.json, the planned weights, the metadata, the architecture)` of a GGUF file (its header only)."""
    gguf = _open(path)
    meta = gguf.metadata
    arch = _check(path, meta, gguf)
    config = _config(meta, arch, {t.name for t in gguf.tensors})
    factors = _rope_factors(path, gguf, config["head_dim"])
    if factors is not None:  # a llama file (_check refuses the tensor elsewhere)
        config["rope_scaling"] = _factors_scaling(factors, config["rope_theta"], config["head_dim"])
    return config, _planned(gguf, config, arch), meta, arch


_ST_METADATA = {"format": "pt"}


def conversion_bytes(path: str | os.PathLike[str]) -> int:
    """The bytes of the converted weights (``model.safetensors``) of a GGUF file; the tokenizer files add a few MB.
    Only the file's header is read."""
    _, planned, _, _ = _prepare(pathlib.Path(path))
    return planned_bytes(planned, _ST_METADATA)


def _dir_bytes(path: pathlib.Path, but: str | None = None) -> int:
    """The bytes of the files in ``path`` (``but`` one)."""
    try:
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file() and p.name != but)
    except OSError:
        return 0


def convert_gguf(path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> pathlib.Path:
    """Writes ``out_dir`` (config.json, model.safetensors, tokenizer files) from a GGUF file, atomically."""
    path, out = pathlib.Path(path), pathlib.Path(out_dir)
    config, planned, meta, arch = _prepare(path)
    tokenizer = _tokenizer(path, meta, arch)
    weights = planned_bytes(planned, _ST_METADATA)
    what = f"converting {path.name}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(out.parent)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{_host_tag()}-{os.getpid()}-"))
    except OSError as e:
        if is_out_of_space(e):
            raise space_error(what, out.parent, weights, e.strerror or str(e)) from None
        raise _cache_error(out.parent, e) from None
    try:
        try:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            small = _dir_bytes(tmp)
            free = shutil.disk_usage(tmp).free
            if free < weights:
                raise space_error(what, out.parent, weights + small, "checked before writing")
            write_safetensors(tmp / _WEIGHTS, planned, _ST_METADATA)
            stat = path.stat()
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            done = {"source": str(path), "size": stat.st_size, "format_version": _FORMAT_VERSION, "files": files}
            (tmp / _DONE).write_text(json.dumps(done, indent=2) + "\n")
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - tokenizers (Rust) reports a full disk as a bare Exception
            if not is_out_of_space(e):
                raise
            cause = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
            raise space_error(what, out.parent, weights + _dir_bytes(tmp, but=_WEIGHTS), cause) from None
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / _DONE).is_file():  # not a concurrent writer finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _damage(out: pathlib.Path) -> str | None:
    """What is wrong with a cache entry (its files against the sizes its marker recorded), or None."""
    try:
        done = json.loads((out / _DONE).read_text())
        files = done["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return f"{_DONE} is unreadable"
    for name, size in files.items():
        f = out / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    try:
        json.loads((out / "config.json").read_text())
        with open(out / _WEIGHTS, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def gguf_source(model_dir: str | os.PathLike[str]) -> str | None:
    """The GGUF file a converted model directory was written from (its marker's record), or None for any other
    directory."""
    try:
        source = json.loads((pathlib.Path(model_dir) / _DONE).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, str) else None


def gguf_model_dir(
    path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """The cached HF directory converted from a GGUF file, converting it on first use.

    The cache key is the file's resolved path, size and modification time (and the converter's
    format version); an entry is used only once complete (its marker file is written last) and
    while its files have the sizes they were written with.
    """
    src = pathlib.Path(path).expanduser().resolve()
    if not src.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    stat = src.stat()
    key = hashlib.sha256(f"{_FORMAT_VERSION}\0{src}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    out = cache_root(cache_dir) / "gguf" / f"{src.stem}-{key[:16]}"
    try:
        exists, done = out.exists(), (out / _DONE).is_file()
    except OSError as e:  # e.g. a cache "directory" that is a file, or unreadable
        raise _cache_error(out.parent, e) from None
    if exists:
        problem = _damage(out) if done else f"no {_DONE}: not written by a finished conversion"
        if problem is not None:
            raise CheckpointError(f"the converted model {str(out)!r} is damaged ({problem}): delete {str(out)!r} "
                                  f"to reconvert it from {src.name}")
        return out
    return convert_gguf(src, out)
