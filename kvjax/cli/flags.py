"""The flags every kvjax command line that runs a method shares, defined once, and their values read once.

    from absl import flags
    from kvjax.cli import flags as shared

    shared.define_shared()                    # --model --model_dir --dtype --method --method_args --budget
                                              # --compression_ratio --kv_dtype --mesh --chat_template
    ...
    values = shared.read_shared(flags.FLAGS)  # a frozen `Shared`: lists parsed, names checked

`python -m kvjax.eval` defines these plus its own; its config object (`kvjax.eval.config.EvalConfig`) extends
`Shared`. `read_shared` takes any mapping of flag values (the flags, a config file's dict merged over them), so a
second entry point parses `--method_args`, amounts, `--kv_dtype` and `--mesh` exactly as the eval does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from absl import flags

from kvjax import methods, rag
from kvjax.chat import CHAT_TEMPLATE_SETTINGS
from kvjax.cli import parse
from kvjax.errors import ConfigError
from kvjax.quant.spec import KVQuant
from kvjax.runtime import sharding

__all__ = ["DEFAULTS", "SHARED_FLAGS", "Shared", "define_shared", "read_shared", "shared_fields"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
CHAT_TEMPLATES = CHAT_TEMPLATE_SETTINGS
#: Each shared flag's default, as typed on a command line (`read_shared` takes it for a value not given).
DEFAULTS: dict[str, Any] = {"model": "kvjax-tiny", "model_dir": None, "dtype": "auto", "method": "full", "budget": None,
                            "compression_ratio": None, "method_args": "", "kv_dtype": "model",
                            "chat_template": "auto", "mesh": None}


def define_shared(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the shared flags in `flag_values` (each once: a second call defines nothing)."""
    def define(kind: Any, name: str, help_text: str, choices: Sequence[str] = ()) -> None:
        if name in flag_values:
            return
        if choices:
            kind(name, DEFAULTS[name], list(choices), help_text, flag_values=flag_values)
        else:
            kind(name, DEFAULTS[name], help_text, flag_values=flag_values)

    define(flags.DEFINE_string, "model", "Preset name (see kvjax.models.presets.available()) or a local HF directory.")
    define(flags.DEFINE_string, "model_dir",
           "Local directory holding the weights of a preset model (else $KVJAX_MODEL_DIR).")
    define(flags.DEFINE_enum, "dtype", "Model dtype; auto = float32 on CPU, bfloat16 elsewhere.", DTYPES)
    define(flags.DEFINE_string, "method",
           "Registered method name, or a comma list to sweep (see kvjax.methods.available()); multi-context "
           "strategies (samkv, cacheblend, epic, reuse, recompute, multi_infllm) run on multidoc/* tasks "
           "(default: multidoc/synthetic, generated offline).")
    define(flags.DEFINE_string, "budget",
           "Tokens kept of each prompt; a comma list sweeps (e.g. 128,512). Ignored by 'full'; refused by the "
           "multi-context strategies (docs/eval.md).")
    define(flags.DEFINE_string, "compression_ratio",
           "Fraction of the prompt removed, in [0, 1); a comma list sweeps. samkv: the share of each document's "
           "middle blocks removed; refused by the other multi-context strategies (docs/eval.md).")
    define(flags.DEFINE_string, "method_args",
           "Method hyperparameters as key=value,... (e.g. window_size=32); scope a key to one method of a sweep "
           "with its name: lagkv.lag_size=128,snapkv.window_size=32. Values separated by | sweep that key, one cell "
           "each (dms.threshold=-3|-4|-5). A budget / compression_ratio given here is the "
           "cell's budget (labelled as --budget's), and refused together with --budget / --compression_ratio.")
    define(flags.DEFINE_string, "kv_dtype",
           "KV-cache storage (kvjax.quant): model (the model dtype), int8, fp8, int4, kivi2, kivi4, with options "
           "such as kivi2:group_size=32:residual=64; a comma list sweeps (e.g. model,int8,kivi2).")
    define(flags.DEFINE_enum, "chat_template", "Wrap prompts in the tokenizer's chat template.", CHAT_TEMPLATES)
    define(flags.DEFINE_string, "mesh",
           "Device mesh over this process's devices, data:D,model:M: the batch on data, heads / KV heads / MLP and "
           "the cache on model (e.g. data:2,model:4). Multi-host: see docs/scale.md.")


#: The flags `define_shared` defines.
SHARED_FLAGS = tuple(DEFAULTS)


@dataclasses.dataclass(frozen=True)
class Shared:
    """The shared flags' values, parsed: lists as tuples, `--method_args` as a read-only dict (a `key=a|b` value is
    a `parse.Alternatives`), `--kv_dtype` as `KVQuant`s (None: the model dtype), `--mesh` as (data, model)."""

    model: str = "kvjax-tiny"
    model_dir: str | None = None
    dtype: str = "auto"
    methods: tuple[str, ...] = ("full",)
    method_args: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    budgets: tuple[int, ...] = ()
    ratios: tuple[float, ...] = ()
    kv_dtypes: tuple[KVQuant | None, ...] = (None,)
    chat_template: str = "auto"
    mesh: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "method_args", MappingProxyType(dict(self.method_args)))


def read_shared(values: Mapping[str, Any] | flags.FlagValues) -> Shared:
    """`Shared` from raw flag values (the flags, or a mapping of their values as typed / as a config file gives
    them): each list parsed and each method name checked, one `ConfigError` line naming the flag otherwise."""
    return Shared(**shared_fields(values))


def shared_fields(values: Mapping[str, Any] | flags.FlagValues) -> dict[str, Any]:
    """The fields of `Shared` (`read_shared`), as a dict: a config object extending `Shared` takes them."""
    def get(name: str) -> Any:
        if isinstance(values, flags.FlagValues):
            return values[name].value
        return values.get(name, DEFAULTS[name])

    names = parse.split(get("method"))
    if not names:
        raise ConfigError("--method is empty")
    for name in names:
        if name not in rag.available():
            methods.method_class(name)  # unknown: one line naming it and the closest names
    mesh = get("mesh")
    sizes = sharding.parse_mesh(mesh) if mesh else None
    return dict(
        model=get("model"),
        model_dir=get("model_dir"),
        dtype=get("dtype") or "auto",
        methods=tuple(names),
        method_args=parse.parse_method_args(get("method_args")),
        budgets=tuple(parse.numbers("budget", get("budget"), int)),
        ratios=tuple(parse.numbers("compression_ratio", get("compression_ratio"), float)),
        kv_dtypes=tuple(parse.kv_dtype_specs(get("kv_dtype"))),
        chat_template=get("chat_template") or "auto",
        mesh=None if sizes is None else (sizes[sharding.DATA], sizes[sharding.MODEL]),
    )
