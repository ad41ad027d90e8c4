"""The places a command line writes, checked before it loads a model: one `ConfigError` line naming the flag and
the path, instead of a traceback (or a model loaded for nothing) when the first result is written."""

from __future__ import annotations

import os

from kvjax.errors import ConfigError


def output_folder(flag: str, path: str, *, writable: bool = True) -> None:
    """Makes the folder `--<flag>=<path>` names when it is missing. Refused: a file there, a folder that cannot be
    made, and with `writable` one nothing can be written in (a caller that may rerun read-only, such as a finished
    sweep, checks what it writes later)."""
    _folder(f"--{flag}={path!r}", path, writable)


def output_file(flag: str, path: str) -> None:
    """`--<flag>=<path>` can be appended to: its folder made and writable, and the file, where it exists already,
    a file this process may write (the file itself is neither created nor opened here)."""
    named = f"--{flag}={path!r}"
    _folder(f"{named}: its folder", os.path.dirname(os.path.abspath(path)), True)
    if os.path.isdir(path):
        raise ConfigError(f"{named} is a folder, not a file")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{named}: cannot write to the file (permission denied)")


def _folder(named: str, path: str, writable: bool) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{named} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{named} cannot be created ({e.strerror or e})") from None
    if writable and not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{named} cannot be written in (permission denied)")
