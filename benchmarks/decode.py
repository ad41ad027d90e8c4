"""Decode speed: per-step latency and tokens/s vs context length and budget, compressed vs `full`.

    python benchmarks/decode.py --out=benchmarks/results/decode.json
    python benchmarks/decode.py --quick --out=/tmp/decode.json

For every (context, method, budget): prefill once (compressing methods chunk by chunk, so memory
stays bounded), then time `kvjax.decode` (one jitted `while_loop`, `--new_tokens - 1` steps) on a
fresh copy of the cache. Reported beside the measured speedup over `full` at the same context
(`speedup`) is the ideal speedup of a memory-bound decode (`ideal_speedup`): bytes read per step
by `full` / by the method, where a step reads the weights once (the embedding table only for its
row) plus the K/V of every allocated cache slot (the XLA decode attention reads the whole padded
cache; the retrieval methods, which gather a compact list of slots per step (`capabilities.gathers`),
read only that list). `analytic` holds the same ideal for a
Llama-3-8B-shaped model in bfloat16 at 32K and 128K tokens (computed, not measured).

Methods whose decode only appends (`Method.decode_appends_only`: full, snapkv, lagkv without decode-time
compression, ...) write the new token in place into their layer's buffers, and StreamingLLM
(`capabilities.evicts_in_place`) also evicts in place. `--compare_general` also times them on the
general path (`method.decode` on the appended layer, as every method did before), interleaved with the fast
path in every repeat, and adds `general_step_ms` and `in_place_speedup` to their rows. `--method_args` (JSON by
method) adds hyperparameters.

Long contexts: prefilling `full` costs O(T^2) (minutes at 128K on a CPU), while its decode step does not
depend on what the cache holds. Above `--synthetic_full_above` tokens `full` therefore decodes from a
cache of the same shape, dtype and layout filled with random keys and values (`synthetic_full_state`,
timed against a real prefill by `--check_synthetic`); compressing methods still prefill for real,
chunk by chunk (linear in T), and methods that cannot chunk are skipped at those lengths.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from typing import Any

import bench_util as bu
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import methods as kvm
from kvjax.errors import ConfigError
from kvjax.methods import capabilities as caps
from kvjax.methods.base import Method, per_example_budget
from kvjax.models.loader import param_shapes

gen = importlib.import_module("kvjax.runtime.generate")


def _kv_read_bytes(cache: Any, method: Method | None = None) -> int:
    """K and V bytes the decode attention reads per step (`cache`: a `ModelCache`): every allocated slot, or for
    a method that gathers a compact list (`capabilities.gathers`: InfLLM, Q-LLM, ActQKV, Quest) that list's
    static width."""
    total = sum(int(layer.k.nbytes + layer.v.nbytes) for layer in cache.layers)
    if method is None or not caps.gathers(method):
        return total
    capacity, layers = cache.capacity, cache.num_layers
    if hasattr(method, "n_local"):  # block retrieval: sinks + retrieved blocks + recent tokens
        blocks = min(method.retrieved_blocks, method.memory_blocks(capacity))
        width = [method.n_init + blocks * method.block_size + method.n_local + method.block_size] * layers
    else:  # Quest: its dense layers read everything, the others their pages
        width = [capacity if layer < method.decode_dense_layers else method._page_width(capacity) * method.page_size
                 for layer in range(layers)]
    return int(total * sum(min(w, capacity) for w in width) / (capacity * layers))


def synthetic_full_state(model: Any, batch: int, context: int, new: int, seed: int = 0) -> Any:
    """What `gen.prefill(model, ids, method="full", max_new_tokens=new)` returns for `[batch, context]`
    prompts, with random K / V in place of the prompt's (the same shapes, dtypes and valid slots)."""
    method = kvm.get("full")
    bucket = gen.bucket_length(context)
    cache = gen.init_cache(method, model.config, batch, method.capacity(bucket, new), model.dtype)
    filled = jnp.arange(cache.capacity) < context
    key_kv, key_logits = jax.random.split(jax.random.key(seed))

    def noise(key: Any, like: Any) -> Any:
        return jnp.where(filled[:, None], jax.random.normal(key, like.shape, jnp.float32), 0).astype(like.dtype)

    def fill(index: int, layer: Any) -> Any:  # each layer in buffers of its own, as prefill leaves them
        key_k, key_v = jax.random.split(jax.random.fold_in(key_kv, index))
        return layer.replace(
            k=noise(key_k, layer.k), v=noise(key_v, layer.v),
            pos=jnp.broadcast_to(jnp.where(filled, jnp.arange(layer.capacity, dtype=jnp.int32), -1), layer.pos.shape),
            length=jnp.full(layer.length.shape, context, jnp.int32),
        )

    cache = cache.replace(layers=tuple(fill(i, layer) for i, layer in enumerate(cache.layers)))
    lengths = np.full((batch,), context, np.int64)
    logits = jax.random.normal(key_logits, (batch, model.config.vocab_size), jnp.float32)
    return gen.PrefillState(cache=cache, logits=logits, prompt_lengths=lengths,
                            budget=jnp.asarray(per_example_budget(method, lengths)), method=method)


def general_decode_path(method: Method) -> Method:
    """The same method with its in-place decode (append only, or append + evict) off: decode slices each
    layer out and writes it back."""
    cls = type(method)
    forced = type(f"{cls.__name__}GeneralDecode", (cls,), {"decode_appends_only": False, "evicts_in_place": False})
    return forced(**{f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init})


def analytic_8b(budgets: list[int], contexts: tuple[int, ...] = (32768, 131072), new: int = 128) -> list[dict]:
    """Ideal memory-bound decode speedups for Llama-3-8B shapes in bfloat16 (no run, arithmetic)."""
    config = bu.model_config("llama-3.1-8b")
    itemsize = 2
    weights = 0
    for name, shape in param_shapes(config).items():
        n = int(np.prod(shape))
        weights += (shape[1] if name == "embed" and not config.tie_word_embeddings else n) * itemsize
    per_token = bu.kv_bytes_per_token(config, "bfloat16")
    rows = []
    for ctx in contexts:
        full = weights + per_token * (ctx + new)
        for b in budgets:
            rows.append(dict(model="llama-3.1-8b", dtype="bfloat16", context=ctx, budget=b,
                             weight_gib=weights / 2**30, full_kv_gib=per_token * (ctx + new) / 2**30,
                             kept_kv_gib=per_token * (b + new) / 2**30,
                             ideal_speedup=full / (weights + per_token * (b + new))))
    return rows


def _in_place(method: Method) -> bool:
    return method.decode_appends_only or caps.evicts_in_place(method)


def run(argv: list[str] | None = None) -> dict:
    p = bu.parser(__doc__.splitlines()[0])
    p.add_argument("--contexts", default=None, help="Prompt lengths (default 1024,4096,8192; quick: 64).")
    p.add_argument("--budgets", default=None, help="Budgets (default 256,1024; quick: 16).")
    p.add_argument("--methods", default=None, help="Comma list (default: snapkv,streaming_llm,lagkv,sagekv,ahakv,"
                                                   "h2o,actqkv).")
    p.add_argument("--new_tokens", type=int, default=None, help="Tokens generated per timed decode (default 33).")
    p.add_argument("--batch", type=int, default=1, help="Prompts decoded together.")
    p.add_argument("--chunk_size", type=int, default=None, help="Prefill chunk for compressing methods (1024).")
    p.add_argument("--compare_general", action="store_true",
                   help="Also time the general decode path of methods that take the in-place one.")
    p.add_argument("--method_args", default=None,
                   help='JSON of extra hyperparameters per method, e.g. {"lagkv": {"compress_decode": false}}.')
    p.add_argument("--synthetic_full_above", type=int, default=32768,
                   help="Contexts above this decode `full` from a random cache of its shape (no O(T^2) prefill).")
    p.add_argument("--check_synthetic", action="store_true",
                   help="Also time `full` on a synthetic cache where it was prefilled for real (adds "
                        "`synthetic_step_ms` to the full rows).")
    args = p.parse_args(argv)
    model_name, dtype, repeats = bu.resolve_common(args)
    contexts = bu.csv_ints(args.contexts) if args.contexts else ([64] if args.quick else [1024, 4096, 8192])
    budgets = bu.csv_ints(args.budgets) if args.budgets else ([16] if args.quick else [256, 1024])
    names = bu.csv_strs(args.methods) if args.methods else (
        ["snapkv"] if args.quick else ["snapkv", "streaming_llm", "lagkv", "sagekv", "ahakv", "h2o", "actqkv"])
    new = args.new_tokens or (9 if args.quick else 33)
    chunk = args.chunk_size or (32 if args.quick else 1024)
    extra_args = json.loads(args.method_args) if args.method_args else {}
    config = bu.model_config(model_name)
    model = bu.random_model(config, dtype)
    w_bytes = bu.weight_bytes(model)
    rows = []
    for ctx in contexts:
        ids = np.random.default_rng(ctx).integers(0, config.vocab_size, (args.batch, ctx))
        settings = [("full", None)] + [(n, b) for n in names for b in budgets if b < ctx]
        long = ctx > args.synthetic_full_above
        states, modes = {}, {}
        for name, budget in settings:
            method = kvm.get(name, **bu.method_args(name, budget or 0, ctx), **extra_args.get(name, {}))
            mode = "chunked" if method.compresses and method.prefill_window() is None and ctx > chunk else "one_shot"
            if name == "full" and long:
                states[(name, budget)], modes[(name, budget)] = synthetic_full_state(model, args.batch, ctx, new), \
                    "synthetic"
                continue
            if long and mode != "chunked" and method.prefill_window() is None:
                print(f"T={ctx:6d} {name:14s} b={budget!s:5s} skipped: prefills the whole prompt at once", flush=True)
                continue
            if mode == "chunked":
                try:
                    states[(name, budget)] = gen.prefill(model, ids, method=method, max_new_tokens=new,
                                                         chunk_size=chunk)
                except ConfigError:  # e.g. lagkv with a global budget compresses the whole prompt at once
                    mode = "one_shot"
            if mode == "one_shot":
                states[(name, budget)] = gen.prefill(model, ids, method=method, max_new_tokens=new)
            modes[(name, budget)] = mode
        bu.block([s.cache for s in states.values()])
        # The general path decodes from the same prefilled cache; only the decode program differs.
        general = {key: dataclasses.replace(s, method=general_decode_path(s.method)) for key, s in states.items()
                   if args.compare_general and _in_place(s.method)}
        if args.check_synthetic and not long:
            general[("full", "synthetic")] = synthetic_full_state(model, args.batch, ctx, new)

        def decode(state: Any) -> Any:
            fresh = dataclasses.replace(state, cache=jax.tree.map(jnp.copy, state.cache))
            bu.block(fresh.cache)
            return fresh

        def timed(state: Any) -> list[float]:
            fresh = decode(state)
            return bu.time_call(lambda: gen.decode(model, fresh, max_new_tokens=new, stop_at_eos=False)[2], 1)

        timings: dict[tuple, list[float]] = {k: [] for k in states}
        general_timings: dict[tuple, list[float]] = {k: [] for k in general}
        for state in [*states.values(), *general.values()]:  # compile
            gen.decode(model, decode(state), max_new_tokens=new, stop_at_eos=False)
        for _ in range(repeats):
            for key in states:  # the two paths of a method back to back
                timings[key] += timed(states[key])
                if key in general:
                    general_timings[key] += timed(general[key])
                if key == ("full", None) and ("full", "synthetic") in general:
                    general_timings[("full", "synthetic")] += timed(general[("full", "synthetic")])
        steps = new - 1
        full_step = bu.median(timings[("full", None)]) / steps
        full_bytes = w_bytes + _kv_read_bytes(states[("full", None)].cache)
        for (name, budget), ts in timings.items():
            step = bu.median(ts) / steps
            kv = _kv_read_bytes(states[(name, budget)].cache, states[(name, budget)].method)
            row = dict(context=ctx, method=name, budget=budget, batch=args.batch, steps=steps,
                       step_ms=step * 1e3, tokens_per_s=args.batch / step, speedup=full_step / step,
                       weight_bytes=w_bytes, kv_read_bytes=kv, ideal_speedup=full_bytes / (w_bytes + kv),
                       cache_capacity=int(states[(name, budget)].cache.capacity), prefill=modes[(name, budget)],
                       decode_path="in_place" if _in_place(states[(name, budget)].method) else "general")
            extra = ""
            if name == "full" and ("full", "synthetic") in general:
                synthetic_step = bu.median(general_timings[("full", "synthetic")]) / steps
                row.update(synthetic_step_ms=synthetic_step * 1e3, synthetic_vs_prefilled=synthetic_step / step)
                extra = f"  synthetic cache {synthetic_step * 1e3:.3f} ms/step (x{synthetic_step / step:.2f})"
            if (name, budget) in general:
                general_step = bu.median(general_timings[(name, budget)]) / steps
                row.update(general_step_ms=general_step * 1e3, in_place_speedup=general_step / step)
                extra = f"  in place x{row['in_place_speedup']:.2f} vs general {general_step * 1e3:.3f} ms/step"
            rows.append(row)
            print(f"T={ctx:6d} {name:14s} b={budget!s:5s} {row['step_ms']:8.3f} ms/step  {row['tokens_per_s']:8.1f} "
                  f"tok/s  x{row['speedup']:.2f} (ideal x{row['ideal_speedup']:.2f}){extra}", flush=True)
    return bu.write(args.out, "decode", args, config, dtype, rows, analytic=analytic_8b([256, 1024, 4096]))


if __name__ == "__main__":
    run(sys.argv[1:])
