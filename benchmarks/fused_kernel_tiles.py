"""The fused decode kernel alone, one layer's call at a time, at its tiles, per storage and context: its bytes a
second as a fraction of the copy bandwidth. Issue 57's item 5 for the attention, and the int8 tile search.

    python benchmarks/fused_kernel_tiles.py --out=/tmp/fused_kernel_tiles.json      # GPU: 8B heads, bf16 / int8
    python benchmarks/fused_kernel_tiles.py --smoke --out=/tmp/fkt.json              # CPU: interpret mode, tiny
    python benchmarks/fused_kernel_tiles.py --compile_for=h200 --out=/tmp/fkt.json   # any machine: does each compile

For each storage of `--kv_dtypes` (`model`: the model dtype; int8, int4, fp8, kivi2, ...) the op the decode step
runs per layer, `kvjax.ops.fused_decode.decode_append_attention(implementation="pallas")` (the Triton kernel: RoPE,
the new token's write, split-K attention; then its split merge), runs over `--layers` layers of a `full` cache of
`--model`'s heads holding `context` tokens (random keys and values, quantized as a prefill stores them), one call
per layer inside one jitted program with the layers donated, as the decode step runs them (no Python dispatch
between calls; no layer served from L2 by the previous call). Each tile (`--tiles`, `block_k:num_warps:num_stages:
programs`, the last the program target, `gpu_target_programs` or a quantized cache's
`gpu_quantized_target_programs`; the tuning's own tile for the storage, `kvjax.tuning.Tuning.tile`, is
always timed first) is timed at `--sweep_context`; at the other `--contexts` the tuning's tile and the sweep's
fastest. Per row: microseconds per call (the median of `--repeats` programs over their layers), the bytes a call
reads (the cache's codes, scales and positions up to its tokens), their rate as a fraction of the copy
bandwidth measured in the same process (`accelerator.copy_bandwidth`), the output's largest difference from the
XLA path on the same layer (relative to its largest value), and the tile against the tuning's. The JSON is
rewritten after every row; `--time_budget_s` stops starting new ones. `--print_best STORAGE FILE` prints the
fastest tile of a result as `throughput.py --tunings` text, nothing where it is the tuning's own (the device
command's `quant_blocks` times it in the whole step).

`--compile_for=h200` (or h100) times nothing: each tile of each storage is compiled for a compile-only GPU
(`gpu_compile.py`'s, from `make gpu-compile`), Triton's compile included: whether it compiles (a tile over the
shared memory fails there as on the card) and the launches XLA:GPU makes of a call.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
import types
from typing import Any

import accelerator
import bench_util as bu
import hlo_count
import jax
import jax.numpy as jnp
import numpy as np
import throughput

from kvjax import methods as kvm
from kvjax import tuning
from kvjax.errors import ConfigError
from kvjax.models.rope_scaling import rope_frequencies
from kvjax.ops import fused_decode as fd

gen = importlib.import_module("kvjax.runtime.generate")

#: The sweep's tiles (`block_k:num_warps:num_stages:programs`, `:pairs` an int8 cache's value codes read as int16
#: pairs, `Tuning.gpu_int8_pairs`) beside the tuning's own: run 14 timed 64 and 128 slots a block, three stages and
#: 512 programs in the whole step; each loop step of the kernel costs about as long whatever its block holds, so
#: larger blocks, more warps and deeper pipelines are the candidates. Read in pairs, int8's loop has no byte loads
#: from shared memory and 6% fewer instructions at 128 slots, and the fused kernel needs 121 registers at 64 slots
#: and 168 at 128 (four and three programs an SM, which only a grid past 256 programs can use: 528 and 392 are one
#: wave of each on 132 SMs; BENCHMARKS.md). `:pairs:f16` also attends with float16 dots (`Tuning.gpu_f16_dots`:
#: int8 codes to float16 by a sign flip and a byte permute): 18% fewer loop instructions at 128 slots than `:pairs`,
#: the same 168 registers.
TILES = ("64:4:2:256,128:4:2:256,256:4:2:256,128:8:2:256,256:8:2:256,128:4:3:256,64:4:3:256,128:4:2:512,"
         "128:4:2:256:pairs,64:4:2:256:pairs,128:4:2:256:pairs:f16,64:4:2:528:pairs,128:4:2:392:pairs")
#: A tile's optional flags: `pairs` (int8 value codes read as int16 pairs, `Tuning.gpu_int8_pairs`), `cvt` (sub-byte
#: codes converted one `cvt` a code, `Tuning.gpu_unpack_asm=False`: the kernels before `kvjax.pallas.gpu_unpack`),
#: `f16` (int8 / fp8 caches attended with float16 dots, `Tuning.gpu_f16_dots`), `bytes` (int4 codes read a byte at a
#: time, `Tuning.gpu_int4_pairs=False`: the kernels before int4's int16 pairs).
FLAGS = ("pairs", "cvt", "f16", "bytes")
#: Storages of sub-byte codes, which `:cvt` tiles apply to.
SUB_BYTE = ("int4", "kivi2", "kivi4")
#: Storages of 8-bit codes, which `:f16` tiles apply to.
EIGHT_BIT = ("int8", "fp8")
#: A row's largest output difference from the XLA path (relative to its largest value) that counts as right.
ERR_TOLERANCE = 5e-2
#: Slots past the context: every timed program writes one token into each layer.
ROOM = 1024


@dataclasses.dataclass(frozen=True)
class Tile:
    block_k: int
    num_warps: int
    num_stages: int
    programs: int
    pairs: bool = False  # int8 codes read as int16 pairs (`Tuning.gpu_int8_pairs`)
    cvt: bool = False  # sub-byte codes converted one `cvt` a code (`Tuning.gpu_unpack_asm=False`)
    f16: bool = False  # 8-bit codes attended with float16 dots (`Tuning.gpu_f16_dots`)
    bytes: bool = False  # int4 codes read a byte at a time (`Tuning.gpu_int4_pairs=False`)

    @property
    def label(self) -> str:
        return (f"{self.block_k}:{self.num_warps}:{self.num_stages}:{self.programs}" + ":pairs" * self.pairs
                + ":cvt" * self.cvt + ":f16" * self.f16 + ":bytes" * self.bytes)

    def tuning_text(self, quantized: bool) -> str:
        """The tile as `throughput.py --tunings` text: the quantized or the plain kernel's fields."""
        prefix = "gpu_quantized_" if quantized else "gpu_"
        block = "gpu_quantized_block_k" if quantized else "gpu_decode_block_k"
        codes = (f",gpu_int8_pairs={str(self.pairs).lower()}" + ",gpu_unpack_asm=false" * self.cvt
                 + ",gpu_int4_pairs=false" * self.bytes + f",gpu_f16_dots={str(self.f16).lower()}") if quantized else ""
        return (f"{block}={self.block_k},{prefix}num_warps={self.num_warps},{prefix}num_stages={self.num_stages},"
                f"{prefix}target_programs={self.programs}{codes}")

    def applied(self, base: tuning.Tuning, quantized: bool) -> tuning.Tuning:
        return dataclasses.replace(base, **throughput.parse_tuning(self.tuning_text(quantized)))


def parse_tile(text: str) -> Tile:
    parts = text.split(":")
    flags = set(parts[4:])
    parts = parts[:4]
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts) or not flags <= set(FLAGS):
        raise ValueError(f"a tile is block_k:num_warps:num_stages:programs (positive ints), then optionally "
                         f"{' / '.join(':' + f for f in FLAGS)}, got {text!r}")
    tile = Tile(*(int(p) for p in parts), pairs="pairs" in flags, cvt="cvt" in flags, f16="f16" in flags,
                bytes="bytes" in flags)
    if tile.block_k < 16 or tile.block_k & (tile.block_k - 1):
        raise ValueError(f"a tile's block_k must be a power of two >= 16, got {text!r}")
    return tile


def tuned_tile(base: tuning.Tuning, kv_dtype: str | None) -> Tile:
    """The tuning's own tile for a storage (None: the model dtype)."""
    return Tile(*base.tile(kv_dtype is not None), base.target_programs(kv_dtype is not None),
                pairs=kv_dtype == "int8" and base.gpu_int8_pairs,
                cvt=kv_dtype in SUB_BYTE and not base.gpu_unpack_asm, f16=kv_dtype in EIGHT_BIT and base.gpu_f16_dots,
                bytes=kv_dtype == "int4" and not base.gpu_int4_pairs)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON file to write.")
    p.add_argument("--smoke", "--quick", dest="smoke", action="store_true", help="Tiny heads, 2 layers (CPU).")
    p.add_argument("--model", default=None, help="A preset whose heads to use (llama-3.1-8b; tiny with --smoke).")
    p.add_argument("--kv_dtypes", default="model,int8", help="Storages, comma list: model, int8, int4, fp8, kivi2...")
    p.add_argument("--contexts", default=None, help="Cached tokens, comma list (8192,32768,129024; 64 --smoke).")
    p.add_argument("--sweep_context", type=int, default=None, help="Where every tile runs (32768; 64 --smoke).")
    p.add_argument("--tiles", default=TILES, help="block_k:num_warps:num_stages:programs each, comma list.")
    p.add_argument("--layers", type=int, default=None, help="Layers per timed program (8; 2 --smoke).")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--copy_mib", type=int, default=None, help="Copy-bandwidth buffer (1024 MiB; 8 --smoke).")
    p.add_argument("--time_budget_s", type=float, default=100.0)
    p.add_argument("--compile_for", choices=("h100", "h200"), default=None,
                   help="Compile each tile for this compile-only GPU instead of timing it.")
    p.add_argument("--print_best", nargs=2, metavar=("STORAGE", "FILE"), default=None,
                   help="Print the fastest tile of STORAGE in a result FILE as --tunings text (nothing where it is "
                   "the tuning's own), and exit.")
    args = p.parse_args(argv)
    if args.print_best:
        return args
    if not args.out:
        p.error("--out is required")
    args.quick = args.smoke
    args.model = args.model or ("tiny" if args.smoke else "llama-3.1-8b")
    args.layers = args.layers or (2 if args.smoke else 8)
    args.copy_mib = args.copy_mib or (8 if args.smoke else 1024)
    args.sweep_context = args.sweep_context or (64 if args.smoke else 32768)
    try:
        args.context_list = bu.csv_ints(args.contexts or ("64" if args.smoke else "8192,32768,129024"))
        args.tile_list = [parse_tile(t) for t in bu.csv_strs(args.tiles)]
        args.dtype_list = [None if s == "model" else s for s in bu.csv_strs(args.kv_dtypes)]
        for kv_dtype in args.dtype_list:
            gen.resolve_kv_dtype(kv_dtype, 128)
    except (ValueError, ConfigError) as e:
        p.error(str(e))
    if args.sweep_context not in args.context_list:
        args.context_list.append(args.sweep_context)
    if min(args.context_list) < 16 or args.layers < 1 or args.repeats < 1:
        p.error("--contexts must be >= 16 tokens, --layers and --repeats >= 1")
    return args


def layers_of(config: Any, context: int, kv_dtype: str | None, count: int, dtype: Any) -> tuple:
    """`count` layers of a `full` cache holding `context` tokens, batch 1: `throughput.synthetic_state`'s."""
    heads = types.SimpleNamespace(config=dataclasses.replace(config, num_layers=count, layer_types=None), dtype=dtype)
    return throughput.synthetic_state(heads, kvm.get("full"), 1, context, ROOM, seed=context,
                                      kv_dtype=kv_dtype).cache.layers


def read_bytes(layer: Any, context: int) -> int:
    """Bytes a call reads of one layer: each leaf along the slot axis (codes, scales, zeros, positions; KIVI's key
    scales and zeros per group of slots) up to `context` tokens, the others (fp8's head scale, KIVI's ring) whole."""
    capacity = layer.capacity
    group = getattr(getattr(layer.k, "spec", None), "group_size", None)
    per_slot = {capacity} | ({-(-capacity // group)} if group else set())
    total = 0
    for leaf in jax.tree.leaves((layer.k, layer.v, layer.pos)):
        whole = leaf.size * leaf.dtype.itemsize
        total += whole * min(context, capacity) // capacity if leaf.ndim >= 3 and leaf.shape[2] in per_slot else whole
    return int(total)


def token(config: Any, dtype: Any, seed: int = 0) -> tuple:
    """A decode token's pre-RoPE q, k and v, and its position (filled in per context)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (1, 1, config.num_heads, config.head_dim), dtype)
    k = jax.random.normal(keys[1], (1, 1, config.num_kv_heads, config.head_dim), dtype)
    v = jax.random.normal(keys[2], (1, 1, config.num_kv_heads, config.head_dim), dtype)
    return q, k, v


def programs() -> tuple[Any, Any]:
    """`(timed, one)`: `timed(layers, inv_freq, q, k, v, positions)` the op over every layer in one program (the
    layers donated), `one(inv_freq, q, k, v, positions, layer, implementation)` one layer's output (nothing donated);
    each traced under the tuning in force when first called."""
    def call(inv_freq: Any, q: Any, k: Any, v: Any, positions: Any, layer: Any, implementation: str) -> tuple:
        return fd.decode_append_attention(q, k, v, positions, layer, inv_freq=inv_freq, implementation=implementation)

    def every_layer(layers: tuple, inv_freq: Any, q: Any, k: Any, v: Any, positions: Any) -> tuple:
        outs, written = [], []
        for layer in layers:
            out, layer = call(inv_freq, q, k, v, positions, layer, "pallas")
            outs.append(jnp.sum(out.astype(jnp.float32)))
            written.append(layer)
        return tuple(written), sum(outs)

    timed = jax.jit(every_layer, donate_argnums=0)
    one = jax.jit(lambda *args: call(*args)[0], static_argnums=6)
    return timed, one


def _rel_err(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / max(1e-6, np.abs(want).max()))


def time_tile(tile: Tile, quantized: bool, base: tuning.Tuning, state: dict, repeats: int) -> dict[str, Any]:
    """One tile on `state`'s layers: compiled, checked against the XLA path on the first layer, timed."""
    token = (state["inv_freq"], *state["token"])
    timed, one = programs()
    with tuning.use(tile.applied(base, quantized)):
        start = time.perf_counter()
        state["layers"], total = timed(state["layers"], *token)
        bu.block(total)
        compile_s = time.perf_counter() - start
        kernel = one(*token, state["layers"][0], "pallas")
        want = one(*token, state["layers"][0], "xla")

        def once() -> Any:
            state["layers"], total = timed(state["layers"], *token)
            return total, state["layers"]

        seconds = bu.median(bu.time_call(once, repeats)) / len(state["layers"])
    return dict(us=seconds * 1e6, first_call_s=round(compile_s, 3), max_rel_err=_rel_err(kernel, want))


def compile_rows(args: argparse.Namespace, config: Any, base: tuning.Tuning) -> dict:
    """Each tile of each storage compiled for `--compile_for` at `--sweep_context` from abstract layers."""
    import gpu_compile  # puts the compile-only CUDA plugin on sys.path: before jax's first backend use, so only here

    device = gpu_compile.gpu_device(args.compile_for)
    on = jax.sharding.SingleDeviceSharding(device)
    place = lambda tree: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=on), tree)  # noqa: E731
    rows: list[dict] = []
    inv_freq = place(jax.ShapeDtypeStruct((config.head_dim // 2,), jnp.float32))
    for kv_dtype in args.dtype_list:
        quantized = kv_dtype is not None
        layers = place(jax.eval_shape(lambda kv_dtype=kv_dtype: layers_of(config, args.sweep_context, kv_dtype, 1,
                                                                           jnp.bfloat16)))
        q, k, v = place(jax.eval_shape(lambda: token(config, jnp.bfloat16)))
        positions = place(jax.ShapeDtypeStruct((1, 1), jnp.int32))
        for tile in _tiles(args.tile_list, base, kv_dtype):
            row = dict(kv_dtype=kv_dtype or "model", context=args.sweep_context, tile=tile.label,
                       tuned=tile == tuned_tile(base, kv_dtype), target=args.compile_for)
            try:
                with tuning.use(tile.applied(base, quantized)), gpu_compile.traced_for_gpu(device):
                    text = programs()[0].lower(layers, inv_freq, q, k, v, positions).compile().as_text()
                row.update(compiled=True, launches=hlo_count.launches(text, body_only=False))
            except Exception as e:  # noqa: BLE001  (a tile Triton cannot fit is a result)
                row.update(compiled=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            print(f"{row['kv_dtype']:6s} {tile.label:14s} " + (
                f"compiled, {row['launches']['total']} launches" if row["compiled"] else row["error"]), flush=True)
    return bu.write(args.out, "fused_kernel_tiles", args, config, "bfloat16", rows, compile_for=args.compile_for)


def _tiles(tiles: list[Tile], base: tuning.Tuning, kv_dtype: str | None) -> list[Tile]:
    """The tuning's tile first, then the others once each (`:pairs` tiles for int8 only, `:cvt` for sub-byte codes
    only, `:f16` for 8-bit codes only, `:bytes` for int4 only: the rest ignore them)."""
    tuned = tuned_tile(base, kv_dtype)
    return [tuned] + [t for t in dict.fromkeys(tiles) if t != tuned and (kv_dtype == "int8" or not t.pairs)
                      and (kv_dtype in SUB_BYTE or not t.cvt) and (kv_dtype in EIGHT_BIT or not t.f16)
                      and (kv_dtype == "int4" or not t.bytes)]


def best(rows: list[dict[str, Any]], kv_dtype: str, context: int | None = None) -> dict[str, Any] | None:
    """The fastest timed row of a storage (at `context`, else at the sweep's), its error within the dtype's."""
    timed = [r for r in rows if r.get("kv_dtype") == kv_dtype and "us" in r and r.get("max_rel_err", 1) < ERR_TOLERANCE
             and (context is None and r.get("sweep") or r.get("context") == context)]
    return min(timed, key=lambda r: r["us"]) if timed else None


def run(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.print_best:
        storage, path = args.print_best
        with open(path) as f:
            row = best(json.load(f)["rows"], storage)
        print("" if row is None or row.get("tuned") else row["tuning_text"])
        return {}
    config = bu.model_config(args.model)
    if args.compile_for:  # the tiles a GPU's defaults would time
        return compile_rows(args, config, tuning.default("gpu"))
    base = tuning.current()
    dtype = jnp.bfloat16
    copy_bps = accelerator.copy_bandwidth(args.copy_mib, args.repeats)["bytes_per_s"]
    print(f"copy bandwidth {copy_bps / 1e9:.1f} GB/s on {jax.devices()[0].device_kind}", flush=True)
    deadline = time.monotonic() + args.time_budget_s
    inv_freq = jnp.asarray(rope_frequencies(config)[0], jnp.float32)
    rows: list[dict] = []
    result: dict = {}
    others = [c for c in args.context_list if c != args.sweep_context]
    # every storage's sweep first (a time budget spent keeps whole sweeps), then the other contexts
    cells = [(kv_dtype, args.sweep_context) for kv_dtype in args.dtype_list]
    cells += [(kv_dtype, context) for kv_dtype in args.dtype_list for context in others]
    for kv_dtype, context in cells:
        quantized, storage = kv_dtype is not None, kv_dtype or "model"
        sweep = context == args.sweep_context
        tiles = _tiles(args.tile_list, base, kv_dtype)
        if not sweep:  # the tuning's tile and the sweep's fastest
            fastest = best(rows, storage)
            tiles = tiles[:1] + ([parse_tile(fastest["tile"])] if fastest and fastest["tile"] != tiles[0].label
                                 else [])
        state = dict(inv_freq=inv_freq, layers=layers_of(config, context, kv_dtype, args.layers, dtype),
                     token=(*token(config, dtype), jnp.full((1, 1), context, jnp.int32)))
        nbytes = read_bytes(state["layers"][0], context)
        reference = None
        for tile in tiles:
            if time.monotonic() > deadline:
                print(f"time budget spent: {storage} at {context} from {tile.label} not run", flush=True)
                return bu.write(args.out, "fused_kernel_tiles", args, config, "bfloat16", rows,
                                copy_bytes_per_s=copy_bps, cut_short=True)
            row = dict(kv_dtype=storage, context=context, sweep=sweep, tile=tile.label,
                       tuning_text=tile.tuning_text(quantized), tuned=tile == tiles[0], layers=args.layers,
                       read_bytes=nbytes)
            try:
                row.update(time_tile(tile, quantized, base, state, args.repeats))
            except (ConfigError, RuntimeError, ValueError) as e:  # a tile that fails to compile is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                rows.append(row)
                print(f"{storage:6s} {context:7d} {tile.label:14s} FAILED {row['error'][:200]}", flush=True)
                continue
            row.update(bytes_per_s=nbytes / (row["us"] * 1e-6))
            row["copy_fraction"] = row["bytes_per_s"] / copy_bps
            reference = row["us"] if row["tuned"] else reference
            row["vs_tuned"] = None if reference is None else reference / row["us"]
            rows.append(row)
            print(f"{storage:6s} {context:7d} {tile.label:14s} {row['us']:9.1f} us "
                  f"{row['bytes_per_s'] / 1e9:8.1f} GB/s = {100 * row['copy_fraction']:5.1f}% of copy, "
                  f"{row['vs_tuned'] or 0:.3f}x the tuning's, err {row['max_rel_err']:.1e}", flush=True)
            result = bu.write(args.out, "fused_kernel_tiles", args, config, "bfloat16", rows,
                              copy_bytes_per_s=copy_bps)
        del state
    return result


def main(argv: list[str]) -> None:
    run(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
