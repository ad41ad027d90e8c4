"""One claim per cell, so that processes sharing an ``--output_dir`` never compute a sample twice.

A process runs a cell's samples only while it holds the cell's claim: an exclusive ``flock`` on
``<run dir>/.claim`` (``.claim.<i>-of-<n>`` for process ``i`` of a multi-process run), whose content names
the holder (host, pid). The kernel drops the lock when its process exits, however it exits (kill -9
included), so a claim is never left stale on a file system with locks. Where ``flock`` is not supported
(some network or FUSE file systems), the claim is the file's existence instead (created with ``O_EXCL``),
and one whose holder is a dead process of this host is taken over (pid liveness; a claim of another host
is honoured until its file is deleted).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
import uuid
from typing import Any

from kvjax._process import pid_alive

__all__ = ["Claim"]

_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


class Claim:
    """The claim of one cell's shard; ``try_acquire`` / ``acquire`` / ``release``, re-entrant per process."""

    def __init__(self, run_dir: str, shard: str = "") -> None:
        self.path = os.path.join(run_dir, f".claim{shard}")
        self.pid_path = self.path + ".pid"  # the fallback claim
        self._fd: int | None = None
        self._pid_file = False  # holding the O_EXCL fallback claim

    @property
    def held(self) -> bool:
        return self._fd is not None or self._pid_file

    def holder(self) -> str:
        """Who holds the claim, as the file says (``pid <n> on <host>``), or ``another process``."""
        info = self._read(self.path) or self._read(self.pid_path)
        if info and "pid" in info:
            return f"pid {info['pid']} on {info.get('host', '?')}"
        return "another process"

    @staticmethod
    def _read(path: str) -> dict[str, Any] | None:
        try:
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) else None

    def try_acquire(self) -> bool:
        """Take the claim if nobody holds it; False when a live process does."""
        if self.held:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # pragma: no cover - not POSIX
            os.close(fd)
            return self._try_pid_file()
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            if e.errno in _UNSUPPORTED:
                return self._try_pid_file()
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)
        self._fd = fd
        return True

    def _try_pid_file(self) -> bool:
        """The fallback without locks: the claim is a file created with O_EXCL; a dead holder's is taken over."""
        path = self.pid_path
        for _ in range(3):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if not self._take_over_stale(path):
                    return False
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(_me(), f)
            self._pid_file = True
            return True
        return False

    @staticmethod
    def _take_over_stale(path: str) -> bool:
        """Removes ``path`` if its holder is a dead process of this host; True when removed."""
        try:
            with open(path, encoding="utf-8") as f:
                before = f.read()
            info = json.loads(before)
        except FileNotFoundError:
            return True
        except (OSError, ValueError):
            return False  # being written, or not ours to judge
        if info.get("host") != socket.gethostname() or pid_alive(int(info.get("pid", -1))):
            return False
        aside = f"{path}.stale-{uuid.uuid4().hex}"
        try:
            os.rename(path, aside)  # atomic: of two processes taking over, one moves it
        except FileNotFoundError:
            return True
        with open(aside, encoding="utf-8") as f:
            moved = f.read()
        if moved != before:  # another process took it over in between: put its live claim back
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
        os.unlink(aside)
        return moved == before

    def acquire(self, poll_s: float = 0.5) -> None:
        """Blocks until the claim is ours (a holder that dies releases it)."""
        while not self.try_acquire():
            time.sleep(poll_s)

    def release(self) -> None:
        """Gives the claim back (exiting the process does too)."""
        if self._fd is not None:
            import fcntl

            try:
                os.ftruncate(self._fd, 0)
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None
        if self._pid_file:
            self._pid_file = False
            try:
                os.unlink(self.pid_path)
            except FileNotFoundError:
                pass
