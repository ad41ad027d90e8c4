"""Generated per-model files in the published layouts, for the methods that read them (DuoAttention's head
pattern, Q-Filters, KVzap's surrogates, Fast KVzip's gates, LU-KV's budget curve, Expected Attention's query
statistics): deterministic contents, written once per process tree under the temp directory."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import numpy as np
from kvzap_weights import write_kvzap

from kvjax.methods.duo_attention import write_attention_pattern
from kvjax.methods.expected_attention_stats import write_statistics
from kvjax.methods.fastkvzip import seeded_gates, write_gates
from kvjax.methods.lukv import seeded_curve, write_budget_curve
from kvjax.methods.qfilter import write_qfilters

VERSION = 1  # bump when the generated contents change
ROOT = pathlib.Path(tempfile.gettempdir()) / f"kvjax-test-learned-{os.getuid()}-v{VERSION}"


def _once(name: str, write) -> str:
    """`ROOT/name`, written by `write(dir)` into a private directory and renamed into place (parallel workers)."""
    final = ROOT / name
    if not final.is_dir():
        ROOT.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=ROOT, prefix=".tmp-"))
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another worker got there first: same contents
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def head_scores(layers: int, kv_heads: int) -> np.ndarray:
    """Distinct scores in (0, 1), spread over layers and heads (no tie decides which heads stream)."""
    n = layers * kv_heads
    return (((np.arange(n) * 7919) % n + 0.5) / n).reshape(layers, kv_heads)


def duo_pattern(layers: int = 2, kv_heads: int = 2, *, sink_size: int = 2, recent_size: int = 6) -> str:
    """A DuoAttention pattern directory for a model of `layers` x `kv_heads`."""
    return _once(f"duo_L{layers}_K{kv_heads}_s{sink_size}_r{recent_size}", lambda d: write_attention_pattern(
        d, head_scores(layers, kv_heads), sink_size=sink_size, recent_size=recent_size, model_name="models/tiny"))


def filters(layers: int = 2, kv_heads: int = 2, head_dim: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(layers, kv_heads, head_dim)).astype(np.float32)


def qfilter_dir(layers: int = 2, kv_heads: int = 2, head_dim: int = 16, seed: int = 0) -> str:
    """A Q-Filters directory (`model.safetensors` + `config.json`) for a model of these dimensions."""
    return _once(f"qfilt_L{layers}_K{kv_heads}_H{head_dim}_s{seed}",
                 lambda d: write_qfilters(d, filters(layers, kv_heads, head_dim, seed)))


def kvzap_dir(layers: int = 2, hidden_size: int = 64, kv_heads: int = 2, hidden_dim: int = 8) -> str:
    """A KVzap MLP checkpoint for a model of `layers` managed layers, this hidden size and KV heads."""
    return _once(f"kvzap_L{layers}_D{hidden_size}_K{kv_heads}_M{hidden_dim}",
                 lambda d: write_kvzap(d, layers, hidden_size, kv_heads, hidden_dim))


def budget_curve(layers: int = 2, kv_heads: int = 2, seed: int = 0) -> np.ndarray:
    """LU-KV prune ratios `[99, layers, kv_heads]`, heads keeping different shares (`lukv.seeded_curve`)."""
    return seeded_curve(layers, kv_heads, seed)


def lukv_curve(layers: int = 2, kv_heads: int = 2, seed: int = 0) -> str:
    """An LU-KV budget curve `.npy` for a model of `layers` x `kv_heads` (the path of the file)."""
    folder = _once(f"lukv_L{layers}_K{kv_heads}_s{seed}",
                   lambda d: write_budget_curve(d / "curve.npy", budget_curve(layers, kv_heads, seed)))
    return str(pathlib.Path(folder) / "curve.npy")


def gate_tensors(layers: int, hidden_size: int, kv_heads: int, groups: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded Fast KVzip gates (`kvjax.methods.fastkvzip.seeded_gates`) for a model of these dimensions."""
    return seeded_gates(layers, hidden_size, kv_heads, groups, seed=seed)


def fastkvzip_gates(layers: int = 2, hidden_size: int = 64, kv_heads: int = 2, groups: int = 2, seed: int = 0) -> str:
    """A Fast KVzip gate directory for a model of `layers` managed layers, this hidden size and KV heads."""
    return _once(f"fastkvzip_L{layers}_D{hidden_size}_K{kv_heads}_G{groups}_s{seed}",
                 lambda d: write_gates(d, gate_tensors(layers, hidden_size, kv_heads, groups, seed=seed)))


def query_statistics(layers: int = 2, num_heads: int = 4, head_dim: int = 16, seed: int = 0) -> tuple:
    """Seeded query statistics `(mean [L, N, H], covariance [L, N, H, H])`: unit-normal means, covariances `A A^T / H`
    of a unit-normal `A` (positive semi-definite)."""
    rng = np.random.default_rng(seed)
    mean = rng.standard_normal((layers, num_heads, head_dim)).astype(np.float32)
    root = rng.standard_normal((layers, num_heads, head_dim, head_dim)) / np.sqrt(head_dim)
    return mean, np.einsum("lnij,lnkj->lnik", root, root).astype(np.float32)


def ea_stats_dir(layers: int = 2, num_heads: int = 4, head_dim: int = 16, seed: int = 0) -> str:
    """An `ExpectedAttentionStats` directory for a model of `layers` managed layers and these query heads."""
    return _once(f"ea_stats_L{layers}_N{num_heads}_H{head_dim}_s{seed}",
                 lambda d: write_statistics(d, *query_statistics(layers, num_heads, head_dim, seed),
                                            model_name="models/tiny", dataset_name="generated"))


#: The arguments naming a file, per method, rebuilt for a model of other dimensions by `for_model`.
FILE_METHODS = ("duo_attention", "qfilter", "kvzap", "dms", "fastkvzip", "lukv", "expected_attention_stats")


def for_model(name: str, args: dict, layers: int, kv_heads: int = 2, head_dim: int = 16,
              hidden_size: int = 64, num_heads: int = 4) -> dict:
    """`args` with the method's generated file swapped for one that fits a model of these dimensions (`layers`:
    those the method manages, `ModelConfig.method_layers`)."""
    args = dict(args)
    if name == "duo_attention":
        args["patterns"] = duo_pattern(layers, kv_heads)
    elif name == "qfilter":
        args["filters"] = qfilter_dir(layers, kv_heads, head_dim)
    elif name == "kvzap":
        args["weights"] = kvzap_dir(layers, hidden_size, kv_heads)
    elif name == "fastkvzip":
        args["gates"] = fastkvzip_gates(layers, hidden_size, kv_heads)
    elif name == "lukv":
        args["curve"] = lukv_curve(layers, kv_heads)
    elif name == "expected_attention_stats":
        args["stats"] = ea_stats_dir(layers, num_heads, head_dim)
    elif name == "dms":  # over KVzap, its default base
        args["base_args"] = {**args.get("base_args", {}), "weights": kvzap_dir(layers, hidden_size, kv_heads)}
    return args
