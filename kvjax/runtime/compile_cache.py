"""JAX's persistent compilation cache, on by default for `generate` / `prefill` and the eval CLI.

A program compiled once (a method at a shape bucket) is written to disk and loaded by the next process
instead of compiled again. The directory is, in order: an explicit `enable_compilation_cache(path)`, the
environment variable `KVJAX_COMPILATION_CACHE_DIR`, else `$XDG_CACHE_HOME/kvjax/jax` (`~/.cache/kvjax/jax`).
Off switch: `KVJAX_COMPILATION_CACHE_DIR=off` (or empty), `enable_compilation_cache(None)`, or the CLI's
`--compilation_cache_dir=off`. A directory the user already gave JAX (`jax_compilation_cache_dir`) is kept.

A directory that cannot be used (not creatable, a file, not writable: a read-only home, a sandbox,
`XDG_CACHE_HOME=/proc/x`) degrades to a run without the persistent cache and one warning naming it and the
variable to set; it never stops a run.
"""

from __future__ import annotations

import logging
import os
import tempfile

import jax

ENV_VAR = "KVJAX_COMPILATION_CACHE_DIR"
_OFF = ("", "0", "off", "none", "false", "no")
_DEFAULT = object()
_state: dict[str, object] = {}
_warned: set[str] = set()
log = logging.getLogger(__name__)


def default_cache_dir() -> str | None:
    """The directory from `KVJAX_COMPILATION_CACHE_DIR` (None when it says off), else the user cache dir."""
    value = os.environ.get(ENV_VAR)
    if value is not None:
        return None if value.strip().lower() in _OFF else os.path.expanduser(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvjax", "jax")


def _unusable(path: str) -> str | None:
    """Why `path` cannot hold the cache (None when it can): created if missing, then a file written in it."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kvjax-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def _reset() -> None:
    """Lets JAX pick up a changed directory even after something compiled already."""
    try:
        from jax.experimental.compilation_cache import compilation_cache as cc

        cc.reset_cache()
    except (ImportError, AttributeError):  # pragma: no cover - an older / newer JAX without it
        pass


def enable_compilation_cache(path: str | None | object = _DEFAULT) -> str | None:
    """Turns the persistent cache on at `path` (default: `default_cache_dir()`; None or "off": off).

    Returns the directory in use (None: off). Every program is cached (no minimum compile time), since
    even the decode loop's seconds of compile count in a first request. Idempotent."""
    if path is _DEFAULT:
        path = default_cache_dir()
    elif isinstance(path, str) and path.strip().lower() in _OFF:
        path = None
    elif isinstance(path, str | os.PathLike):  # `--compilation_cache_dir=~/x`: the shell leaves that `~` alone
        path = os.path.expanduser(path)
    user_dir = jax.config.jax_compilation_cache_dir
    if user_dir and user_dir != _state.get("dir"):  # the user configured JAX directly: theirs wins
        _state["dir"] = user_dir
        return user_dir
    if path == _state.get("dir", False):
        return path
    if path is not None:
        problem = _unusable(str(path))
        if problem is not None:
            if str(path) not in _warned:
                _warned.add(str(path))
                log.warning("kvjax: the compilation cache directory %s cannot be used (%s); running without the "
                            "persistent compilation cache (set %s to a writable directory, or to 'off')",
                            path, problem, ENV_VAR)
            path = None
    if path == _state.get("dir", False):
        return path
    if path is None:
        jax.config.update("jax_compilation_cache_dir", None)
    else:
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _reset()
    _state["dir"] = path
    return path


def ensure_compilation_cache() -> str | None:
    """`enable_compilation_cache()` unless the process already chose (called by `prefill`)."""
    if "dir" in _state:
        return _state["dir"]  # type: ignore[return-value]
    return enable_compilation_cache()
