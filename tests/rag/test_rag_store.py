"""Document caches: A.1 statistics against NumPy, and save / load with orbax (new process, damage, mismatch)."""

import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from ragdata import DOC_IDS, LAYOUT, PREFIX, QUERY, documents, model_for
from tiny import full_disk_during, tiny_model

from kvjax import rag
from kvjax.errors import CheckpointError, ConfigError, KvjaxError
from kvjax.rag import analysis

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_geometry_of_a_document():
    geo = analysis.geometry(41, 64, LAYOUT)  # init [0, 4), middle [4, 33), local [33, 41)
    keep = np.flatnonzero(np.asarray(geo.keep))
    np.testing.assert_array_equal(keep, np.r_[0:4, 33:41])
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(geo.middle)), np.arange(4, 33))
    assert LAYOUT.middle_blocks(41) == 8 == int(np.asarray(geo.block_valid).sum())
    np.testing.assert_array_equal(np.asarray(geo.block_len)[:9], [4] * 7 + [1, 0])
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(geo.qloc)), np.arange(33, 41))
    short = analysis.geometry(10, 16, LAYOUT)
    assert not np.asarray(short.middle).any() and np.asarray(short.keep).sum() == 10
    with pytest.raises(ConfigError, match="local_blocks"):
        rag.BlockLayout(local_blocks=0)


def _attention_np(q, k, n):
    """Head-averaged causal softmax of the first n tokens, float64: [n, n]."""
    heads, kv = q.shape[1], k.shape[1]
    a = np.zeros((n, n))
    for h in range(heads):
        s = q[:n, h].astype(np.float64) @ k[:n, h // (heads // kv)].T.astype(np.float64) / np.sqrt(q.shape[-1])
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        a += p / p.sum(1, keepdims=True)
    return a / heads


def test_appendix_a1_statistics_match_numpy():
    rng = np.random.default_rng(0)
    n, n_pad = 57, 64
    q = rng.standard_normal((n_pad, 4, 16)).astype(np.float32)
    k = rng.standard_normal((n_pad, 2, 16)).astype(np.float32)
    geo = analysis.geometry(n, n_pad, LAYOUT)
    pos = jnp.where(geo.valid, jnp.arange(n_pad), -1)
    stats = analysis.layer_statistics(jnp.asarray(q), jnp.asarray(k), pos, geo)
    a = _attention_np(q, k, n)
    col = np.array([a[t + 1:, t].mean() if t < n - 1 else 0.0 for t in range(n)])
    block = np.asarray(geo.block)[:n]
    m = LAYOUT.middle_blocks(n)
    alpha = np.zeros(m)
    for b in range(m):
        members = np.flatnonzero(block == b)
        r = members[np.argmax(col[members])]
        assert int(stats["rep_token"][b]) == r
        assert float(stats["unimportance"][b]) == pytest.approx(col[r], rel=1e-4)
        x = np.arange(1, n - r)
        alpha[b] = -np.polyfit(np.log(x), np.log(np.maximum(a[r + x, r], 1e-12)), 1)[0]
    np.testing.assert_allclose(np.asarray(stats["alpha"])[:m], alpha, rtol=1e-3, atol=1e-4)
    assert int(stats["b_max"]) == np.argmin(alpha)
    assert int(stats["b_min"]) == np.argmin([col[np.flatnonzero(block == b)].max() for b in range(m)])
    np.testing.assert_allclose(np.asarray(stats["k_block"])[:m],
                               [k[:n][block == b].mean(0) for b in range(m)], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["k_anchor"]), k[np.asarray(geo.keep)].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["q_loc"]), q[n - 8:n].mean(0), rtol=1e-5, atol=1e-6)


def test_power_law_fit_recovers_the_exponent():
    x = np.arange(1, 400, dtype=np.float32)
    y = np.log(0.3 * x ** -1.37)
    slope, ok = analysis.fit_slope(jnp.log(jnp.asarray(x)), jnp.asarray(y), jnp.ones_like(jnp.asarray(x), bool))
    assert bool(ok) and float(-slope) == pytest.approx(1.37, abs=1e-5)


def test_pauta_is_one_sided_and_needs_eleven_blocks():
    usable = jnp.ones(10, bool)
    worst = jnp.asarray([0.0] + [1.0] * 9)  # the most extreme z-score 10 samples allow: exactly 3
    assert not analysis.pauta_outliers(worst, usable).any()
    alpha = jnp.asarray([1.0] * 12 + [-50.0])
    np.testing.assert_array_equal(np.asarray(analysis.pauta_outliers(alpha, jnp.ones(13, bool))), [False] * 12 + [True])
    assert not analysis.pauta_outliers(-alpha, jnp.ones(13, bool)).any()  # a large alpha is not flagged


def test_prefill_documents_pads_to_buckets_and_fingerprints():
    docs = documents()
    assert [d.length for d in docs] == list(map(len, DOC_IDS)) and {d.padded_length for d in docs} == {64}
    assert len(docs[0].k) == len(docs[0].v) == 2 == docs[0].num_layers  # one buffer per layer
    assert {k.shape for k in docs[0].k + docs[0].v} == {(2, 64, 16)} and docs[0].k_block.shape == (2, 13, 2, 16)
    assert docs[0].fingerprint == rag.model_fingerprint(model_for()) != rag.model_fingerprint(tiny_model(seed=1))
    assert rag.model_fingerprint(model_for()) != rag.model_fingerprint(tiny_model(num_layers=3))


CHILD = """
import sys, json
import numpy as np
sys.path[:0] = [{tests!r}, {tests!r} + "/rag"]
import conftest  # noqa: F401
from ragdata import QUERY, PREFIX, model_for
from kvjax import rag
docs = rag.load_documents({path!r}, model_for())
fields = rag.store.ARRAY_FIELDS
arrays = {{f"{{i}}_{{name}}": np.asarray(getattr(d, name)) for i, d in enumerate(docs) for name in fields}}
out = rag.answer(model_for(), docs, QUERY, prefix=PREFIX, strategy="reuse", max_new_tokens=2)
np.savez({out!r}, logits=out.query_logits, **arrays)
print(json.dumps([d.length for d in docs]))
"""


def test_document_cache_survives_save_and_load_in_a_new_process(tmp_path):
    docs = documents()
    path = tmp_path / "corpus"
    rag.save_documents(path, docs)
    with pytest.raises(CheckpointError, match="already exists"):
        rag.save_documents(path, docs)
    out = tmp_path / "child.npz"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    script = CHILD.format(tests=str(TESTS), path=str(path), out=str(out))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [d.length for d in docs]
    child = np.load(out)
    for i, d in enumerate(docs):
        for name in rag.store.ARRAY_FIELDS:
            mine = np.asarray(getattr(d, name))
            theirs = child[f"{i}_{name}"]
            assert mine.dtype == theirs.dtype and mine.tobytes() == theirs.tobytes(), (i, name)
    here = rag.answer(model_for(), docs, QUERY, prefix=PREFIX, strategy="reuse", max_new_tokens=2)
    assert here.query_logits.tobytes() == child["logits"].tobytes()


def test_damaged_or_mismatched_checkpoints_are_refused(tmp_path):
    docs = documents()[:2]
    good = tmp_path / "good"
    rag.save_documents(good, docs)
    assert [d.length for d in rag.load_documents(good)] == [d.length for d in docs]
    with pytest.raises(CheckpointError, match="different model"):
        rag.load_documents(good, tiny_model(seed=1))
    with pytest.raises(CheckpointError, match="different model"):
        rag.load_documents(good, tiny_model(num_layers=3))
    with pytest.raises(CheckpointError, match="does not exist"):
        rag.load_documents(tmp_path / "nope")

    def damaged(name, damage):
        target = tmp_path / name
        rag.save_documents(target, docs)
        damage(target)
        return target

    def truncate_data(target):
        data = max((p for p in (target / "arrays").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])

    def flip_data(target):
        data = max((p for p in (target / "arrays").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))

    def cut_manifest(target):
        meta = target / "manifest" / "metadata"
        meta.write_text(meta.read_text()[:40])

    def drop_arrays(target):
        import shutil

        shutil.rmtree(target / "arrays")

    for name, damage, match in [("trunc", truncate_data, "truncated or damaged|checksum"),
                                ("flip", flip_data, "checksum"),
                                ("manifest", cut_manifest, "manifest"),
                                ("noarrays", drop_arrays, "missing: the store is truncated")]:
        with pytest.raises(CheckpointError, match=match):
            rag.load_documents(damaged(name, damage), model_for())


def test_a_store_of_the_stacked_layout_is_refused_with_one_clear_error(tmp_path, monkeypatch):
    """Format version 1 (each document's K/V one `[L, ...]` array, before the per-layer layout) is refused
    before anything is read, even by a model whose fingerprint the old store could not match; version 2 holds
    one entry per layer and loads into per-layer buffers."""
    old = tmp_path / "old"
    with monkeypatch.context() as patch:
        patch.setattr(rag.store, "FORMAT_VERSION", 1)
        rag.save_documents(old, documents()[:1])
    assert json.loads((old / "manifest" / "metadata").read_text())["version"] == 1
    for model in (model_for(), tiny_model(seed=1), None):
        with pytest.raises(CheckpointError, match="format version 1 .*stacked over layers.*prefill and save the "
                                                  "documents again"):
            rag.load_documents(old, model)
    new = tmp_path / "new"
    rag.save_documents(new, documents()[:1])
    meta = json.loads((new / "manifest" / "metadata").read_text())
    assert meta["version"] == 2 and meta["documents"][0]["num_layers"] == 2
    assert [info["shape"] for info in meta["documents"][0]["arrays"]["k"]] == [[2, 64, 16]] * 2
    loaded = rag.load_documents(new, model_for())[0]
    assert len(loaded.k) == len(loaded.v) == 2
    for a, b in zip(loaded.k + loaded.v, documents()[0].k + documents()[0].v, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("where", ["under_a_file", "proc", "read_only_fs", "no_permission", "full_disk"])
def test_a_store_path_that_cannot_be_written_is_a_checkpoint_error_naming_it(tmp_path, monkeypatch, caplog, where):
    """Issue 60: saving under a file, where nothing can be created (/proc/self), on a read-only file system or into a
    folder without write permission raised the OS's own error from deep inside the save; now one CheckpointError
    names the path and what stops it, and nothing is left behind. A disk that fills while orbax writes (a real EFBIG
    under a file-size limit) raised tensorstore's ValueError after orbax logged its traceback, and left orbax's
    temporary folder."""
    import errno
    import stat

    docs = documents()[:1]
    if where == "under_a_file":
        (tmp_path / "notes.txt").write_text("x")
        path, why = tmp_path / "notes.txt" / "store", f"{tmp_path / 'notes.txt'} is a file, not a folder"
    elif where == "proc":
        path, why = pathlib.Path("/proc/self/kvjax_store"), ""
    elif where == "read_only_fs":  # no read-only mount here without privileges: the OS's answer, as it comes
        real_mkdir = os.mkdir

        def read_only(p, *args, **kwargs):
            if str(p).startswith(str(tmp_path / "ro")):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(p))
            return real_mkdir(p, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", read_only)
        path, why = tmp_path / "ro" / "store", os.strerror(errno.EROFS)
    elif where == "full_disk":
        import orbax.checkpoint as ocp

        full_disk_during(monkeypatch, ocp.Checkpointer, "save")
        path, why = tmp_path / "store", ""
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        if os.access(locked, os.W_OK):  # root writes anyway: then the folder is writable and the save succeeds
            rag.save_documents(locked / "store", docs)
            return
        path, why = locked / "store", os.strerror(errno.EACCES)
    with caplog.at_level(logging.INFO), pytest.raises(
            CheckpointError, match=f"cannot save the document store to {re.escape(str(path))}: {re.escape(why)}"
    ) as excinfo:
        rag.save_documents(path, docs)
    if where != "proc":
        assert not [p for p in tmp_path.rglob("*kvjax-tmp*")]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    if where == "full_disk":
        assert "File too large" in str(excinfo.value) and not path.exists()


def test_save_takes_any_iterable_of_documents_and_refuses_a_single_one(tmp_path):
    """A generator is saved whole (it was read twice: once to see whether any document was quantized, which used it
    up, so orbax got no documents and the save failed as if the folder were unwritable); a single DocumentCache (not
    in a list) is one clear error, and nothing is written."""
    docs = documents(analyze=False)
    rag.save_documents(tmp_path / "gen", (d for d in docs))
    loaded = rag.load_documents(tmp_path / "gen", model_for())
    assert [d.length for d in loaded] == [d.length for d in docs]
    for got, want in zip(loaded, docs, strict=True):
        for a, b in zip(got.k + got.v, want.k + want.v, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(KvjaxError, match="list of DocumentCache, got one DocumentCache"):
        rag.save_documents(tmp_path / "one", docs[0])
    assert not (tmp_path / "one").exists()
