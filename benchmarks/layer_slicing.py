"""Does the compiler copy each layer's slice of the stacked weights and K / V inside the layer scan?

    python benchmarks/layer_slicing.py --out=/tmp/layer_slicing.json --hlo_dir=/tmp/hlo    # on a GPU
    python benchmarks/layer_slicing.py --smoke --out=/tmp/layer_slicing.json              # CPU, seconds

Until issue 43, kvjax stacked every layer's weights and cache on a leading `[L]` axis and ran the layers in a
`lax.scan`; this study is what moved it to per-layer buffers (`separate` below, now the model's layout), and it
stays to check that choice on new hardware or compilers. A decode step is memory-bound: it should take (weight
bytes + K/V bytes) / bandwidth. If the compiler materializes each layer's slice before the dot or kernel that
reads it (a copy: read + write), the step moves about three times those bytes. This script times the two halves
of a Llama-3-8B-shaped decode step (bfloat16, batch 1) in a jitted loop over `--layers` layers, laid out four
ways:

* `scan_xs`: the stack as the scan's `xs` (sliced per iteration), as the stacked layout held the weights;
* `scan_carry`: the stack in the carry, indexed with the layer id, as the stacked decode step read the cache;
* `unrolled`: the `scan_xs` loop with `unroll=True` (static slices);
* `separate`: a Python loop over `--layers` separate arrays, one buffer per layer (no slicing at all).

(`in_place`, the stack handed whole to `decode_attention(layer=i)`, went with that argument: with one buffer per
layer no kernel reads a stacked cache; its measurements are in BENCHMARKS.md.)

Parts: `mlp` (the SwiGLU MLP, x `[1, hidden]` against the stacked gate / up / down matrices) and
`attention` (decode attention, XLA reference and the Pallas kernel, over `--contexts` cached tokens).
Reported: ms per step and the effective bandwidth (bytes the step must read / time), against a copy.
`--hlo_dir` keeps each compiled program's HLO text, to read which copies the compiler made.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import time
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import bench_util as bu  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from accelerator import copy_bandwidth  # noqa: E402

from kvjax.ops import attention as attn_ops  # noqa: E402

LAYOUTS = ("scan_xs", "scan_carry", "unrolled", "separate")


def _time(fn: Any, args: tuple, repeats: int) -> float:
    """Median wall seconds of `fn(*args)` after one warm-up call."""
    jax.block_until_ready(fn(*args))
    return bu.median(bu.time_call(lambda: fn(*args), repeats))


def _loop(layout: str, layer_fn: Any, stacks: tuple, x: Any) -> Any:
    """A jitted function running `layer_fn(x, *layer_arrays) -> x` over every layer in `layout`."""
    if layout == "separate":
        def run(x: Any, *per_layer: Any) -> Any:
            for arrays in zip(*per_layer, strict=True):  # one separate buffer per layer and array
                x = layer_fn(x, *arrays)
            return x
        return jax.jit(run)
    if layout == "scan_carry":
        def run(x: Any, *stack: Any) -> Any:
            def body(carry: Any, i: Any) -> tuple:
                x, stack = carry
                arrays = [jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in stack]
                return (layer_fn(x, *arrays), stack), None
            n = stack[0].shape[0]
            return jax.lax.scan(body, (x, stack), jnp.arange(n, dtype=jnp.int32))[0][0]
        return jax.jit(run)
    unroll = layout == "unrolled"

    def run(x: Any, *stack: Any) -> Any:
        return jax.lax.scan(lambda x, arrays: (layer_fn(x, *arrays), None), x, stack, unroll=unroll)[0]
    return jax.jit(run)


def _args(layout: str, stacks: tuple, x: Any) -> tuple:
    if layout == "separate":
        return (x, *[list(a) for a in stacks])  # list(a): L separate device arrays
    return (x, *stacks)


def _measure(part: str, label: str, layer_fn: Any, stacks: tuple, x: Any, bytes_per_step: int,
             args: argparse.Namespace, copy_bps: float | None) -> list[dict]:
    rows = []
    for layout in bu.csv_strs(args.layouts):
        fn = _loop(layout, layer_fn, stacks, x)
        call_args = _args(layout, stacks, x)
        row: dict[str, Any] = dict(part=part, variant=label, layout=layout, layers=args.layers,
                                   bytes_per_step=bytes_per_step)
        try:
            if args.hlo_dir:
                text = fn.lower(*call_args).compile().as_text()
                path = pathlib.Path(args.hlo_dir) / f"{part}_{label}_{layout}.hlo.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                row["hlo_copies"] = text.count(" copy(") + text.count("copy-start(")
            ms = _time(fn, call_args, args.repeats) * 1e3
        except Exception as e:  # a layout that fails is a result, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"{part:9s} {label:12s} {layout:10s} FAILED {row['error'][:200]}", flush=True)
            rows.append(row)
            continue
        row.update(ms=ms, bytes_per_s=bytes_per_step / (ms * 1e-3))
        row["copy_fraction"] = None if not copy_bps else row["bytes_per_s"] / copy_bps
        frac = "" if not copy_bps else f" = {100 * row['copy_fraction']:.0f}% of copy"
        print(f"{part:9s} {label:12s} {layout:10s} {ms:8.3f} ms {row['bytes_per_s'] / 1e9:7.1f} GB/s{frac}",
              flush=True)
        rows.append(row)
    return rows


def mlp_rows(args: argparse.Namespace, copy_bps: float | None) -> list[dict]:
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 4)
    h, f, n = args.hidden, args.intermediate, args.layers
    gate = (0.02 * jax.random.normal(keys[0], (n, h, f), dtype)).astype(dtype)
    up = (0.02 * jax.random.normal(keys[1], (n, h, f), dtype)).astype(dtype)
    down = (0.02 * jax.random.normal(keys[2], (n, f, h), dtype)).astype(dtype)
    x = jax.random.normal(keys[3], (1, h), dtype)

    def layer(x: Any, wg: Any, wu: Any, wd: Any) -> Any:
        return x + (jax.nn.silu(x @ wg) * (x @ wu)) @ wd

    nbytes = gate.nbytes + up.nbytes + down.nbytes
    return _measure("mlp", f"{h}x{f}", layer, (gate, up, down), x, nbytes, args, copy_bps)


def attention_rows(args: argparse.Namespace, copy_bps: float | None) -> list[dict]:
    dtype = jnp.bfloat16
    rows = []
    qh, kvh, d, n = args.q_heads, args.kv_heads, args.head_dim, args.layers
    for context in bu.csv_ints(args.contexts):
        keys = jax.random.split(jax.random.key(context), 3)
        ks = jax.random.normal(keys[0], (n, 1, kvh, context, d), dtype)
        vs = jax.random.normal(keys[1], (n, 1, kvh, context, d), dtype)
        q = jax.random.normal(keys[2], (1, qh, d), dtype)
        qpos = jnp.asarray([context - 1], jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (1, kvh, context))
        valid = jnp.ones((1, kvh, context), bool)
        for impl in args.implementations.split(","):
            op = functools.partial(attn_ops.decode_attention, implementation=impl)

            def layer(q: Any, k: Any, v: Any, op: Any = op, rest: tuple = (qpos, pos, valid)) -> Any:
                qpos, pos, valid = rest  # the output feeds the next layer's query
                return op(q, qpos, k, v, pos, valid).astype(q.dtype)

            rows += _measure("attention", f"{context}_{impl}", layer, (ks, vs), q, ks.nbytes + vs.nbytes, args,
                             copy_bps)
        del ks, vs
    return rows


def _model(args: argparse.Namespace) -> dict[str, Any]:
    """The shapes timed, in the `model` record `report.py` reads."""
    return dict(name="decode-step parts (MLP, attention)", num_layers=args.layers, hidden_size=args.hidden,
                num_heads=args.q_heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype="bfloat16")


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file (rewritten after each part).")
    p.add_argument("--hlo_dir", default=None, help="Keep each compiled program's HLO text here.")
    p.add_argument("--smoke", action="store_true", help="Tiny shapes: checks the script on CPU.")
    p.add_argument("--parts", default="mlp,attention")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"Comma list of {LAYOUTS}.")
    p.add_argument("--layers", type=int, default=None, help="Layers (32; smoke 2).")
    p.add_argument("--hidden", type=int, default=None, help="Hidden size (4096; smoke 64).")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (14336; smoke 128).")
    p.add_argument("--q_heads", type=int, default=None, help="Query heads (32; smoke 4).")
    p.add_argument("--kv_heads", type=int, default=None, help="KV heads (8; smoke 2).")
    p.add_argument("--head_dim", type=int, default=None, help="Head size (128; smoke 16).")
    p.add_argument("--contexts", default=None, help="Cached tokens (32768,131072; smoke 64).")
    p.add_argument("--implementations", default=None, help="Attention paths (xla,pallas; smoke xla).")
    p.add_argument("--repeats", type=int, default=None, help="Timed runs (20; smoke 2).")
    args = p.parse_args(argv)
    smoke = args.smoke
    for name, full, small in (("layers", 32, 2), ("hidden", 4096, 64), ("intermediate", 14336, 128),
                              ("q_heads", 32, 4), ("kv_heads", 8, 2), ("head_dim", 128, 16),
                              ("contexts", "32768,131072", "64"),
                              ("implementations", "xla,pallas", "xla"), ("repeats", 20, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if smoke else full)
    result: dict[str, Any] = dict(benchmark="layer_slicing", machine=bu.machine(), model=_model(args), args=vars(args),
                                  rows=[], time=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    copy = None if smoke else copy_bandwidth(1024, args.repeats)
    copy_bps = None if copy is None else copy["bytes_per_s"]
    if copy_bps:
        print(f"copy bandwidth {copy_bps / 1e9:.1f} GB/s", flush=True)
    result["copy_bandwidth"] = copy
    parts = {"mlp": mlp_rows, "attention": attention_rows}
    for part in bu.csv_strs(args.parts):
        result["rows"] += parts[part](args, copy_bps)
        out.write_text(json.dumps(result, indent=1, default=bu._jsonable))
    return result


if __name__ == "__main__":
    run()
