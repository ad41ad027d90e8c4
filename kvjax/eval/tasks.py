"""`kvjax.eval.tasks` is `kvjax.tasks` (the tasks moved below the eval, where training imports them too).

This module replaces itself, and each task module, by the `kvjax.tasks` one in `sys.modules`, so
`from kvjax.eval.tasks.base import Sample` and `kvjax.eval.tasks.get(...)` keep working and name the same
objects (a monkeypatch of one is a patch of the other).
"""

import sys

from kvjax import tasks as _tasks
from kvjax.tasks import (  # noqa: F401  (each loaded, so each gets its alias below)
    base,
    haystack,
    infinitebench,
    longbench,
    metrics,
    multidoc,
    multidoc_synthetic,
    needle,
    passkey,
    ruler,
)

for _name, _module in list(sys.modules.items()):
    if _name.startswith("kvjax.tasks."):
        sys.modules["kvjax.eval.tasks." + _name.removeprefix("kvjax.tasks.")] = _module
sys.modules[__name__] = _tasks
