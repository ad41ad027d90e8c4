"""kvjax's GGUF reader and de-quantizers against the `gguf` package (llama.cpp's own Python reader and NumPy
de-quantization, an independent implementation), block by block and bit for bit.

Every type kvjax reads gets random blocks: once with finite float16 scales (the weights a model holds), once with
every byte random (NaN / inf scales: both sides must agree there too), in odd shapes (one row, one block, rows
not a multiple of anything but the block size, 1-D and 3-D tensors), and through the chunked row path with chunk
boundaries in the middle of the tensor.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kvjax.models import gguf_quants as q  # noqa: E402
from kvjax.models.gguf_file import GgufFormatError, read_gguf  # noqa: E402

# Where each block keeps its float16 scales (ggml-common.h), set to finite values for the "finite" blocks.
_HALF_OFFSETS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip
_FLOATS = {"F32": np.float32, "F16": np.float16}
SHAPES = [(1, 1), (1, 5), (7, 3), (13, 1), (3,), (2, 3, 2)]  # in blocks along the last axis


def _blocks(kind: str, shape_in_blocks: tuple[int, ...], finite: bool, seed: int) -> tuple[np.ndarray, tuple]:
    """Raw bytes ``[rows, row_bytes]`` and the weights' shape."""
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    shape = (*shape_in_blocks[:-1], shape_in_blocks[-1] * block)
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    rng = np.random.default_rng(seed)
    n_blocks = rows * shape_in_blocks[-1]
    if finite and kind in _FLOATS:
        raw = (rng.standard_normal(n_blocks) * 3).astype(_FLOATS[kind]).view(np.uint8).reshape(n_blocks, nbytes)
    elif finite and kind == "BF16":
        raw = (rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        raw = raw.view(np.uint8).reshape(n_blocks, nbytes)
    else:
        raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
        if finite:
            for offset in _HALF_OFFSETS[kind]:
                halves = rng.uniform(-2.0, 2.0, (n_blocks, 1)).astype(np.float16)
                raw[:, offset : offset + 2] = halves.view(np.uint8)
    return raw.reshape(rows, -1), shape


def _reference(raw: np.ndarray, kind: str, shape: tuple) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float32).reshape(shape)


def _assert_blocks_equal(ours: np.ndarray, theirs: np.ndarray, block: int, what: str) -> None:
    a, b = ours.reshape(-1, block), theirs.reshape(-1, block)
    same = np.all((a == b) | (np.isnan(a) & np.isnan(b)), axis=1)
    if not same.all():
        i = int(np.flatnonzero(~same)[0])
        raise AssertionError(f"{what}: block {i} of {len(same)} differs: ours {a[i][:8]}... gguf {b[i][:8]}...")


@pytest.mark.parametrize("kind", list(q.DEQUANTIZERS))
@pytest.mark.parametrize("finite", [True, False], ids=["finite", "random_bytes"])
def test_dequantize_matches_gguf_block_by_block(kind, finite):
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    for i, blocks in enumerate(SHAPES):
        raw, shape = _blocks(kind, blocks, finite, seed=100 * i + len(kind))
        theirs = _reference(raw, kind, shape)
        with np.errstate(all="ignore"):
            ours = q.dequantize(raw, kind, shape)
        assert ours.shape == shape and ours.dtype == np.float32
        if finite:
            assert np.isfinite(theirs).all() and np.abs(theirs).max() > 0
        _assert_blocks_equal(ours, theirs, block, f"{kind} {shape}")


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_1", "Q3_K", "Q4_K", "Q6_K", "BF16"])
def test_row_chunks_cover_the_tensor_once(kind):
    """Chunks of a bounded number of rows (here 3, 4 or 6 rows of 2 blocks), aligned to ``align_rows``, in order,
    converted into the requested dtype: their concatenation is the whole-tensor reference."""
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    raw, shape = _blocks(kind, (17, 2), True, seed=7)
    theirs = _reference(raw, kind, shape)
    for chunk_rows, align, dtype in ((3, 1, np.float32), (4, 2, np.float32), (5, 3, np.float16)):
        parts = list(q.dequantize_rows(raw, kind, shape[1], dtype, chunk_weights=chunk_rows * 2 * block,
                                       align_rows=align))
        starts = [s for s, _ in parts]
        assert starts == list(range(0, 17, starts[1])) and all(s % align == 0 for s in starts)
        assert all(p.dtype == dtype and p.shape[0] <= max(chunk_rows, align) for _, p in parts)
        np.testing.assert_array_equal(np.concatenate([p for _, p in parts]), theirs.astype(dtype))


def test_bad_row_lengths_are_refused():
    raw = np.zeros((2, 18), np.uint8)
    with pytest.raises(ValueError, match="not a whole number of 32-blocks"):
        list(q.dequantize_rows(raw, "Q4_0", 40))
    with pytest.raises(ValueError, match="take 36 bytes, got an array of shape"):
        list(q.dequantize_rows(raw, "Q4_0", 64))
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        list(q.dequantize_rows(raw, "IQ2_XXS", 256))


def test_type_table_matches_gguf():
    for type_id, t in q.GGML_TYPES.items():
        theirs = gguf.GGMLQuantizationType(type_id)
        assert theirs.name == t.name
        if t.block_size is not None:
            assert gguf.GGML_QUANT_SIZES[theirs] == (t.block_size, t.type_size)


def _write_every_kind(path) -> dict:
    """A GGUF with every metadata value type and a tensor of every type kvjax reads (odd shapes)."""
    w = gguf.GGUFWriter(str(path), "llama")
    meta = {"t.u8": (w.add_uint8, 200), "t.i8": (w.add_int8, -5), "t.u16": (w.add_uint16, 60000),
            "t.i16": (w.add_int16, -300), "t.u32": (w.add_uint32, 4_000_000_000), "t.i32": (w.add_int32, -7),
            "t.f32": (w.add_float32, 0.25), "t.u64": (w.add_uint64, 2**40), "t.i64": (w.add_int64, -(2**40)),
            "t.f64": (w.add_float64, 1e-300), "t.bool": (w.add_bool, True), "t.str": (w.add_string, "héllo ☀"),
            "t.ints": (w.add_array, [1, 2, 3]), "t.strs": (w.add_array, ["a", "", "ü"]),
            "t.floats": (w.add_array, [0.5, -1.5])}
    for key, (add, value) in meta.items():
        add(key, value)
    shapes = {}
    for i, kind in enumerate(q.DEQUANTIZERS):
        raw, shape = _blocks(kind, (3, 2) if i % 2 else (5,), True, seed=i)
        gtype = gguf.GGMLQuantizationType[kind]
        if kind in _FLOATS:
            w.add_tensor(f"t{i}.{kind}", raw.view(_FLOATS[kind]).reshape(shape))
        else:
            w.add_tensor(f"t{i}.{kind}", raw, raw_dtype=gtype)
        shapes[f"t{i}.{kind}"] = shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: v for k, (_, v) in meta.items()}


def test_reader_matches_gguf(tmp_path):
    path = tmp_path / "every.gguf"
    written = _write_every_kind(path)
    ours = read_gguf(path)
    theirs = gguf.GGUFReader(str(path))
    for key, value in written.items():
        assert ours.metadata[key] == pytest.approx(value) if isinstance(value, float) else ours.metadata[key] == value
    assert set(ours.metadata) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.type_name, a.shape, a.offset, a.nbytes) == (
            b.tensor_type.name, tuple(reversed(b.shape.tolist())), b.data_offset, int(b.n_bytes))
        np.testing.assert_array_equal(ours.raw_rows(a).reshape(-1), np.asarray(b.data).reshape(-1).view(np.uint8))
        kind = a.type_name
        _assert_blocks_equal(q.dequantize(ours.raw_rows(a), kind, a.shape), _reference(np.asarray(b.data), kind,
                             a.shape), a.ggml_type.block_size, a.name)


def test_reader_refuses_damaged_files(tmp_path):
    path = tmp_path / "every.gguf"
    _write_every_kind(path)
    data = path.read_bytes()
    cases = {
        "short": (data[:20], "too short"),
        "header": (data[:300], "truncated"),
        "data": (data[:-10], "truncated"),
        "magic": (b"GGML" + data[4:], "magic"),
        "version": (data[:4] + (7).to_bytes(4, "little") + data[8:], "version 7"),
        "big_endian": (data[:4] + (3).to_bytes(4, "big") + data[8:], "big-endian"),
        "tensors": (data[:8] + (2**40).to_bytes(8, "little") + data[16:], "tensor count"),
        "fields": (data[:16] + (2**50).to_bytes(8, "little") + data[24:], "metadata count"),
    }
    for name, (blob, match) in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(blob)
        with pytest.raises(GgufFormatError, match=match):
            read_gguf(bad)
