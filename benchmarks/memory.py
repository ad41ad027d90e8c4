"""Memory: cache bytes and compiled peak memory of one-shot vs chunked prefill.

    python benchmarks/memory.py --out=benchmarks/results/memory.json
    python benchmarks/memory.py --quick --out=/tmp/memory.json

Peak memory comes from XLA's own buffer assignment of the per-layer prefill program
(`jax.jit(...).lower(...).compile().memory_analysis()` of `kvjax.runtime.forward.prefill_block`): the
program's peak = arguments + outputs - donated (aliased) + temporaries, and while it runs the rest of the model
stays resident (every other layer's weights and cache, the global weights, the last hidden states), so the
prefill's peak = the program's peak + those bytes. Prefill calls that one program for every layer of a chunk
(a one-shot prefill is one chunk; a chunked prefill compiles it twice, the last chunk being its own program)
with the layer's cache and activations donated, so nothing else grows with the prompt but the host-side token
ids. With a compressing method the cache is allocated at budget + new tokens and each chunk adds `chunk`
slots to the layer being run, so the peak depends on budget + chunk only: the rows at 4x and 16x (and,
compiled only, 64x / 256x) the budget show it. (LagKV with a global budget compresses the whole prompt at
once and refuses chunks: `unsupported`.)

`measured` rows run the chunked prefill for real at 4x and 16x the budget and record the cache
actually held between chunks (and the device's peak bytes where the backend reports them).
`--analyze_model=llama-3.1-8b` adds compiled-only rows for a Llama-3-8B-shaped model at 32K / 128K
tokens (nothing is allocated: the programs are compiled from shapes).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import bench_util as bu
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import methods as kvm
from kvjax import tuning
from kvjax.errors import ConfigError
from kvjax.models.loader import layer_shapes, param_shapes
from kvjax.models.model import resolve_dtype
from kvjax.runtime import forward, step

gen = importlib.import_module("kvjax.runtime.generate")


def compiled_memory(config: Any, method: Any, final_chunk: bool, fresh: bool, batch: int, capacity: int,
                    tokens: int, dtype: Any) -> dict[str, int]:
    """Memory stats of a prefill chunk of `tokens` on a cache of `capacity` slots: XLA's buffer assignment of
    the per-layer program (`argument`, `output`, `alias`, `temp`) and the prefill's `peak`, that program's
    peak plus what stays resident beside it (the other layers' weights and caches, the global weights, the
    last hidden states)."""
    dtype = resolve_dtype(dtype)
    weights = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in param_shapes(config).items()}
    layer_weights = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in layer_shapes(config).items()}
    inv_freq = jax.ShapeDtypeStruct((config.head_dim // 2,), jnp.float32)
    cache = jax.eval_shape(lambda: gen.init_cache(method, config, batch, capacity, dtype))

    def i32(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    def nbytes(tree: Any) -> int:
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    layer_cache = cache.layer(0)  # every layer has this shape (and sees the shared state, if any)
    compiled = forward.prefill_block.lower(
        config, method, final_chunk, fresh, tuning.current(), layer_weights, (inv_freq, 1.0), layer_cache,
        jax.ShapeDtypeStruct((batch, tokens, config.hidden_size), dtype), i32(batch, tokens), i32(batch), i32(),
    ).compile()
    m = compiled.memory_analysis()
    stats = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, alias=m.alias_size_in_bytes,
                 temp=m.temp_size_in_bytes)
    stats["cache"] = nbytes(cache)
    stats["weights"] = nbytes(weights)
    resident = (stats["weights"] - nbytes(layer_weights) + stats["cache"] - nbytes(layer_cache)
                + batch * config.hidden_size * jnp.dtype(dtype).itemsize)  # + prefill's last hidden states
    stats["peak"] = stats["argument"] + stats["output"] - stats["alias"] + stats["temp"] + resident
    return stats


def prefill_memory(config: Any, method: Any, prompt: int, chunk: int | None, new: int, dtype: Any,
                   batch: int = 1) -> dict[str, Any]:
    """Compiled memory of a whole prefill of `prompt` tokens: one program, or the larger chunk program."""
    bucket = gen.bucket_length(prompt, multiple=chunk or 1)
    capacity = method.capacity(bucket, new)
    if chunk is None or chunk >= bucket:  # one chunk into an empty cache: attends its own keys (as prefill does)
        stats = compiled_memory(config, method, True, step.attends_own_chunk(method), batch, capacity, bucket, dtype)
    else:
        both = [compiled_memory(config, method, final, False, batch, capacity, chunk, dtype)
                for final in (False, True)]
        stats = max(both, key=lambda s: s["peak"])
    stats["non_weight_peak"] = stats["peak"] - stats["weights"]
    return dict(capacity=capacity, bucket=bucket, **stats)


def _rows(model_name: str, config: Any, dtype: str, names: list[str], budget: int, chunk: int, prompts: list[int],
          new: int) -> list[dict]:
    rows = []
    kv_token = bu.kv_bytes_per_token(config, dtype)
    for prompt in prompts:
        full_one_shot = None
        for name in ["full", *names]:
            method = kvm.get(name, **bu.method_args(name, budget, prompt))
            for mode, c in (("one_shot", None), ("chunked", chunk)):
                try:
                    stats = prefill_memory(config, method, prompt, c, new, dtype)
                except ConfigError as e:  # a method that cannot prefill chunk by chunk with these settings
                    rows.append(dict(model=model_name, dtype=dtype, method=name, mode=mode, prompt=prompt,
                                     budget=budget, chunk=c, unsupported=str(e)))
                    continue
                if name == "full" and mode == "one_shot":
                    full_one_shot = stats
                row = dict(model=model_name, dtype=dtype, method=name, mode=mode, prompt=prompt,
                           budget=None if name == "full" else budget, chunk=c, new_tokens=new,
                           multiple_of_budget=prompt / budget, **stats,
                           kv_slots_bound=None if name == "full" else (budget + new + chunk),
                           kv_bound_bytes=None if name == "full" else (budget + new + chunk) * kv_token,
                           peak_vs_full_one_shot=stats["peak"] / full_one_shot["peak"],
                           non_weight_peak_vs_full_one_shot=stats["non_weight_peak"] / full_one_shot["non_weight_peak"])
                rows.append(row)
                print(f"{model_name:12s} T={prompt:7d} {name:8s} {mode:8s} cache {stats['cache'] / 2**20:9.2f} MiB  "
                      f"peak-weights {stats['non_weight_peak'] / 2**20:9.2f} MiB  "
                      f"x{row['non_weight_peak_vs_full_one_shot']:.3f} of full one-shot", flush=True)
    return rows


def _measured(model: Any, names: list[str], budget: int, chunk: int, prompts: list[int], new: int) -> list[dict]:
    """Runs the chunked prefill and records the cache it holds (and device peak bytes where reported)."""
    rows = []
    for name in names:
        for prompt in prompts:
            method = kvm.get(name, **bu.method_args(name, budget, prompt))
            ids = np.random.default_rng(prompt).integers(0, model.config.vocab_size, (1, prompt))
            try:
                state = gen.prefill(model, ids, method=method, max_new_tokens=new, chunk_size=chunk)
            except ConfigError:
                continue
            bu.block(state.cache)
            stats = jax.devices()[0].memory_stats() or {}
            kept = np.mean([np.asarray(layer.length).mean() for layer in state.cache.layers])
            rows.append(dict(method=name, prompt=prompt, budget=budget, chunk=chunk, capacity=state.cache.capacity,
                             cache_bytes=state.cache.nbytes, kept_tokens=float(kept),
                             device_peak_bytes=stats.get("peak_bytes_in_use")))
    return rows


def run(argv: list[str] | None = None) -> dict:
    p = bu.parser(__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=None, help="Tokens kept (default 256; quick: 16).")
    p.add_argument("--chunk_size", type=int, default=None, help="Prefill chunk (default 256; quick: 16).")
    p.add_argument("--multiples", default=None, help="Prompt lengths as multiples of the budget "
                                                      "(default 4,16,64,256; quick: 4,16).")
    p.add_argument("--methods", default=None, help="Compressing methods (default snapkv,sagekv,h2o,lagkv).")
    p.add_argument("--analyze_model", default=None, help="Also compile-only rows for this preset (llama-3.1-8b).")
    p.add_argument("--analyze_contexts", default="32768,131072", help="Prompt lengths for --analyze_model.")
    p.add_argument("--analyze_dtype", default=None, help="dtype for --analyze_model (CPU: float32; CPU compiles "
                                                         "upcast bf16 matmuls, which would count weight copies).")
    args = p.parse_args(argv)
    model_name, dtype, _ = bu.resolve_common(args)
    budget = args.budget or (16 if args.quick else 256)
    chunk = args.chunk_size or (16 if args.quick else 256)
    multiples = bu.csv_ints(args.multiples) if args.multiples else ([4, 16] if args.quick else [4, 16, 64, 256])
    default = ["snapkv"] if args.quick else ["snapkv", "sagekv", "h2o", "lagkv"]
    names = bu.csv_strs(args.methods) if args.methods else default
    new = 8 if args.quick else 32
    config = bu.model_config(model_name)
    rows = _rows(model_name, config, dtype, names, budget, chunk, [m * budget for m in multiples], new)
    model = bu.random_model(config, dtype)
    measured = _measured(model, names, budget, chunk, [m * budget for m in multiples if m <= 16], new)
    if args.analyze_model:
        a_config = bu.model_config(args.analyze_model)
        a_dtype = args.analyze_dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
        rows += _rows(args.analyze_model, a_config, a_dtype, names[:1], 1024, 1024,
                      bu.csv_ints(args.analyze_contexts), 128)
    return bu.write(args.out, "memory", args, config, dtype, rows, measured=measured)


if __name__ == "__main__":
    run(sys.argv[1:])
