"""Bad stored files: damaged, truncated, foreign or half-written `kvjax.rag` document stores.

Oracle: the documents that were saved (compared byte for byte) and the store's own bytes before the
call (a refused load or save must leave them as they were). Each damaged store gives one
`CheckpointError` naming the store and the file; in a fresh process nothing else reaches stderr
(orbax's background threads printed ~70 'Event loop is closed' tracebacks when handed such a store).
Kill -9 at several points of `save_documents` never leaves a store that loads as valid but wrong.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvjax import rag
from kvjax.errors import CheckpointError, KvjaxError

TESTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
# Three short documents on the tiny model with 4-token blocks (kept identical in the child processes).
SETUP = """
import numpy as np
from tiny import tiny_model
from kvjax import rag
def model_for():
    return tiny_model()
def make_docs(n):
    ids = [np.random.default_rng(10 + i).integers(0, 96, m).tolist() for i, m in enumerate((41, 60, 52))]
    layout = rag.BlockLayout(block_size=4, init_blocks=1, local_blocks=2)
    return rag.prefill_documents(model_for(), ids[:n], layout=layout, analyze=False)
"""
_ns: dict = {}
exec(SETUP, _ns)
model_for = _ns["model_for"]


def _docs(n: int = 2) -> list[rag.DocumentCache]:
    return _ns["make_docs"](n)


def _snapshot(root: pathlib.Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}


def _same(loaded: list[rag.DocumentCache], saved: list[rag.DocumentCache]) -> bool:
    if len(loaded) != len(saved):
        return False
    for a, b in zip(loaded, saved, strict=True):
        for name in rag.store.ARRAY_FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            if (x is None) != (y is None) or (x is not None and np.asarray(x).tobytes() != np.asarray(y).tobytes()):
                return False
        if (a.length, a.layout, a.fingerprint) != (b.length, b.layout, b.fingerprint):
            return False
    return True


@pytest.fixture(scope="module")
def good_store(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("store") / "corpus"
    rag.save_documents(path, _docs())
    return path


def _copy(good: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    target = tmp_path / "copy"
    shutil.copytree(good, target)
    return target


def _largest(root: pathlib.Path) -> pathlib.Path:
    return max((p for p in (root / "arrays").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate(root):
    f = _largest(root)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f.relative_to(root).as_posix(), "truncated or damaged"


def _flip(root):
    f = _largest(root)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    return f.relative_to(root).as_posix(), "fails its SHA-256 checksum"


def _garbage_array_metadata(root):  # the damage that made orbax print its thread tracebacks
    f = root / "arrays" / "array_metadatas" / "process_0"
    f.write_bytes(b"\x00garbage" * 4)
    return "arrays/array_metadatas/process_0", "truncated or damaged"


def _drop_file(root):
    f = root / "manifest" / "metadata"
    f.unlink()
    return "manifest/metadata", "is missing"


def _cut_record(root):
    f = root / rag.store.STORE_RECORD
    f.write_text(f.read_text()[:30])
    return rag.store.STORE_RECORD, "unreadable or truncated"


def _no_record(root):  # what an interrupted save or an older kvjax leaves
    (root / rag.store.STORE_RECORD).unlink()
    return rag.store.STORE_RECORD, "not a complete kvjax document store"


@pytest.mark.parametrize("damage", [_truncate, _flip, _garbage_array_metadata, _drop_file, _cut_record, _no_record])
def test_damaged_store_is_one_clear_error_and_left_untouched(good_store, tmp_path, damage):
    target = _copy(good_store, tmp_path)
    name, what = damage(target)
    before = _snapshot(target)
    with pytest.raises(CheckpointError) as err:
        rag.load_documents(target, model_for())
    assert str(target) in str(err.value) and name in str(err.value) and what in str(err.value), err.value
    assert _snapshot(target) == before


def test_foreign_directory_and_a_file_are_refused(tmp_path):
    foreign = tmp_path / "foreign"
    (foreign / "arrays").mkdir(parents=True)
    (foreign / "arrays" / "data.bin").write_bytes(b"not a store")
    with pytest.raises(CheckpointError, match=r"foreign is not a complete kvjax document store"):
        rag.load_documents(foreign)
    a_file = tmp_path / "corpus.json"
    a_file.write_text("{}")
    with pytest.raises(CheckpointError, match=r"corpus.json is not a directory"):
        rag.load_documents(a_file)
    # save_documents(overwrite=True) never deletes a directory that is not a kvjax store.
    before = _snapshot(foreign)
    with pytest.raises(CheckpointError, match=r"foreign exists and is not a kvjax document store"):
        rag.save_documents(foreign, _docs(), overwrite=True)
    assert _snapshot(foreign) == before


CHILD_LOAD = """
import sys
sys.path.insert(0, {tests!r})
{setup}
from kvjax import rag
from kvjax.errors import CheckpointError, KvjaxError
for path in sys.argv[1:]:
    for _ in range(4):  # orbax's thread tracebacks came in about a third of the loads of a damaged store
        try:
            rag.load_documents(path, model_for())
            print("LOADED", path)
        except CheckpointError as e:
            print("REFUSED", path)
"""


def test_damaged_stores_print_no_traceback_in_a_fresh_process(good_store, tmp_path):
    targets = []
    for i, damage in enumerate([_garbage_array_metadata, _truncate, _drop_file]):
        target = tmp_path / f"d{i}"
        shutil.copytree(good_store, target)
        damage(target)
        targets.append(str(target))
    proc = subprocess.run([sys.executable, "-c", CHILD_LOAD.format(tests=str(TESTS), setup=SETUP), *targets],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == sum((["REFUSED", t] * 4 for t in targets), [])
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr, proc.stderr[-3000:]


def test_a_refused_overwrite_keeps_the_previous_store(good_store, tmp_path):
    target = _copy(good_store, tmp_path)
    before = _snapshot(target)
    with pytest.raises(Exception, match="not a DocumentCache"):
        rag.save_documents(target, ["not a cache"], overwrite=True)
    assert _snapshot(target) == before
    assert _same(rag.load_documents(target, model_for()), _docs())


def test_save_without_overwrite_keeps_a_store_a_killed_save_left_aside(good_store, tmp_path):
    # A save killed between its two renames leaves the previous store at .<name>.kvjax-old-<pid>; the next
    # save brings it back first, and without overwrite=True it must then refuse, not replace it.
    target = tmp_path / "copy"
    shutil.copytree(good_store, tmp_path / ".copy.kvjax-old-999999999")  # no such process
    with pytest.raises(CheckpointError, match="already exists"):
        rag.save_documents(target, _docs(1))
    assert _snapshot(target) == _snapshot(good_store)
    assert _same(rag.load_documents(target, model_for()), _docs())


def test_a_store_name_with_glob_characters_leaves_other_stores_leftovers_alone(good_store, tmp_path):
    # The leftovers of a killed save are found by name; "corpus?" read as a pattern matched corpus1's, so its save
    # moved corpus1's set-aside previous store into place as its own and refused to write (then loaded as corpus1).
    aside = tmp_path / ".corpus1.kvjax-old-999999999"  # no such process: corpus1's save was killed mid-replace
    shutil.copytree(good_store, aside)
    target = tmp_path / "corpus?"
    new = _docs(1)
    rag.save_documents(target, new)
    assert _same(rag.load_documents(target, model_for()), new)
    assert _snapshot(aside) == _snapshot(good_store)  # corpus1's previous store is still there to bring back


def test_a_store_path_with_brackets_is_refused_before_anything_is_written(tmp_path):
    # orbax globs below the folder it writes, so a "[...]" in the path matched other names: the save "succeeded" and
    # the sealed store's arrays were unreadable ("unreadable or truncated" at every load).
    (tmp_path / "runs[2]").mkdir()
    for target in (tmp_path / "corpus[12]", tmp_path / "runs[2]" / "corpus"):
        with pytest.raises(CheckpointError, match=r"\[\.\.\.\]"):
            rag.save_documents(target, _docs(1))
        assert not target.exists() and not list(target.parent.glob(".*kvjax*"))


# ---------------------------------------------------------------------------------------------
# kill -9 during save_documents
# ---------------------------------------------------------------------------------------------
CHILD_SAVE = """
import json, os, signal, sys
sys.path.insert(0, {tests!r})
{setup}
from kvjax.rag import store

path, point, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
docs = make_docs(n)

def die(*_, **__):
    os.kill(os.getpid(), signal.SIGKILL)

real_seal, real_rename, real_dump = store._seal, os.rename, json.dump
if point == "before_seal":
    store._seal = die
elif point == "mid_seal":  # half of the record reaches the file, then the process dies
    def half_dump(obj, out, **kw):
        text = json.dumps(obj, **kw)
        out.write(text[: len(text) // 2]); out.flush(); die()
    store.json.dump = half_dump
elif point in ("before_rename", "between_renames"):
    calls = []
    def counting_rename(a, b):
        calls.append(a)
        if len(calls) == (1 if point == "before_rename" else 2):
            die()
        return real_rename(a, b)
    def seal_then_arm(root):
        real_seal(root)
        os.rename = counting_rename
    store._seal = seal_then_arm
import orbax.checkpoint  # noqa: F401  (imported before "saving": the timed kills land in the save itself)
print("saving", flush=True)
store.save_documents(path, docs, overwrite=True)
print("saved", flush=True)
"""


def _save_in_child(path: pathlib.Path, point: str, n: int, kill_after: float | None = None) -> int:
    script = CHILD_SAVE.format(tests=str(TESTS), setup=SETUP)
    proc = subprocess.Popen([sys.executable, "-c", script, str(path), point, str(n)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    if kill_after is not None:
        assert proc.stdout.readline().strip() == "saving"
        time.sleep(kill_after)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=600)
    return proc.returncode


def _check_after_kill(path: pathlib.Path, previous: list | None, new: list) -> str:
    """The store at `path` is absent, the previous one, or the new one, byte for byte; never anything else."""
    try:
        loaded = rag.load_documents(path, model_for())
    except CheckpointError as e:
        assert previous is None or "left the previous store" in str(e), e
        return "absent"
    if _same(loaded, new):
        return "new"
    assert previous is not None and _same(loaded, previous), "a killed save left a store that loads but is wrong"
    return "previous"


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before_seal", "mid_seal", "before_rename", "between_renames"])
def test_kill_9_inside_save_documents_never_leaves_a_wrong_store(tmp_path, point):
    old, new = _docs(2), _docs(3)
    path = tmp_path / "corpus"
    rag.save_documents(path, old)
    assert _save_in_child(path, point, 3) == -signal.SIGKILL
    outcome = _check_after_kill(path, old, new)
    assert outcome == ("absent" if point == "between_renames" else "previous")
    # The next save cleans up (and first brings back a previous store a kill left aside), then succeeds.
    rag.save_documents(path, new, overwrite=True)
    assert _same(rag.load_documents(path, model_for()), new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


@pytest.mark.slow
def test_kill_9_at_random_times_during_a_first_save(tmp_path):
    new = _docs(3)
    outcomes = []
    for i, delay in enumerate([0.0, 0.05, 0.15, 0.3, 3.0]):
        path = tmp_path / f"corpus{i}"
        code = _save_in_child(path, "timed", 3, kill_after=delay)
        assert code in (0, -signal.SIGKILL)
        outcomes.append(_check_after_kill(path, None, new))
        if code == -signal.SIGKILL:
            rag.save_documents(path, new, overwrite=True)  # a rerun is not blocked by what the kill left
            assert _same(rag.load_documents(path, model_for()), new)
    assert set(outcomes) <= {"absent", "new"}
    print("outcomes", outcomes)


def test_overwrite_and_verify_must_be_bools(good_store, tmp_path):
    # overwrite="no" is a truthy string: the store was replaced by the call that meant to keep it.
    target = _copy(good_store, tmp_path)
    before = _snapshot(target)
    with pytest.raises(KvjaxError, match="overwrite must be True or False, got 'no'"):
        rag.save_documents(target, _docs(1), overwrite="no")
    assert _snapshot(target) == before
    with pytest.raises(KvjaxError, match="verify must be True or False"):
        rag.load_documents(target, model_for(), verify="yes")
