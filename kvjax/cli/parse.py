"""Parsers of the command-line values the CLIs share: comma lists, `--method_args`, amounts and `--kv_dtype`.

Every function is pure and raises `ConfigError` with one line naming the flag and the bad item.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from typing import Any

from absl import flags

from kvjax.cli.refuse import flag_message, help_hint, refuse
from kvjax.errors import ConfigError, KvjaxError
from kvjax.quant.spec import KVQuant, parse_kv_dtype

__all__ = ["AMOUNT_KEYS", "HELP_FLAGS", "Alternatives", "each_value", "flatten_method_args", "kv_dtype_names",
           "kv_dtype_specs", "numbers", "parse_flags", "parse_literal", "parse_method_args", "scoped_args", "split"]

#: The help flags: absl exits 1 on them, the CLIs 0.
HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")

#: The `--method_args` keys that are a cell's amount (labelled as `--budget` / `--compression_ratio`).
AMOUNT_KEYS = ("budget", "compression_ratio")


def split(value: str | None, sep: str = ",", *, keep_empty: bool = False) -> list[str]:
    """`sep`-separated items (stripped; empty ones dropped unless `keep_empty`); separators inside brackets or
    quotes stay in their item, so a `--method_args` value can be a dict or list literal
    (`base_args={'weights':'DIR','model_type':'linear'}`)."""
    items, current, depth, quote = [], [], 0, ""
    for char in value or "":
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        elif char == sep and depth == 0:
            items.append("".join(current))
            current = []
            continue
        current.append(char)
    items.append("".join(current))
    return [v.strip() for v in items if keep_empty or v.strip()]


class Alternatives(tuple):
    """The values of one `--method_args` key written `key=a|b|c`: the sweep has a cell for each."""


def parse_literal(text: str) -> Any:
    """A Python literal (`8`, `0.5`, `[1, 2]`, `{'a': 1}`), `true` / `false` / `none` in any case, else the text."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_method_args(spec: str | dict | None) -> dict[str, Any]:
    """`key=value,key=value` (values parsed as Python literals; `a|b` sweeps) or a dict from a config file.

    A key given twice is refused (it would silently take its last value); `key=a|b` sweeps both."""
    if isinstance(spec, dict):
        return dict(spec)
    out: dict[str, Any] = {}
    for item in split(spec):
        if "=" not in item:
            raise ConfigError(f"--method_args entry {item!r} is not key=value")
        key, value = item.split("=", 1)
        key = key.strip()
        values = split(value, "|", keep_empty=True)
        if len(values) > 1 and not all(values):
            raise ConfigError(f"--method_args entry {item!r} has an empty value between its | separators")
        if key in out:
            raise ConfigError(f"--method_args sets {key!r} twice ({key}={out[key]!r} and {item}): give it once, or "
                              f"sweep its values with | ({key}=a|b)")
        parsed = [parse_literal(v) for v in values] or [parse_literal("")]
        unique = [v for i, v in enumerate(parsed) if v not in parsed[:i]]  # a repeated value is one cell
        out[key] = Alternatives(unique) if len(unique) > 1 else unique[0]
    return out


def each_value(args: dict[str, Any]) -> list[dict[str, Any]]:
    """`args` with every `Alternatives` value taken one at a time: the product over its swept keys, in order."""
    out: list[dict[str, Any]] = [{}]
    for key, value in args.items():
        choices = value if isinstance(value, Alternatives) else (value,)
        out = [{**done, key: choice} for done in out for choice in choices]
    return out


def scoped_args(method_args: dict[str, Any], name: str) -> dict[str, Any]:
    """Arguments for method `name`: unscoped keys, plus `name.key` keys (scoped to that method, so they win)."""
    out = {k: v for k, v in method_args.items() if "." not in k}
    out.update({k.split(".", 1)[1]: v for k, v in method_args.items() if k.startswith(name + ".")})
    return out


def flatten_method_args(value: dict, prefix: str = "") -> list[str]:
    """`{"lagkv": {"lag_size": 128}, "seed": 1}` -> `["lagkv.lag_size=128", "seed=1"]`: a top-level dict is a
    method's (or strategy's) scope; a dict inside one (`{"dms": {"base_args": {...}}}`) stays one dict literal."""
    items = []
    for key, val in value.items():
        if isinstance(val, dict) and not prefix:
            items += flatten_method_args(val, f"{prefix}{key}.")
        elif isinstance(val, dict):
            items.append(f"{prefix}{key}={val!r}")
        else:
            items.append(f"{prefix}{key}={val!r}" if isinstance(val, str) else f"{prefix}{key}={val}")
    return items


def numbers(flag: str, value: str | None, kind: type) -> list:
    """A comma list of `--budget` (int > 0), `--compression_ratio` (float in [0, 1)) or `--context_length` values,
    each once in the order given; an empty item (`64,,128`, `64,`) is refused, not dropped."""
    items = split(value, keep_empty=True) if value is not None and str(value).strip() else []
    out = []
    for item in items:
        if not item:
            raise ConfigError(f"--{flag}={value!r} has an empty entry")
        try:
            number = kind(item)
        except ValueError:
            raise ConfigError(f"--{flag} value {item!r} is not a{'n integer' if kind is int else ' number'}") from None
        if kind is int and number <= 0:
            raise ConfigError(f"--{flag} values must be > 0, got {number}")
        if kind is float and not 0.0 <= number < 1.0:
            raise ConfigError(f"--{flag} values must be in [0, 1), got {number}")
        out.append(number)
    return list(dict.fromkeys(out))  # a repeated value is one cell


def kv_dtype_specs(value: str | None) -> list[KVQuant | None]:
    """`--kv_dtype`'s comma list parsed once: a `kvjax.quant.KVQuant` per quantized format, None for the model
    dtype, each once in the order given."""
    items = [v.strip() for v in (value or "").split(",")] if value and value.strip() else ["model"]
    out = []
    for item in items:
        if not item:
            raise ConfigError(f"--kv_dtype={value!r} has an empty entry")
        try:
            out.append(parse_kv_dtype(item))
        except KvjaxError as e:
            raise ConfigError(f"--kv_dtype value {item!r}: {e}") from None
    return list(dict.fromkeys(out))


def kv_dtype_names(value: str | None) -> list[str | None]:
    """`kv_dtype_specs` as canonical names (None: the model dtype)."""
    return [None if spec is None else spec.name for spec in kv_dtype_specs(value)]


def parse_flags(flag_values: flags.FlagValues, argv: list[str], name: str,
                describe: Callable[[flags.Error], str] = str, doc: str = "") -> list[str]:
    """absl's parsing of `argv` into `flag_values`: a bad flag is refused in one line (`describe(error)`, exit 2);
    a help flag exits 0 (absl's is 1). A registry of its own (no absl help flags in it) prints `doc` and its flags."""
    if "help" not in flag_values and any(a.split("=", 1)[0] in HELP_FLAGS for a in argv[1:]):
        print(f"{doc.strip()}\n\nFlags:\n{flag_values.get_help()}")
        sys.exit(0)
    try:
        return flag_values(argv)
    except flags.Error as e:
        refuse(name, f"{flag_message(describe(e))} {help_hint(name)}")
    except SystemExit as e:
        if e.code == 1 and any(a.split("=", 1)[0] in HELP_FLAGS for a in argv[1:]):
            sys.exit(0)
        raise
