"""Write a safetensors file tensor by tensor, chunk by chunk, so no more than one chunk is ever in memory.

The format: an 8-byte little-endian header length, a JSON header (``{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {...}}``, offsets relative to the data section, padded here with spaces to a
multiple of 8 bytes), then the tensors' bytes in C order, back to back. The header is written first from the
planned shapes, so the file's size is known before any data is produced (:func:`planned_bytes`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["PlannedTensor", "planned_bytes", "write_safetensors"]

_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}


class PlannedTensor(NamedTuple):
    """A tensor to write: its name, shape and dtype, and a callable giving its C-order chunks (arrays whose
    concatenation along axis 0 is the tensor)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: Callable[[], Iterable[np.ndarray]]


def _header(tensors: Sequence[PlannedTensor], metadata: dict[str, str] | None) -> bytes:
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for t in tensors:
        n = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
        entries[t.name] = {"dtype": _DTYPES[np.dtype(t.dtype)], "shape": list(t.shape),
                           "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def planned_bytes(tensors: Sequence[PlannedTensor], metadata: dict[str, str] | None = None) -> int:
    """The size of the file :func:`write_safetensors` writes for ``tensors``."""
    data = sum(int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize for t in tensors)
    return 8 + len(_header(tensors, metadata)) + data


def write_safetensors(path: str | os.PathLike[str], tensors: Sequence[PlannedTensor],
                      metadata: dict[str, str] | None = None) -> int:
    """Writes ``tensors`` to ``path`` one chunk at a time; returns the bytes written. A chunk of the wrong dtype
    or a tensor whose chunks do not add up to its shape is a ValueError (the file is then incomplete)."""
    header = _header(tensors, metadata)
    written = 0
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        written += 8 + len(header)
        for t in tensors:
            want = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
            got = 0
            for chunk in t.chunks():
                chunk = np.ascontiguousarray(chunk)
                if chunk.dtype != np.dtype(t.dtype):
                    raise ValueError(f"tensor {t.name!r}: a chunk of dtype {chunk.dtype}, planned {t.dtype}")
                f.write(memoryview(chunk).cast("B"))
                got += chunk.nbytes
            if got != want:
                raise ValueError(f"tensor {t.name!r}: its chunks hold {got} bytes, its shape {t.shape} needs {want}")
            written += got
    return written
