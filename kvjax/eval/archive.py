"""Packed run archives: every run directory of one leaderboard panel in one ``<name>.runs.tar.xz``.

    python -m kvjax.eval.archive pack results/leaderboard/smollm2-135m --context_length=2048 \\
        --out=docs/leaderboard/runs/smollm2-135m-2k.runs.tar.xz
    tar -xJf docs/leaderboard/runs/smollm2-135m-2k.runs.tar.xz -C results/leaderboard   # the run directories back

An archive is a plain tar of the run directories' files, byte for byte, under ``<model>/<run dir>/``, so
extracting it into ``results/leaderboard`` gives back what ``make leaderboard`` resumes from. Packing is
deterministic (sorted names, zeroed owners and times, one xz preset): the same runs give the same bytes.

``kvjax.eval.report`` and ``kvjax.eval.leaderboard`` read an archive in place, named directly or found
under a directory they are given, as if its run directories were on disk.
"""

from __future__ import annotations

import io
import json
import lzma
import os
import sys
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvjax.cli.refuse import ArgumentParser, refused
from kvjax.eval.results import CONFIG, METRICS, read_json_object, record_problem
from kvjax.tasks.base import DataError

__all__ = ["SUFFIX", "PackedRun", "find_archives", "is_archive", "main", "pack", "read_archive"]

SUFFIX = ".runs.tar.xz"
_PRESET = 9 | lzma.PRESET_EXTREME
_FORMAT = tarfile.GNU_FORMAT
_RUN_FILES = (CONFIG, METRICS)


@dataclass(frozen=True)
class PackedRun:
    """One run directory read from an archive: ``path`` is ``<archive>/<member dir>`` (for messages)."""

    path: str
    config: dict[str, Any] | None
    metrics: dict[str, Any] | None
    records: list[dict[str, Any]]


def is_archive(path: str) -> bool:
    return path.endswith(SUFFIX) and os.path.isfile(path)


def find_archives(paths: Sequence[str]) -> list[str]:
    """Archives named in ``paths`` or found (recursively) under the directories among them."""
    found: list[str] = []
    for root in paths:
        if is_archive(root):
            found.append(root)
        elif os.path.isdir(root):
            for d, _, files in os.walk(root):
                found.extend(os.path.join(d, f) for f in files if f.endswith(SUFFIX))
    return sorted(set(found))


def _is_predictions(name: str) -> bool:
    return name.startswith("predictions") and name.endswith(".jsonl")


def _json_object(data: bytes, where: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {where}: {e}") from None
    return obj if isinstance(obj, dict) else None


def _records(data: bytes, where: str, seen: set[str]) -> Iterator[dict[str, Any]]:
    """The records of one packed predictions file, the first of each sample id kept (as on disk)."""
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        rec = _json_object(raw, f"{where}:{lineno}")
        problem = record_problem(rec)
        if problem:
            raise DataError(f"{where}:{lineno}: prediction record {problem}")
        if str(rec["id"]) not in seen:
            seen.add(str(rec["id"]))
            yield rec


def read_archive(path: str) -> list[PackedRun]:
    """Every run directory packed in ``path``, in name order."""
    files: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(path, "r:xz") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                run_dir, name = os.path.split(member.name)
                if name in _RUN_FILES or _is_predictions(name):
                    handle = tar.extractfile(member)
                    files.setdefault(run_dir, {})[name] = handle.read() if handle else b""
    except (OSError, EOFError, tarfile.TarError, lzma.LZMAError) as e:
        raise DataError(f"cannot read run archive {path}: {e}") from None
    runs = []
    for run_dir in sorted(files):
        where = f"{path}/{run_dir}"
        found = files[run_dir]
        seen: set[str] = set()
        records = [
            rec for name in sorted(n for n in found if _is_predictions(n))
            for rec in _records(found[name], f"{where}/{name}", seen)
        ]
        config, metrics = (_json_object(found[n], f"{where}/{n}") if n in found else None for n in _RUN_FILES)
        runs.append(PackedRun(where, config, metrics, records))
    return runs


def _run_dirs(src: str, context_length: int | None) -> list[str]:
    """Run directories under ``src`` (those holding a config.json), of one context length if given."""
    out = []
    for d, _, names in os.walk(src):
        if CONFIG not in names:
            continue
        if context_length is not None and (
                read_json_object(os.path.join(d, CONFIG)) or {}).get("context_length") != context_length:
            continue
        out.append(d)
    return sorted(out)


def pack(src: str, out: str, context_length: int | None = None) -> int:
    """Packs the run directories under ``src`` into ``out`` as ``<basename(src)>/<run dir>/<file>``;
    returns how many run directories went in."""
    if not out.endswith(SUFFIX):
        raise DataError(f"an archive's name ends with {SUFFIX}: {out}")
    dirs = _run_dirs(src, context_length)
    if not dirs:
        raise DataError(f"no run directories under {src}" + (f" at {context_length}" if context_length else ""))
    base = os.path.dirname(os.path.abspath(src))
    tmp = f"{out}.tmp-{os.getpid()}"  # written aside and renamed into place: a failed pack leaves nothing
    try:
        with lzma.open(tmp, "wb", preset=_PRESET) as xz, tarfile.open(fileobj=xz, mode="w", format=_FORMAT) as tar:
            for d in dirs:
                for name in sorted(n for n in os.listdir(d) if n in _RUN_FILES or _is_predictions(n)):
                    with open(os.path.join(d, name), "rb") as f:
                        data = f.read()
                    info = tarfile.TarInfo(os.path.relpath(os.path.join(os.path.abspath(d), name), base))
                    info.size, info.mode, info.mtime = len(data), 0o644, 0
                    tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return len(dirs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m kvjax.eval.archive", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="pack the run directories under SRC into one archive")
    p.add_argument("src", help="a directory of run directories, e.g. results/leaderboard/smollm2-135m")
    p.add_argument("--out", required=True, help=f"the archive to write (a name ending in {SUFFIX})")
    p.add_argument("--context_length", type=int, default=None, help="only the runs of this context length")
    args = parser.parse_args(argv)
    try:
        n = pack(args.src, args.out, args.context_length)
    except (DataError, OSError) as e:
        return refused("kvjax.eval.archive", e)
    print(f"{args.out}: {n} run directories")
    return 0


if __name__ == "__main__":
    sys.exit(main())
