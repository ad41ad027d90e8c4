"""One eval cell: ``Cell``, what the sweep plan (``kvjax.eval.plan``) makes and the runner runs, and ``CellKey``,
its identity: every setting that changes a result, in one key.

A ``Cell`` holds the built method (or multi-context strategy) and the values its sweep varies, and its ``key``;
every other view of a cell is read from these two (a report's ``Run`` merges run directories on the key their
``config.json`` stores).

``CellKey`` is what the run directory's name encodes (``run_name``), what a resume compares with the
stored ``config.json`` (a mismatch is refused, naming the fields), what the eval CLI de-duplicates a
sweep's cells by, and what ``report`` / ``leaderboard`` merge runs on. Execution settings that do not
change a prediction (batch size, mesh, shared prefill, progress, throttle, number of samples) are not
part of it; they are recorded in ``config.json`` only.

Fields: model (the last path component of ``--model``), method, task, context length, budget, compression
ratio, method arguments, seed, query_aware, question_first, dtype (resolved: ``auto`` is stored as the
dtype it chose), chat_template, chunk_size, max_new_tokens (None: the task's own), data_dir (absolute,
only for tasks that read files), kv_dtype (the cache's storage, ``kvjax.quant``'s canonical name; None: the
model dtype) and answer_prefix (``--answer_prefix`` where the task takes it; None: the task's own). A field that
holds its "absent" default and was added after archived results existed (kv_dtype, answer_prefix) is left out of
the stored key and the digest, so those results keep their names and load as model-dtype, own-prefix cells.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvjax.errors import KvjaxError

if TYPE_CHECKING:
    from kvjax.methods.base import Method
    from kvjax.quant.spec import KVQuant

__all__ = ["Cell", "CellKey", "EXTRA_FIELDS", "run_name"]

#: Fields beyond (model, method, task, length, budget, ratio, method_args, query_aware), shown in reports only
#: where they differ between the runs shown.
EXTRA_FIELDS = ("seed", "question_first", "answer_prefix", "dtype", "chat_template", "chunk_size", "max_new_tokens",
                "data_dir", "kv_dtype")
#: Fields added after results were archived: omitted from `as_dict` (and so the digest) while None.
_LATER_FIELDS = ("kv_dtype", "answer_prefix")
_DEFAULTS = {"seed": 0, "question_first": False, "chat_template": "auto"}


def _tag(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", str(value)).strip("_") or "_"


def _plain(obj: Any) -> Any:
    """JSON-able, order-free form of a method-argument value (tuples as lists, non-finite floats as str)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, bool | int | float | str) or obj is None:
        return obj
    return str(obj)


def model_label(model: str) -> str:
    """The model as run names show it: the last component of a path, else the name."""
    return os.path.basename(str(model).rstrip("/\\")) or str(model)


@dataclasses.dataclass(frozen=True)
class CellKey:
    """One cell's identity (see the module docstring). ``method_args`` is a sorted tuple of (name, value)."""

    model: str
    method: str
    task: str
    context_length: int
    budget: int | None = None
    compression_ratio: float | None = None
    method_args: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    query_aware: bool = False
    question_first: bool = False
    dtype: str | None = None
    chat_template: str | None = "auto"
    chunk_size: int | None = None
    max_new_tokens: int | None = None
    data_dir: str | None = None
    kv_dtype: str | None = None
    answer_prefix: str | None = None

    def __post_init__(self) -> None:
        args = self.method_args
        items = args.items() if isinstance(args, Mapping) else args
        set_ = object.__setattr__
        set_(self, "method_args", tuple(sorted(((str(k), _plain(v)) for k, v in items), key=lambda kv: kv[0])))
        set_(self, "model", model_label(self.model))
        set_(self, "context_length", int(self.context_length))
        set_(self, "budget", None if self.budget is None else int(self.budget))
        set_(self, "compression_ratio", None if self.compression_ratio is None else float(self.compression_ratio))
        set_(self, "seed", int(self.seed))
        set_(self, "query_aware", bool(self.query_aware))
        set_(self, "question_first", bool(self.question_first))
        if self.kv_dtype is not None:
            from kvjax.quant import kv_dtype_name

            name = kv_dtype_name(self.kv_dtype)
            set_(self, "kv_dtype", None if name == "model" else name)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (``method_args`` as a dict), as ``config.json`` stores it under ``cell``."""
        out = dataclasses.asdict(self)
        out["method_args"] = dict(self.method_args)
        for name in _LATER_FIELDS:
            if out[name] is None:
                del out[name]
        return out

    def digest(self) -> str:
        """10 hex digits of a hash of every field."""
        blob = json.dumps(self.as_dict(), sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:10]

    def name(self) -> str:
        """The run directory's name: ``task__length__model__method[__b<budget>][__r<ratio>][__query_aware]
        [__question_first][__kv-<kv_dtype>][__answer-<prefix>]__s<seed>__<digest>``; the readable part is a
        convenience, the digest covers every field."""
        parts = [_tag(self.task.replace("/", "-")), str(self.context_length), _tag(self.model), _tag(self.method)]
        if self.budget is not None:
            parts.append(f"b{self.budget}")
        if self.compression_ratio is not None:
            parts.append(f"r{self.compression_ratio:g}")
        if self.query_aware:
            parts.append("query_aware")
        if self.question_first:
            parts.append("question_first")
        if self.kv_dtype is not None:
            parts.append(f"kv-{_tag(self.kv_dtype)}")
        if self.answer_prefix is not None:
            parts.append(f"answer-{_tag(self.answer_prefix)}")
        parts += [f"s{self.seed}", self.digest()]
        return "__".join(parts)

    def diff(self, other: CellKey) -> list[str]:
        """``field=<other's value> (this: <ours>)`` for every field that differs."""
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        mine["method_args"], theirs["method_args"] = dict(self.method_args), dict(other.method_args)
        return [f"{k}={theirs[k]!r} (this command: {mine[k]!r})" for k in mine if mine[k] != theirs[k]]

    def extras(self) -> dict[str, Any]:
        """The fields of ``EXTRA_FIELDS`` as a dict."""
        return {k: getattr(self, k) for k in EXTRA_FIELDS}

    @classmethod
    def from_config(cls, config: Mapping[str, Any], record: Mapping[str, Any] | None = None, *,
                    where: str = "config.json") -> CellKey:
        """The key a run directory's ``config.json`` (and its first record, for older files) describes.

        Configs written since the key exists hold it under ``cell``; older ones are read from their fields
        and ``flags``, with the defaults for what they do not hold. A field of the wrong kind (an edited
        ``"budget": "abc"``) is a `KvjaxError` naming `where` (the file) and the value.
        """
        try:
            return cls._from_config(config, record)
        except (TypeError, ValueError) as e:  # KvjaxError included (an unknown kv_dtype)
            raise KvjaxError(f"{where}: cannot read the cell key it stores ({e}); restore the file or move its run "
                             "directory away") from None

    @classmethod
    def _from_config(cls, config: Mapping[str, Any], record: Mapping[str, Any] | None) -> CellKey:
        stored = config.get("cell")
        if isinstance(stored, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in stored.items() if k in known})
        record = record or {}
        flags = config.get("flags") if isinstance(config.get("flags"), Mapping) else {}
        md = record.get("metadata", {}) if isinstance(record.get("metadata"), Mapping) else {}
        margs = config.get("method_args", flags.get("method_args")) or {}
        if not isinstance(margs, Mapping):
            margs = {"_": str(margs)}
        task = str(config.get("task") or record.get("task") or md.get("task") or "")

        def flag(name: str) -> Any:
            return flags.get(name, _DEFAULTS.get(name))

        length = config.get("context_length", md.get("context_length"))
        return cls(
            model=str(config.get("model") or ""),
            method=str(config.get("method") or record.get("method") or ""),
            task=task,
            context_length=int(length) if length not in (None, "") else 0,
            budget=config.get("budget", record.get("budget")),
            compression_ratio=config.get("compression_ratio", record.get("compression_ratio")),
            method_args=margs,
            seed=flag("seed") or 0,
            query_aware=bool(config.get("query_aware", flags.get("query_aware", False))),
            question_first=bool(flag("question_first")),
            dtype=config.get("dtype"),
            chat_template=flag("chat_template"),
            chunk_size=flag("chunk_size"),
            max_new_tokens=flag("max_new_tokens"),
            data_dir=data_dir_for(task, flag("data_dir")),
        )  # kv_dtype: older than the flag, these runs used the model dtype


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell of a sweep: the method built with its arguments and amount (``method``; None for a multi-context
    strategy, then ``rag_strategy``), the task and context length, the cache's storage (``kv_dtype``: a
    ``kvjax.quant.KVQuant``, None for the model dtype) and its identity (``key``: set by the plan; None for a cell
    built by hand, which the runner runs alike). ``method_args`` is a sorted tuple of (name, value)."""

    method_name: str
    method: Method | None
    task_name: str
    context_length: int
    budget: int | None = None
    compression_ratio: float | None = None
    method_args: tuple[tuple[str, Any], ...] = ()
    rag_strategy: Any = None
    kv_dtype: KVQuant | None = None
    key: CellKey | None = None

    @property
    def kv_dtype_name(self) -> str | None:
        """The cache format's canonical name (``kvjax.quant``), None for the model dtype."""
        return None if self.kv_dtype is None else self.kv_dtype.name

    @property
    def label(self) -> str:
        amount = (
            f"budget={self.budget}"
            if self.budget is not None
            else (f"ratio={self.compression_ratio}" if self.compression_ratio is not None else "no budget")
        )
        kv = f", kv_dtype={self.kv_dtype_name}" if self.kv_dtype is not None else ""
        args = f" [{','.join(f'{k}={v}' for k, v in self.method_args)}]" if self.method_args else ""
        return f"{self.method_name}{args} ({amount}{kv}) on {self.task_name} @ {self.context_length}"


def data_dir_for(task: str, data_dir: str | None) -> str | None:
    """``data_dir`` as a cell holds it: absolute, and only for a task that reads files (else None)."""
    if not data_dir:
        return None
    from kvjax import tasks  # local: the key must not need the registry to be imported

    return os.path.abspath(data_dir) if tasks.reads_data(task) else None


def run_name(**fields: Any) -> str:
    """``CellKey(**fields).name()``: the directory name of one cell."""
    return CellKey(**fields).name()
