"""Load a Hugging Face safetensors checkpoint into kvjax's parameter layout (host numpy arrays).

Each decoder layer's tensors are arrays of their own (``layers.{i}.<name>``; `nest` turns the flat dict into
the `{..., "layers": (layer_0, layer_1, ...)}` pytree the model runs on), and projections are reshaped to
per-head einsum layouts (see :func:`param_shapes`):

=========================  =================  ===========================================================
kvjax key                  shape              from Hugging Face (``model.layers.{i}.`` prefix)
=========================  =================  ===========================================================
``embed``                  ``[V, D]``         ``model.embed_tokens.weight``
``layers.{i}.attn_norm``   ``[D]``            ``input_layernorm.weight``
``layers.{i}.qkv``         ``[D, K, G+2, H]`` ``self_attn.q_proj`` / ``k_proj`` / ``v_proj`` ``.weight``, fused
                                              (G = N / K): ``[:, :, :G]`` is q_proj [N*H, D] reshaped
                                              (K, G, H, D), transposed (3, 0, 1, 2); ``[:, :, G]`` k_proj
                                              [K*H, D] reshaped (K, H, D), transposed (2, 0, 1);
                                              ``[:, :, G+1]`` v_proj likewise
``layers.{i}.o``           ``[N, H, D]``      ``self_attn.o_proj.weight`` [D, N*H]:
                                              reshape (D, N, H), transpose (1, 2, 0)
``layers.{i}.qkv_bias``    ``[K, G+2, H]``    ``q_proj`` / ``k_proj`` / ``v_proj`` ``.bias`` if qkv_bias, fused
                                              the same way
``layers.{i}.o_bias``      ``[D]``            ``o_proj.bias`` if o_bias
``layers.{i}.q_norm``/k    ``[H]``            ``self_attn.q_norm`` / ``k_norm`` ``.weight`` if qk_norm
                                              (Qwen3, Gemma 3)
``layers.{i}.mlp_norm``    ``[D]``            ``post_attention_layernorm.weight`` (Gemma 3:
                                              ``pre_feedforward_layernorm``)
``layers.{i}.gate_up``     ``[D, 2, F]``      ``mlp.gate_proj`` (``[:, 0]``) / ``up_proj`` (``[:, 1]``)
                                              ``.weight`` transposed
``layers.{i}.down``        ``[F, D]``         ``mlp.down_proj.weight`` transposed
``layers.{i}.gate_up_bias``  ``[2, F]``       ``gate_proj`` / ``up_proj`` ``.bias`` if mlp_bias
``layers.{i}.down_bias``   ``[D]``            ``down_proj.bias`` if mlp_bias
``layers.{i}.post_attn_    ``[D]``            Gemma 3 (post_norms): ``post_attention_layernorm`` /
norm`` / ``post_mlp_norm``                    ``post_feedforward_layernorm`` ``.weight``
``final_norm``             ``[D]``            ``model.norm.weight``
``lm_head``                ``[D, V]``         ``lm_head.weight`` transposed; absent when tied
=========================  =================  ===========================================================

The fused arrays (see `kvjax.models.block`) are allocated once and each HF tensor is written into its slice as it
streams in, so no unfused copy is ever held. Phi-3's own fused tensors map straight in: its
``self_attn.qkv_proj.weight`` ``[(N + 2K) H, D]`` gives q (its first N H rows), k and v; its
``mlp.gate_up_proj.weight`` ``[2F, D]`` gives gate (first F rows) and up. A multimodal Gemma 3 checkpoint
(``config.multimodal``) holds the text decoder under ``language_model.model.`` (head:
``language_model.lm_head.weight``); its vision tower and projector are not read.

Only ``config.json`` and ``*.safetensors`` are read (``safe_open(framework="numpy")``, so nothing
touches an accelerator and bf16 stays bf16 via ml_dtypes); pickled checkpoints are refused. Every
parameter must be found, every tensor used, and every shape must match, else
:class:`~kvjax.errors.CheckpointError` names the tensor and file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np
import safetensors

from kvjax.errors import CheckpointError, ConfigError
from kvjax.models.config import ModelConfig, check_no_remote_code, missing_model_error, read_config_json

__all__ = [
    "check_no_remote_code",
    "hf_tensor_names",
    "load_checkpoint",
    "load_params",
    "param_shapes",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
# Non-persistent buffers some old exports still carry; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}
_ALLOWED_DTYPES = frozenset(_SAFETENSORS_DTYPES.values())
_MAX_LISTED = 10
_CONVERT_HINT = (
    "kvjax never unpickles checkpoints; convert to safetensors with transformers, on a machine "
    'where you trust the file: `python -c "from transformers import AutoModelForCausalLM as M; '
    "M.from_pretrained('IN_DIR').save_pretrained('OUT_DIR', safe_serialization=True)\"` "
    "(or download the repository's *.safetensors files instead)"
)


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


LAYER_PREFIX = "layers."


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every parameter of one decoder layer (names without the ``layers.{i}.`` prefix)."""
    d, f = config.hidden_size, config.intermediate_size
    n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
    g = n // k
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (d,), "qkv": (d, k, g + 2, h), "o": (n, h, d)}
    if config.qkv_bias:
        shapes["qkv_bias"] = (k, g + 2, h)
    if config.o_bias:
        shapes["o_bias"] = (d,)
    if config.qk_norm:
        shapes.update(q_norm=(h,), k_norm=(h,))
    shapes.update(mlp_norm=(d,), gate_up=(d, 2, f), down=(f, d))
    if config.mlp_bias:
        shapes.update(gate_up_bias=(2, f), down_bias=(d,))
    if config.post_norms:
        shapes.update(post_attn_norm=(d,), post_mlp_norm=(d,))
    return shapes


def separate_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One decoder layer's parameters with the projections unfused (q ``[D, N, H]``, k / v ``[D, K, H]``, gate /
    up ``[D, F]``, their biases; `kvjax.models.block.fuse_layer` fuses them), in the order `DecoderLM.random` draws
    them, so a seed gives the weights it gave before the projections were fused."""
    d, f = config.hidden_size, config.intermediate_size
    n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (d,), "q": (d, n, h), "k": (d, k, h), "v": (d, k, h),
                                          "o": (n, h, d)}
    if config.qkv_bias:
        shapes.update(q_bias=(n, h), k_bias=(k, h), v_bias=(k, h))
    if config.o_bias:
        shapes["o_bias"] = (d,)
    if config.qk_norm:
        shapes.update(q_norm=(h,), k_norm=(h,))
    shapes.update(mlp_norm=(d,), gate=(d, f), up=(d, f), down=(f, d))
    if config.mlp_bias:
        shapes.update(gate_bias=(f,), up_bias=(f,), down_bias=(d,))
    if config.post_norms:
        shapes.update(post_attn_norm=(d,), post_mlp_norm=(d,))
    return shapes


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every kvjax parameter, keyed as :func:`load_params` returns them."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (config.vocab_size, config.hidden_size)}
    one = layer_shapes(config)
    for i in range(config.num_layers):
        shapes.update({f"{LAYER_PREFIX}{i}.{name}": shape for name, shape in one.items()})
    shapes["final_norm"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
    return shapes


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The model's weights pytree from flat ``layers.{i}.<name>`` keys: the global weights plus ``layers``, a
    tuple with one dict per decoder layer. The arrays are not copied."""
    out: dict[str, Any] = {}
    layers: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith(LAYER_PREFIX):
            index, _, name = key[len(LAYER_PREFIX):].partition(".")
            layers.setdefault(int(index), {})[name] = value
        else:
            out[key] = value
    out["layers"] = tuple(layers[i] for i in range(len(layers)))
    return out


def flatten(weights: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `nest`: flat ``layers.{i}.<name>`` keys (a flat dict is returned as is)."""
    if "layers" not in weights:
        return dict(weights)
    out = {key: value for key, value in weights.items() if key != "layers"}
    for i, layer in enumerate(weights["layers"]):
        out.update({f"{LAYER_PREFIX}{i}.{name}": value for name, value in layer.items()})
    return out


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One HF tensor (or a block of its rows) and where it goes: ``out[key][dest] = transform(tensor[rows])``
    (``layer``: its decoder layer; ``rows``: ``(start, stop)`` of a fused HF tensor's part, None: all of it;
    ``dest``: the index of its slice in a fused kvjax array, None: the whole array)."""

    key: str
    layer: int | None
    hf_name: str
    hf_shape: tuple[int, ...]
    transform: Callable[[np.ndarray], np.ndarray]
    rows: tuple[int, int] | None = None
    dest: tuple[Any, ...] | None = None

    @property
    def part_shape(self) -> tuple[int, ...]:
        """The shape of what `transform` reads: the rows taken, or the whole tensor."""
        if self.rows is None:
            return self.hf_shape
        return (self.rows[1] - self.rows[0], *self.hf_shape[1:])

    def read(self, tensor: np.ndarray) -> np.ndarray:
        return self.transform(tensor if self.rows is None else tensor[self.rows[0] : self.rows[1]])

    def target(self, array: np.ndarray) -> np.ndarray:
        """The part of the kvjax array `array` (of ``key``) this tensor fills: a view."""
        return array if self.dest is None else array[self.dest]


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.T


def _heads_in(heads: int, head_dim: int, hidden: int) -> Callable[[np.ndarray], np.ndarray]:
    """[heads*head_dim, D] -> [D, heads, head_dim]."""
    return lambda w: w.reshape(heads, head_dim, hidden).transpose(2, 0, 1)


def _heads_out(heads: int, head_dim: int, hidden: int) -> Callable[[np.ndarray], np.ndarray]:
    """[D, heads*head_dim] -> [heads, head_dim, D]."""
    return lambda w: w.reshape(hidden, heads, head_dim).transpose(1, 2, 0)


def _grouped_heads_in(kv_heads: int, group: int, head_dim: int, hidden: int) -> Callable[[np.ndarray], np.ndarray]:
    """[kv_heads*group*head_dim, D] (query head n = kv * group + g) -> [D, kv_heads, group, head_dim]."""
    return lambda w: w.reshape(kv_heads, group, head_dim, hidden).transpose(3, 0, 1, 2)


def _split_heads(heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda b: b.reshape(heads, head_dim)


def _split_groups(kv_heads: int, group: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda b: b.reshape(kv_heads, group, head_dim)


#: Tensors of a multimodal checkpoint that kvjax does not read (the text decoder is read alone).
_MULTIMODAL_SKIPPED = ("vision_tower.", "multi_modal_projector.")


def _prefixes(config: ModelConfig) -> tuple[str, str]:
    """Where the decoder's tensors live: `(prefix of model.*, name of the LM head)`."""
    if config.multimodal:
        return "language_model.model.", "language_model.lm_head.weight"
    return "model.", "lm_head.weight"


_ALL = slice(None)


def _qkv_parts(n: int, k: int) -> tuple[slice, int, int]:
    """Where q, k and v sit along the fused ``qkv``'s group axis (its third, the bias's second)."""
    g = n // k
    return slice(0, g), g, g + 1


def _attention_entries(config: ModelConfig, i: int, a: str) -> list[_Entry]:
    d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    key = f"layers.{i}.qkv"
    q_in = _grouped_heads_in(k, n // k, h, d)
    dest = [(_ALL, _ALL, part) for part in _qkv_parts(n, k)]
    if config.model_type == "phi3":  # one fused [q; k; v] projection
        name, shape = a + "qkv_proj.weight", ((n + 2 * k) * h, d)
        return [
            _Entry(key, i, name, shape, q_in, (0, n * h), dest[0]),
            _Entry(key, i, name, shape, _heads_in(k, h, d), (n * h, (n + k) * h), dest[1]),
            _Entry(key, i, name, shape, _heads_in(k, h, d), ((n + k) * h, (n + 2 * k) * h), dest[2]),
        ]
    return [
        _Entry(key, i, a + "q_proj.weight", (n * h, d), q_in, dest=dest[0]),
        _Entry(key, i, a + "k_proj.weight", (k * h, d), _heads_in(k, h, d), dest=dest[1]),
        _Entry(key, i, a + "v_proj.weight", (k * h, d), _heads_in(k, h, d), dest=dest[2]),
    ]


def _qkv_bias_entries(config: ModelConfig, i: int, a: str) -> list[_Entry]:
    n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
    key, g = f"layers.{i}.qkv_bias", n // k
    qd, kd, vd = _qkv_parts(n, k)
    return [
        _Entry(key, i, a + "q_proj.bias", (n * h,), _split_groups(k, g, h), dest=(_ALL, qd)),
        _Entry(key, i, a + "k_proj.bias", (k * h,), _split_heads(k, h), dest=(_ALL, kd)),
        _Entry(key, i, a + "v_proj.bias", (k * h,), _split_heads(k, h), dest=(_ALL, vd)),
    ]


def _mlp_entries(config: ModelConfig, i: int, m: str) -> list[_Entry]:
    d, f = config.hidden_size, config.intermediate_size
    key = f"layers.{i}.gate_up"
    if config.model_type == "phi3":  # one fused [gate; up] projection
        name, shape = m + "gate_up_proj.weight", (2 * f, d)
        return [_Entry(key, i, name, shape, _transpose, (0, f), (_ALL, 0)),
                _Entry(key, i, name, shape, _transpose, (f, 2 * f), (_ALL, 1))]
    return [_Entry(key, i, m + "gate_proj.weight", (f, d), _transpose, dest=(_ALL, 0)),
            _Entry(key, i, m + "up_proj.weight", (f, d), _transpose, dest=(_ALL, 1))]


def _plan(config: ModelConfig) -> list[_Entry]:
    d, v, f = config.hidden_size, config.vocab_size, config.intermediate_size
    n, h = config.num_heads, config.head_dim
    base, head = _prefixes(config)
    entries = [_Entry("embed", None, base + "embed_tokens.weight", (v, d), _identity)]
    for i in range(config.num_layers):
        p = f"{base}layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        entries.append(_Entry(f"layers.{i}.attn_norm", i, p + "input_layernorm.weight", (d,), _identity))
        entries += _attention_entries(config, i, a)
        entries.append(_Entry(f"layers.{i}.o", i, a + "o_proj.weight", (d, n * h), _heads_out(n, h, d)))
        if config.qkv_bias:
            entries += _qkv_bias_entries(config, i, a)
        if config.o_bias:
            entries.append(_Entry(f"layers.{i}.o_bias", i, a + "o_proj.bias", (d,), _identity))
        if config.qk_norm:
            entries += [_Entry(f"layers.{i}.q_norm", i, a + "q_norm.weight", (h,), _identity),
                        _Entry(f"layers.{i}.k_norm", i, a + "k_norm.weight", (h,), _identity)]
        if config.post_norms:  # Gemma: post_attention_layernorm follows attention; the MLP's input norm is "pre"
            entries += [
                _Entry(f"layers.{i}.post_attn_norm", i, p + "post_attention_layernorm.weight", (d,), _identity),
                _Entry(f"layers.{i}.mlp_norm", i, p + "pre_feedforward_layernorm.weight", (d,), _identity),
                _Entry(f"layers.{i}.post_mlp_norm", i, p + "post_feedforward_layernorm.weight", (d,), _identity),
            ]
        else:
            entries.append(_Entry(f"layers.{i}.mlp_norm", i, p + "post_attention_layernorm.weight", (d,), _identity))
        entries += _mlp_entries(config, i, m)
        entries.append(_Entry(f"layers.{i}.down", i, m + "down_proj.weight", (d, f), _transpose))
        if config.mlp_bias:
            entries += [
                _Entry(f"layers.{i}.gate_up_bias", i, m + "gate_proj.bias", (f,), _identity, dest=(0,)),
                _Entry(f"layers.{i}.gate_up_bias", i, m + "up_proj.bias", (f,), _identity, dest=(1,)),
                _Entry(f"layers.{i}.down_bias", i, m + "down_proj.bias", (d,), _identity),
            ]
    entries.append(_Entry("final_norm", None, base + "norm.weight", (d,), _identity))
    if not config.tie_word_embeddings:
        entries.append(_Entry("lm_head", None, head, (v, d), _transpose))
    return entries


def hf_tensor_names(config: ModelConfig) -> list[str]:
    """The Hugging Face tensor names a checkpoint of ``config`` must contain."""
    return list(dict.fromkeys(e.hf_name for e in _plan(config)))


def _check_dir(model_dir: str | os.PathLike[str]) -> pathlib.Path:
    path = pathlib.Path(model_dir).expanduser()
    if not path.exists():
        raise missing_model_error(path)
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a directory")
    return path


def _safe_open(path: pathlib.Path) -> Any:
    try:
        return safetensors.safe_open(str(path), framework="numpy")
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"cannot read safetensors file {str(path)!r} (corrupt or truncated?): {e}"
        ) from e


def _file_keys(path: pathlib.Path) -> list[str]:
    with _safe_open(path) as f:
        return list(f.keys())


def _tensor_files(model_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Map every tensor name of the checkpoint to the safetensors file holding it: ``model.safetensors`` when present,
    else the shards ``model.safetensors.index.json`` lists, else every ``*.safetensors`` file. transformers looks in
    that order too (an unsharded ``save_pretrained`` over a sharded checkpoint deletes the shards but leaves the
    stale index)."""
    index_file = model_dir / INDEX_FILE
    if index_file.is_file() and not (model_dir / SINGLE_FILE).is_file():
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{str(index_file)!r} is not valid JSON: {e}") from e
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(
                f"{str(index_file)!r} has no valid weight_map (tensor name -> shard file)"
            )
        absent = {s for s in weight_map.values() if not (model_dir / s).is_file()}
        if absent:
            raise CheckpointError(
                f"{str(index_file)!r} names shard file(s) that do not exist in "
                f"{str(model_dir)!r}: {_listing(absent)}"
            )
        return {name: model_dir / shard for name, shard in weight_map.items()}

    single = model_dir / SINGLE_FILE
    files = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickled = sorted({p.name for pat in _PICKLE_PATTERNS for p in model_dir.glob(pat)})
        if pickled:
            raise CheckpointError(
                f"{str(model_dir)!r} holds only pickled checkpoint files ({_listing(pickled)}): "
                + _CONVERT_HINT
            )
        raise CheckpointError(
            f"no safetensors weights in {str(model_dir)!r}: expected {SINGLE_FILE} or "
            f"{INDEX_FILE} with its shards"
        )
    out: dict[str, pathlib.Path] = {}
    for path in files:
        for name in _file_keys(path):
            if name in out:
                raise CheckpointError(
                    f"tensor {name!r} appears in both {out[name].name!r} and {path.name!r}"
                )
            out[name] = path
    return out


def _resolve_dtype(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        resolved = np.dtype(dtype)
    except TypeError as e:
        raise ConfigError(f"dtype={dtype!r} is not a numpy dtype") from e
    if resolved not in _ALLOWED_DTYPES:
        raise ConfigError(
            f"dtype={dtype!r} is not supported; use float32, bfloat16, float16 or float64"
        )
    return resolved


def _is_ignored(name: str, config: ModelConfig) -> bool:
    return name.endswith(_IGNORED_SUFFIXES) or (config.multimodal and name.startswith(_MULTIMODAL_SKIPPED))


def _equal_rows(a: np.ndarray, b: np.ndarray, rows: int = 4096) -> bool:
    """``a`` (cast to ``b``'s dtype) equals ``b``; compared in row blocks to bound the memory."""
    if a.shape != b.shape:
        return False
    return all(
        np.array_equal(a[i : i + rows].astype(b.dtype), b[i : i + rows])
        for i in range(0, a.shape[0], rows)
    )


def load_params(
    model_dir: str | os.PathLike[str], config: ModelConfig, dtype: Any = None
) -> dict[str, np.ndarray]:
    """Read the checkpoint in ``model_dir`` into kvjax's layout (see :func:`param_shapes`).

    Returns host numpy arrays in the checkpoint's dtype (bf16 stays ``ml_dtypes.bfloat16``), or
    cast to ``dtype`` (e.g. ``np.float32``) when given. Each tensor is written into its preallocated array
    (a fused projection's: into its slice of it), so no second copy is kept.
    """
    path = _check_dir(model_dir)
    want = _resolve_dtype(dtype)
    entries = _plan(config)
    files = _tensor_files(path)
    searched = _listing({p.name for p in files.values()})

    missing = list(dict.fromkeys(e.hf_name for e in entries if e.hf_name not in files))
    needed = {e.hf_name for e in entries}
    base, head_name = _prefixes(config)
    tied_head = None
    if config.tie_word_embeddings and head_name in files:
        tied_head = files[head_name]  # accepted only if equal to the embedding (below)
    unused = [
        n
        for n in files
        if n not in needed
        and not _is_ignored(n, config)
        and not (tied_head is not None and n == head_name)
    ]
    unused_msg = (
        f"unused tensor(s) {_listing(unused)} (in {_listing({files[n].name for n in unused})})"
    )
    if missing:
        raise CheckpointError(
            f"checkpoint in {str(path)!r} is missing tensor(s) {_listing(missing)} "
            f"(searched {searched})" + (f"; it also has {unused_msg}" if unused else "")
        )
    if unused:
        raise CheckpointError(
            f"checkpoint in {str(path)!r} has {unused_msg}, not part of a "
            f"model_type={config.model_type!r} model with this config.json"
        )

    by_file: dict[pathlib.Path, list[_Entry]] = {}
    for e in entries:
        by_file.setdefault(files[e.hf_name], []).append(e)

    # Pass 1: headers only -- presence, shapes and dtypes, before allocating anything.
    src_dtypes: dict[str, set[np.dtype]] = {}
    for file, file_entries in by_file.items():
        with _safe_open(file) as f:
            keys = set(f.keys())
            for e in {e.hf_name: e for e in file_entries}.values():
                if e.hf_name not in keys:
                    raise CheckpointError(
                        f"tensor {e.hf_name!r} is listed for {file.name!r} in {INDEX_FILE} but "
                        f"{file.name!r} does not contain it"
                    )
                sl = f.get_slice(e.hf_name)
                shape, st_dtype = tuple(sl.get_shape()), sl.get_dtype()
                if shape != e.hf_shape:
                    raise CheckpointError(
                        f"tensor {e.hf_name!r} in {file.name!r} has shape {shape}, expected "
                        f"{e.hf_shape} from config.json"
                    )
                if st_dtype not in _SAFETENSORS_DTYPES:
                    raise CheckpointError(
                        f"tensor {e.hf_name!r} in {file.name!r} has dtype {st_dtype}; expected "
                        "a floating type (BF16, F16, F32, F64)"
                    )
                for part in file_entries:
                    if part.hf_name == e.hf_name:
                        src_dtypes.setdefault(part.key, set()).add(_SAFETENSORS_DTYPES[st_dtype])

    shapes = param_shapes(config)
    out: dict[str, np.ndarray] = {}
    for key, shape in shapes.items():
        if want is not None:
            key_dtype = want
        else:
            found = src_dtypes[key]
            key_dtype = next(iter(found)) if len(found) == 1 else np.dtype(np.float32)
        out[key] = np.empty(shape, key_dtype)

    # Pass 2: data, one file open at a time, each tensor read once and written straight into its array(s).
    for file, file_entries in by_file.items():
        parts: dict[str, list[_Entry]] = {}
        for e in file_entries:
            parts.setdefault(e.hf_name, []).append(e)
        with _safe_open(file) as f:
            for name, named in parts.items():
                try:
                    tensor = f.get_tensor(name)
                except (safetensors.SafetensorError, OSError, ValueError) as err:
                    raise CheckpointError(
                        f"cannot read tensor {name!r} from {str(file)!r} "
                        f"(corrupt or truncated?): {err}"
                    ) from err
                for e in named:  # into the preallocated array, or its slice of a fused one
                    e.target(out[e.key])[...] = e.read(tensor)
                del tensor

    if tied_head is not None:
        with _safe_open(tied_head) as f:
            head = f.get_tensor(head_name)
        embed_name = base + "embed_tokens.weight"
        if not _equal_rows(head, out["embed"]):
            raise CheckpointError(
                f"unused tensor {head_name!r} in {tied_head.name!r}: config.json sets "
                f"tie_word_embeddings=true but {head_name} differs from {embed_name!r}"
            )
    return out


def load_checkpoint(
    model_dir: str | os.PathLike[str], dtype: Any = None
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read ``config.json`` (refusing remote code) and the weights of a local HF directory."""
    path = _check_dir(model_dir)
    raw = read_config_json(path)
    check_no_remote_code(raw)
    try:
        config = ModelConfig.from_hf_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path / 'config.json'}: {e}") from e
    return config, load_params(path, config, dtype=dtype)


def tensor_plan(config: ModelConfig) -> list[_Entry]:
    """Every HF tensor of `config` with its kvjax name, layer index, HF shape and transform."""
    return _plan(config)
