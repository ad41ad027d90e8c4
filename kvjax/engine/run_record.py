"""What made a job's answers: the settings `kvjax.run` keeps beside its output, so a resume under other flags is
refused instead of mixing two configurations' answers in one file.

`<output>.run.json` holds the settings that decide an answer: the model (its name and a SHA-256 of its config), the
dtype, the method and every hyperparameter, the storage format, the chat template, the prefill chunk and the
requests' defaults. It is written before the first answer is appended, and compared with the run's own settings
whenever the output already holds an answer. The engine's sizes (`--slots`, `--steps`, `--prefill_tokens`,
`--prefill_batch`, `--memory_fraction`, `--mesh`, `--share_prompts`, `--prompt_store`) change how fast answers come,
not what they are, and are not recorded.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kvjax.errors import KvjaxError

SUFFIX = ".run.json"
FORMAT = "kvjax.run settings"


class RunRecordError(KvjaxError):
    """An output's answers were made under other settings, or under settings nobody recorded."""


def path_of(output: str) -> str:
    """The settings file beside `output`."""
    return output + SUFFIX


def normalized(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` as they read back from JSON (tuples as lists, other objects as their text), keys sorted."""
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def holds_answers(output: str) -> bool:
    """Whether `output` exists and holds any text (a torn last line included)."""
    if not os.path.isfile(output):
        return False
    with open(output, "rb") as f:
        return any(line.strip() for line in f)


def _shown(value: Any) -> str:
    return "unset" if value is None else json.dumps(value)


def differences(recorded: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """`--flag: A there, B now` for each setting that differs (method hyperparameters as `--method_args name`)."""
    out = []
    for key in sorted(set(recorded) | set(settings)):
        if key == "format":
            continue
        old, new = recorded.get(key), settings.get(key)
        if key == "method_args" and isinstance(old, dict) and isinstance(new, dict):
            out += [f"--method_args {name}: {_shown(old.get(name))} there, {_shown(new.get(name))} now"
                    for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
        elif old != new:
            out.append(f"--{key}: {_shown(old)} there, {_shown(new)} now")
    return out


def check(output: str, settings: dict[str, Any]) -> None:
    """Refuses resuming `output` when its answers were made under other `settings` (or under unrecorded ones); an
    output with no answer yet binds nothing."""
    if not holds_answers(output):
        return
    record = path_of(output)
    where = f"the answers in {output}"
    if not os.path.isfile(record):
        raise RunRecordError(f"{where} have no {os.path.basename(record)} beside them saying which settings made "
                             "them; move the file away, or give another --output")
    try:
        with open(record, encoding="utf-8") as f:
            recorded = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunRecordError(f"cannot read {record}: {e}") from None
    if not isinstance(recorded, dict) or recorded.get("format") != FORMAT:
        raise RunRecordError(f"{record} is not a kvjax.run settings file")
    changed = differences(recorded, normalized(settings))
    if changed:
        raise RunRecordError(f"{where} were made with other settings ({'; '.join(changed)}): rerun with those, or "
                             "give another --output")


def write(output: str, settings: dict[str, Any]) -> None:
    """Records `settings` beside `output` (replacing the file in one rename), before its first answer."""
    record = path_of(output)
    temporary = f"{record}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, **normalized(settings)}, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(temporary, record)


__all__ = ["RunRecordError", "check", "differences", "holds_answers", "normalized", "path_of", "write"]
