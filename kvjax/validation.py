"""Shared plain-Python checks of public arguments, run before anything is traced.

Every public entry point that takes token ids (`model(ids)`, `generate` / `prefill`, `kvjax.rag`)
goes through `token_ids` / `token_rows`, so out-of-vocabulary, negative, float or empty ids fail the
same way everywhere with a `KvjaxError` naming the argument and the bad value, instead of JAX
silently clamping a gather or NumPy silently truncating a float.

Hyperparameters (of methods, RAG strategies) are checked by type in `check_hyperparameters` (from the
dataclass annotations) and by range in the owner's `__post_init__` with `check_int` / `check_choice` /
`check_bool` / `check_ratio`, which raise a `ConfigError` naming the owner, the hyperparameter and the value.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import numbers
import os
import pathlib
import types
import typing
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvjax.errors import ConfigError, KvjaxError

__all__ = ["as_bool", "as_int", "check_bool", "check_choice", "check_hyperparameters", "check_int", "check_ratio",
           "eos_ids", "token_ids", "token_rows"]


def _show(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(value: Any) -> bool:
    """A Python / NumPy integer (bool excluded: `True` is no token id or size)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def as_int(value: Any, name: str, *, minimum: int | None = None) -> int:
    """`value` as an int; `KvjaxError` naming `name` when it is not an integer (or below `minimum`)."""
    if not is_int(value):
        raise KvjaxError(f"{name} must be an integer, got {_show(value)} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise KvjaxError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def orbax_path_problem(path: str | os.PathLike) -> str | None:
    """Why orbax cannot write a checkpoint under `path`, or None: it finds the files it wrote with a glob below the
    folder, so a `[...]` anywhere in the absolute path reads as a character class, the merge finds nothing, and the
    checkpoint it leaves cannot be read back ('*' and '?' match themselves and do no harm)."""
    parts = pathlib.Path(path).expanduser().absolute().parts
    if all(fnmatch.fnmatchcase(part, part) for part in parts):
        return None
    return "orbax cannot write a checkpoint under a path with '[...]' in it (it reads the path as a glob pattern)"


#: Sampling draws are keyed by 32 bits: a seed outside [0, 2**32) would alias another (2**32 draws as 0).
SEED_LIMIT = 2**32


def is_seed(value: Any) -> bool:
    """An integer sampling seed in [0, 2**32) (`SEED_LIMIT`), bool excluded."""
    return is_int(value) and 0 <= value < SEED_LIMIT


def as_seed(value: Any, name: str = "seed") -> int:
    """`value` as a sampling seed: an integer in [0, 2**32); `KvjaxError` naming `name` for anything else."""
    value = as_int(value, name, minimum=0)
    if value >= SEED_LIMIT:
        raise KvjaxError(f"{name} must be below 2**32 = {SEED_LIMIT} (draws are keyed by 32 bits), got {value}")
    return value


def as_bool(value: Any, name: str) -> bool:
    """`value` as a bool; `KvjaxError` naming `name` for anything else (the string "False" is truthy)."""
    if not isinstance(value, bool | np.bool_):
        raise KvjaxError(f"{name} must be True or False, got {_show(value)} ({type(value).__name__})")
    return bool(value)


def token_ids(value: Any, name: str, vocab_size: int | None = None) -> np.ndarray:
    """`value` (a list / array of ids, any rank) as an int64 array; refuses non-integer or out-of-vocabulary ids."""
    if isinstance(value, str | bytes):
        raise KvjaxError(f"{name} must be token ids, got a string {_show(value)}; tokenize it first")
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:  # ragged nesting, objects NumPy cannot hold
        raise KvjaxError(f"{name} must be token ids (a list or array of integers), got {_show(value)}") from e
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise KvjaxError(f"{name} must hold integer token ids, got {arr.dtype} values {_show(value)}")
    arr = arr.astype(np.int64) if arr.size else np.zeros(arr.shape, np.int64)
    if vocab_size is not None and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise KvjaxError(f"{name}: token ids must be in [0, {vocab_size}), got {bad}")
    return arr


def token_rows(value: Any, name: str, vocab_size: int | None = None, *, allow_empty_rows: bool = False
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """A batch of prompts: `[B, T]` int64 tokens (right-padded with 0) and the row lengths for a
    ragged list of lists (None for an array or a flat list: every row is full). Refuses an empty batch."""
    ragged = (isinstance(value, list | tuple) and len(value) > 0
              and all(isinstance(r, list | tuple | np.ndarray) for r in value))
    if ragged:
        rows = [token_ids(r, f"{name}[{i}]", vocab_size).reshape(-1) for i, r in enumerate(value)]
        lengths = np.array([len(r) for r in rows], np.int64)
        if not allow_empty_rows and (lengths == 0).any():
            raise KvjaxError(f"{name}[{int(np.argmin(lengths))}] is an empty prompt: every prompt needs a token")
        tokens = np.zeros((len(rows), max(1, int(lengths.max()))), np.int64)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        return tokens, lengths
    if isinstance(value, list | tuple) and len(value) == 0:
        raise KvjaxError(f"{name} is empty: give at least one prompt of at least one token")
    tokens = token_ids(value, name, vocab_size)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise KvjaxError(f"{name} must be [batch, seq] or a list of token lists, got shape {tokens.shape}")
    if tokens.shape[0] == 0 or (tokens.shape[1] == 0 and not allow_empty_rows):
        raise KvjaxError(f"{name} is empty (shape {tokens.shape}): give at least one prompt of at least one token")
    return tokens, None


def eos_ids(value: Any, vocab_size: int, name: str = "eos_token_id") -> tuple[int, ...]:
    """An EOS id or a sequence of them as a tuple of ints inside the vocabulary."""
    if isinstance(value, np.ndarray) and value.ndim <= 1:  # a tokenizer's or NumPy's ids, as a list
        value = value.tolist() if np.issubdtype(value.dtype, np.integer) else list(value.reshape(-1))
    items = (value,) if not isinstance(value, Sequence) or isinstance(value, str | bytes) else tuple(value)
    out = []
    for v in items:
        if not is_int(v):
            raise KvjaxError(f"{name} must be a token id or a list of them, got {_show(value)}")
        if not 0 <= v < vocab_size:
            raise KvjaxError(f"{name} {int(v)} is outside the vocabulary [0, {vocab_size})")
        out.append(int(v))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Hyperparameter types
# ---------------------------------------------------------------------------------------------
def _accepts(kind: Any, value: Any) -> bool | None:
    """Whether `value` fits the annotation `kind`; None when `kind` is not a simple scalar type."""
    origin = typing.get_origin(kind)
    if origin is typing.Union or origin is types.UnionType:
        verdicts = [_accepts(k, value) for k in typing.get_args(kind)]
        if any(v is True for v in verdicts):
            return True
        return None if any(v is None for v in verdicts) else False
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool | np.bool_)
    if kind is int:
        return is_int(value)
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)
    if kind is str:
        return isinstance(value, str)
    return None


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve at run time: check nothing
        return {}
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name in hints}


def check_hyperparameters(cls: type, values: dict[str, Any], owner: str) -> None:
    """`ConfigError` naming the hyperparameter and value when a value has the wrong scalar type
    (`compression_ratio="0.5"`, `budget=True`, `window_size=4.5`), before `cls.__post_init__` compares it."""
    kinds = _field_types(cls)
    for key, value in values.items():
        if key in kinds and _accepts(kinds[key], value) is False:
            want = str(kinds[key]).replace("typing.", "").replace("<class '", "").replace("'>", "")
            raise ConfigError(f"{owner}: {key} must be {want}, got {_show(value)} ({type(value).__name__})")


# ---------------------------------------------------------------------------------------------
# Hyperparameter ranges (one `ConfigError` naming the owner, the hyperparameter and the value)
# ---------------------------------------------------------------------------------------------
def check_int(owner: str, name: str, value: object, minimum: int, *, optional: bool = False) -> None:
    """`ConfigError` unless `value` is a Python int (not a bool) >= `minimum`; `optional`: None passes too."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")


def check_choice(owner: str, name: str, value: object, choices: tuple) -> None:
    """`ConfigError` unless `value` is one of `choices`."""
    if value not in choices:
        raise ConfigError(f"{owner}: {name} must be one of {list(choices)}, got {value!r}")


def check_bool(owner: str, name: str, value: object) -> None:
    """`ConfigError` unless `value` is a bool (1 / 0 are not accepted)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}: {name} must be True or False, got {value!r}")


def check_number(owner: str, name: str, value: object, minimum: float | None = None, *, above: float | None = None,
                 maximum: float | None = None, optional: bool = False) -> None:
    """`ConfigError` unless `value` is a finite Python number (an int or a float, not a bool, NaN or inf), at least
    `minimum`, more than `above` and at most `maximum` where given; `optional`: None passes too."""
    if optional and value is None:
        return
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (minimum is not None and value < minimum) or (above is not None and value <= above) \
            or (maximum is not None and value > maximum):
        if minimum is None and above is None:
            bounds = "" if maximum is None else f" <= {maximum}"
        elif maximum is not None:
            bounds = f" in [{minimum}, {maximum}]" if minimum is not None else f" in ({above}, {maximum}]"
        else:
            bounds = f" >= {minimum}" if minimum is not None else f" > {above}"
        raise ConfigError(f"{owner}: {name} must be {'None or ' if optional else ''}a finite number{bounds}, "
                          f"got {value!r}")


def check_ratio(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    """`ConfigError` unless `value` is a number (not a bool) in [0, 1]; `optional`: None passes too."""
    check_number(owner, name, value, 0, maximum=1, optional=optional)
