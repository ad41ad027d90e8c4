"""The fused decode kernel against the XLA path inside an 8B-shaped decode loop (issue 57, item 2).

    python benchmarks/fused_decode.py --out=/tmp/fused_decode.json                  # GPU: 8B shape, 32K + 1K
    python benchmarks/fused_decode.py --quick --out=/tmp/fd.json                    # CPU: tiny, interpret mode

Two ways, at each `--contexts` and `--kv_dtypes` (model, int8, int4, kivi2, ...), for `--impls`:

* `runtime`: `kvjax.decode` itself on the cache (`full`), the runtime's XLA decode (the default tuning without
  `decode_append_attention`, which the GPU's default lists);
* `runtime_pallas`: `kvjax.decode` with the fused kernel forced on: `decode_append_attention` added to the tuning's
  `auto_pallas`, so every layer the kernel takes (`kvjax.runtime.step.fuses_decode`) runs RoPE, the in-place
  write and the attention as one `pallas_call` (the A/B that decides the GPU default; `throughput.py
  --tuning=auto_pallas=block_sparse_decode_attention+decode_append_attention` is the same switch);
* `xla` / `pallas`: this script's own decode loop over the model's weights, the op called directly (per layer the
  block's norm and fused q / k / v projection without RoPE, `kvjax.models.block.projections`, the op, the output
  projection, the MLP, each residual; greedy tokens in one jitted `while_loop` with the cache donated): its XLA
  path, the runtime's composition (RoPE, `append_token`, `decode_attention`), and the Triton kernel. The harness
  isolates the op from the runtime's other choices; its `xla` row should match `runtime`.

Each row: ms per token (median of `--repeats` loops after a compile), tokens/s, the bytes a step moves
(weights + the cache) against the device's read bandwidth, launches per step and per layer from the compiled
loop's HLO (`hlo_count.py`; on a GPU also its command-buffer regions: whether the Triton custom calls sit inside
them or split them); for `pallas`, its first step's logits and greedy tokens against `xla` on the same cache; for
`runtime_pallas`, its speed and greedy tokens against `runtime`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import bench_util as bu  # noqa: E402
import hlo_count  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import throughput  # noqa: E402

from kvjax import methods as kvm  # noqa: E402
from kvjax import tuning  # noqa: E402
from kvjax.cache import ModelCache  # noqa: E402
from kvjax.models import block  # noqa: E402
from kvjax.ops import fused_decode as fd  # noqa: E402
from kvjax.ops import norm as norm_ops  # noqa: E402

gen = importlib.import_module("kvjax.runtime.generate")
IMPLS = ("xla", "pallas", "runtime", "runtime_pallas")


def kernel_on() -> dict[str, Any]:
    """The tuning fields that force the fused kernel on in the runtime (`runtime_pallas`): the XLA path's with it."""
    return dict(auto_pallas=kernel_off()["auto_pallas"] | {fd.OP}, auto_fused_quantized=True)


def kernel_off() -> dict[str, Any]:
    """The tuning fields of the runtime's XLA path (`runtime`): neither the fused decode nor the RMSNorm kernel,
    which the GPU's default lists (run 13 measured both rows so)."""
    return dict(auto_pallas=tuning.current().auto_pallas - {fd.OP, norm_ops.OP})


def step(config: Any, impl: str, weights: dict, rope: Any, cache: ModelCache, tokens: Any, positions: Any
         ) -> tuple[Any, ModelCache]:
    """One token per example through every layer (unrolled): logits `[B, V]` and the cache."""
    x = block.embed(config, weights, tokens[:, None])
    pos = positions[:, None]
    for i, lw in enumerate(weights["layers"]):
        inv_freq, scaling = block.layer_rope(config, rope, i)
        q, k, v = block.projections(config, lw, block.norm(config, x, lw["attn_norm"]))
        attn, layer = fd.decode_append_attention(
            q, k, v, pos, cache.layer(i), inv_freq=inv_freq, scaling=scaling,
            query_scale=getattr(config, "query_scale", 1.0), implementation=impl)
        cache = cache.with_layer(i, layer)
        out = block.out_proj(lw, attn)
        if "post_attn_norm" in lw:
            out = block.norm(config, out, lw["post_attn_norm"])
        x = x + out
        out = block.mlp(lw, block.norm(config, x, lw["mlp_norm"]), getattr(config, "hidden_act", "silu"))
        if "post_mlp_norm" in lw:
            out = block.norm(config, out, lw["post_mlp_norm"])
        x = x + out
    return block.logits(config, weights, x[:, 0]), cache


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(6,))
def decode_loop(config: Any, impl: str, new: int, tune: tuning.Tuning, weights: dict, rope: Any, cache: ModelCache,
                first_logits: Any, start: Any) -> tuple[Any, ModelCache]:
    """`new` greedy tokens per example from `first_logits`, the first at positions `start` `[B]`."""
    batch = first_logits.shape[0]
    first = jnp.argmax(first_logits, axis=-1).astype(jnp.int32)
    out = jnp.zeros((batch, new), jnp.int32).at[:, 0].set(first)

    def body(carry: tuple) -> tuple:
        i, cache, out, prev = carry
        with tuning.use(tune):
            logits, cache = step(config, impl, weights, rope, cache, prev, start + i - 1)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return i + 1, cache, jax.lax.dynamic_update_index_in_dim(out, tok, i, axis=1), tok

    _, cache, out, _ = jax.lax.while_loop(lambda c: c[0] < new, body, (jnp.int32(1), cache, out, first))
    return out, cache


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def first_logits(config: Any, impl: str, tune: tuning.Tuning, weights: dict, rope: Any, cache: ModelCache,
                 tokens: Any, positions: Any) -> Any:
    """The logits of one step (no donation: the same cache serves both paths)."""
    with tuning.use(tune):
        return step(config, impl, weights, rope, cache, tokens, positions)[0]


def _state(model: Any, context: int, new: int, kv_dtype: str | None) -> Any:
    return throughput.synthetic_state(model, kvm.get("full"), 1, context, new, kv_dtype=kv_dtype)


def _loop_args(model: Any, state: Any) -> tuple:
    return model.weights(), model.rope(), state.cache, state.logits, jnp.asarray(state.prompt_lengths, jnp.int32)


def _launches(model: Any, impl: str, context: int, new: int, kv_dtype: str | None) -> dict[str, Any]:
    """Launches per step of the compiled loop, and per layer (against the model cut to one layer)."""
    def count(m: Any, details: bool = False) -> dict[str, Any]:
        state = _state(m, context, new, kv_dtype)
        if impl.startswith("runtime"):
            lowered = gen._decode_loop.lower(
                m.config, gen.decode_program_key(state.method), new, 0.0, 1.0, tuning.current(), m.weights(),
                m.rope(), state.cache, state.logits, np.asarray(state.prompt_lengths, np.int32), state.budget,
                np.asarray([-1], np.int32), np.int32(0), np.uint32(0))
        else:
            lowered = decode_loop.lower(m.config, impl, new, tuning.current(), *_loop_args(m, state))
        compiled, thunks = hlo_count.compile_with_thunks(lowered)
        text = compiled.as_text()
        counts = hlo_count.launches(text)
        if details:  # on a GPU the CUDA-graph regions come from the thunks (`thunks`), not the HLO (`graphs`)
            extra.update(graphs=hlo_count.graphs(text), thunks=thunks, strays=hlo_count.strays(text))
        return counts

    extra: dict[str, Any] = {}
    full = count(model, details=True)
    layers = model.config.num_layers
    one = count(bu.random_model(dataclasses.replace(model.config, num_layers=1), model.dtype))
    per_layer = {k: (full.get(k, 0) - one.get(k, 0)) / max(1, layers - 1) for k in set(full) | set(one)
                 if full.get(k, 0) != one.get(k, 0)}
    each = per_layer.pop("total", 0.0)
    return dict(launches_per_step=full["total"], launches_per_layer=each, launches_outside_layers=one["total"] - each,
                per_layer_by_kind=dict(sorted(per_layer.items(), key=lambda kv: -kv[1])), **extra)


def row(args: argparse.Namespace, model: Any, impl: str, context: int, kv_dtype: str | None,
        read: float | None, count: bool) -> dict[str, Any]:
    new = args.new_tokens
    out: dict[str, Any] = dict(impl=impl, context=context, kv_dtype=kv_dtype or "model", new_tokens=new)
    if impl in ("pallas", "runtime_pallas"):
        config = model.config
        layer = jax.eval_shape(lambda: gen.init_cache(kvm.get("full"), config, 1, 16, model.dtype, kv_dtype).layer(0))
        why = fd.kernel_unsupported(layer)
        if why:
            return dict(out, skipped=why)
    if count:
        out.update(_launches(model, impl, context, new, kv_dtype))

    def once() -> Any:
        state = _state(model, context, new, kv_dtype)
        bu.block(state.cache)
        moved.append(throughput.step_bytes(model, state.cache))  # before the decode donates the cache
        start = time.perf_counter()
        if impl.startswith("runtime"):
            tokens = gen.decode(model, state, max_new_tokens=new, stop_at_eos=False)[0]
        else:
            tokens = decode_loop(model.config, impl, new, tuning.current(), *_loop_args(model, state))[0]
        tokens = np.asarray(tokens)
        return time.perf_counter() - start, tokens

    moved: list[int] = []  # each call's bytes a step (no second cache allocated to count them)
    before = throughput.peak_bytes()
    first, tokens = once()
    times = [once()[0] for _ in range(args.repeats)]
    step_s = bu.median(times) / (new - 1)
    out.update(first_call_s=first, step_ms=step_s * 1e3, tokens_per_s=1.0 / step_s, bytes_per_step=moved[-1],
               tokens=tokens[0].tolist(), **throughput.row_peak(before, throughput.peak_bytes()))
    if read:
        out["fraction_of_read_bandwidth"] = moved[-1] / step_s / read
    return out


def _compare(model: Any, context: int, kv_dtype: str | None) -> dict[str, Any]:
    """The kernel's first-step logits against the XLA path's on the same cache."""
    state = _state(model, context, 2, kv_dtype)
    tokens = jnp.argmax(state.logits, axis=-1).astype(jnp.int32)
    positions = jnp.asarray(state.prompt_lengths, jnp.int32)
    args = (model.weights(), model.rope(), state.cache, tokens, positions)
    want = np.asarray(first_logits(model.config, "xla", tuning.current(), *args), np.float32)
    got = np.asarray(first_logits(model.config, "pallas", tuning.current(), *args), np.float32)
    return dict(logits_max_rel_err=float(np.abs(got - want).max() / max(1e-6, np.abs(want).max())),
                same_argmax=bool((got.argmax(-1) == want.argmax(-1)).all()))


def run(argv: list[str] | None = None) -> dict:
    p = bu.parser(__doc__.splitlines()[0])
    p.add_argument("--contexts", default=None, help="Cached tokens (32768,1024; quick 64).")
    p.add_argument("--kv_dtypes", default="model,int8",
                   help="Cache storages: model, int8, int4, kivi2 (any the kernel takes).")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"Comma list of {IMPLS}.")
    p.add_argument("--new_tokens", type=int, default=None, help="Tokens per timed loop (33; quick 4).")
    p.add_argument("--no_hlo", dest="hlo", action="store_false", help="Skip the launch counts (two compiles).")
    p.add_argument("--time_budget_s", type=float, default=1e9, help="Start no new row after this many seconds.")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    name, dtype, args.repeats = bu.resolve_common(args)
    args.model = name if args.model or args.quick else "llama-3.1-8b"
    args.new_tokens = args.new_tokens or (4 if args.quick else 33)
    contexts = bu.csv_ints(args.contexts or ("64" if args.quick else "32768,1024"))
    impls = bu.csv_strs(args.impls)
    unknown = set(impls) - set(IMPLS)
    if unknown:
        raise SystemExit(f"fused_decode.py: unknown impls {sorted(unknown)}; choose from {IMPLS}")
    kv_dtypes = [None if d == "model" else d for d in bu.csv_strs(args.kv_dtypes)]
    config = bu.model_config(args.model)
    if any(w is not None for w in config.layer_windows):
        raise SystemExit("fused_decode.py: a model without sliding-window layers (their rings append differently)")
    model = bu.random_model(config, dtype)
    read = None if args.quick else throughput.read_bandwidth(4096)
    deadline = time.monotonic() + args.time_budget_s
    rows: list[dict[str, Any]] = []
    result: dict = {}
    for context in contexts:
        for kv_dtype in kv_dtypes:
            for impl in impls:
                if time.monotonic() > deadline:
                    rows.append(dict(impl=impl, context=context, kv_dtype=kv_dtype or "model", skipped="time budget"))
                    continue
                try:
                    with tuning.override(**(kernel_on() if impl == "runtime_pallas" else kernel_off())):
                        r = row(args, model, impl, context, kv_dtype, read, args.hlo and context == contexts[0])
                    if impl == "pallas" and "skipped" not in r:
                        r.update(_compare(model, context, kv_dtype))
                except Exception as e:  # a kernel that fails to compile is a result, not a crash
                    r = dict(impl=impl, context=context, kv_dtype=kv_dtype or "model",
                             error=f"{type(e).__name__}: {str(e)[-1500:]}")
                against = "runtime" if impl == "runtime_pallas" else "xla"
                base = next((x for x in rows if x["impl"] == against and x["context"] == context
                             and x["kv_dtype"] == r["kv_dtype"] and "step_ms" in x), None)
                if base and "step_ms" in r and r is not base:
                    r[f"speedup_vs_{against}"] = base["step_ms"] / r["step_ms"]
                    r[f"same_tokens_as_{against}"] = r["tokens"] == base["tokens"]
                rows.append(r)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                                  if k not in ("tokens", "per_layer_by_kind", "strays", "graphs", "thunks")}),
                         flush=True)
                result = bu.write(args.out, "fused_decode", args, config, dtype, rows, read_bandwidth=read)
    if rows and "skipped" in rows[-1]:  # the rows the time budget left out, recorded
        result = bu.write(args.out, "fused_decode", args, config, dtype, rows, read_bandwidth=read)
    return result


if __name__ == "__main__":
    run()
