"""Whether a process still runs (a leaf: it imports nothing of kvjax); used to tell a stale lock or claim."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """True while process `pid` exists on this host, another user's included. A pid that names no single process
    (0 or negative: os.kill reads those as process groups) counts as alive, so that nothing unverifiable is taken
    over."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
