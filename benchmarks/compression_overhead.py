"""Compression overhead: what each method's prefill compression costs next to the prefill forward.

    python benchmarks/compression_overhead.py --out=benchmarks/results/compression_overhead.json
    python benchmarks/compression_overhead.py --quick --out=/tmp/co.json

Per context length and method, three numbers, all from the same run:
* `prefill_ratio`: end-to-end `kvjax.prefill` time of the method / that of `full` (what a user sees).
* `hook_fraction`: the method's `prefill` hook alone (every layer, on a realistic cache and queries),
  as a fraction of the model's forward pass over the same tokens (`transformer.forward`, exact causal
  attention over T keys, no cache) -- the compression overhead proper. One-shot methods only: methods
  that compress chunk by chunk (InfLLM, Q-LLM, ActQKV) run their hook once per window; for them the
  end-to-end ratio is the figure.
* `full_prefill_over_forward`: `full`'s runtime prefill / the forward, the runtime's own overhead.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

import bench_util as bu
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax import methods as kvm
from kvjax.methods.base import CacheSpec, Step, per_example_budget
from kvjax.models import transformer

gen = importlib.import_module("kvjax.runtime.generate")


@functools.partial(jax.jit, static_argnums=0)
def _forward(config: Any, weights: dict, rope: tuple, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    return transformer.forward(config, weights, rope, tokens, positions)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _hook(method: Any, capacity: int, num_layers: int, work: Any, q: jax.Array, positions: jax.Array,
          budget: jax.Array, inv_freq: jax.Array, layer: jax.Array) -> Any:
    step = Step(positions=positions, budget=budget, layer=layer, inv_freq=inv_freq, capacity=capacity,
                num_layers=num_layers, final_chunk=True)
    return method.prefill(work, q, step)


def _work_cache(method: Any, config: Any, capacity: int, t: int, dtype: Any, seed: int) -> tuple[Any, jax.Array]:
    """One layer's cache as the hook receives it: `capacity + t` slots holding the t prompt tokens."""
    spec = CacheSpec(batch=1, kv_heads=config.num_kv_heads, capacity=capacity, num_heads=config.num_heads,
                     head_dim=config.head_dim, num_layers=config.num_layers, dtype=dtype)
    state = dict(method.init_cache_state(spec))
    cache = kvc.init(1, config.num_kv_heads, capacity, config.head_dim, dtype, score=method.uses_score,
                     attend=method.uses_attend, state=state)
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (1, t, config.num_kv_heads, config.head_dim)
    k = jax.random.normal(keys[0], shape, dtype)
    v = jax.random.normal(keys[1], shape, dtype)
    q = jax.random.normal(keys[2], (1, t, config.num_heads, config.head_dim), dtype)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    return kvc.append(kvc.extend(cache, t), k, v, positions), q


def run(argv: list[str] | None = None) -> dict:
    p = bu.parser(__doc__.splitlines()[0])
    p.add_argument("--contexts", default=None, help="Prompt lengths (default 1024,2048,4096; quick: 64).")
    p.add_argument("--budget", type=int, default=None, help="Tokens kept (default 256; quick: 16).")
    p.add_argument("--methods", default=None, help="Comma list or 'all' (default: the main eviction methods).")
    args = p.parse_args(argv)
    model_name, dtype, repeats = bu.resolve_common(args)
    contexts = bu.csv_ints(args.contexts) if args.contexts else ([64] if args.quick else [1024, 2048, 4096])
    budget = args.budget or (16 if args.quick else 256)
    if args.methods == "all":
        names = [m for m in kvm.available() if m != "full"]
    elif args.methods:
        names = bu.csv_strs(args.methods)
    else:
        names = ["snapkv"] if args.quick else list(bu.DEFAULT_METHODS)
    config = bu.model_config(model_name)
    model = bu.random_model(config, dtype)
    weights, rope = model.weights(), model.rope()
    rows = []
    for t in contexts:
        ids = np.random.default_rng(t).integers(0, config.vocab_size, (1, t))
        positions = jnp.arange(t, dtype=jnp.int32)[None]
        tokens = jnp.asarray(ids, jnp.int32)
        fwd = lambda tokens=tokens, positions=positions: _forward(config, weights, rope, tokens, positions)  # noqa: E731
        bu.block(fwd())
        methods = {"full": kvm.get("full")}
        methods.update({n: kvm.get(n, **bu.method_args(n, budget, t)) for n in names})
        runs = {}
        for name, method in methods.items():
            runs[name] = functools.partial(gen.prefill, model, ids, method=method, max_new_tokens=1)
            bu.block(runs[name]().cache)  # compile
        # Interleave the repeats so drift hits every method alike.
        times: dict[str, list[float]] = {n: [] for n in ["forward", *methods]}
        for _ in range(repeats):
            times["forward"] += bu.time_call(fwd, 1)
            for name, fn in runs.items():
                times[name] += bu.time_call(lambda fn=fn: fn().cache, 1)
        t_fwd, t_full = bu.median(times["forward"]), bu.median(times["full"])
        for name, method in methods.items():
            row: dict[str, Any] = dict(
                context=t, method=name, budget=None if name == "full" else budget,
                args=bu.method_args(name, budget, t), prefill_s=bu.median(times[name]),
                prefill_ratio=bu.median(times[name]) / t_full, forward_s=t_fwd,
                full_prefill_over_forward=t_full / t_fwd, hook_s=None, hook_fraction=None,
            )
            if name != "full" and method.prefill_window() is None:
                capacity = method.capacity(gen.bucket_length(t), 1)
                work, q = _work_cache(method, config, capacity, t, model.dtype, seed=t)
                lengths = np.array([t])
                step_budget = jnp.asarray(per_example_budget(method, lengths))

                def hooks(method=method, capacity=capacity, work=work, q=q, step_budget=step_budget,
                          positions=positions):
                    return [_hook(method, capacity, config.num_layers, work, q, positions, step_budget, rope[0],
                                  jnp.int32(i)) for i in range(config.num_layers)]

                bu.block(hooks())
                row["hook_s"] = bu.median(bu.time_call(hooks, repeats))
                row["hook_fraction"] = row["hook_s"] / t_fwd
            rows.append(row)
            print(f"T={t:6d} {name:14s} prefill {row['prefill_s']*1e3:8.1f} ms  x{row['prefill_ratio']:.2f} of full"
                  + (f"  hook {row['hook_fraction']*100:6.1f}% of forward" if row["hook_fraction"] is not None
                     else ""), flush=True)
    return bu.write(args.out, "compression_overhead", args, config, dtype, rows)


if __name__ == "__main__":
    run(sys.argv[1:])
