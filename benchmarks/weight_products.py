"""Each weight product of a decode step alone, as a fraction of the copy bandwidth: XLA's against the Pallas kernel
(`kvjax.pallas.gpu_linear`) at its tiles. Issue 57's item 5.

    python benchmarks/weight_products.py --out=/tmp/weight_products.json            # 8B shape, rows 1 and 16
    python benchmarks/weight_products.py --smoke --out=/tmp/wp.json                  # CPU, tiny shapes, seconds

For each product of a layer of `--model` (q|k|v `[D, (N + 2K) H]`, o `[N H, D]`, gate|up `[D, 2F]`, down `[F, D]`),
the LM head `[D, V]`, and each `--rows` (1: batch-1 decode; 16: 16 x 8K), the product runs as the model runs it
(`kvjax.ops.linear`): with its RMSNorm before it (q|k|v, gate|up; the final norm before the LM head, which gives
float32 logits), its residual add after it (o), or both the SiLU activation product before it and the residual add
after it (down). One jitted program runs it over `--layers` weight matrices (the LM head over two) in buffers of
their own (as the model's layers lie: no Python dispatch per call, and no
matrix served from L2 by the previous call), timed as the median of `--repeats` runs after warm-up:

* `xla`: `kvjax.ops.linear.linear_xla` (XLA:GPU's split-K Triton GEMM fusions, the norm and the add around them);
* `kernel bn:bk:warps:stages`: the kernel with that tile (`--tiles`; the first is `kvjax.tuning`'s `gpu_linear_*`
  default), its result compared with XLA's.

Per row: microseconds per product, the weight bytes it streams per second and that as a fraction of the device's
copy bandwidth (`accelerator.copy_bandwidth`, measured in the same process), and the kernel's error. The JSON is
rewritten after every row; `--time_budget_s` stops starting new ones.

`--compile_for=h200` (or h100) times nothing: it compiles each variant of one product for a compile-only GPU
(`gpu_compile.py`'s, jax's CUDA plugin from `make gpu-compile`, on any machine), Triton's own compile included, and
records whether it compiled (a tile over the shared memory fails there as it would on the card) and the launches
XLA:GPU makes of it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import accelerator
import bench_util as bu
import hlo_count
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import ConfigError
from kvjax.ops.linear import linear_xla
from kvjax.pallas import gpu_linear

#: A layer's weight products, in the block's order, and the LM head after the last layer.
PRODUCTS = ("qkv", "o", "gate_up", "down", "lm_head")
#: What each product fuses, as the block runs it.
FUSED = {"qkv": "norm", "o": "residual", "gate_up": "norm", "down": "activation+residual",
         "lm_head": "norm, float32 logits"}
#: Copies of the LM head per timed program: one matrix of 1 GB (8B shape) already dwarfs the L2.
HEAD_COPIES = 2
TILES = "32:256:4:3,16:256:4:3,64:128:4:3,16:512:4:4,32:256:8:3"


def shapes(config: Any) -> dict[str, tuple[int, int]]:
    """`(depth, width)` of each product of one layer, and of the LM head."""
    d, h = config.hidden_size, config.head_dim
    return {"qkv": (d, (config.num_heads + 2 * config.num_kv_heads) * h), "o": (config.num_heads * h, d),
            "gate_up": (d, 2 * config.intermediate_size), "down": (config.intermediate_size, d),
            "lm_head": (d, config.vocab_size)}


def parse_tile(text: str) -> dict[str, int]:
    parts = [int(p) for p in text.split(":")]
    if len(parts) != 4 or any(p <= 0 for p in parts):
        raise ValueError(f"a tile is block_n:block_k:num_warps:num_stages, got {text!r}")
    return dict(zip(("block_n", "block_k", "num_warps", "num_stages"), parts, strict=True))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", "--quick", dest="smoke", action="store_true", help="Tiny shapes, 2 layers (CPU).")
    p.add_argument("--model", default=None, help="A preset (default llama-3.1-8b; tiny with --smoke).")
    p.add_argument("--rows", default="1,16", help="Rows of the product (decode batch), comma list, each 1..64.")
    p.add_argument("--products", default=",".join(PRODUCTS), help=f"Comma list of {PRODUCTS}.")
    p.add_argument("--tiles", default=TILES, help="The kernel's tiles, block_n:block_k:num_warps:num_stages each.")
    p.add_argument("--layers", type=int, default=None, help="Weight matrices per timed program (32; 2 --smoke).")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--copy_mib", type=int, default=None, help="Copy-bandwidth buffer (1024 MiB; 8 --smoke).")
    p.add_argument("--time_budget_s", type=float, default=100.0)
    p.add_argument("--compile_for", choices=("h100", "h200"), default=None,
                   help="Compile each variant for this compile-only GPU instead of timing it.")
    args = p.parse_args(argv)
    args.quick = args.smoke
    args.model = args.model or ("tiny" if args.smoke else "llama-3.1-8b")
    args.layers = args.layers or (2 if args.smoke else 32)
    args.copy_mib = args.copy_mib or (8 if args.smoke else 1024)
    try:
        args.row_counts = bu.csv_ints(args.rows)
        args.tile_list = [parse_tile(t) for t in bu.csv_strs(args.tiles)]
    except ValueError as e:
        p.error(str(e))
    bad = [r for r in args.row_counts if not 1 <= r <= gpu_linear.MAX_ROWS]
    if bad:
        p.error(f"--rows: each must be 1..{gpu_linear.MAX_ROWS}, got {bad}")
    unknown = sorted(set(bu.csv_strs(args.products)) - set(PRODUCTS))
    if unknown:
        p.error(f"--products: unknown {unknown}; choose from {PRODUCTS}")
    if args.layers < 1 or args.repeats < 1:
        p.error("--layers and --repeats must be >= 1")
    return args


def _operands(name: str, rows: int, depth: int, width: int, layers: int, dtype: Any) -> tuple:
    keys = jax.random.split(jax.random.key(depth * 7 + width), layers + 3)
    ws = tuple(jax.random.normal(keys[i], (depth, width), dtype) * (depth ** -0.5) for i in range(layers))
    x = jax.random.normal(keys[-1], (rows, 2, depth) if name == "down" else (rows, depth), dtype)
    norm = jax.random.normal(keys[-2], (depth,), dtype) if name in ("qkv", "gate_up", "lm_head") else None
    residual = jax.random.normal(keys[-3], (rows, width), dtype) if name in ("o", "down") else None
    return ws, x, norm, residual


def _timed(fn: Any, ws: tuple, x: Any, norm: Any, residual: Any, repeats: int) -> tuple[float, Any]:
    """Seconds per product of `fn(x, w, norm, residual)` over every `w` of `ws` in one program, and the first
    product."""
    run = jax.jit(lambda ws, x, nw, r: [fn(x, w, nw, r) for w in ws])
    outs = bu.block(run(ws, x, norm, residual))
    seconds = bu.median(bu.time_call(lambda: run(ws, x, norm, residual), repeats)) / len(ws)
    return seconds, outs[0]


def _variants(tiles: list[dict[str, int]]) -> list[tuple[str, dict[str, int] | None]]:
    return [("xla", None)] + [(f"kernel {t['block_n']}:{t['block_k']}:{t['num_warps']}:{t['num_stages']}", t)
                              for t in tiles]


def _product(name: str, tile: dict[str, int] | None) -> Any:
    """`fn(x, w, norm_weight, residual)` of one variant of product `name` (absent extras are None; the down product
    takes the MLP's gate|up and its SiLU product; the LM head gives float32 logits)."""
    gated = "silu" if name == "down" else None
    out = jnp.float32 if name == "lm_head" else None
    if tile is None:
        return lambda x, w, nw, r: linear_xla(x, w, "td,dn->tn", norm_weight=nw, gated=gated, residual=r,
                                              preferred_element_type=out)
    return lambda x, w, nw, r: gpu_linear.linear(x, w, norm_weight=nw, gated=gated, residual=r, out_dtype=out, **tile)


def compile_rows(args: argparse.Namespace, config: Any) -> dict:
    """Each variant of each product compiled for `--compile_for` from abstract operands: compiled or the error, and
    XLA:GPU's launches."""
    import gpu_compile  # puts the compile-only CUDA plugin on sys.path: before jax's first backend use, so only here

    device = gpu_compile.gpu_device(args.compile_for)
    on = jax.sharding.SingleDeviceSharding(device)
    shaped = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=on)  # noqa: E731
    rows_out: list[dict] = []
    for name in bu.csv_strs(args.products):
        depth, width = shapes(config)[name]
        norm, residual = name in ("qkv", "gate_up", "lm_head"), name in ("o", "down")
        for rows in args.row_counts:
            x = shaped((rows, 2, depth) if name == "down" else (rows, depth))
            operands = (x, shaped((depth, width)), shaped((depth,)) if norm else None,
                        shaped((rows, width)) if residual else None)
            for label, tile in _variants(args.tile_list):
                row = dict(product=name, rows=rows, depth=depth, width=width, impl=label, target=args.compile_for)
                try:
                    with gpu_compile.traced_for_gpu(device):
                        text = jax.jit(_product(name, tile)).lower(*operands).compile().as_text()
                    row.update(compiled=True, launches=hlo_count.launches(text, body_only=False))
                except Exception as e:  # noqa: BLE001  (a tile Triton cannot fit is a result)
                    row.update(compiled=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                rows_out.append(row)
                print(f"{name:8s} rows={rows:3d} {label:22s} " + (
                    f"compiled, {row['launches']['total']} launches" if row["compiled"] else row["error"]),
                      flush=True)
    return bu.write(args.out, "weight_products", args, config, "bfloat16", rows_out, compile_for=args.compile_for,
                    tiles=args.tile_list)


def run(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    config = bu.model_config(args.model)
    if args.compile_for:
        return compile_rows(args, config)
    dtype = jnp.bfloat16
    copy_bps = accelerator.copy_bandwidth(args.copy_mib, args.repeats)["bytes_per_s"]
    print(f"copy bandwidth {copy_bps / 1e9:.1f} GB/s on {jax.devices()[0].device_kind}", flush=True)
    deadline = time.monotonic() + args.time_budget_s
    rows_out: list[dict] = []
    result: dict = {}
    for name in bu.csv_strs(args.products):
        depth, width = shapes(config)[name]
        layers = min(args.layers, HEAD_COPIES) if name == "lm_head" else args.layers
        for rows in args.row_counts:
            ws, x, norm, residual = _operands(name, rows, depth, width, layers, dtype)
            base = dict(product=name, rows=rows, depth=depth, width=width, fused=FUSED[name], layers=layers,
                        weight_bytes=depth * width * jnp.dtype(dtype).itemsize)
            want = None
            for label, tile in _variants(args.tile_list):
                if time.monotonic() > deadline:
                    print(f"time budget spent: {name} rows={rows} {label} and later not run", flush=True)
                    result = bu.write(args.out, "weight_products", args, config, "bfloat16", rows_out,
                                      copy_bytes_per_s=copy_bps, tiles=args.tile_list, cut_short=True)
                    return result
                row = dict(base, impl=label)
                try:
                    seconds, out = _timed(_product(name, tile), ws, x, norm, residual, args.repeats)
                except (ConfigError, RuntimeError, ValueError) as e:  # a tile that fails to compile is a result
                    row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                    rows_out.append(row)
                    print(f"{name:8s} rows={rows:3d} {label:22s} FAILED {row['error'][:200]}", flush=True)
                    continue
                row.update(us=seconds * 1e6, bytes_per_s=base["weight_bytes"] / seconds)
                row["copy_fraction"] = row["bytes_per_s"] / copy_bps
                if tile is None:
                    want = np.asarray(out, np.float32)
                else:
                    got = np.asarray(out, np.float32)
                    row["max_rel_err"] = float(np.abs(got - want).max() / max(1e-6, np.abs(want).max()))
                rows_out.append(row)
                err = f" err {row['max_rel_err']:.1e}" if "max_rel_err" in row else ""
                print(f"{name:8s} rows={rows:3d} {label:22s} {row['us']:9.1f} us {row['bytes_per_s'] / 1e9:8.1f} GB/s "
                      f"= {100 * row['copy_fraction']:5.1f}% of copy{err}", flush=True)
                result = bu.write(args.out, "weight_products", args, config, "bfloat16", rows_out,
                                  copy_bytes_per_s=copy_bps, tiles=args.tile_list)
    return result


def main(argv: list[str]) -> None:
    run(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
