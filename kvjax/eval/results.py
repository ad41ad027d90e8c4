"""Crash-safe result storage for eval runs.

A run directory ``<output_dir>/<run_name>/`` holds

* ``predictions.jsonl``: one JSON object per finished sample, appended, flushed and fsync'd per sample
  (with several processes, each writes ``predictions.<index>-of-<count>.jsonl``);
* ``metrics.json`` and ``config.json``: written atomically (temporary file, fsync, rename).

The directory's name is its cell's key (``kvjax.eval.cell.CellKey``): a resume whose stored key differs
is refused (``check_identity``), and a process runs a cell only while it holds its claim (``claim``,
``kvjax.eval.claims``), so processes sharing an output folder split its cells instead of repeating them.

Resume: ``RunDir`` drops a torn last line (a kill in the middle of a write leaves a line without its
newline) when it opens its predictions file, and ``done_ids()`` lists the samples already finished in any
shard, so a re-run skips them and no sample is lost or duplicated.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import logging
import math
import os
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from kvjax.errors import ConfigError, KvjaxError
from kvjax.eval.cell import CellKey, run_name
from kvjax.eval.claims import Claim
from kvjax.tasks.base import DataError, Sample, default_aggregate

__all__ = [
    "CellKey",
    "ResultWriteError",
    "RunDir",
    "deterministic_part",
    "model_fingerprint",
    "make_record",
    "read_predictions",
    "record_problem",
    "run_name",
    "shard",
    "summarize",
    "write_json_atomic",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Errors of a write that no retry in this process fixes (a full disk, a quota, a read-only file system).
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO)


class ResultWriteError(KvjaxError):
    """A result file could not be written (the message names it); what was written before is intact."""

PREDICTIONS = "predictions.jsonl"
METRICS = "metrics.json"
CONFIG = "config.json"
_SHARD_FILE = re.compile(r"predictions(\.\d+-of-\d+)?\.jsonl")


def shard(items: Sequence[T], process_index: int, process_count: int) -> list[T]:
    """This process's share of ``items``: every ``process_count``-th item from ``process_index``.

    Strided rather than contiguous so that shards get a similar mix of lengths; the shards of all
    processes partition ``items`` exactly.
    """
    if process_count < 1 or not 0 <= process_index < process_count:
        raise KvjaxError(f"invalid shard: process_index={process_index}, process_count={process_count}")
    return list(items[process_index::process_count])


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _jsonable(obj: Any) -> Any:
    """Replace non-finite floats (invalid JSON) by None and tuples by lists, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically: a reader sees the old file or the new one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(_jsonable(obj), f, indent=2, sort_keys=True, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            raise ResultWriteError(f"cannot write {path}: {e.strerror or e}; its previous content is intact") from None
        raise
    _fsync_dir(directory)


def _repair_torn_tail(path: str) -> int:
    """Truncate a last line that lacks its newline; return the number of bytes dropped."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb") as f:  # read-only first: a finished run in a read-only folder must re-run
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
    with open(path, "rb+") as f:
        # Scan back in blocks for the last newline.
        pos, keep = size, 0
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            block = f.read(step)
            idx = block.rfind(b"\n")
            if idx != -1:
                keep = pos + idx + 1
                break
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


_NOT_A_FILE_HINT = "a predictions file holds one JSON record per line (move it away and a resume re-runs its samples)"


def _repair_hint(path: str, lineno: int) -> str:
    return f"to repair, delete that line (sed -i '{lineno}d' {shlex.quote(path)}); a resume then re-runs its sample"


def _iter_lines(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Records of one predictions file; a torn last line is skipped, a bad complete line raises."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:  # a directory of that name, no permission, an I/O error
        raise DataError(f"cannot read {path}: {e.strerror or e}; {_NOT_A_FILE_HINT}") from None
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline
    if torn.strip():
        log.warning("%s: ignoring an unfinished last line (%d bytes)", path, len(torn))
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}:{lineno}: corrupt prediction record ({e}); {_repair_hint(path, lineno)}") from None
        problem = record_problem(rec)
        if problem:
            raise DataError(f"{path}:{lineno}: prediction record {problem}; {_repair_hint(path, lineno)}")
        yield lineno, rec


def record_problem(rec: Any) -> str | None:
    """What keeps a JSON line from being a record the scores are read from (None: nothing): an 'id', 'scores' an
    object of finite numbers, 'metadata' an object."""
    if not isinstance(rec, dict) or "id" not in rec:
        return "without an 'id'"
    scores = rec.get("scores", {})
    if not isinstance(scores, Mapping) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in scores.values()):
        return f"whose 'scores' is not an object of finite numbers ({json.dumps(scores)[:80]})"
    if not isinstance(rec.get("metadata", {}), Mapping):
        return f"whose 'metadata' is not an object ({json.dumps(rec['metadata'])[:80]})"
    return None


def read_predictions(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Records from several predictions files, the first record of each sample id kept."""
    seen: set[str] = set()
    out = []
    for path in paths:
        for _, rec in _iter_lines(path):
            rid = str(rec["id"])
            if rid in seen:
                continue
            seen.add(rid)
            out.append(rec)
    return out


#: Record keys that say how a sample ran, not what it gave: wall-clock timings, and whether its prefill forward
#: was shared with other cells (``--shared_prefill``, an execution setting).
EXECUTION_KEYS = ("timings", "shared_prefill")


def deterministic_part(record: Mapping[str, Any]) -> dict[str, Any]:
    """A prediction record without ``EXECUTION_KEYS``: what identical runs reproduce byte for byte."""
    return {k: v for k, v in record.items() if k not in EXECUTION_KEYS}


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """A short hash of a model directory's config and weights (sizes plus the first and last MiB of each
    safetensors file), so resuming into results made with other weights is caught without reading
    gigabytes."""
    digest = hashlib.sha256()
    config = os.path.join(model_dir, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            digest.update(f.read())
    for path in sorted(glob.glob(os.path.join(glob.escape(str(model_dir)), "*.safetensors"))):
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


class RunDir:
    """One run's directory: append predictions, list finished ids, write metrics and config.

    ``process_index`` / ``process_count`` select this process's predictions file in multi-host runs.
    Opening repairs a torn last line of this process's file.
    """

    def __init__(
        self,
        output_dir: str,
        run_name: str,
        *,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        if process_count < 1 or not 0 <= process_index < process_count:
            raise KvjaxError(f"invalid process_index={process_index} for process_count={process_count}")
        self.path = os.path.join(output_dir, run_name)
        self.name = run_name
        os.makedirs(self.path, exist_ok=True)
        self._shard_tag = "" if process_count == 1 else f".{process_index:03d}-of-{process_count:03d}"
        fname = PREDICTIONS if process_count == 1 else f"predictions{self._shard_tag}.jsonl"
        self.predictions_path = os.path.join(self.path, fname)
        self.metrics_path = os.path.join(self.path, METRICS)
        self.config_path = os.path.join(self.path, CONFIG)
        if os.path.lexists(self.predictions_path) and not os.path.isfile(self.predictions_path):
            raise DataError(f"{self.predictions_path} is not a file; {_NOT_A_FILE_HINT}")
        dropped = _repair_torn_tail(self.predictions_path)
        if dropped:
            log.warning(
                "%s: dropped an unfinished last record (%d bytes) left by an interrupted run",
                self.predictions_path,
                dropped,
            )

    def prediction_files(self) -> list[str]:
        """All shards' predictions files in this directory, sorted."""
        files = glob.glob(os.path.join(glob.escape(self.path), "predictions*.jsonl"))
        return sorted(f for f in files if _SHARD_FILE.fullmatch(os.path.basename(f)))

    def append(self, record: Mapping[str, Any]) -> None:
        """Append one finished sample (must have an ``id``) and make it durable before returning."""
        if "id" not in record:
            raise KvjaxError("a prediction record needs an 'id'")
        line = json.dumps(_jsonable(record), ensure_ascii=False, default=str) + "\n"
        fd = os.open(self.predictions_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(fd).st_size
        try:
            data = line.encode("utf-8")
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            os.fsync(fd)
        except OSError as e:
            if e.errno not in WRITE_ERRNOS:
                raise
            try:  # drop the part of the line that made it, so the file holds whole records only
                os.ftruncate(fd, size)
            except OSError:
                pass  # a later open drops the torn line (_repair_torn_tail)
            raise ResultWriteError(
                f"cannot write {self.predictions_path}: {e.strerror or e}; the samples finished before are kept: "
                "free space (or fix the folder) and rerun the same command to resume"
            ) from None
        finally:
            os.close(fd)

    def records(self) -> list[dict[str, Any]]:
        """Finished records of every shard (first record per id)."""
        return read_predictions(self.prediction_files())

    def done_ids(self) -> set[str]:
        """Ids of the samples already finished in any shard."""
        return {str(r["id"]) for r in self.records()}

    def records_outside(self, ids: set[str]) -> list[tuple[str, int, str]]:
        """(file, line, id) of every record, in any shard, whose id is not in `ids`."""
        return [(path, lineno, str(rec["id"])) for path in self.prediction_files()
                for lineno, rec in _iter_lines(path) if str(rec["id"]) not in ids]

    def write_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Write ``metrics.json`` atomically (not at all when it already holds ``metrics``)."""
        _write_if_changed(self.metrics_path, metrics)

    def write_config(self, config: Mapping[str, Any]) -> None:
        """Write ``config.json`` atomically (not at all when it already holds ``config``)."""
        _write_if_changed(self.config_path, config)

    def claim(self) -> Claim:
        """This process's claim on the directory (its shard's, in a multi-process run)."""
        return Claim(self.path, self._shard_tag)

    def check_identity(self, key: CellKey) -> None:
        """Refuse to resume finished samples that a different cell (another dtype, seed, ...) produced."""
        stored = self.read_config()
        if not stored or not self.done_ids():
            return
        records = self.records()
        differ = key.diff(CellKey.from_config(stored, records[0] if records else None, where=self.config_path))
        if differ:
            raise ConfigError(
                f"{self.path} holds results of another setting: {'; '.join(differ)}; rerun with that setting, "
                "or use another --output_dir, or delete that directory"
            )

    def check_model(self, fingerprint: str) -> None:
        """Refuse to resume finished samples that another model (other weights) produced."""
        before = (self.read_config() or {}).get("model_fingerprint")
        if before and before != fingerprint and self.done_ids():
            raise ConfigError(
                f"{self.path} holds results of a different model (fingerprint {before}, now {fingerprint}); "
                "use another --output_dir or delete that directory"
            )

    def read_config(self) -> dict[str, Any] | None:
        """``config.json`` if present."""
        return read_json_object(self.config_path)

    def read_metrics(self) -> dict[str, Any] | None:
        """``metrics.json`` if present."""
        return read_json_object(self.metrics_path)


def _write_if_changed(path: str, obj: Any) -> None:
    """Leave a file that already holds ``obj`` untouched, so a finished run re-runs in a read-only folder."""
    try:
        with open(path, encoding="utf-8") as f:
            if json.load(f) == json.loads(json.dumps(_jsonable(obj), default=str)):
                return
    except (OSError, ValueError):
        pass
    write_json_atomic(path, obj)


def read_json_object(path: str) -> dict[str, Any] | None:
    """The JSON object in `path` (a run's config.json / metrics.json): None when the file is absent or holds no
    object, `DataError` naming the file when it cannot be read."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 (UnicodeDecodeError)
        raise DataError(f"cannot read {path}: {e}") from None
    return obj if isinstance(obj, dict) else None


def make_record(
    sample: Sample,
    prediction: str,
    scores: Mapping[str, float],
    *,
    method: str,
    budget: int | None = None,
    compression_ratio: float | None = None,
    timings: Mapping[str, float] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The JSON record of one finished sample, as ``RunDir.append`` stores it.

    Keys: ``id``, ``task``, ``method``, ``budget``, ``compression_ratio``, ``prediction``, ``answers``,
    ``metric`` (primary score name), ``scores``, ``metadata`` (the sample's), any ``extra`` keys (e.g.
    ``kept_tokens``), then ``timings`` (wall-clock seconds: e.g. prefill, decode), the only part that differs
    between identical runs (``deterministic_part`` drops it; ``python -m kvjax.eval.report --compare``).
    """
    return {
        "id": sample.id,
        "task": sample.metadata.get("task"),
        "method": method,
        "budget": budget,
        "compression_ratio": compression_ratio,
        "prediction": prediction,
        "answers": list(sample.answers),
        "metric": sample.metric,
        "scores": {k: float(v) for k, v in scores.items()},
        "metadata": dict(sample.metadata),
        **extra,
        "timings": dict(timings or {}),  # last: the line up to here is byte-identical across identical runs
    }


def summarize(records: Sequence[Mapping[str, Any]], task: str | None = None) -> dict[str, Any]:
    """``metrics.json`` content for a run: the task's own aggregation when ``task`` is registered
    (LongBench-E buckets, needle grid), the generic means otherwise."""
    if task:
        from kvjax import tasks as registry  # local: results must not need the registry to load

        try:
            t = registry.get(task)
        except KvjaxError:
            t = None
        if t is not None:
            return t.aggregate(records)
    return default_aggregate(records)
