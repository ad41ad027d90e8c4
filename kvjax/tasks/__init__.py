"""Task registry: ``available()``, ``get(name, **options)`` and ``expand("ruler,passkey")``.

The long-context tasks and their metrics (``kvjax.tasks.metrics``), below both the eval (``kvjax.eval``) and
training / calibration (``kvjax.train``, ``kvjax.calibrate``), which build their prompts from them. They import
nothing of kvjax but ``kvjax.errors``. ``kvjax.eval.tasks`` and ``kvjax.eval.metrics`` are aliases of these
modules, kept for code written against the old paths.

Names:

* ``ruler/<task>``: niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery, vt, cwe, fwe,
  qa_1, qa_2 (synthetic; qa_* read a local SQuAD / HotpotQA file from ``data_dir``);
* ``passkey`` (5 digits), ``passkey_64`` (64 digits), ``passkey_<n>`` (n digits);
* ``needle`` (depth x length grid);
* ``longbench/<dataset>`` and ``longbench/<dataset>_e`` (LongBench-E), English datasets;
* ``infinitebench/<task>``: passkey, number_string, kv_retrieval, code_debug, math_find,
  longbook_choice_eng;
* ``multidoc/<dataset>``: 2wikimqa, musique, hotpotqa (LongBench files);
* ``multidoc/synthetic`` (two facts in two of several documents), ``multidoc/synthetic_1fact``, and
  ``multidoc/synthetic_<D>docs[_<k>fact]`` for ``D`` documents: generated offline, the default task of the
  multi-context (RAG) strategies.

Groups for ``expand``: ``ruler``, ``ruler_synthetic`` (no data needed), ``longbench``, ``longbench_e``,
``infinitebench``, ``multidoc`` (the LongBench files), ``multidoc_synthetic``.

Every task accepts the options ``tokenizer``, ``skip_malformed`` and ``haystack_file`` (ignored where
irrelevant) plus its own (see each module); unknown names raise ``KvjaxError``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from kvjax.errors import ConfigError, KvjaxError
from kvjax.tasks.base import (
    BaseTask,
    DataError,
    LengthError,
    Sample,
    Task,
    build_prompt,
    full_prompt,
)
from kvjax.tasks.infinitebench import INFINITEBENCH_TASKS
from kvjax.tasks.longbench import LONGBENCH_TASKS, UNSUPPORTED_TASKS
from kvjax.tasks.multidoc import MULTIDOC_TASKS
from kvjax.tasks.multidoc_synthetic import SYNTHETIC_TASKS, synthetic_task
from kvjax.tasks.needle import NeedleTask
from kvjax.tasks.passkey import PasskeyTask
from kvjax.tasks.ruler import RULER_TASKS

__all__ = [
    "BaseTask",
    "DataError",
    "GROUPS",
    "LengthError",
    "Sample",
    "Task",
    "available",
    "build_prompt",
    "expand",
    "full_prompt",
    "get",
    "reads_data",
    "takes_option",
]

_REGISTRY: dict[str, Callable[..., BaseTask]] = {
    **RULER_TASKS,
    "passkey": partial(PasskeyTask, "passkey", digits=5),
    "passkey_64": partial(PasskeyTask, "passkey_64", digits=64),
    "needle": partial(NeedleTask, "needle"),
    **LONGBENCH_TASKS,
    **INFINITEBENCH_TASKS,
    **MULTIDOC_TASKS,
    **SYNTHETIC_TASKS,
}

_PASSKEY_N = re.compile(r"passkey_(\d+)")

GROUPS: dict[str, tuple[str, ...]] = {
    "ruler": tuple(n for n in RULER_TASKS),
    "ruler_synthetic": tuple(n for n in RULER_TASKS if not n.startswith("ruler/qa_")),
    "longbench": tuple(n for n in LONGBENCH_TASKS if not n.endswith("_e")),
    "longbench_e": tuple(n for n in LONGBENCH_TASKS if n.endswith("_e")),
    "infinitebench": tuple(INFINITEBENCH_TASKS),
    "multidoc": tuple(MULTIDOC_TASKS),
    "multidoc_synthetic": tuple(SYNTHETIC_TASKS),
}


def available() -> list[str]:
    """All registered task names, sorted."""
    return sorted(_REGISTRY)


def get(name: str, **options: Any) -> BaseTask:
    """Build the task ``name`` with its options; ``ConfigError`` naming close matches if unknown."""
    if name in _REGISTRY:
        return _REGISTRY[name](**options)
    if name in UNSUPPORTED_TASKS:
        return UNSUPPORTED_TASKS[name](**options)
    m = _PASSKEY_N.fullmatch(name)
    if m:
        return PasskeyTask(name, digits=int(m.group(1)), **options)
    synthetic = synthetic_task(name, **options)
    if synthetic is not None:
        return synthetic
    close = difflib.get_close_matches(name, available(), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(f"unknown task {name!r}{hint} (groups: {', '.join(GROUPS)}; see kvjax.tasks.available())")


def reads_data(name: str) -> bool:
    """Whether task ``name`` reads files from ``data_dir`` (False for an unknown name)."""
    try:
        return bool(get(name).reads_data)
    except KvjaxError:
        return False


def takes_option(name: str, option: str) -> bool:
    """Whether task ``name`` has its own option ``option`` (False for an unknown name)."""
    try:
        return option in get(name).options
    except KvjaxError:
        return False


def expand(spec: str | Iterable[str]) -> list[str]:
    """Task names from a comma list (or iterable) of names and group names, in order, without repeats.

    Names are validated (unknown ones raise ``ConfigError``) but no task is built.
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in (s.strip() for s in items):
        if not item:
            continue
        names = GROUPS.get(item, (item,))
        for n in names:
            if n not in _REGISTRY and not _PASSKEY_N.fullmatch(n):
                get(n)  # raises with a helpful message (also for unsupported datasets)
            if n not in out:
                out.append(n)
    if not out:
        raise ConfigError(f"no task given in {spec!r}")
    return out
