"""The eval's settings, read once from the flags (and a `--config` file) into a frozen `EvalConfig`.

    config = from_flags(FLAGS)     # every value parsed and checked: one ConfigError line naming the flag
    cells = plan.cells(config)     # kvjax/eval/plan.py: the sweep, a pure function of the config

A `--config` file (`ml_collections.config_flags`: `--config=path.py` or `--config=path.py:arg` for
`get_config(arg)`, fields overridable as `--config.<flag>=...`) gives values for the flags of `RECORDED_FLAGS`;
a flag given on the command line wins over the file's value. Nothing here loads a model or touches a device, so
`--dry_run` and the tests build configs freely (`EvalConfig(methods=("snapkv",), budgets=(64,))`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from absl import flags

from kvjax import rag
from kvjax import tasks as task_registry
from kvjax.cli import parse
from kvjax.cli.flags import Shared, shared_fields
from kvjax.errors import ConfigError
from kvjax.tasks.ruler import ANSWER_PREFIXES
from kvjax.validation import is_seed

__all__ = ["DEFAULT_RAG_TASK", "DEFAULT_TASK", "RECORDED_FLAGS", "EvalConfig", "from_flags", "from_values",
           "load_config_file"]

DEFAULT_TASK = "ruler/niah_single_1"
DEFAULT_CONTEXT_LENGTH = "1024"
DEFAULT_RAG_TASK = "multidoc/synthetic"
SHARED_PREFILL_MODES = ("auto", "yes", "no")

#: The flags a config file may set; `config.json` records their values under "flags" (with `config` itself).
RECORDED_FLAGS = ("model", "model_dir", "method", "budget", "compression_ratio", "method_args", "config", "task",
                  "data_dir", "context_length", "max_samples", "batch_size", "dtype", "kv_dtype", "query_aware",
                  "chat_template", "question_first", "answer_prefix", "chunk_size", "max_new_tokens", "mesh",
                  "output_dir", "seed", "skip_malformed")
#: Flags of the run that change no result (a config file may not set them; config.json does not record them).
RUN_FLAGS = ("throttle_s", "progress", "compilation_cache_dir", "shared_prefill", "dry_run")


@dataclasses.dataclass(frozen=True)
class EvalConfig(Shared):
    """Every setting of one `python -m kvjax.eval` invocation, parsed (`Shared`'s fields plus the eval's own).

    `tasks`: task names, groups expanded (empty: the default task for the methods); `recorded_flags`: the raw
    values of `RECORDED_FLAGS` as `config.json` stores them."""

    tasks: tuple[str, ...] = ()
    data_dir: str | None = None
    context_lengths: tuple[int, ...] = (1024,)
    max_samples: int = 20
    batch_size: int = 1
    query_aware: bool = False
    question_first: bool = False
    answer_prefix: str = "task"
    chunk_size: int | None = None
    max_new_tokens: int | None = None
    output_dir: str = "results"
    seed: int = 0
    skip_malformed: bool = False
    throttle_s: float = 0.0
    progress: bool = True
    compilation_cache_dir: str | None = None
    shared_prefill: str = "auto"
    dry_run: bool = False
    recorded_flags: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "recorded_flags", MappingProxyType(dict(self.recorded_flags)))
        if not self.tasks:
            object.__setattr__(self, "tasks", tuple(task_registry.expand(
                DEFAULT_RAG_TASK if self.multi_context else DEFAULT_TASK)))
        self._check()

    @property
    def answer_prefix_tasks(self) -> tuple[str, ...]:
        """The tasks that take `--answer_prefix` (the others keep their own prefix, and their cells' keys say so)."""
        return tuple(name for name in self.tasks if task_registry.takes_option(name, "answer_prefix"))

    @property
    def multi_context(self) -> bool:
        """Whether a method of the sweep is a multi-context (RAG) strategy."""
        return any(name in rag.available() for name in self.methods)

    def _check(self) -> None:
        """The checks of single values and of pairs of flags; what depends on a method's hyperparameters is the
        plan's (`plan.cells`), what depends on the model `checks.check_cells`'."""
        if not self.context_lengths:
            raise ConfigError("--context_length is empty")
        for flag in ("batch_size", "chunk_size", "max_new_tokens"):
            value = getattr(self, flag)
            if value is not None and value <= 0:
                raise ConfigError(f"--{flag} must be > 0, got {value}")
        if not is_seed(self.seed):
            raise ConfigError(f"--seed must be an integer in [0, 2**32), got {self.seed!r}")
        if self.data_dir is not None and not os.path.isdir(self.data_dir):
            raise ConfigError(f"--data_dir {self.data_dir!r} is not a directory")
        if isinstance(self.throttle_s, bool) or not isinstance(self.throttle_s, int | float) \
                or not math.isfinite(self.throttle_s) or self.throttle_s < 0:
            raise ConfigError(f"--throttle_s must be a finite number of seconds >= 0, got {self.throttle_s!r}")
        if self.shared_prefill not in SHARED_PREFILL_MODES:
            raise ConfigError(f"--shared_prefill must be one of {list(SHARED_PREFILL_MODES)}, got "
                              f"{self.shared_prefill!r}")
        batched = [name for name in self.methods if name not in rag.available()]  # RAG strategies: one by one
        if self.mesh and batched and self.batch_size % self.mesh[0]:
            raise ConfigError(f"--batch_size={self.batch_size} is not a multiple of the mesh's data axis "
                              f"({self.mesh[0]})")
        if self.answer_prefix not in ANSWER_PREFIXES:
            raise ConfigError(f"--answer_prefix must be one of {list(ANSWER_PREFIXES)}, got {self.answer_prefix!r}")
        if self.answer_prefix != "task" and not self.answer_prefix_tasks:
            raise ConfigError(f"--answer_prefix={self.answer_prefix} applies to RULER's niah tasks; --task="
                              f"{','.join(self.tasks)} has none")
        compressing = [name for name in self.methods if name != "full"]
        if self.question_first and not self.query_aware and compressing:
            raise ConfigError(
                f"--question_first puts the question into the compressed context, which makes --method={compressing} "
                "query-aware: add --query_aware, or run --method=full alone"
            )


def from_values(values: Mapping[str, Any]) -> EvalConfig:
    """An `EvalConfig` from raw flag values (as typed on a command line, or as a config file gives them)."""
    shared = shared_fields(values)
    multi_context = any(name in rag.available() for name in shared["methods"])
    lengths = parse.numbers("context_length", values.get("context_length", DEFAULT_CONTEXT_LENGTH), int)
    task = values.get("task")
    if task is not None and not str(task).strip(" ,"):  # `--task=` names no task; unset gives the default
        raise ConfigError(f"--task is empty ({task!r}); leave it out for the default task")
    task = task or (DEFAULT_RAG_TASK if multi_context else DEFAULT_TASK)
    own = {k: values[k] for k in ("data_dir", "max_samples", "batch_size", "query_aware", "question_first",
                                  "answer_prefix", "chunk_size", "max_new_tokens", "output_dir", "seed",
                                  "skip_malformed", "throttle_s", "progress", "compilation_cache_dir",
                                  "shared_prefill", "dry_run")
           if k in values}
    return EvalConfig(**shared, **own, tasks=tuple(task_registry.expand(task)), context_lengths=tuple(lengths),
                      recorded_flags={k: values.get(k) for k in RECORDED_FLAGS})


def from_flags(fv: flags.FlagValues) -> EvalConfig:
    """The config of a parsed command line: the flags, with a `--config` file's values where a flag was not
    given."""
    values = {name: fv[name].value for name in (*RECORDED_FLAGS, *RUN_FLAGS) if name in fv}
    spec = config_spec(fv)
    values["config"] = spec
    if spec is None:
        return from_values(values)
    for key, value in load_config_file(fv).items():
        if key not in RECORDED_FLAGS or key == "config" or key not in fv:
            raise ConfigError(f"--config {spec!r} sets {key!r}, which is not a flag of kvjax.eval")
        if not fv[key].present:
            values[key] = _flag_value(fv[key], value, spec)
    return from_values(values)


def config_spec(fv: flags.FlagValues) -> str | None:
    """`--config`'s argument as given (`path.py` or `path.py:arg`), None without one."""
    if "config" not in fv or not fv["config"].present:
        return None
    return fv["config"].config_filename


def load_config_file(fv: flags.FlagValues) -> dict[str, Any]:
    """The values `get_config()` of the `--config` file returned, as a dict (a load failure: one line)."""
    spec = config_spec(fv)
    path = spec.split(":", 1)[0]
    try:
        config = fv["config"].value
        config = config.to_dict() if hasattr(config, "to_dict") else config
    except OSError as e:  # config_flags defers a file it could not read to the first access
        if not os.path.isfile(path):
            raise ConfigError(f"--config file {path!r} does not exist") from None
        raise ConfigError(f"--config {spec!r} failed to load: {str(e).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--config {spec!r}: get_config() returned {type(config).__name__}, not a ConfigDict or "
                          "dict of flag values")
    return dict(config)


def _flag_value(flag: flags.Flag, value: Any, spec: str) -> Any:
    """A config file's `value` for `flag` as the command line would give it: `method_args` dicts flattened, lists
    joined with commas, strings for string flags, other flags' values checked by the flag's parser."""
    if flag.name == "method_args" and isinstance(value, dict):
        return ",".join(parse.flatten_method_args(value))
    if isinstance(value, list | tuple):
        value = ",".join(str(v) for v in value)
    if value is None:
        return None
    if flag.flag_type() == "string":
        return str(value)
    try:
        return flag.parser.parse(value)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--config {spec!r} sets {flag.name}={value!r}: {e}") from None
