"""Shared pieces of the benchmark scripts: models, machine description, timing, JSON output.

Every benchmark reports each method as a ratio against the full cache measured in the same run
(machines are noisy; ratios travel better than absolute times) and names the machine it ran on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.config import ModelConfig, RopeConfig
from kvjax.models.model import DecoderLM, resolve_dtype

#: Method arguments for the benchmarks, by method; `{budget}` is filled in per run. Retrieval methods
#: (infllm, qllm, actqkv) take block / window sizes instead of a budget and are sized to the context.
_BUDGETED = {
    "streaming_llm", "snapkv", "pyramidkv", "knorm", "random", "adakv", "lagkv", "sagekv", "sagekv_union",
    "ahakv", "h2o", "tova", "nacl", "quest", "lm_infinite", "merging",
}
DEFAULT_METHODS = (
    "streaming_llm", "snapkv", "pyramidkv", "knorm", "adakv", "lagkv", "sagekv", "ahakv", "h2o", "tova", "actqkv",
)


def small_config(**overrides: Any) -> ModelConfig:
    """The CPU benchmark model: Llama-shaped, 4 layers, GQA 8/2 heads of 32, hidden 256 (~3.5M parameters)."""
    fields = dict(
        model_type="llama", vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=4,
        num_heads=8, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0),
        max_position_embeddings=1 << 20, eos_token_ids=(),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_config(**overrides: Any) -> ModelConfig:
    """`--quick` model: the test suite's tiny shape (2 layers, hidden 64)."""
    fields = dict(
        model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0),
        max_position_embeddings=8192, eos_token_ids=(),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def model_config(name: str) -> ModelConfig:
    """`small`, `tiny`, or a preset name (`llama-3.1-8b`: Llama-3-8B shape with a 128K context)."""
    if name == "small":
        return small_config()
    if name == "tiny":
        return tiny_config()
    from kvjax.models.presets import preset_config

    config = preset_config(name)
    return dataclasses.replace(config, eos_token_ids=())


def random_model(config: ModelConfig, dtype: Any = jnp.float32, seed: int = 0, scale: float = 0.05) -> DecoderLM:
    """Random weights drawn on the device (an 8B model needs no host copy), each layer's in buffers of its own;
    norms at one."""
    from kvjax.models.loader import param_shapes

    dtype = resolve_dtype(dtype)
    key = jax.random.key(seed)

    @functools.partial(jax.jit, static_argnums=(1,))
    def draw(key: Any, shape: tuple[int, ...]) -> Any:  # one fused program: no float32 copy of a weight
        return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)

    weights = {}
    for i, (name, shape) in enumerate(sorted(param_shapes(config).items())):
        weights[name] = jnp.ones(shape, dtype) if name.endswith("norm") else draw(jax.random.fold_in(key, i), shape)
    return DecoderLM(config, weights, dtype=dtype)


def method_args(name: str, budget: int, context: int) -> dict[str, Any]:
    """Hyperparameters of `name` for a `budget`-token cache of a `context`-token prompt."""
    if name == "full":
        return {}
    if name in _BUDGETED:
        args: dict[str, Any] = {"budget": budget}
        if name in ("snapkv", "pyramidkv", "adakv", "ahakv", "nacl"):
            key = "recent_size" if name == "ahakv" else "window_size"
            if name == "adakv":
                args["base_args"] = {"window_size": min(32, budget // 4)}
            else:
                args[key] = min(32, budget // 4)
        if name == "lagkv":
            args.update(sink_size=16, lag_size=min(128, max(8, budget // 4)))
        if name == "lm_infinite":
            args["n_global"] = min(128, budget // 2)
        return args
    if name in ("infllm", "qllm", "actqkv"):
        # Retrieval over a block memory: sinks + local window + top-k blocks, ~budget tokens attended.
        block = 64 if budget >= 512 else 16
        n_local = budget // 2
        topk = max(1, (budget - n_local - block) // block)
        return dict(n_init=block, n_local=n_local, block_size=block, window=min(256, n_local), topk=topk)
    raise ValueError(f"no benchmark arguments for method {name!r}")


def kvpress_version(python: str, extra_path: str | None = None) -> str:
    """kvpress's version and its torch's / transformers' for the interpreter `python` (its own environment),
    with `extra_path` first on its PYTHONPATH."""
    code = ("import importlib.metadata as m; print(' / '.join(f'{p} {m.version(p)}' "
            "for p in ('kvpress', 'torch', 'transformers')))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (extra_path, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=env).stdout.strip()


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    dev = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def block(x: Any) -> Any:
    return jax.block_until_ready(x)


def time_call(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Wall seconds of `repeats` calls of `fn` (each result blocked on)."""
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(fn())
        out.append(time.perf_counter() - start)
    return out


#: jax.monitoring's event for one XLA backend compile (`jax._src.dispatch.BACKEND_COMPILE_EVENT`).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileLog:
    """Seconds of every XLA backend compile while active (`jax.monitoring`'s compile-duration event): tells a call
    that compiled from one that ran. `with CompileLog() as log: ...; log.count, log.seconds`."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self._active = False

    def _listen(self, event: str, seconds: float, **_: Any) -> None:
        if self._active and event == BACKEND_COMPILE_EVENT:
            self.durations.append(seconds)

    def __enter__(self) -> CompileLog:
        self._active = True
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister is not None:  # older JAX: the listener stays, inactive
            unregister(self._listen)

    @property
    def count(self) -> int:
        return len(self.durations)

    @property
    def seconds(self) -> float:
        return float(sum(self.durations))


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def weight_bytes(model: DecoderLM, decode: bool = True) -> int:
    """Bytes of weights a decode step reads (the embedding table only for its one row, unless tied)."""
    from kvjax.models.loader import flatten

    total = 0
    for name, w in flatten(model.weights()).items():
        if decode and name == "embed" and not model.config.tie_word_embeddings:
            total += w.shape[1] * w.dtype.itemsize
        else:
            total += w.size * w.dtype.itemsize
    return total


def kv_bytes_per_token(config: ModelConfig, dtype: Any) -> int:
    """K + V bytes of one token over every layer."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(resolve_dtype(dtype)).itemsize


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="JSON file to write (directories are created).")
    p.add_argument("--quick", action="store_true", help="Tiny model, short contexts, one repeat (smoke test).")
    p.add_argument("--model", default=None, help="small (CPU default), tiny, or a preset such as llama-3.1-8b.")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (accelerator default).")
    p.add_argument("--repeats", type=int, default=None, help="Timed repeats per measurement (median reported).")
    return p


def resolve_common(args: argparse.Namespace) -> tuple[str, str, int]:
    """(model name, dtype, repeats) with the `--quick` / backend defaults filled in."""
    on_cpu = jax.default_backend() == "cpu"
    model = args.model or ("tiny" if args.quick else "small")
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    repeats = args.repeats or (1 if args.quick else 3)
    return model, dtype, repeats


def write(path: str, name: str, args: argparse.Namespace, config: ModelConfig, dtype: str, rows: list[dict],
          **extra: Any) -> dict:
    """Writes the result JSON (benchmark, machine, model, settings, rows) and returns it."""
    result = {
        "benchmark": name,
        "machine": machine(),
        "model": {
            "name": args.model or ("tiny" if args.quick else "small"),
            "dtype": dtype,
            **{k: getattr(config, k) for k in (
                "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                "vocab_size")},
        },
        "argv": sys.argv[1:],
        "quick": bool(args.quick),
        "rows": rows,
        **extra,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=_jsonable)
    return result


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return str(x)


def csv_ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def csv_strs(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]
