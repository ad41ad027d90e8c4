"""Accelerator run: kernels compiled vs XLA, decode-attention bandwidth, Llama-3-8B-shaped end to end.

    python benchmarks/accelerator.py --out=benchmarks/results/accelerator.json            # all parts
    python benchmarks/accelerator.py --parts=bandwidth,kernels --out=/tmp/acc_kernels.json
    python benchmarks/accelerator.py --parts=e2e --contexts=32768 --out=/tmp/acc_e2e32k.json
    python benchmarks/accelerator.py --smoke --out=/tmp/acc.json                           # CPU, seconds

Parts (`--parts`, comma list):

* `bandwidth`: the device's copy bandwidth, `2 x bytes / time` of a jitted elementwise pass over a
  `--copy_mib` buffer (median of `--repeats` runs after a warm-up).
* `kernels`: at each `--kernel_contexts` (8K, 32K, 128K) cached tokens with Llama-3-8B heads (32 query /
  8 KV heads of 128, bfloat16, batch 1), the kernel behind `implementation="pallas"` (the Triton kernels of
  `kvjax.pallas.gpu_attention` on a GPU, the Mosaic ones on a TPU, interpret mode on CPU) against the
  compiled XLA reference: the outputs compared (max error / max |reference|) and both timed (median of
  `--repeats` runs after warm-up); decode-attention bandwidth = K/V bytes read per step / time, against
  the measured copy bandwidth. Dense decode attention reads the whole cache; block-sparse reads sinks +
  local window + `--sparse_blocks` retrieved blocks of `--sparse_block` slots.
* `tune`: the GPU dense decode kernel's knobs (`block_k` 32 / 64 / 128, `num_warps` 4 / 8, `num_stages`
  1 / 2 / 3, `num_splits` auto / 64) at `--tune_context` (32K) cached tokens, each compared and timed.
* `prefill`: `prefill_attention` of a `--prefill_contexts` (8K, 32K) prompt over its own keys with the
  same heads: the blockwise XLA path against `implementation="dot_product_attention"` (cuDNN on an NVIDIA
  GPU), compared and timed (median of `--prefill_op_repeats`), with TFLOP/s of the causal attention.
* `e2e`: `kvjax.prefill` + `kvjax.decode` on random Llama-3-8B-shaped bf16 weights drawn on the device
  (no download) at each `--contexts` (32K, 128K) for each `--methods`: prefill seconds (first call, with
  compilation, and a second timed call), decode tokens/s (median over `--e2e_repeats`), speedup over `full`
  beside the ideal of a memory-bound step (weights + allocated K/V bytes), peak device memory. With
  `--isolate` (default off CPU) each row runs in its own process so the peak is that row's.
  `--attention=pallas` makes `implementation="auto"` pick the decode-attention kernel inside the model.

The JSON is rewritten after every row, so a run cut short keeps what it measured; `--time_budget_s`
stops starting new rows (default 480 s: one 10-minute device command). `report.py` renders it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import subprocess
import sys
import time
from typing import Any

# Each end-to-end row may run in a child process: the parent must not preallocate the accelerator's memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import bench_util as bu  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvjax import methods as kvm  # noqa: E402
from kvjax import tuning  # noqa: E402
from kvjax.errors import ConfigError  # noqa: E402
from kvjax.ops import _impl  # noqa: E402
from kvjax.ops import attention as attn_ops  # noqa: E402
from kvjax.ops import sparse_attention as sparse_ops  # noqa: E402

gen = importlib.import_module("kvjax.runtime.generate")

PARTS = ("bandwidth", "kernels", "tune", "prefill", "e2e")
E2E_METHODS = ("full", "snapkv", "streaming_llm", "sagekv", "lagkv", "ahakv", "actqkv")


def _median_time(fn: Any, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        bu.block(fn())
    return bu.median(bu.time_call(fn, repeats))


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def copy_bandwidth(mib: int, repeats: int) -> dict[str, Any]:
    """Bytes moved per second by an elementwise pass (read + write) over `mib` MiB of float32."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.5 + 1.0)
    t = _median_time(lambda: f(x), repeats)
    return dict(copy_mib=mib, seconds=t, bytes_per_s=2 * x.nbytes / t)


@dataclasses.dataclass
class Heads:
    q: int = 32
    kv: int = 8
    dim: int = 128


def _attention_inputs(heads: Heads, context: int, dtype: Any, seed: int = 0) -> tuple:
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (1, heads.q, heads.dim), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (1, heads.kv, context, heads.dim), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (1, heads.kv, context, heads.dim), jnp.float32).astype(dtype)
    pos = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (1, heads.kv, context))
    valid = jnp.ones((1, heads.kv, context), bool)
    return q, jnp.asarray([context - 1], jnp.int32), k, v, pos, valid


def _sparse_plan(heads: Heads, context: int, block: int, blocks: int, sink: int, local: int) -> tuple:
    """Sinks `[0, sink)`, local window `[context - local, context)`, `blocks` distinct retrieved blocks between."""
    middle = np.arange(sink, context - local - block + 1, block)
    rng = np.random.default_rng(context)
    picks = np.stack([np.sort(rng.choice(middle, min(blocks, len(middle)), replace=False)) for _ in range(heads.kv)])
    starts = jnp.asarray(picks[None], jnp.int32)
    ranges = jnp.asarray(np.broadcast_to([[0, sink], [context - local, context]], (1, heads.kv, 2, 2)), jnp.int32)
    return starts, jnp.full((1, heads.kv), picks.shape[1], jnp.int32), ranges, sink + local + picks.shape[1] * block


def _kv_bytes(heads: Heads, dtype: Any, slots: int) -> int:
    """K + V bytes of `slots` cached tokens (all KV heads): what one decode step reads over them."""
    return slots * 2 * heads.kv * heads.dim * jnp.dtype(dtype).itemsize


def _rel_err(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - want).max() / max(1e-6, np.abs(want).max()))


def _in_loop_ms(layers: int, heads: Heads, context: int, dtype: Any, ref_fn: Any, kernel_fn: Any,
                op_args: tuple) -> dict[str, float]:
    """Per-layer ms of the op inside one jitted program over `layers` K / V caches in buffers of their own, as
    the model's decode step runs it (its layers unrolled, each reading its own layer's buffers where they lie):
    no Python dispatch per call, and any copy the compiler makes of a layer's K / V shows as a slower layer."""
    keys = jax.random.split(jax.random.key(layers), 2 * layers)
    shape = (1, heads.kv, context, heads.dim)
    # Drawn in the cache dtype: no float32 copy of every layer.
    ks = tuple(jax.random.normal(keys[2 * i], shape, dtype) for i in range(layers))
    vs = tuple(jax.random.normal(keys[2 * i + 1], shape, dtype) for i in range(layers))
    out = {}
    for label, fn in (("xla", ref_fn), ("kernel", kernel_fn)):
        def every_layer(ks: tuple, vs: tuple, fn: Any = fn) -> list:
            return [fn(op_args[0], op_args[1], k, v, *op_args[4:]) for k, v in zip(ks, vs, strict=True)]

        run = jax.jit(every_layer)
        out[f"loop_{label}_ms"] = _median_time(lambda r=run: r(ks, vs), 3) * 1e3 / layers
    return out


def kernel_rows(args: argparse.Namespace, heads: Heads, dtype: Any, copy_bps: float | None) -> list[dict]:
    tol = 2e-2 if jnp.dtype(dtype).itemsize == 2 else 1e-4
    rows = []
    for context in bu.csv_ints(args.kernel_contexts):
        inputs = _attention_inputs(heads, context, dtype)
        starts, count, ranges, attended = _sparse_plan(heads, context, args.sparse_block, args.sparse_blocks,
                                                       args.sparse_sink, min(args.sparse_local, context // 4))
        ops = {
            "decode_attention": (functools.partial(attn_ops.decode_attention, implementation="xla"),
                                 functools.partial(attn_ops.decode_attention, implementation="pallas"),
                                 inputs, context),
            "block_sparse_decode_attention": (
                functools.partial(sparse_ops.block_sparse_decode_attention, block_size=args.sparse_block,
                                  implementation="xla"),
                functools.partial(sparse_ops.block_sparse_decode_attention, block_size=args.sparse_block,
                                  implementation="pallas"),
                (*inputs, starts, count, ranges), attended),
        }
        for name, (ref_fn, kernel_fn, op_args, slots) in ops.items():
            ref, kern = jax.jit(ref_fn), jax.jit(kernel_fn)
            row: dict[str, Any] = dict(op=name, context=context, dtype=jnp.dtype(dtype).name, q_heads=heads.q,
                                       kv_heads=heads.kv, head_dim=heads.dim, attended_tokens=slots,
                                       kv_bytes_read=_kv_bytes(heads, dtype, slots))
            if name == "block_sparse_decode_attention" and jax.default_backend() not in ("gpu", "cpu"):
                rows.append(dict(row, skipped="Triton kernel only: it would run interpreted here"))
                continue
            try:
                err = _rel_err(kern(*op_args), ref(*op_args))
                row.update(max_rel_err=err, tolerance=tol, equal=err <= tol)
                row["xla_ms"] = _median_time(lambda f=ref, a=op_args: f(*a), args.repeats) * 1e3
                row["kernel_ms"] = _median_time(lambda f=kern, a=op_args: f(*a), args.repeats) * 1e3
            except Exception as e:  # a kernel that fails to compile is a result, not a crash
                row.update(error=f"{type(e).__name__}: {str(e)[:2000]}", equal=False)
                rows.append(row)
                print(f"T={context:7d} {name:30s} FAILED {row['error'][:300]}", flush=True)
                continue
            row["speedup"] = row["xla_ms"] / row["kernel_ms"]
            if args.loop_layers:
                row.update(_in_loop_ms(args.loop_layers, heads, context, dtype, ref_fn, kernel_fn, op_args))
            row["kernel_bytes_per_s"] = row["kv_bytes_read"] / (row["kernel_ms"] * 1e-3)
            row["kernel_copy_fraction"] = None if not copy_bps else row["kernel_bytes_per_s"] / copy_bps
            rows.append(row)
            frac = "" if not copy_bps else f" = {100 * row['kernel_copy_fraction']:.0f}% of copy"
            loop = ""
            if "loop_kernel_ms" in row:
                row["loop_kernel_bytes_per_s"] = row["kv_bytes_read"] / (row["loop_kernel_ms"] * 1e-3)
                row["loop_kernel_copy_fraction"] = None if not copy_bps else row["loop_kernel_bytes_per_s"] / copy_bps
                loop = (f"; over {args.loop_layers} per-layer buffers: xla {row['loop_xla_ms']:.3f} kernel "
                        f"{row['loop_kernel_ms']:.3f} ms/layer {row['loop_kernel_bytes_per_s'] / 1e9:.1f} GB/s")
            print(f"T={context:7d} {name:30s} err {err:.1e} xla {row['xla_ms']:.3f} ms kernel "
                  f"{row['kernel_ms']:.3f} ms (x{row['speedup']:.2f}) {row['kernel_bytes_per_s'] / 1e9:.1f} GB/s{frac}"
                  + loop, flush=True)
    return rows


def tune_rows(args: argparse.Namespace, heads: Heads, dtype: Any, copy_bps: float | None) -> list[dict]:
    """The GPU dense decode kernel's knobs (`block_k`, `num_warps`, `num_stages`, `num_splits`) at
    `--tune_context` cached tokens: each setting compared with XLA and timed. GPU only."""
    if jax.default_backend() != "gpu" and not args.smoke:
        return [dict(skipped="the Triton kernel's knobs are tuned on a GPU only")]
    from kvjax.pallas import gpu_attention

    context = args.tune_context
    inputs = _attention_inputs(heads, context, dtype)
    want = jax.jit(functools.partial(attn_ops.decode_attention, implementation="xla"))(*inputs)
    kv_bytes = _kv_bytes(heads, dtype, context)
    rows = []
    grid = ((32,), (4,), (1, 2), (None,)) if args.smoke else ((32, 64, 128), (4, 8), (1, 2, 3), (None, 64))
    for block_k in grid[0]:
        for num_warps in grid[1]:
            for num_stages in grid[2]:
                for num_splits in grid[3]:
                    knobs = dict(block_k=block_k, num_warps=num_warps, num_stages=num_stages, num_splits=num_splits)
                    row: dict[str, Any] = dict(op="decode_attention", context=context, **knobs)
                    fn = jax.jit(functools.partial(gpu_attention.decode_attention, **knobs,
                                                   interpret=True if args.smoke else None))
                    try:
                        row["max_rel_err"] = _rel_err(fn(*inputs), want)
                        row["kernel_ms"] = _median_time(lambda f=fn: f(*inputs), args.repeats) * 1e3
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        rows.append(row)
                        print(f"tune {knobs} FAILED {row['error'][:200]}", flush=True)
                        continue
                    row["kernel_bytes_per_s"] = kv_bytes / (row["kernel_ms"] * 1e-3)
                    row["kernel_copy_fraction"] = None if not copy_bps else row["kernel_bytes_per_s"] / copy_bps
                    rows.append(row)
                    print(f"tune {knobs} err {row['max_rel_err']:.1e} {row['kernel_ms']:.3f} ms "
                          f"{row['kernel_bytes_per_s'] / 1e9:.0f} GB/s", flush=True)
    return rows


def prefill_rows(args: argparse.Namespace, heads: Heads, dtype: Any) -> list[dict]:
    """`prefill_attention` of a `T`-token prompt over its own keys: the blockwise XLA path against
    `jax.nn.dot_product_attention` (cuDNN on an NVIDIA GPU), compared and timed; decides its "auto"."""
    rows = []
    for t in bu.csv_ints(args.prefill_contexts):
        keys = jax.random.split(jax.random.key(t), 3)
        q = jax.random.normal(keys[0], (1, t, heads.q, heads.dim), jnp.float32).astype(dtype)
        k = jax.random.normal(keys[1], (1, heads.kv, t, heads.dim), jnp.float32).astype(dtype)
        v = jax.random.normal(keys[2], (1, heads.kv, t, heads.dim), jnp.float32).astype(dtype)
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        k_pos = jnp.broadcast_to(pos[:, None], (1, heads.kv, t))
        op_args = (q, pos, k, v, k_pos, jnp.ones((1, heads.kv, t), bool))
        # Causal attention FLOPs: QK^T and PV over the lower triangle.
        flops = 2 * 2 * heads.q * heads.dim * t * (t + 1) / 2
        ref = jax.jit(functools.partial(attn_ops.prefill_attention, implementation="xla"))
        row: dict[str, Any] = dict(op="prefill_attention", context=t, dtype=jnp.dtype(dtype).name, q_heads=heads.q,
                                   kv_heads=heads.kv, head_dim=heads.dim, flops=flops)
        try:
            want = ref(*op_args)
            row["xla_ms"] = _median_time(lambda f=ref, a=op_args: f(*a), args.prefill_op_repeats, warmup=1) * 1e3
        except Exception as e:
            rows.append(dict(row, error=f"xla: {type(e).__name__}: {str(e)[:1500]}"))
            print(f"T={t:7d} prefill_attention xla FAILED {rows[-1]['error'][:300]}", flush=True)
            continue
        fused = jax.jit(functools.partial(attn_ops.prefill_attention, implementation="dot_product_attention"))
        try:
            err = _rel_err(fused(*op_args), want)
            row.update(max_rel_err=err, tolerance=2e-2, equal=err <= 2e-2)
            row["fused_ms"] = _median_time(lambda f=fused, a=op_args: f(*a), args.prefill_op_repeats,
                                           warmup=1) * 1e3
            row["speedup"] = row["xla_ms"] / row["fused_ms"]
        except Exception as e:
            row.update(error=f"dot_product_attention: {type(e).__name__}: {str(e)[:1500]}", equal=False)
        # The one-shot prefill's mask-free path: one causal call with sequence lengths (`causal_prefix_attention`).
        causal = jax.jit(functools.partial(attn_ops.causal_prefix_attention, implementation="dot_product_attention"))
        causal_args = (q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), jnp.asarray([t], jnp.int32))
        try:
            row["causal_max_rel_err"] = _rel_err(causal(*causal_args), want)
            row["causal_equal"] = row["causal_max_rel_err"] <= 2e-2
            row["causal_ms"] = _median_time(lambda f=causal, a=causal_args: f(*a), args.prefill_op_repeats,
                                            warmup=1) * 1e3
            row["causal_tflops"] = flops / (row["causal_ms"] * 1e-3) / 1e12
        except Exception as e:
            row.update(causal_error=f"{type(e).__name__}: {str(e)[:1500]}", causal_equal=False)
        row["xla_tflops"] = flops / (row["xla_ms"] * 1e-3) / 1e12
        if "fused_ms" in row:
            row["fused_tflops"] = flops / (row["fused_ms"] * 1e-3) / 1e12
        rows.append(row)
        causal_text = (f"; one causal call {row['causal_ms']:.1f} ms ({row['causal_tflops']:.0f} TFLOP/s) err "
                       f"{row['causal_max_rel_err']:.1e}" if "causal_ms" in row
                       else f"; one causal call FAILED {row['causal_error'][:300]}")
        print(f"T={t:7d} prefill_attention xla {row['xla_ms']:.1f} ms ({row['xla_tflops']:.0f} TFLOP/s) "
              + (f"dot_product_attention {row['fused_ms']:.1f} ms (x{row['speedup']:.2f}) err {err:.1e}"
                 if "fused_ms" in row else f"dot_product_attention FAILED {row['error'][:300]}") + causal_text,
              flush=True)
    return rows


def e2e_row(args: argparse.Namespace, model: Any, name: str, context: int) -> dict[str, Any]:
    """Prefill + decode of one method at one context on `model` (random weights)."""
    new = args.new_tokens
    method = kvm.get(name, **bu.method_args(name, args.budget, context))
    chunked = method.compresses and method.prefill_window() is None
    ids = np.random.default_rng(context).integers(0, model.config.vocab_size, (1, context))

    def prefill() -> Any:
        return gen.prefill(model, ids, method=method, max_new_tokens=new,
                           chunk_size=args.chunk_size if chunked else None)

    start = time.perf_counter()
    try:
        state = prefill()
    except ConfigError:  # e.g. lagkv with a global budget compresses the whole prompt at once
        chunked = False
        start = time.perf_counter()
        state = prefill()
    bu.block(state.cache)
    first = time.perf_counter() - start
    timed = None
    if args.prefill_repeats:
        del state
        timed = bu.median(bu.time_call(lambda: prefill().cache, args.prefill_repeats))
        state = prefill()
        bu.block(state.cache)

    def fresh() -> Any:
        s = dataclasses.replace(state, cache=jax.tree.map(jnp.copy, state.cache))
        bu.block(s.cache)
        return s

    s = fresh()
    start = time.perf_counter()
    bu.block(gen.decode(model, s, max_new_tokens=new, stop_at_eos=False)[2])  # compile + one run
    decode_first = time.perf_counter() - start
    times = []
    for _ in range(args.e2e_repeats):
        s = fresh()
        times += bu.time_call(lambda s=s: gen.decode(model, s, max_new_tokens=new, stop_at_eos=False)[2], 1)
    step = bu.median(times) / (new - 1)
    return dict(method=name, context=context, budget=None if name == "full" else args.budget, new_tokens=new,
                prefill_mode="chunked" if chunked else "one_shot", prefill_first_s=first, prefill_s=timed,
                decode_first_s=decode_first,
                step_ms=step * 1e3, tokens_per_s=1.0 / step, cache_capacity=int(state.cache.capacity),
                kv_bytes_per_step=sum(int(layer.k.nbytes + layer.v.nbytes) for layer in state.cache.layers),
                weight_bytes=bu.weight_bytes(model), peak_bytes=peak_bytes())


def _with_ratios(rows: list[dict]) -> list[dict]:
    """Speedup over `full` at the same context and the memory-bound ideal (weights + K/V bytes per step)."""
    full = {r["context"]: r for r in rows if r["method"] == "full" and "step_ms" in r}
    for r in rows:
        f = full.get(r["context"])
        if f is None or "step_ms" not in r:
            continue
        r["speedup"] = f["step_ms"] / r["step_ms"]
        r["ideal_speedup"] = (f["weight_bytes"] + f["kv_bytes_per_step"]) / (r["weight_bytes"] + r["kv_bytes_per_step"])
    return rows


#: The `kvjax.tuning.override`s `_set_attention` enters, held open for the process.
_TUNING = contextlib.ExitStack()


def _set_attention(choice: str, causal_prefill: bool = False, masked_prefill: bool = False) -> None:
    """`--attention=pallas`: `implementation="auto"` picks the decode-attention kernel on this backend;
    `--causal_prefill`: a one-shot prefill takes one causal fused call per layer (tuning `auto_causal_prefix`);
    `--masked_prefill`: it does not (the per-block masked path, the GPU default before run 6). The tuning
    overrides stay entered for the rest of the process (`_TUNING`)."""
    if causal_prefill:
        _TUNING.enter_context(tuning.override(auto_causal_prefix=True))
    if masked_prefill:
        _TUNING.enter_context(tuning.override(auto_causal_prefix=False))
    if choice == "pallas":
        _TUNING.enter_context(tuning.override(auto_pallas=tuning.current().auto_pallas | {"decode_attention"}))


def _model(args: argparse.Namespace) -> Any:
    return bu.random_model(bu.model_config(args.model), args.dtype)


def _one_e2e(args: argparse.Namespace) -> None:
    """Child process of `--isolate`: one row, printed as JSON on the last line."""
    _set_attention(args.attention, args.causal_prefill, args.masked_prefill)
    row = e2e_row(args, _model(args), args.one_method, args.one_context)
    print("ROW " + json.dumps(row), flush=True)


def e2e_rows(args: argparse.Namespace, argv: list[str], deadline: float, sink: Any) -> list[dict]:
    rows: list[dict] = []
    model = None
    for context in bu.csv_ints(args.contexts):
        for name in bu.csv_strs(args.methods):
            if time.monotonic() > deadline:
                rows.append(dict(method=name, context=context, skipped="time budget"))
                continue
            try:
                if args.isolate:
                    cmd = [sys.executable, os.path.abspath(__file__), *argv, f"--one_method={name}",
                           f"--one_context={context}"]
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1, deadline -
                                          time.monotonic() + 60))
                    lines = [x for x in proc.stdout.splitlines() if x.startswith("ROW ")]
                    if proc.returncode or not lines:
                        raise RuntimeError(f"child exit {proc.returncode}: {proc.stderr[-1500:]}")
                    row = json.loads(lines[-1][4:])
                else:
                    model = model or _model(args)
                    row = e2e_row(args, model, name, context)
            except Exception as e:  # out of memory, compile failure, child timeout: recorded, run goes on
                row = dict(method=name, context=context, error=f"{type(e).__name__}: {str(e)[-1500:]}")
            rows.append(row)
            _with_ratios(rows)
            sink(rows)
            if "error" in row:
                print(f"T={context:7d} {name:14s} FAILED {row['error'][:300]}", flush=True)
            else:
                print(f"T={context:7d} {name:14s} prefill {row['prefill_first_s']:.1f} s (first) "
                      f"{row['tokens_per_s']:.1f} tok/s x{row.get('speedup', float('nan')):.2f} "
                      f"(ideal x{row.get('ideal_speedup', float('nan')):.2f}) peak "
                      f"{(row['peak_bytes'] or 0) / 2**30:.1f} GiB", flush=True)
    return rows


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write (directories are created).")
    p.add_argument("--smoke", action="store_true", help="Tiny shapes and model: checks the script on CPU.")
    p.add_argument("--parts", default=",".join(PARTS), help=f"Comma list of {PARTS}.")
    p.add_argument("--repeats", type=int, default=None, help="Timed runs per measurement (30; smoke 2).")
    p.add_argument("--copy_mib", type=int, default=None, help="Copy-bandwidth buffer (1024 MiB; smoke 4).")
    p.add_argument("--kernel_contexts", default=None, help="Cached tokens for the kernels (8192,32768,131072).")
    p.add_argument("--sparse_block", type=int, default=64, help="Retrieved block size, slots (power of two).")
    p.add_argument("--sparse_blocks", type=int, default=None, help="Retrieved blocks per KV head (32; smoke 2).")
    p.add_argument("--sparse_sink", type=int, default=None, help="Sink slots always attended (128; smoke 16).")
    p.add_argument("--sparse_local", type=int, default=None, help="Local-window slots (2048; smoke 32).")
    p.add_argument("--loop_layers", type=int, default=None,
                   help="Also time each kernel per layer inside one program over this many per-layer caches, as "
                        "the decode step runs it (32; 0: off).")
    p.add_argument("--tune_context", type=int, default=None, help="Tokens of the `tune` part (32768; smoke 128).")
    p.add_argument("--prefill_contexts", default=None, help="Prompts of the prefill part (8192,32768; smoke 256).")
    p.add_argument("--prefill_op_repeats", type=int, default=None, help="Timed runs per prefill op (5; smoke 1).")
    p.add_argument("--contexts", default=None, help="End-to-end prompt lengths (32768,131072; smoke 128).")
    p.add_argument("--methods", default=",".join(E2E_METHODS), help="End-to-end methods.")
    p.add_argument("--budget", type=int, default=None, help="KV budget of the compressing methods (1024; smoke 32).")
    p.add_argument("--new_tokens", type=int, default=None, help="Tokens per timed decode (33; smoke 5).")
    p.add_argument("--chunk_size", type=int, default=None, help="Chunked-prefill chunk (2048; smoke 32).")
    p.add_argument("--prefill_repeats", type=int, default=1, help="Timed prefills after the first (0: first only).")
    p.add_argument("--e2e_repeats", type=int, default=None, help="Timed decodes per end-to-end row (5; smoke 1).")
    p.add_argument("--model", default=None, help="Preset (llama-3.1-8b) or tiny / small (smoke: tiny).")
    p.add_argument("--dtype", default="bfloat16", help="Weights, cache and kernel dtype.")
    p.add_argument("--attention", default="auto", choices=("auto", "pallas"),
                   help="pallas: the model's decode attention runs the kernel (tuning auto_pallas overridden).")
    p.add_argument("--causal_prefill", action="store_true",
                   help="One-shot prefills through one causal fused attention call per layer (no mask; the GPU "
                        "default).")
    p.add_argument("--masked_prefill", action="store_true",
                   help="One-shot prefills through the per-block masked path (`auto` without the causal call).")
    p.add_argument("--isolate", default=None, choices=("yes", "no"),
                   help="Each end-to-end row in its own process (clean peak memory); default yes off CPU.")
    p.add_argument("--time_budget_s", type=float, default=480.0, help="Start no new row after this many seconds.")
    p.add_argument("--one_method", default=None, help=argparse.SUPPRESS)
    p.add_argument("--one_context", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    smoke = args.smoke
    pick = lambda value, full, small: value if value is not None else (small if smoke else full)  # noqa: E731
    args.repeats = pick(args.repeats, 30, 2)
    args.e2e_repeats = pick(args.e2e_repeats, 5, 1)
    args.copy_mib = pick(args.copy_mib, 1024, 4)
    args.kernel_contexts = pick(args.kernel_contexts, "8192,32768,131072", "128,256")
    args.sparse_blocks = pick(args.sparse_blocks, 32, 2)
    args.sparse_sink = pick(args.sparse_sink, 128, 16)
    args.sparse_local = pick(args.sparse_local, 2048, 32)
    args.contexts = pick(args.contexts, "32768,131072", "128")
    args.loop_layers = pick(args.loop_layers, 32, 2)
    args.tune_context = pick(args.tune_context, 32768, 128)
    args.prefill_contexts = pick(args.prefill_contexts, "8192,32768", "256")
    args.prefill_op_repeats = pick(args.prefill_op_repeats, 5, 1)
    args.budget = pick(args.budget, 1024, 32)
    args.new_tokens = pick(args.new_tokens, 33, 5)
    args.chunk_size = pick(args.chunk_size, 2048, 32)
    args.model = pick(args.model, "llama-3.1-8b", "tiny")
    if smoke:
        args.sparse_block = min(args.sparse_block, 16)
        args.prefill_repeats = min(args.prefill_repeats, 1)
    args.isolate = (args.isolate or ("no" if jax.default_backend() == "cpu" else "yes")) == "yes"
    return args


def run(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.one_method:
        _one_e2e(args)
        return {}
    deadline = time.monotonic() + args.time_budget_s
    parts = bu.csv_strs(args.parts)
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"accelerator.py: unknown parts {sorted(unknown)}; choose from {PARTS}")
    heads = Heads(q=8, kv=2, dim=64) if args.smoke else Heads()
    config = bu.model_config(args.model)
    result: dict[str, Any] = dict(benchmark="accelerator", machine=bu.machine(), argv=argv, smoke=args.smoke,
                                  model=dict(name=args.model, dtype=args.dtype, **{k: getattr(config, k) for k in (
                                      "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                                      "head_dim", "vocab_size")}),
                                  attention=args.attention,
                                  causal_prefill=args.causal_prefill, masked_prefill=args.masked_prefill,
                                  kernel_heads=dataclasses.asdict(heads), bandwidth=None,
                                  kernels=[], tune=[], prefill=[], e2e=[],
                                  # Pallas ops this script does not time (no GPU variant; on a TPU their Mosaic
                                  # kernels are tested by tests/pallas, not measured here).
                                  not_measured=sorted(_impl.PALLAS_OPS - {"decode_attention",
                                                                          "block_sparse_decode_attention"}))

    def write(**update: Any) -> None:
        result.update(update)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=bu._jsonable)

    copy_bps = None
    if "bandwidth" in parts:
        bw = copy_bandwidth(args.copy_mib, args.repeats)
        copy_bps = bw["bytes_per_s"]
        print(f"copy bandwidth {copy_bps / 1e9:.1f} GB/s ({args.copy_mib} MiB)", flush=True)
        write(bandwidth=bw)
    if "kernels" in parts:
        write(kernels=kernel_rows(args, heads, jnp.dtype(args.dtype), copy_bps))
    if "tune" in parts:
        write(tune=tune_rows(args, heads, jnp.dtype(args.dtype), copy_bps))
    if "prefill" in parts:
        write(prefill=prefill_rows(args, heads, jnp.dtype(args.dtype)))
    if "e2e" in parts:
        _set_attention(args.attention, args.causal_prefill, args.masked_prefill)
        child = [a for a in argv if not a.startswith(("--parts", "--out", "--isolate", "--time_budget_s"))]
        e2e_rows(args, child + ["--parts=e2e", f"--out={args.out}.child"], deadline, lambda rows: write(e2e=rows))
    write()
    return result


if __name__ == "__main__":
    run()
