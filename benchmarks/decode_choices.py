"""What issue 57's GPU measurements choose, by the rules docs/performance.md states ("What closes issue 57"): the
kernels `kvjax.tuning` lists in `auto_pallas` on GPU, the XLA path's slot multiple, the weight-product kernel's tile,
the command-buffer variant of XLA_FLAGS, whether the fused kernel takes quantized caches and its tile for them,
whether the quantized kernels keep `kvjax.pallas.gpu_unpack`'s assembly, and whether they read int4 codes in pairs.
Each choice names the rows it rests on; a choice without its rows says so.

    python benchmarks/decode_choices.py OUT [OUT2 ...]   # the device commands' folders (a later one's file wins)

Reads (each optional): `bars.json`, `graphs_today.json`, `graphs_<variant>.json`, `quant_ab.json`,
`fused_kernel_tiles.json`, `fused_kernel_tiles_old.json`, `fused_kernel_tiles_unpack.json` and `quant_blocks.json`
(the first command),
`weight_products.json` and `fused_decode.json` (the second). `decode_bars.py` prints this after the bars.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import decode_bars as db

from kvjax import tuning

KERNELS_12 = frozenset({"decode_append_attention", "rms_norm"})
KERNELS_6 = KERNELS_12 | {"linear"}
#: How often a decode step runs each product, per layer or once (the LM head).
PER_STEP = {"qkv": "layers", "o": "layers", "gate_up": "layers", "down": "layers", "lm_head": 1}
#: A kernel row's largest output difference from the XLA path, relative to its largest value, that counts as right
#: (`fused_kernel_tiles.best`'s).
ERR_TOLERANCE = 5e-2


#: The XLA path's tuning text in the device command since run 13, when the GPU's defaults took KERNELS_12: in a
#: folder with rows under it, an empty tuning means KERNELS_12; in one without (run 13 and before), the XLA path.
XLA_PATH = "auto_pallas=block_sparse_decode_attention"


def kernels(tuning: str, defaults: frozenset[str] = frozenset()) -> frozenset[str]:
    """The `auto_pallas` ops a variant's tuning text lists (`decode_bars.kernel_ops`), as a set; `defaults` for a
    text that sets no `auto_pallas`."""
    ops = db.kernel_ops(tuning)
    return defaults if ops is None else frozenset(ops)


def default_kernels(*row_sets: list[dict[str, Any]]) -> frozenset[str]:
    """What an empty tuning ran in these rows' command: KERNELS_12 where the XLA path was named, else nothing."""
    return KERNELS_12 if any(r.get("tuning") == XLA_PATH for rows in row_sets for r in rows) else frozenset()


def _xla(row: dict[str, Any], defaults: frozenset[str]) -> bool:
    """Whether a row ran the XLA path as it is (no kernel, no other tuning field)."""
    tuning = row.get("tuning") or ""
    plain = all(f.partition("=")[0].strip() == "auto_pallas" for f in tuning.split(",") if f.strip())
    return plain and not kernels(tuning, defaults)


def _pairs(bars: list[dict[str, Any]], ops: frozenset[str]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(the XLA path's row, the variant's row) of every decode shape `bars.json` measured under both."""
    defaults = default_kernels(bars)
    key = lambda r: (r["method"], r.get("budget"), r["context"], r["batch"], r.get("kv_dtype", "model"))  # noqa: E731
    base = {key(r): r for r in bars if _xla(r, defaults)}
    return [(base[key(r)], r) for r in bars
            if not _xla(r, defaults) and kernels(r.get("tuning") or "", defaults) == ops and key(r) in base]


def choose_kernels(bars: list[dict[str, Any]], graphs: list[dict[str, Any]],
                   fused: list[dict[str, Any]]) -> list[str]:
    """Every kernel if `bars` measures them faster than the XLA path on every decode row with the prefill within
    10%; else the fused decode and norm kernels if `graphs_today` measures their step faster than the XLA path's in
    `bars`; and the fused kernel on int8 if `fused_decode` measures it faster there."""
    lines = []
    pairs = _pairs(bars, KERNELS_6)
    if not pairs:
        lines.append("every kernel: no row of `bars.json` under both the XLA path and every kernel")
    else:
        faster = [new["step_ms"] < old["step_ms"] for old, new in pairs]
        prefill = [new["prefill_s"] / old["prefill_s"] for old, new in pairs
                   if "prefill_s" in new and "prefill_s" in old]
        ratios = ", ".join(f"{new['method']} {new['batch']} x {db.size(new['context'])} "
                           f"{old['step_ms'] / new['step_ms']:.2f}x" for old, new in pairs)
        ok = all(faster) and all(0.9 <= p <= 1.1 for p in prefill)
        lines.append(f"every kernel ({ratios}; prefill {', '.join(f'{p:.2f}x' for p in prefill) or 'not timed'}): "
                     + (f"**join** `auto_pallas` on GPU: {' + '.join(sorted(KERNELS_6))}" if ok else "not all faster"))
        if ok:
            return lines
    defaults = default_kernels(bars, graphs)
    twelve = [r for r in graphs if kernels(r["tuning"], defaults) == KERNELS_12]
    lines.append(_against_defaults("fused decode + norm", bars, twelve, "**join** `auto_pallas` on GPU"))
    by = {(r["impl"], r["kv_dtype"]): r for r in fused if "step_ms" in r}
    for dtype in ("int8",):
        if ("runtime", dtype) in by and ("runtime_pallas", dtype) in by:
            ratio = by[("runtime", dtype)]["step_ms"] / by[("runtime_pallas", dtype)]["step_ms"]
            lines.append(f"fused decode on an {dtype} cache ({ratio:.2f}x): "
                         + ("**join**" if ratio > 1 else "not faster: stay off"))
    return lines


def _against_defaults(name: str, bars: list[dict[str, Any]], rows: list[dict[str, Any]], verdict: str) -> str:
    """`rows` (decode_profile.py's, 1 x 32K) against the defaults' `bars.json` rows of the same method and context:
    `verdict` if faster on each."""
    defaults = default_kernels(bars)
    base = {(r["method"], r["context"]): r["step_ms"] for r in bars if _xla(r, defaults) and r["batch"] == 1}
    mine = {(r["method"], r["context"]): r["wall_ms_per_step"] for r in rows if "wall_ms_per_step" in r}
    both = sorted(set(base) & set(mine))
    if not both:
        return f"{name}: no `graphs_today.json` row beside the XLA path's `bars.json` rows"
    cells = ", ".join(f"{m} 1 x {db.size(c)} {base[m, c] / mine[m, c]:.2f}x" for m, c in both)
    return f"{name} ({cells}): " + (verdict if all(mine[k] < base[k] for k in both) else "not faster: stays off")


def choose_slots(bars: list[dict[str, Any]], graphs: list[dict[str, Any]]) -> list[str]:
    """The XLA path's slot multiple: 256 (no padded copy of V) if `graphs_today` measures it faster than the
    defaults."""
    defaults = default_kernels(bars, graphs)
    rows = [r for r in graphs if "cache_slot_multiple=256" in r["tuning"] and not kernels(r["tuning"], defaults)]
    return [_against_defaults("XLA path, cache_slot_multiple=256", bars, rows,
                              "**the GPU default** (`Tuning.cache_slot_multiple`)")]


def choose_tile(products: list[dict[str, Any]], layers: int) -> list[str]:
    """The tile whose products, each weighted by how often a step runs it (`layers` times, the LM head once), take
    the least time at each row count, against XLA's."""
    lines = []
    for rows in sorted({r["rows"] for r in products}):
        timed = [r for r in products if r["rows"] == rows and "us" in r]
        wanted = {r["product"] for r in timed if r["impl"] == "xla"}
        totals = {}
        for impl in {r["impl"] for r in timed}:
            mine = {r["product"]: r["us"] for r in timed if r["impl"] == impl}
            if set(mine) >= wanted:  # a tile that failed on a product XLA ran is no candidate
                totals[impl] = sum((layers if PER_STEP[p] == "layers" else 1) * mine[p] for p in wanted)
        tiles = [impl for impl in totals if impl != "xla"]
        if not wanted or not tiles:
            lines.append(f"tile at {rows} row(s): no product timed under XLA and every product under a tile")
            continue
        best = min(tiles, key=totals.get)
        ratio = totals["xla"] / totals[best]
        knobs = ", ".join(f"gpu_linear_{k}={v}" for k, v in zip(
            ("block_n", "block_k", "num_warps", "num_stages"), best.removeprefix("kernel ").split(":"), strict=True))
        lines.append(f"tile at {rows} row(s): {best} ({totals[best] / 1e3:.2f} ms of products a step, XLA's "
                     f"{totals['xla'] / 1e3:.2f} ms, {ratio:.2f}x): "
                     + (f"**{knobs}**" if ratio > 1 else "XLA's products are faster"))
    return lines or ["tile: no `weight_products.json`"]


def choose_flags(graphs: dict[str, list[dict[str, Any]]], bars: list[dict[str, Any]] = ()) -> list[str]:
    """The command-buffer variant with the least ms per step for the kernel set the variants ran (every kernel up
    to run 13, the defaults since), `full` and SnapKV rows."""
    defaults = default_kernels(list(bars), *graphs.values())
    ran = {kernels(r["tuning"], defaults) for v, rows in graphs.items() if v != "today" for r in rows}
    ops = KERNELS_6 if KERNELS_6 in ran or not ran else next(iter(ran))
    timed = {variant: {r["method"]: r["wall_ms_per_step"] for r in rows
                       if kernels(r["tuning"], defaults) == ops and "wall_ms_per_step" in r}
             for variant, rows in graphs.items()}
    timed = {variant: ms for variant, ms in timed.items() if ms}
    common = set.intersection(*(set(ms) for ms in timed.values())) if timed else set()  # methods every variant ran
    means = {variant: sum(ms[m] for m in common) / len(common) for variant, ms in timed.items() if common}
    if "today" not in means or len(means) < 2:
        return ["command buffers: `graphs_today.json` and another variant needed"]
    best = min(means, key=means.get)
    cells = ", ".join(f"{v} {m:.2f} ms" for v, m in means.items())
    return [f"command buffers ({cells}): " + ("today's flags stay" if best == "today" else
                                              f"**{best}** ({means['today'] / means[best]:.3f}x today's)")]


def choose_quantized(rows: list[dict[str, Any]], listed: Iterable[str] = ()) -> list[str]:
    """`auto_fused_quantized`: each quantized storage's step on the fused kernel against the XLA path (`quant_ab`);
    a storage joins the GPU's `listed` ones where the kernel is faster on it (its compiled tests passed: `tests57`),
    and leaves them where it is not."""
    def steps(fused: bool) -> dict[str, float]:
        return {r["kv_dtype"]: r["step_ms"] for r in rows if r.get("kv_dtype", "model") != "model" and "step_ms" in r
                and ("auto_fused_quantized=true" in (r.get("tuning") or "")) == fused
                and (fused or r.get("tuning") == XLA_PATH)}

    xla, fused = steps(False), steps(True)
    both = [s for s in xla if s in fused]
    if not both:
        return ["quantized caches on the fused kernel: no `quant_ab.json` pair (XLA path and fused, one storage)"]
    speed = {s: xla[s] / fused[s] for s in both}
    cells = ", ".join(f"{s} {x:.2f}x" for s, x in speed.items())
    faster = {s for s, x in speed.items() if x > 1}
    slower = {s for s, x in speed.items() if x <= 1}
    listed = set(listed)
    chosen = (listed | faster) - slower
    named = lambda names: "+".join(sorted(names)) or "nothing"  # noqa: E731
    verdict = (f"`auto_fused_quantized` stays {named(listed)}" if chosen == listed else
               f"**auto_fused_quantized={named(chosen)}** on GPU (today {named(listed)})"
               + (", if `tests57` passed" if chosen - listed else ""))
    if slower:
        verdict += f"; {', '.join(sorted(slower))} stay on XLA"
    return [f"quantized caches, fused kernel over the XLA path ({cells}): {verdict}"]


def f16_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each `:f16` tile (an 8-bit cache attended with float16 dots, `gpu_f16_dots`) against its twin in bf16, same
    storage and context, and whether its output is within the kernel's tolerance of the XLA path."""
    timed = {(r["kv_dtype"], r["context"], r["tile"]): r for r in rows if "us" in r}
    lines = []
    for (storage, context, tile), row in timed.items():
        twin = timed.get((storage, context, tile.removesuffix(":f16"))) if tile.endswith(":f16") else None
        if twin:
            right = row.get("max_rel_err", 1.0) < ERR_TOLERANCE
            lines.append(f"{storage} with float16 dots at {twin['tile']}, {context} tokens: {row['us']:.1f} us "
                         f"against {twin['us']:.1f} us in bf16 ({twin['us'] / row['us']:.3f}x), output "
                         + ("within" if right else f"**off** ({row.get('max_rel_err', float('nan')):.1e})")
                         + " the XLA path's")
    return lines


def choose_quantized_tile(tiles: list[dict[str, Any]], blocks: list[dict[str, Any]],
                          unpack: list[dict[str, Any]] = ()) -> list[str]:
    """The quantized kernels' tile (`gpu_quantized_*`, `gpu_int8_pairs`, `gpu_f16_dots`): `fused_kernel_tiles`'
    fastest int8 tile at its sweep (`:pairs`: its codes read as int16 pairs, `gpu_int8_pairs`; `:f16`: float16
    dots, `gpu_f16_dots`), taken where `quant_blocks` measures int8's whole step faster under it than on the
    defaults; each storage's kernel as a fraction of copy at the tuning's tile and its fastest, each pairs tile
    against the same tile reading bytes, each float16 one against the same in bf16. `gpu_f16_dots` also covers fp8
    caches: a tile with it is not taken where `unpack_ab` (`unpack`) measured fp8's float16 output off."""
    lines = []
    for storage in dict.fromkeys(r["kv_dtype"] for r in tiles):
        timed = [r for r in tiles if r["kv_dtype"] == storage and r.get("sweep") and "us" in r]
        tuned = next((r for r in timed if r.get("tuned")), None)
        fastest = min(timed, key=lambda r: r["us"], default=None)
        if tuned and fastest:
            lines.append(f"{storage} kernel alone at {tuned['context']} tokens: the tuning's tile {tuned['tile']} "
                         f"{tuned['us']:.1f} us ({100 * tuned['copy_fraction']:.0f}% of copy), fastest "
                         f"{fastest['tile']} {fastest['us']:.1f} us ({100 * fastest['copy_fraction']:.0f}%)")
        for row in (r for r in timed if r["tile"].endswith(":pairs")):  # int8's codes as int16 pairs, or bytes
            twin = next((r for r in timed if r["tile"] == row["tile"].removesuffix(":pairs")), None)
            if twin:
                lines.append(f"{storage} read in pairs at {twin['tile']}: {row['us']:.1f} us against "
                             f"{twin['us']:.1f} us a byte at a time ({twin['us'] / row['us']:.3f}x)")
    lines += f16_lines([r for r in tiles if r.get("sweep")])
    steps = {(r.get("tuning") or ""): r["step_ms"] for r in blocks
             if r.get("kv_dtype") == "int8" and r.get("batch") == 1 and "step_ms" in r}
    others = {t: ms for t, ms in steps.items() if t.startswith("gpu_quantized_block_k=")}
    if "" not in steps or not others:
        return lines + ["quantized tile: `quant_blocks.json` needs int8 on the defaults and at kernel_tiles' fastest"]
    text, ms = min(others.items(), key=lambda kv: kv[1])
    ratio = steps[""] / ms
    fp8_off = "gpu_f16_dots=true" in text and any(
        r["kv_dtype"] == "fp8" and r["tile"].endswith(":f16") and r.get("max_rel_err", 1.0) >= ERR_TOLERANCE
        for r in unpack if "us" in r)
    verdict = (f"**{text}** ({ratio:.3f}x)" if ratio > 1.01 and not fp8_off else
               f"the tuning's tile stays ({ratio:.3f}x, but fp8's float16 output was off)" if ratio > 1.01 else
               "the tuning's tile stays")
    return lines + [f"quantized tile: int8's step {steps['']:.2f} ms on the defaults, {ms:.2f} ms at {text}: "
                    + verdict]


def _against_twins(rows: list[dict[str, Any]], suffix: str, kinds: Iterable[str] | None, this: str,
                   other: str) -> tuple[list[str], bool | None]:
    """Each kernel row (of a storage in `kinds`; None: any) against its twin at the same tile plus `suffix`, same
    context: a line each (`this` and `other` name how each reads its codes), and whether every row is right (within
    the kernel's tolerance of the XLA path) and no more than 1% slower than its twin (None: no pair)."""
    timed = {(r["kv_dtype"], r["context"], r["tile"]): r for r in rows
             if "us" in r and (kinds is None or r["kv_dtype"] in kinds)}
    lines, keep = [], None
    for (storage, context, tile), row in timed.items():
        twin = timed.get((storage, context, tile + suffix))
        if twin is None:
            continue
        right = row.get("max_rel_err", 1.0) < ERR_TOLERANCE
        ok = right and twin["us"] / row["us"] >= 0.99
        keep = ok if keep is None else keep and ok
        lines.append(f"{storage} kernel alone at {context} tokens, {tile}: {row['us']:.1f} us {this} "
                     f"({100 * row['copy_fraction']:.0f}% of copy), {twin['us']:.1f} us {other} "
                     f"({100 * twin['copy_fraction']:.0f}%): {twin['us'] / row['us']:.3f}x, output "
                     + ("within" if right else f"**off** ({row.get('max_rel_err', float('nan')):.1e})")
                     + " the XLA path's")
    return lines, keep


def choose_unpack(rows: list[dict[str, Any]]) -> list[str]:
    """`gpu_unpack_asm` (`unpack_ab`: `fused_kernel_tiles` on int4 / KIVI at the tuning's tile and its `:cvt` twin):
    the assembly stays on where, for every sub-byte storage timed both ways, its output is within the kernel's
    tolerance of the XLA path and its call no more than 1% slower than the `cvt` a code; else
    **gpu_unpack_asm=False**."""
    lines, keep = _against_twins(rows, ":cvt", None, "with the unpack assembly", "a `cvt` a code")
    lines += f16_lines(rows)  # fp8's float16 dots, which `unpack_ab` also times: reported, chosen with int8's tile
    if keep is None:
        return lines + ["unpack assembly: no `fused_kernel_tiles_unpack.json` pair (`unpack_ab`)"] if rows else []
    return lines + ["unpack assembly: " + ("`gpu_unpack_asm` stays on" if keep else "**gpu_unpack_asm=False**")]


def choose_int4_pairs(rows: list[dict[str, Any]]) -> list[str]:
    """`gpu_int4_pairs` (`unpack_ab`: `fused_kernel_tiles` on int4 at the tuning's tile, its codes read as int16
    pairs, and its `:bytes` twin): the pairs stay on where their output is within the kernel's tolerance of the XLA
    path and their call no more than 1% slower than a byte at a time; else **gpu_int4_pairs=False**."""
    lines, keep = _against_twins(rows, ":bytes", ("int4",), "its codes read in pairs", "a byte at a time")
    if keep is None:
        return lines + ["int4 pairs: no `fused_kernel_tiles_unpack.json` pair (`unpack_ab`)"] if rows else []
    return lines + ["int4 pairs: " + ("`gpu_int4_pairs` stays on" if keep else "**gpu_int4_pairs=False**")]


def compare_old_kernel(tiles: list[dict[str, Any]], old: list[dict[str, Any]]) -> list[str]:
    """The fused kernel alone now against the code before the masked-logit select (`kernel_tiles_old`), each
    storage, context and tile both files timed."""
    def timed(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
        return {(r["kv_dtype"], r["context"], r["tile"]): r for r in rows if "us" in r}

    now, before = timed(tiles), timed(old)
    lines = [f"{k[0]} kernel alone at {k[1]} tokens, {k[2]}: {now[k]['us']:.1f} us now "
             f"({100 * now[k]['copy_fraction']:.0f}% of copy), {before[k]['us']:.1f} us before the masked-logit "
             f"select ({100 * before[k]['copy_fraction']:.0f}%): {before[k]['us'] / now[k]['us']:.3f}x"
             for k in now if k in before]
    return lines if old else []


def report(outs: Sequence[str]) -> str:
    """The choices from the device commands' folders (a later folder's file wins)."""
    def load(name: str) -> list[dict[str, Any]]:
        return next((rows for rows in (db.load(out, name) for out in reversed(outs)) if rows), [])

    layers = next((db.model_layers(out, "weight_products.json") for out in reversed(outs)
                   if db.model_layers(out, "weight_products.json")), 0)
    graphs = {v: load(f"graphs_{v}.json") for v in ("today", "while", "while_unroll", "concurrent")}
    lines = choose_kernels(load("bars.json"), graphs["today"], load("fused_decode.json"))
    lines += choose_slots(load("bars.json"), graphs["today"])
    lines += choose_tile(load("weight_products.json"), layers)
    lines += choose_flags({v: rows for v, rows in graphs.items() if rows}, load("bars.json"))
    lines += choose_quantized(load("quant_ab.json"), tuning.default("gpu").auto_fused_quantized)
    lines += choose_quantized_tile(load("fused_kernel_tiles.json"), load("quant_blocks.json"),
                                   load("fused_kernel_tiles_unpack.json"))
    lines += compare_old_kernel(load("fused_kernel_tiles.json"), load("fused_kernel_tiles_old.json"))
    lines += choose_unpack(load("fused_kernel_tiles_unpack.json"))
    lines += choose_int4_pairs(load("fused_kernel_tiles_unpack.json"))
    return "\n".join(f"* {line}" for line in lines) + "\n"


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outs", nargs="+", help="The device commands' result folders.")
    args = p.parse_args(argv)
    missing = [out for out in args.outs if not os.path.isdir(out)]
    if missing:
        p.error(f"no such folder: {', '.join(missing)}")
    print(report(args.outs), end="")


if __name__ == "__main__":
    main(sys.argv[1:])
