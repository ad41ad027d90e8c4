"""The XLA:GPU command-buffer (CUDA graph) variants of issue 57's A/B, and what each really sets.

    python benchmarks/xla_flags.py --out=/tmp/xla_flags.json          # each variant's effective debug options
    python benchmarks/xla_flags.py --print=while                      # the XLA_FLAGS of a variant (or profile)

`--xla_gpu_enable_command_buffer` takes either a plain list of command types, which *replaces* XLA's default list
(a list without FUSION stops capturing fusions), or `+TYPE` / `-TYPE` entries, which add to / remove from the
defaults. The token loop is a `while`, which the defaults do not capture (each iteration returns to the host), so
the variants add WHILE with `+WHILE`.

`effective(flags)` checks what a flag string really sets on the installed jaxlib: it compiles a trivial program in
a child process with `--xla_dump_to` and reads the debug options XLA compiled it with (the dump's
`compile_options.textproto`), so a flag that did not parse, or a list that dropped the defaults, shows before a
GPU minute is spent. XLA parses the debug options the same way for every backend (the GPU flags are recorded on
CPU too), so the children run on the CPU backend, all at once.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

#: The A/B variants: XLA_FLAGS added to the process's own (`today`: none).
VARIANTS: dict[str, str] = {
    "today": "",
    "while": "--xla_gpu_enable_command_buffer=+WHILE",
    "while_unroll": "--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_command_buffer_unroll_loops=true",
    "concurrent": "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT_REGIONS",
    # Not a graph variant: GEMMs without split-K, so a GEMM's epilogue can take the residual add (the fused decode
    # path compiles to 12 launches per layer for an H200 instead of 14; BENCHMARKS.md). Slower GEMVs, or not: the
    # device command's split_k_ab stage times it.
    "no_split_k": "--xla_gpu_experimental_force_split_k=1",
    # Command buffers off (the empty set), for an A/B of graphs against none.
    "no_graphs": "--xla_gpu_enable_command_buffer=",
}
#: Profiles keep command buffers on only with this (else XLA runs op by op under the profiler).
PROFILE_WITH_GRAPHS = "--xla_enable_command_buffers_during_profiling=true"

_CHILD = "import jax, jax.numpy as jnp; jax.jit(lambda x: x * 2 + 1)(jnp.ones(8)).block_until_ready()"
_KEYS = ("xla_gpu_enable_command_buffer", "xla_gpu_command_buffer_unroll_loops",
         "xla_gpu_command_buffer_scheduling_mode", "xla_enable_command_buffers_during_profiling",
         "xla_gpu_graph_min_graph_size", "xla_gpu_command_buffer_update_mode", "xla_gpu_experimental_force_split_k")


def effective(flags: str) -> dict:
    """The command-buffer options XLA compiles with when the process runs with `XLA_FLAGS=flags` (plus any XLA_FLAGS
    already set): `{"command_buffer_types": [...], option: value, ...}`, or `{"error": ...}` when the child fails
    (a flag XLA does not know aborts it)."""
    return effective_all([flags])[0]


def effective_all(variants: list[str]) -> list[dict]:
    """`effective` of each flag string, the children run at once on the CPU backend (XLA parses its debug options
    the same way for every backend, and no child takes the accelerator's memory)."""
    with tempfile.TemporaryDirectory() as root:
        procs = []
        for i, flags in enumerate(variants):
            dump = os.path.join(root, str(i))
            env = dict(os.environ, JAX_PLATFORMS="cpu",
                       XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags} --xla_dump_to={dump}".strip())
            procs.append((dump, subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True)))
        return [_read(dump, proc) for dump, proc in procs]


def _read(dump: str, proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=300)
    if proc.returncode:
        return dict(error=(stderr or stdout)[-600:])
    files = sorted(glob.glob(os.path.join(dump, "*", "compile_options.textproto")))
    if not files:
        return dict(error="XLA wrote no compile_options.textproto")
    with open(files[-1]) as f:
        lines = [line.strip() for line in f if ":" in line]
    out: dict = {"command_buffer_types": []}
    for line in lines:
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "xla_gpu_enable_command_buffer":
            out["command_buffer_types"].append(value)
        elif key in _KEYS:
            out[key] = value
    return out


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON file: every variant's effective options.")
    p.add_argument("--print", dest="show", default=None,
                   help="Print one variant's XLA_FLAGS (or `profile`: graphs on under the profiler) and exit.")
    p.add_argument("--quick", action="store_true", help="Accepted for the smoke runner (nothing changes).")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.show is not None:
        known = {**VARIANTS, "profile": PROFILE_WITH_GRAPHS}
        if args.show not in known:
            raise SystemExit(f"xla_flags.py: unknown variant {args.show!r}; choose from {sorted(known)}")
        print(known[args.show])
        return {}
    import jax

    named = {**VARIANTS, "plain_list_replaces": "--xla_gpu_enable_command_buffer=WHILE", "profile": PROFILE_WITH_GRAPHS}
    got = dict(zip(named, effective_all(list(named.values())), strict=True))
    defaults = got["today"]
    rows = []
    for name, flags in named.items():
        kept = set(defaults.get("command_buffer_types", [])) <= set(got[name].get("command_buffer_types", []))
        rows.append(dict(variant=name, flags=flags, effective=got[name], keeps_default_types=kept))
    result = dict(benchmark="xla_flags", jax=jax.__version__, backend=jax.default_backend(),
                  xla_flags=os.environ.get("XLA_FLAGS", ""), default_types=defaults.get("command_buffer_types"),
                  rows=rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    run()
