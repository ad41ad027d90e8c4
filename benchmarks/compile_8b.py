"""Compile time of the generation programs at a real model's shape, from abstract shapes (no weights needed).

    python benchmarks/compile_8b.py --out=/tmp/compile_8b.json                     # llama-3.1-8b shape, 32K
    python benchmarks/compile_8b.py --smoke --out=/tmp/compile_8b.json             # tiny shape, seconds

For each method: the one per-layer prefill program (`kvjax.runtime.forward.prefill_block`, which every layer
calls) and the decode loop (`generate._decode_loop`, the layers unrolled inside it) are lowered from
`jax.ShapeDtypeStruct`s of the model's weights and the method's cache and compiled, timed cold (persistent
compilation cache off) and warm (a second process loading them from a fresh persistent cache directory that the
first one filled). The per-layer prefill program does not grow with depth; the decode loop does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import bench_util as bu
import jax
import jax.numpy as jnp

from kvjax import methods as kvm
from kvjax import tuning
from kvjax.models.loader import layer_shapes
from kvjax.runtime import forward

gen = importlib.import_module("kvjax.runtime.generate")


def abstract_weights(config: Any, dtype: Any) -> dict:
    def s(shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    out = {"embed": s((config.vocab_size, config.hidden_size)), "final_norm": s((config.hidden_size,))}
    if not config.tie_word_embeddings:
        out["lm_head"] = s((config.hidden_size, config.vocab_size))
    out["layers"] = tuple({k: s(v) for k, v in layer_shapes(config).items()} for _ in range(config.num_layers))
    return out


def lower_decode_loop(config: Any, key: Any, tune: Any, weights: Any, cache: Any, batch: int, new: int,
                      sharding: Any = None) -> Any:
    """`generate._decode_loop` lowered for `key` (the method the program is compiled for) from abstract `weights`
    and `cache`; its other operands (RoPE, first logits, lengths, budget, EOS ids, pad id, seed) made abstract here,
    on `sharding` when given (a device to compile for)."""
    def s(shape: tuple[int, ...], dt: Any = jnp.int32) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    return gen._decode_loop.lower(
        config, key, new, 0.0, 1.0, tune, weights, (s((config.head_dim // 2,), jnp.float32), 1.0), cache,
        s((batch, config.vocab_size), jnp.float32), s((batch,)), s((batch,)), s((1,)), s(()), s((), jnp.uint32))


def compile_times(model_name: str, dtype_name: str, method_name: str, budget: int, context: int, new: int,
                  batch: int) -> dict[str, float]:
    """Seconds to lower + compile the prefill layer program and the decode loop (in this process)."""
    config = bu.model_config(model_name)
    dtype = jnp.dtype(dtype_name)
    method = kvm.get(method_name, **({} if method_name == "full" else bu.method_args(method_name, budget, context)))
    weights = abstract_weights(config, dtype)
    bucket = gen.bucket_length(context)
    cache = jax.eval_shape(lambda: gen.init_cache(method, config, batch, method.capacity(bucket, new), dtype))
    rope = (jax.ShapeDtypeStruct((config.head_dim // 2,), jnp.float32), 1.0)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    tune = tuning.current()
    out = {}
    start = time.perf_counter()
    forward.prefill_block.lower(
        config, method, True, True, tune, weights["layers"][0], rope, cache.layer(0),
        jax.ShapeDtypeStruct((batch, bucket, config.hidden_size), dtype), i32(batch, bucket), i32(batch), i32(),
    ).compile()
    out["prefill_layer_s"] = time.perf_counter() - start
    start = time.perf_counter()
    lower_decode_loop(config, method, tune, weights, cache, batch, new).compile()
    out["decode_loop_s"] = time.perf_counter() - start
    return out


def _child(args: argparse.Namespace, method: str, cache_dir: str | None) -> dict[str, float]:
    env = dict(os.environ, KVJAX_COMPILATION_CACHE_DIR=cache_dir or "off")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", method, "--model", args.model, "--dtype", args.dtype,
           "--budget", str(args.budget), "--context", str(args.context), "--new_tokens", str(args.new_tokens),
           "--batch", str(args.batch), "--out", "-"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("TIMES ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"child exit {proc.returncode}: {proc.stderr[-1500:]}")
    return json.loads(lines[-1][6:])


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--methods", default="full,snapkv,streaming_llm,h2o,quest,infllm")
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--timeout_s", type=float, default=900)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model = args.model or ("tiny" if args.smoke else "llama-3.1-8b")
    args.budget = args.budget or (16 if args.smoke else 1024)
    args.context = args.context or (64 if args.smoke else 32768)
    if args.one:
        from kvjax.runtime.compile_cache import ensure_compilation_cache

        ensure_compilation_cache()
        times = compile_times(args.model, args.dtype, args.one, args.budget, args.context, args.new_tokens, args.batch)
        print("TIMES " + json.dumps(times), flush=True)
        return
    rows = []
    for method in bu.csv_strs(args.methods):
        with tempfile.TemporaryDirectory() as cache_dir:
            try:
                cold = _child(args, method, None)
                _child(args, method, cache_dir)  # fills the persistent cache
                warm = _child(args, method, cache_dir)
                row = dict(method=method, **{f"cold_{k}": v for k, v in cold.items()},
                           **{f"warm_{k}": v for k, v in warm.items()})
            except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
                row = dict(method=method, error=f"{type(e).__name__}: {str(e)[-800:]}")
        rows.append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        args.quick = args.smoke
        bu.write(args.out, "compile_8b", args, bu.model_config(args.model), args.dtype, rows,
                 context=args.context, budget=args.budget, batch=args.batch)


if __name__ == "__main__":
    main(sys.argv[1:])
