"""What a compiled program launches, read from its optimized HLO (`jax.jit(f).lower(...).compile().as_text()`).

Used by `decode_profile.py` (kernels per decode step and per layer, on any backend, without a profiler) and
`fused_decode.py`. The text is parsed per computation; an instruction "launches" unless it only names or
regroups buffers (parameters, constants, tuples, bitcasts, ...). On a GPU that is a kernel (a fusion, a
library or Pallas custom call, a copy, an unfused scatter); on CPU a thunk. Fusions count as one each; their
fused computations are not launches.

* `launches(text, body_only=True)`: counts by kind (the opcode; fusions by their name stem, e.g.
  `loop_pad_fusion`, `input_scatter_fusion`, and custom calls by target) in the `while` bodies (the token
  loop's step) or in the whole program.
* `strays(text)`: the copies, transposes and pads among them (standalone or the root of a fusion): shape, fusion
  and the source line XLA recorded, the layout traffic a fused decode step should not have.
* `graphs(text)`: XLA:GPU command buffers (`--xla_gpu_enable_command_buffer`): how many regions, what they
  capture, what runs outside them (a `while` outside means the token loop returns to the host each iteration; a
  Pallas custom call outside splits a region). All zero off GPU.
"""

from __future__ import annotations

import collections
import re
from typing import Any

#: Opcodes that launch nothing: they name, regroup or alias buffers.
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
                   "replica-id", "opt-barrier", "optimization-barrier", "add-dependency", "copy-start", "copy-done",
                   "domain"})
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"[\]\})] ([a-z][a-z0-9_\-]*)\(")
_STRAY = ("copy", "transpose", "pad")


def _computations(text: str) -> dict[str, list[dict[str, Any]]]:
    comps: dict[str, list[dict[str, Any]]] = {}
    current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header[2]
            comps[current] = []
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line) if current else None
        if m is None:
            continue
        op = _OPCODE.search(m[3])
        if op is None:
            continue
        comps[current].append(dict(name=m[2], opcode=op[1], root=bool(m[1]), text=m[3],
                                   shape=m[3][:op.start() + 1].strip()))
    return comps


def _frames(text: str) -> dict[int, list[str]]:
    """stack_frame_id -> the frames' `file:line function`, innermost first (the StackFrames tables XLA prints)."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            tables[section] = {}
            continue
        m = re.match(r"^(\d+) (.*)$", line) if section else None
        if m is None:
            section = None if line.startswith("%") or line.startswith("ENTRY") else section
            continue
        tables[section][int(m[1])] = m[2]
    files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})

    def location(i: int) -> str:
        f = dict(re.findall(r"(\w+)=(\d+)", tables["FileLocations"].get(i, "")))
        name = files.get(int(f.get("file_name_id", 0)), '"?"').strip('"')
        name = name.split("/kvjax/")[-1] if "/kvjax/" in name else name.rsplit("/", 1)[-1]
        return f"{name}:{f.get('line', '?')} {funcs.get(int(f.get('function_name_id', 0)), '').strip(chr(34))}"

    out: dict[int, list[str]] = {}
    for frame in tables.get("StackFrames", {}):
        chain, seen, at = [], set(), frame
        while at and at not in seen and at in tables["StackFrames"]:
            seen.add(at)
            f = dict(re.findall(r"(\w+)=(\d+)", tables["StackFrames"][at]))
            chain.append(location(int(f.get("file_location_id", 0))))
            at = int(f.get("parent_frame_id", 0))
        out[frame] = chain
    return out


def source(instr: dict[str, Any], frames: dict[int, list[str]]) -> str | None:
    """The innermost kvjax frame (`file:line function`) of an instruction, else its op_name."""
    m = re.search(r"stack_frame_id=(\d+)", instr["text"])
    chain = frames.get(int(m[1]), []) if m else []
    ours = [f for f in chain if f.startswith(("kvjax/", "benchmarks/")) or ".py" in f.split(":")[0]
            and "site-packages" not in f]
    if ours:
        return ours[0]
    name = re.search(r'op_name="([^"]+)"', instr["text"])
    return name[1][-120:] if name else None


def _called(instr: dict[str, Any], key: str) -> list[str]:
    return re.findall(rf"{key}=%([\w.\-]+)", instr["text"])


def _stem(name: str) -> str:
    return re.sub(r"(\.\d+)+$", "", name)


def _kind(instr: dict[str, Any]) -> str:
    if instr["opcode"] == "fusion":
        return _stem(instr["name"])
    if instr["opcode"] == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', instr["text"])
        return f"custom-call:{target[1] if target else '?'}"
    return instr["opcode"]


def _bodies(comps: dict[str, list[dict[str, Any]]]) -> list[str]:
    return sorted({c for instrs in comps.values() for i in instrs if i["opcode"] == "while"
                   for c in _called(i, "body")})


def _reachable_launches(comps: dict, names: list[str]) -> list[dict[str, Any]]:
    """The launching instructions of `names` and of the computations they call (calls, conditionals, nested
    loops), fused computations excluded."""
    out, seen, todo = [], set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for instr in comps[name]:
            if instr["opcode"] == "fusion":
                out.append(instr)
                continue
            for key in ("to_apply", "body", "condition", "branch_computations", "true_computation",
                        "false_computation", "calls"):
                todo += _called(instr, key)
            if instr["opcode"] == "conditional":
                todo += re.findall(r"%([\w.\-]+)", instr["text"].split("branch_computations=")[-1])
            if instr["opcode"] not in _FREE and instr["opcode"] not in ("call", "while", "conditional"):
                out.append(instr)
    return out


def _roots(text: str, comps: dict, body_only: bool) -> list[str]:
    """The `while` bodies, or the entry computation."""
    if body_only:
        return _bodies(comps)
    entry = re.search(r"^ENTRY\s+%([\w.\-]+)", text, re.M)
    return [entry[1]] if entry else []


def launches(text: str, body_only: bool = True) -> dict[str, int]:
    """Launches by kind in the `while` bodies (`body_only`) or in the whole program, plus their `total`."""
    comps = _computations(text)
    roots = _roots(text, comps, body_only)
    counts = collections.Counter(_kind(i) for i in _reachable_launches(comps, roots))
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])), total=sum(counts.values()))


def strays(text: str, body_only: bool = True, limit: int = 40) -> list[dict[str, Any]]:
    """Copies, transposes and pads among the launches (standalone, or a fusion whose root is one)."""
    comps = _computations(text)
    roots = _roots(text, comps, body_only)
    frames = _frames(text)
    found = []
    for instr in _reachable_launches(comps, roots):
        what = instr["opcode"]
        if what == "fusion":
            fused = _called(instr, "calls")
            root = next((i for c in fused for i in comps.get(c, []) if i["root"]), None)
            what = root["opcode"] if root else what
        if what in _STRAY:
            found.append(dict(kind=_kind(instr), op=what, shape=instr["shape"], source=source(instr, frames)))
    return found[:limit]


def graphs(text: str) -> dict[str, Any]:
    """XLA:GPU command-buffer regions (computations XLA outlined as `command_buffer*`): their count, the launches
    they capture, and the launches of the program that stay outside them (by kind)."""
    comps = _computations(text)
    regions = [n for n in comps if n.startswith("command_buffer")]
    inside = collections.Counter(_kind(i) for i in _reachable_launches(comps, regions))
    everything = _reachable_launches(comps, _roots(text, comps, False))
    captured = {id(i) for i in _reachable_launches(comps, regions)}
    outside = collections.Counter(_kind(i) for i in everything if id(i) not in captured)
    loops = [i for c in comps.values() for i in c if i["opcode"] == "while"]
    loops_inside = sum(1 for r in regions for i in comps[r] if i["opcode"] == "while")
    return dict(regions=len(regions), captured=dict(inside), outside=dict(outside), loops=len(loops),
                loops_in_regions=loops_inside)


def by_source(text: str, body_only: bool = True) -> list[tuple[int, str, str]]:
    """`(count, kind, source line)` of the launches, most frequent first: which line of kvjax each kernel comes
    from (what a fold or a fused kernel would remove)."""
    comps = _computations(text)
    frames = _frames(text)
    counts = collections.Counter((_kind(i), source(i, frames) or "-")
                                 for i in _reachable_launches(comps, _roots(text, comps, body_only)))
    return [(n, kind, where) for (kind, where), n in counts.most_common()]


_THUNK = re.compile(r"^(\s*)\d+:\s+(k\w+)\s")
#: Thunks that launch nothing themselves: they sequence, loop over or capture other thunks.
_STRUCTURAL = frozenset({"kCommandBuffer", "kWhile", "kConditional", "kSequential"})


def thunk_loop(text: str) -> dict[str, Any]:
    """The token loop in XLA:GPU's thunk sequence (`*.thunk_sequence_after_thunk_passes.txt` of `--xla_dump_to`,
    where jaxlib 0.10's XLA forms its command buffers), for the `kWhile` body that launches most: `launches`
    (kernels, copies, library calls), `body_regions` (command-buffer, i.e. CUDA-graph, regions at the body's top
    level) and `in_body_regions` (the launches in them), `loop_captured` (the `kWhile` itself inside a command
    buffer; else each iteration returns to the host for its condition) and `in_graphs` (the launches that run
    inside a CUDA graph either way)."""
    raw = text.splitlines()
    lines = [(len(m[1]), m[2]) for m in map(_THUNK.match, raw) if m]
    best: dict[str, Any] = {}
    for i, line in enumerate(raw):
        if line.strip() != "body:":
            continue
        body = [m for m in map(_THUNK.match, raw[i + 1:]) if m]
        if not body:
            continue
        top = len(body[0][1])
        members = []
        for m in body:
            if len(m[1]) < top:
                break
            members.append((len(m[1]), m[2]))
        region_depth = None
        inside = outside = regions = 0
        for indent, kind in members:
            if indent == top:
                region_depth = indent if kind == "kCommandBuffer" else None
                regions += kind == "kCommandBuffer"
            if kind in _STRUCTURAL:
                continue
            if region_depth is not None and indent > region_depth:
                inside += 1
            else:
                outside += 1
        if inside + outside > best.get("launches", -1):
            best = dict(launches=inside + outside, body_regions=regions, in_body_regions=inside)
    def enclosing(j: int) -> str | None:  # the thunk a line is nested in: the nearest earlier one indented less
        return next((lines[i][1] for i in range(j - 1, -1, -1) if lines[i][0] < lines[j][0]), None)

    whiles = [j for j, (_, kind) in enumerate(lines) if kind == "kWhile"]
    best["loop_captured"] = bool(whiles) and all(enclosing(j) == "kCommandBuffer" for j in whiles)
    best["in_graphs"] = best.get("launches", 0) if best["loop_captured"] else best.get("in_body_regions", 0)
    return best


def compile_with_thunks(lowered: Any) -> tuple[Any, dict[str, Any]]:
    """`lowered.compile()` with XLA's dumps in a temporary directory, and `thunk_loop` of the thunk sequence it
    wrote ({} where the backend writes none: XLA:CPU)."""
    import glob
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as dump:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        found = glob.glob(os.path.join(dump, "*.thunk_sequence_after_thunk_passes.txt"))
        return compiled, (thunk_loop(open(sorted(found)[-1]).read()) if found else {})
