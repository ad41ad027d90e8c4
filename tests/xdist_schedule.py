"""The test suite's xdist schedule (tests/conftest.py takes its hook): `-n N` with each module that defines a
module-scoped fixture run on one worker.

xdist's default (`load`) hands tests out one at a time, so two workers can each build a module's fixture (the
benchmark scripts' runs three minutes). Here such a module is one unit of work, handed out first (the largest
first, xdist's `loadscope` order); every other test is a unit of its own, handed out as a worker frees, in
collection order. xdist's `--dist loadgroup` would group by marks, but it renames node ids through an attribute
pytest 9 no longer reads.

A worker that crashes (a native crash inside XLA, not an assertion) is replaced, as under `load`: the rest of its
work goes back in the queue, and the test it was running runs once more only if pytest-rerunfailures asks
(`--reruns 1 --only-rerun "crashed while running"`, the Makefile's), through `mark_test_pending`, which xdist's
`loadscope` does not implement.
"""

from __future__ import annotations

import functools
import pathlib
import re

import pytest

_MODULE_FIXTURE = re.compile(r"@pytest\.fixture\([^)]*scope=\"module\"")


@functools.cache
def has_module_fixture(path: pathlib.Path) -> bool:
    """Whether the test module at `path` defines a module-scoped fixture."""
    return path.is_file() and _MODULE_FIXTURE.search(path.read_text(encoding="utf-8")) is not None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The schedule above for xdist's default `--dist load`; any other `--dist` is xdist's own."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            self.reruns: set[str] = set()  # crashed tests put back: each a unit of its own

        def _split_scope(self, nodeid: str) -> str:
            if nodeid in self.reruns:
                return f"{nodeid} (rerun)"
            module = nodeid.split("::")[0]
            return module if has_module_fixture(config.rootpath / module) else nodeid

        def remove_node(self, node) -> str | None:
            """`loadscope`'s, except that the test the node crashed in is not put back with the rest of its work."""
            workload = self.assigned_work.pop(node)
            if not self._pending_of(workload):
                return None
            crashed = next(nodeid for unit in workload.values() for nodeid, done in unit.items() if not done)
            for scope, unit in workload.items():
                unit.pop(crashed, None)
                if not all(unit.values()):
                    self.workqueue[scope] = unit
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

        def mark_test_pending(self, item: str) -> None:
            """The crashed `item` once more, next, as a unit of its own."""
            self.reruns.add(item)
            scope = self._split_scope(item)
            self.workqueue[scope] = {item: False}
            self.workqueue.move_to_end(scope, last=False)
            for other in self.assigned_work:
                self._reschedule(other)

    return ModuleFixtureScheduling(config, log)
