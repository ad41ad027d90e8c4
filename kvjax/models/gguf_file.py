"""A GGUF file's metadata and tensor table, read by kvjax itself (NumPy, a memory map; no ``gguf`` package).

GGUF (llama.cpp's format, versions 2 and 3, little-endian): the magic ``GGUF``, a uint32 version, uint64 counts of
tensors and of metadata pairs; each pair a string key (uint64 length + UTF-8), a uint32 value type and the value
(``ARRAY``: a uint32 element type, a uint64 count, the elements); each tensor its name, a uint32 number of
dimensions, the uint64 dimensions (fastest first), a uint32 GGML type and a uint64 offset into the data section,
which starts at the next multiple of ``general.alignment`` (default 32) after the table. Numeric arrays (262144
token scores) are read as one NumPy view each; only strings are decoded one by one.

Any structural damage (a short file, a bad magic, counts larger than the file) raises :class:`GgufFormatError`
before a tensor is touched; :func:`read_gguf` checks that every tensor of a known type lies inside the file.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import struct
from typing import Any

import numpy as np

from kvjax.models.gguf_quants import GGML_TYPES, GgmlType

__all__ = ["GgufFile", "GgufFormatError", "GgufTensor", "is_gguf_file", "read_gguf"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# value type id -> (struct format, numpy dtype) for the fixed-size scalars
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}  # fmt: skip
_STRING, _ARRAY, _BOOL = 8, 9, 7


class GgufFormatError(ValueError):
    """The bytes are not a well-formed GGUF file (truncated, damaged or another format)."""


@dataclasses.dataclass(frozen=True)
class GgufTensor:
    """One tensor of the table: ``shape`` in NumPy order (slowest axis first), its type, and its bytes' place."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GgmlType
    type_id: int
    offset: int  # from the start of the file
    nbytes: int | None  # None for a type kvjax does not know the block size of

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


@dataclasses.dataclass
class GgufFile:
    path: pathlib.Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GgufTensor]
    data: np.ndarray  # the whole file, a read-only uint8 memory map

    def raw_rows(self, tensor: GgufTensor) -> np.ndarray:
        """The tensor's bytes as ``[rows, bytes per row]`` uint8 (a view of the memory map)."""
        if tensor.nbytes is None:
            raise GgufFormatError(f"tensor {tensor.name!r} has type {tensor.type_name}, whose size is unknown")
        rows = int(np.prod(tensor.shape[:-1], dtype=np.int64)) if len(tensor.shape) > 1 else 1
        return self.data[tensor.offset : tensor.offset + tensor.nbytes].reshape(rows, -1)


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GgufFormatError(f"the file ends at byte {len(self.buf)} inside its header (truncated)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def count(self, what: str, min_item_bytes: int) -> int:
        n = self.take("<Q")
        if n * min_item_bytes > len(self.buf) - self.pos:
            raise GgufFormatError(f"{what} count {n} does not fit in the {len(self.buf)}-byte file (truncated or "
                                  "damaged)")
        return n

    def string(self) -> str:
        n = self.count("string length", 1)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GgufFormatError(f"a string at byte {self.pos - n} is not UTF-8 ({e})") from None

    def array(self, item_type: int) -> Any:
        if item_type == _STRING:
            return [self.string() for _ in range(self.count("array", 8))]
        if item_type not in _SCALARS:
            raise GgufFormatError(f"array of value type {item_type} is not a GGUF type")
        dtype = np.dtype(_SCALARS[item_type][1])
        n = self.count("array", dtype.itemsize)
        values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
        self.pos += n * dtype.itemsize
        return values.astype(bool).tolist() if item_type == _BOOL else values.tolist()

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array(self.take("<I"))
        if value_type not in _SCALARS:
            raise GgufFormatError(f"value type {value_type} is not a GGUF type")
        value = self.take(_SCALARS[value_type][0])
        return bool(value) if value_type == _BOOL else value


def _tensor_nbytes(name: str, shape: tuple[int, ...], t: GgmlType) -> int | None:
    if t.block_size is None or t.type_size is None:
        return None
    if shape and shape[-1] % t.block_size:
        raise GgufFormatError(f"tensor {name!r}: rows of {shape[-1]} are not whole {t.name} blocks of {t.block_size}")
    return int(np.prod(shape, dtype=np.int64)) // t.block_size * t.type_size


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file named ``*.gguf`` or one starting with the GGUF magic (a file named otherwise,
    e.g. an Ollama blob, is a GGUF file too when its first bytes say so)."""
    path = pathlib.Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(len(_MAGIC)) == _MAGIC
    except OSError:
        return False


def read_gguf(path: str | os.PathLike[str]) -> GgufFile:
    """The metadata (a dict of Python values) and tensor table of a GGUF file; the tensors stay in the memory map."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    if size < 24:
        raise GgufFormatError(f"{size} bytes is too short for a GGUF header (truncated)")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))
    magic = bytes(cur.buf[:4])
    cur.pos = 4
    if magic != _MAGIC:
        raise GgufFormatError(f"the file starts with {magic!r}, not GGUF's magic {_MAGIC!r}")
    version = cur.take("<I")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in (2, 3):
            raise GgufFormatError("a big-endian GGUF file; kvjax reads little-endian ones")
        raise GgufFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = cur.count("tensor", 8 + 4 + 4 + 8)
    n_fields = cur.count("metadata", 8 + 4)
    metadata: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        if n_dims > 8:
            raise GgufFormatError(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(cur.take("<Q") for _ in range(n_dims))
        type_id, offset = cur.take("<I"), cur.take("<Q")
        table.append((name, tuple(reversed(dims)), type_id, offset))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
        raise GgufFormatError(f"general.alignment={alignment!r} is not a positive multiple of 8")
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, type_id, offset in table:
        t = GGML_TYPES.get(type_id, GgmlType(f"type id {type_id}"))
        nbytes = _tensor_nbytes(name, shape, t)
        if start + offset + (nbytes or 0) > size:
            raise GgufFormatError(f"tensor {name!r} ends at byte {start + offset + (nbytes or 0)} of a {size}-byte "
                                  "file (truncated)")
        tensors.append(GgufTensor(name, shape, t, type_id, start + offset, nbytes))
    return GgufFile(path, version, metadata, tensors, data)
