"""`python -m kvjax.eval`: evaluate KV-cache compression methods on long-context tasks.

    python -m kvjax.eval --method=snapkv,streaming_llm --budget=128,512 --task=ruler/niah_single_1
    python -m kvjax.eval --method=samkv,cacheblend,epic,reuse,recompute   # multidoc/synthetic, kvjax-tiny
    python -m kvjax.eval --method=samkv --model=qwen2.5-7b --model_dir=/models/Qwen2.5-7B-Instruct
    python -m kvjax.eval --config=configs/tiny_sweep.py

Every cell (method, budget or ratio, task, context length and every other setting that changes a result:
kvjax/eval/cell.py) gets a run directory `<output_dir>/<run>/` with `predictions.jsonl` (one line per
finished sample, flushed as it finishes), `metrics.json` and `config.json`. Re-running the same command
resumes: finished samples are skipped (Ctrl-C stops with exit code 130 and says how many samples are kept);
a directory holding another setting's results is refused. Processes sharing an --output_dir split its
cells (one claim per cell), and a repeated cell runs once. At the end a pivot
(methods x task and budget, cells `score (kept tokens)`) is printed and the report's default plot
(`kvjax.eval.report.default_plots`) is written to `<output_dir>/plots/`; render saved runs with
`python -m kvjax.eval.report <output_dir>`. Nothing is downloaded: synthetic tasks are generated offline,
benchmark tasks read their published JSONL files from `--data_dir`.
"""

from __future__ import annotations

import ast
import glob
import os
import platform
import subprocess
import sys
from typing import Any

from absl import app, flags

from kvjax.errors import ConfigError, KvjaxError

FLAGS = flags.FLAGS

flags.DEFINE_string(
    "model",
    "kvjax-tiny",
    "Preset name (see kvjax.models.presets.available()) or a local HF directory.",
)
flags.DEFINE_string("model_dir", None, "Local directory holding the weights of a preset model (else $KVJAX_MODEL_DIR).")
flags.DEFINE_string(
    "method",
    "full",
    "Registered method name, or a comma list to sweep (see kvjax.methods.available()); multi-context "
    "strategies (samkv, cacheblend, epic, reuse, recompute, multi_infllm) run on multidoc/* tasks "
    "(default: multidoc/synthetic, generated offline).",
)
flags.DEFINE_string(
    "budget",
    None,
    "Tokens kept of each prompt; a comma list sweeps (e.g. 128,512). Ignored by 'full'; refused by the "
    "multi-context strategies (docs/eval.md).",
)
flags.DEFINE_string(
    "compression_ratio", None,
    "Fraction of the prompt removed, in [0, 1); a comma list sweeps. samkv: the share of each document's middle "
    "blocks removed; refused by the other multi-context strategies (docs/eval.md).",
)
flags.DEFINE_string(
    "method_args",
    "",
    "Method hyperparameters as key=value,... (e.g. window_size=32); scope a key to one method of a sweep "
    "with its name: lagkv.lag_size=128,snapkv.window_size=32. Values separated by | sweep that key, one cell "
    "each (dms.threshold=-3|-4|-5). A budget / compression_ratio given here is the "
    "cell's budget (labelled as --budget's), and refused together with --budget / --compression_ratio.",
)
flags.DEFINE_string(
    "config",
    None,
    "Python file with get_config() returning an ml_collections.ConfigDict of these flags "
    "(flags given on the command line win).",
)
flags.DEFINE_string(
    "task",
    None,
    "Task name or group, or a comma list (see kvjax.eval.tasks.available()). Default: ruler/niah_single_1, or "
    "multidoc/synthetic when --method names a multi-context strategy.",
)
flags.DEFINE_string(
    "data_dir",
    None,
    "Directory with benchmark files in their published formats (LongBench JSONL, ...).",
)
flags.DEFINE_string(
    "context_length",
    "1024",
    "Target prompt length in tokens for synthetic tasks (truncation limit for file-based ones); a comma list sweeps.",
)
flags.DEFINE_integer(
    "max_samples", 20, "Samples per task (<= 0: every sample of a file-based task; synthetic tasks need > 0)."
)
flags.DEFINE_integer("batch_size", 1, "Prompts generated together (padded to the longest).")
flags.DEFINE_enum(
    "dtype",
    "auto",
    ["auto", "float32", "bfloat16", "float16"],
    "Model dtype; auto = float32 on CPU, bfloat16 elsewhere.",
)
flags.DEFINE_string(
    "kv_dtype",
    "model",
    "KV-cache storage (kvjax.quant): model (the model dtype), int8, fp8, int4, kivi2, kivi4, with options such as "
    "kivi2:group_size=32:residual=64; a comma list sweeps (e.g. model,int8,kivi2).",
)
flags.DEFINE_boolean(
    "query_aware",
    False,
    "Compress the context together with the question (default: compress the "
    "context alone, then feed the question, as kvpress's query-agnostic setting).",
)
flags.DEFINE_enum("chat_template", "auto", ["auto", "yes", "no"], "Wrap prompts in the tokenizer's chat template.")
flags.DEFINE_boolean(
    "question_first",
    False,
    "Also state the question at the top of the prompt, before the context (the 'query-aware "
    "contextualization' of Liu et al., 2023). Small instruct models need it to read a long prompt as a "
    "retrieval task under their chat template. It puts the question inside the context that methods "
    "compress, so it needs --query_aware unless every method is 'full'.",
)
flags.DEFINE_integer(
    "chunk_size", None,
    "Prefill the context chunk by chunk (bounded memory for compressing methods); capped at the prompt's length.",
)
flags.DEFINE_integer("max_new_tokens", None, "Tokens generated per answer (default: the task's own answer length).")
flags.DEFINE_string("output_dir", "results", "Where run directories are written.")
flags.DEFINE_integer("seed", 0, "Seed for synthetic data and sampling.")
flags.DEFINE_boolean("skip_malformed", False, "Skip malformed JSONL lines with a warning instead of stopping.")
flags.DEFINE_float("throttle_s", 0.0, "Sleep after each sample (rate limiting; tests use it to interrupt a run).")
flags.DEFINE_boolean("progress", True, "Show a progress bar.")
flags.DEFINE_string(
    "mesh",
    None,
    "Device mesh over this process's devices, data:D,model:M: the batch on data, heads / KV heads / MLP and the "
    "cache on model (e.g. data:2,model:4). Multi-host: see docs/scale.md.",
)
flags.DEFINE_string(
    "compilation_cache_dir", None,
    "JAX's persistent compilation cache (default $KVJAX_COMPILATION_CACHE_DIR, else ~/.cache/kvjax/jax; 'off': none).",
)
flags.DEFINE_enum(
    "shared_prefill", "auto", ["auto", "yes", "no"],
    "One prefill forward per batch for every one-shot cell of a (task, length) (kvjax/eval/sweep.py): auto = when "
    "two or more cells qualify; yes = always (a cell then gives the same predictions alone as in a sweep); no = never.",
)
flags.DEFINE_boolean(
    "dry_run", False, "Validate the flags / config and print the planned runs, without loading a model."
)


def _split(value: str | None, sep: str = ",", *, keep_empty: bool = False) -> list[str]:
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


def _parse_literal(text: str) -> Any:
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
    """`key=value,key=value` (values parsed as Python literals) or a dict from a config file."""
    if isinstance(spec, dict):
        return dict(spec)
    out: dict[str, Any] = {}
    for item in _split(spec):
        if "=" not in item:
            raise ConfigError(f"--method_args entry {item!r} is not key=value")
        key, value = item.split("=", 1)
        values = _split(value, "|", keep_empty=True)
        if len(values) > 1 and not all(values):
            raise ConfigError(f"--method_args entry {item!r} has an empty value between its | separators")
        parsed = [_parse_literal(v) for v in values] or [_parse_literal("")]
        unique = [v for i, v in enumerate(parsed) if v not in parsed[:i]]  # a repeated value is one cell
        out[key.strip()] = Alternatives(unique) if len(unique) > 1 else unique[0]
    return out


def _each_value(args: dict[str, Any]) -> list[dict[str, Any]]:
    """`args` with every `Alternatives` value taken one at a time: the product over its swept keys, in order."""
    out: list[dict[str, Any]] = [{}]
    for key, value in args.items():
        choices = value if isinstance(value, Alternatives) else (value,)
        out = [{**done, key: choice} for done in out for choice in choices]
    return out


def _numbers(flag: str, value: str | None, kind: type) -> list:
    out = []
    for item in _split(value):
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


def _flatten_method_args(value: dict, prefix: str = "") -> list[str]:
    """`{"lagkv": {"lag_size": 128}, "seed": 1}` -> `["lagkv.lag_size=128", "seed=1"]`: a top-level dict is a
    method's (or strategy's) scope; a dict inside one (`{"dms": {"base_args": {...}}}`) stays one dict literal."""
    items = []
    for key, val in value.items():
        if isinstance(val, dict) and not prefix:
            items += _flatten_method_args(val, f"{prefix}{key}.")
        elif isinstance(val, dict):
            items.append(f"{prefix}{key}={val!r}")
        else:
            items.append(f"{prefix}{key}={val!r}" if isinstance(val, str) else f"{prefix}{key}={val}")
    return items


def load_config_file(spec: str) -> dict[str, Any]:
    """Values of `get_config()` (or `get_config(arg)` for `path:arg`) of a config file, as a dict."""
    path, arg = spec, None
    if not os.path.isfile(path) and ":" in spec:
        path, arg = spec.rsplit(":", 1)
    if not os.path.isfile(path):
        raise ConfigError(f"--config file {path!r} does not exist")
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("kvjax_eval_config", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
        config = module.get_config() if arg is None else module.get_config(arg)
    except Exception as e:  # a user's file: report, don't trace back
        raise ConfigError(f"--config {spec!r} failed to load: {type(e).__name__}: {e}") from None
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ConfigError(f"--config {spec!r}: get_config() returned {type(config).__name__}, not a ConfigDict or "
                          "dict of flag values")
    return dict(config)


def _apply_config_file(spec: str) -> None:
    """Fills flags not given on the command line from a config file."""
    for key, value in load_config_file(spec).items():
        if key not in FLAGS or key not in _OWN_FLAGS:
            raise ConfigError(f"--config {spec!r} sets {key!r}, which is not a flag of kvjax.eval")
        if FLAGS[key].present:
            continue
        if key == "method_args" and isinstance(value, dict):
            value = ",".join(_flatten_method_args(value))
        elif isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value)
        if value is not None and FLAGS[key].flag_type() == "string":
            value = str(value)
        FLAGS[key].value = value


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("kvjax", "jax", "jaxlib", "flax", "transformers", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def check_cell(method: Any, context_length: int, max_positions: int) -> None:
    """The checks `prefill` makes of a method and prompt length, for one cell of a sweep, before any cell runs.

    Prompts are built to fit `context_length` tokens with their answers, so that is the longest sequence.
    """
    if method is not None:
        from kvjax.runtime.generate import check_context

        method.validate(context_length, 1, max_positions)
        try:
            check_context(method, context_length, context_length, max_positions)
        except KvjaxError as e:
            raise ConfigError(f"--context_length={context_length}: {e}") from None
    elif context_length > max_positions:
        raise ConfigError(
            f"--context_length={context_length} exceeds the model's maximum context of {max_positions} tokens"
        )


def _check_output_dir(path: str) -> None:
    """`--output_dir` must be a directory (made when missing); a read-only one is refused when a run writes."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--output_dir {path!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--output_dir {path!r} cannot be created: {e.strerror or e}") from None


def _check_cells_creatable(path: str, names: list[str]) -> None:
    """Run directories can be made in `path` when a cell has none yet (a finished sweep reruns read-only)."""
    if all(os.path.isdir(os.path.join(path, n)) for n in names):
        return
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvjax-probe-", dir=path))
    except OSError as e:
        raise ConfigError(f"--output_dir {path!r}: cannot create run directories in it ({e.strerror or e})") from None


def _cell_key(setting: Any, dtype: str) -> Any:
    """The identity of one cell (kvjax/eval/cell.py): every flag that changes its results."""
    from kvjax.eval.cell import CellKey, data_dir_for

    rag_cell = setting.rag_strategy is not None
    return CellKey(
        model=FLAGS.model,
        method=setting.method_name,
        task=setting.task_name,
        context_length=setting.context_length,
        budget=setting.budget,
        compression_ratio=setting.compression_ratio,
        method_args=dict(setting.method_args),
        seed=FLAGS.seed,
        query_aware=FLAGS.query_aware,
        question_first=FLAGS.question_first,
        dtype=dtype,
        chat_template=FLAGS.chat_template,
        kv_dtype=setting.kv_dtype,
        chunk_size=None if rag_cell else FLAGS.chunk_size,  # the RAG path prefills documents whole
        max_new_tokens=FLAGS.max_new_tokens,
        data_dir=data_dir_for(setting.task_name, FLAGS.data_dir),
    )


def _load_samples(tasks_mod: Any, encoder: Any, tokenizer: Any, settings: list) -> dict[tuple[str, int], tuple]:
    """Every (task, context length)'s samples, before the first cell runs; a task with none is refused."""
    import dataclasses

    out: dict[tuple[str, int], tuple[Any, list]] = {}
    for setting in settings:
        key = (setting.task_name, setting.context_length)
        if key in out:
            continue
        task = tasks_mod.get(setting.task_name, tokenizer=tokenizer, skip_malformed=FLAGS.skip_malformed)
        samples = task.samples(
            count_tokens=encoder.count_tokens,
            context_length=setting.context_length,
            num_samples=max(0, FLAGS.max_samples),
            seed=FLAGS.seed,
            data_dir=FLAGS.data_dir,
        )
        if not samples:
            hint = "its data file holds no sample (empty file?)"
            if FLAGS.max_samples <= 0:
                hint = f"--max_samples={FLAGS.max_samples} makes none for a synthetic task (give > 0), or {hint}"
            raise ConfigError(f"task {setting.task_name!r} at --context_length={setting.context_length} has no "
                              f"samples: {hint}")
        if FLAGS.max_new_tokens is not None:
            samples = [dataclasses.replace(s, max_new_tokens=FLAGS.max_new_tokens) for s in samples]
        out[key] = (task, samples)
    return out


def _scoped_args(method_args: dict[str, Any], name: str) -> dict[str, Any]:
    """Arguments for method `name`: unscoped keys, plus `name.key` keys (scoped to that method)."""
    out = {k: v for k, v in method_args.items() if "." not in k}
    out.update({k.split(".", 1)[1]: v for k, v in method_args.items() if k.startswith(name + ".")})
    return out


_AMOUNT_KEYS = ("budget", "compression_ratio")


def _amounts(
    name: str, args: dict[str, Any], budgets: list[int], ratios: list[float]
) -> list[tuple[int | None, float | None]]:
    """The (budget, ratio) cells of method `name`. A budget or ratio in its --method_args is its cell's (and pops
    out of `args`), refused together with --budget / --compression_ratio, which would silently override it."""
    given = {k: args.pop(k) for k in _AMOUNT_KEYS if k in args}
    if given:
        if budgets or ratios:
            flag = ",".join([f"--budget={','.join(map(str, budgets))}"] * bool(budgets)
                            + [f"--compression_ratio={','.join(map(str, ratios))}"] * bool(ratios))
            raise ConfigError(f"--method_args sets {', '.join(f'{k}={v!r}' for k, v in given.items())} for {name} "
                              f"and {flag} sets it too: give the amount in one place (scope --method_args to a "
                              "method, e.g. snapkv.budget=64, for a different amount per method)")
        budget, ratio = given.get("budget"), given.get("compression_ratio")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise ConfigError(f"--method_args budget for {name} must be an integer > 0, got {budget!r}")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float)
                                  or not 0.0 <= ratio < 1.0):
            raise ConfigError(f"--method_args compression_ratio for {name} must be in [0, 1), got {ratio!r}")
        return [(budget, None if ratio is None else float(ratio))]
    amounts: list[tuple[int | None, float | None]] = [(b, None) for b in budgets] + [(None, r) for r in ratios]
    return amounts or [(None, None)]


def parse_kv_dtypes(value: str | None) -> list[str | None]:
    """`--kv_dtype`'s comma list as canonical names (None: the model dtype), each once, in the order given."""
    from kvjax.quant import parse_kv_dtype

    items = [v.strip() for v in (value or "").split(",")] if value and value.strip() else ["model"]
    out = []
    for item in items:
        if not item:
            raise ConfigError(f"--kv_dtype={value!r} has an empty entry")
        try:
            spec = parse_kv_dtype(item)
        except KvjaxError as e:
            raise ConfigError(f"--kv_dtype value {item!r}: {e}") from None
        out.append(None if spec is None else spec.name)
    return list(dict.fromkeys(out))


def check_kv_dtype(kv_dtype: str | None, config: Any) -> None:
    """The checks `prefill` makes of a cache format against the model (head_dim packing)."""
    if kv_dtype is None:
        return
    from kvjax.runtime.generate import resolve_kv_dtype

    try:
        resolve_kv_dtype(kv_dtype, config.head_dim)
    except KvjaxError as e:
        raise ConfigError(f"--kv_dtype={kv_dtype}: {e}") from None


def _settings(
    methods_mod: Any,
    method_names: list[str],
    budgets: list[int],
    ratios: list[float],
    method_args: dict[str, Any],
    tasks: list[str],
    lengths: list[int],
    kv_dtypes: list[str | None] = (None,),
) -> list:
    """Every cell of the sweep, each once (a repeated method, budget or length adds none)."""
    from kvjax import rag
    from kvjax.eval.rag_amounts import strategy_args
    from kvjax.eval.runner import Setting

    unknown_scopes = {k.split(".", 1)[0] for k in method_args if "." in k} - set(method_names)
    if unknown_scopes:
        raise ConfigError(f"--method_args scopes {sorted(unknown_scopes)} name no method of --method={method_names}")
    out: dict[tuple, Setting] = {}
    for name, args in ((n, a) for n in dict.fromkeys(method_names) for a in _each_value(_scoped_args(method_args, n))):
        if name == "full":
            for key in _AMOUNT_KEYS:  # an unscoped amount is --budget's: ignored by the full cache
                if key in args and f"full.{key}" not in method_args:
                    args.pop(key)
            amounts: list[tuple[int | None, float | None]] = [(None, None)]
        else:
            amounts = _amounts(name, args, budgets, ratios)
        for budget, ratio in amounts:
            if name in rag.available():  # a multi-context strategy: runs through kvjax.rag
                method, strategy = None, rag.get_strategy(name, **strategy_args(name, args, budget, ratio))
            else:
                kwargs = dict(args)
                if budget is not None:
                    kwargs["budget"] = budget
                if ratio is not None:
                    kwargs["compression_ratio"] = ratio
                method, strategy = methods_mod.get(name, **kwargs), None  # validates before anything runs
            margs = tuple(sorted(args.items()))
            for kv_dtype in kv_dtypes:
                for task in tasks:
                    for length in lengths:
                        key = (name, budget, ratio, _frozen(margs), task, length, kv_dtype)
                        out.setdefault(key, Setting(name, method, task, length, budget, ratio, margs, strategy,
                                                    kv_dtype))
    return list(out.values())


def _frozen(value: Any) -> Any:
    """`value` with its dicts and lists as tuples, so method arguments such as `base_args={...}` key a cell."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _with_tokenizer(setting: Any, encoder: Any) -> Any:
    """A context-replay method (KVzip) gets its repeat prompt from the tokenizer (`ContextReplay.with_tokenizer`)."""
    import dataclasses

    from kvjax.methods import capabilities as caps

    if setting.method is None or not caps.replays_context(setting.method):
        return setting
    return dataclasses.replace(setting, method=setting.method.with_tokenizer(encoder.tokenizer, encoder.use_template))


DEFAULT_TASK = "ruler/niah_single_1"
DEFAULT_RAG_TASK = "multidoc/synthetic"


def run(argv: list[str]) -> int:
    """The CLI body; raises KvjaxError for bad input (main turns it into exit code 2)."""
    if len(argv) > 1:
        raise ConfigError(f"unexpected positional arguments {argv[1:]}; every option is a --flag")
    if FLAGS.config:
        _apply_config_file(FLAGS.config)

    from kvjax import methods as methods_mod
    from kvjax.eval import tasks as tasks_mod

    method_names = _split(FLAGS.method)
    if not method_names:
        raise ConfigError("--method is empty")
    from kvjax import rag

    for name in method_names:
        if name not in rag.available():
            methods_mod.method_class(name)
    budgets = _numbers("budget", FLAGS.budget, int)
    ratios = _numbers("compression_ratio", FLAGS.compression_ratio, float)
    lengths = _numbers("context_length", FLAGS.context_length, int)
    if not lengths:
        raise ConfigError("--context_length is empty")
    method_args = parse_method_args(FLAGS.method_args)
    multi_context = any(name in rag.available() for name in method_names)
    task_names = tasks_mod.expand(FLAGS.task or (DEFAULT_RAG_TASK if multi_context else DEFAULT_TASK))
    if FLAGS.batch_size <= 0:
        raise ConfigError(f"--batch_size must be > 0, got {FLAGS.batch_size}")
    if FLAGS.chunk_size is not None and FLAGS.chunk_size <= 0:
        raise ConfigError(f"--chunk_size must be > 0, got {FLAGS.chunk_size}")
    if FLAGS.max_new_tokens is not None and FLAGS.max_new_tokens <= 0:
        raise ConfigError(f"--max_new_tokens must be > 0, got {FLAGS.max_new_tokens}")
    if FLAGS.data_dir is not None and not os.path.isdir(FLAGS.data_dir):
        raise ConfigError(f"--data_dir {FLAGS.data_dir!r} is not a directory")
    from kvjax.runtime import sharding

    mesh_sizes = sharding.parse_mesh(FLAGS.mesh) if FLAGS.mesh else None
    batched = [name for name in method_names if name not in rag.available()]  # RAG strategies run one by one
    if mesh_sizes and batched and FLAGS.batch_size % mesh_sizes[sharding.DATA]:
        raise ConfigError(
            f"--batch_size={FLAGS.batch_size} is not a multiple of the mesh's data axis ({mesh_sizes[sharding.DATA]})"
        )
    compressing = [name for name in method_names if name != "full"]
    if FLAGS.question_first and not FLAGS.query_aware and compressing:
        raise ConfigError(
            f"--question_first puts the question into the compressed context, which makes --method={compressing} "
            "query-aware: add --query_aware, or run --method=full alone"
        )
    kv_dtypes = parse_kv_dtypes(FLAGS.kv_dtype)
    settings = _settings(methods_mod, method_names, budgets, ratios, method_args, task_names, lengths, kv_dtypes)
    if FLAGS.dry_run:
        print(f"model: {FLAGS.model}")
        for setting in settings:
            print(setting.label)
        print(f"{len(settings)} runs planned")
        return 0

    sharding.maybe_initialize_distributed()  # multi-process launches (docs/scale.md), before any device use
    import jax

    dtype = FLAGS.dtype if FLAGS.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    keys = [_cell_key(s, dtype) for s in settings]
    _check_output_dir(FLAGS.output_dir)
    _check_cells_creatable(FLAGS.output_dir, [k.name() for k in keys])
    from kvjax.eval.results import RunDir, model_fingerprint, read_predictions, shard
    from kvjax.models.model import load_model
    from kvjax.models.presets import resolve_model_dir
    from kvjax.models.tokenizer import load_tokenizer

    model = load_model(FLAGS.model, dtype=dtype, model_dir=FLAGS.model_dir)
    fingerprint = model_fingerprint(resolve_model_dir(FLAGS.model, model_dir=FLAGS.model_dir))
    tokenizer = load_tokenizer(FLAGS.model, model_dir=FLAGS.model_dir)
    from kvjax.eval.runner import PromptEncoder, check_sample_ids

    encoder = PromptEncoder(tokenizer, FLAGS.chat_template, question_first=FLAGS.question_first)
    settings = [_with_tokenizer(s, encoder) for s in settings]
    mesh = None
    if mesh_sizes:
        mesh = sharding.make_mesh(mesh_sizes[sharding.DATA], mesh_sizes[sharding.MODEL])
        model = sharding.shard_model(model, mesh)
    for setting in settings:  # every cell, before the first one runs (and before building long prompts)
        check_cell(setting.method, setting.context_length, model.config.max_position_embeddings)
        check_kv_dtype(setting.kv_dtype, model.config)
    process_index, process_count = jax.process_index(), jax.process_count()

    sample_cache = _load_samples(tasks_mod, encoder, tokenizer, settings)
    for key in keys:  # a corrupt predictions line of any cell stops the sweep before anything is written
        read_predictions(glob.glob(os.path.join(glob.escape(os.path.join(FLAGS.output_dir, key.name())),
                                                "predictions*.jsonl")))
    from kvjax.eval import sweep

    shared = sweep.shared_cells(settings, FLAGS.shared_prefill, chunk_size=FLAGS.chunk_size, mesh=mesh)
    cells: list[sweep.Cell] = []
    for setting, key in zip(settings, keys, strict=True):
        task, samples = sample_cache[(setting.task_name, setting.context_length)]
        if setting.rag_strategy is not None and any(not s.documents for s in samples):
            raise ConfigError(
                f"--method={setting.method_name} is a multi-context strategy: it needs a task whose samples are "
                f"split into documents (multidoc/*), not {setting.task_name!r}"
            )
        run_dir = RunDir(FLAGS.output_dir, key.name(), process_index=process_index, process_count=process_count)
        run_dir.check_model(fingerprint)
        run_dir.check_identity(key)
        check_sample_ids(run_dir, task, samples, count_tokens=encoder.count_tokens, seed=FLAGS.seed,
                         context_length=setting.context_length, data_dir=FLAGS.data_dir)  # issue 60: foreign records
        _OPENED.append(run_dir)
        cells.append(sweep.Cell(setting, task, shard(samples, process_index, process_count), run_dir))
    context = {
        "model": model, "encoder": encoder, "mesh": mesh, "shared": {id(cells[i]) for i in shared},
        "config": lambda cell, key: _cell_config(cell.setting, key, fingerprint, model, dtype, process_count),
        "keys": {id(c): k for c, k in zip(cells, keys, strict=True)},
    }
    _run_cells(cells, context)
    _print_summary([c.run_dir for c in cells], write_plot=process_index == 0)
    return 0


def _cell_config(setting: Any, key: Any, fingerprint: str, model: Any, dtype: str, process_count: int) -> dict:
    """`config.json` of one cell: its key (`cell`), the flags, the model, versions and device."""
    import jax

    return {
        "cell": key.as_dict(),
        "model_fingerprint": fingerprint,
        "flags": {f: FLAGS[f].value for f in FLAGS if f in _OWN_FLAGS},
        "method": setting.method_name,
        "budget": setting.budget,
        "compression_ratio": setting.compression_ratio,
        "query_aware": FLAGS.query_aware,
        "method_args": dict(setting.method_args),
        "method_hyperparameters": setting.method.hyperparameters()
        if setting.method
        else setting.rag_strategy.hyperparameters(),
        "multi_context": setting.rag_strategy is not None,
        "task": setting.task_name,
        "context_length": setting.context_length,
        "model": FLAGS.model,
        "model_config": model.config.to_hf_dict(),
        "dtype": dtype,
        "kv_dtype": setting.kv_dtype or "model",
        "versions": _versions(),
        "git_commit": _git_commit(),
        "device": {
            "backend": jax.default_backend(),
            "kind": jax.devices()[0].device_kind,
            "count": jax.device_count(),
            "process_count": process_count,
        },
    }


def _todo(cell: Any) -> int:
    done = cell.run_dir.done_ids()
    return sum(1 for s in cell.samples if s.id not in done)


def _run_cells(cells: list, context: dict) -> None:
    """Runs every cell this process can claim; then waits for the cells other processes hold and finishes them
    (nothing, unless their holder died). A finished cell is not claimed: it reruns in a read-only folder."""
    from kvjax.eval.runner import finish_setting

    queued, held, deferred = [], [], []
    for cell in cells:
        if not _todo(cell):
            cell.run_dir.write_config(context["config"](cell, context["keys"][id(cell)]))
            finish_setting(cell.run_dir, cell.setting)
            continue
        claim = cell.run_dir.claim()
        if not claim.try_acquire():
            print(f"kvjax.eval: {cell.run_dir.name} is being run by {claim.holder()}; running the other cells "
                  "first", file=sys.stderr)
            deferred.append((cell, claim))
            continue
        held.append(claim)
        cell.run_dir.write_config(context["config"](cell, context["keys"][id(cell)]))
        if id(cell) in context["shared"]:  # run below, together with the cells it shares a prefill with
            queued.append(cell)
            continue
        _run_one(cell, context)
        claim.release()
    if queued:
        _run_group(queued, context)
    for claim in held:
        claim.release()
    for cell, claim in deferred:
        if not claim.try_acquire():
            print(f"kvjax.eval: waiting for {claim.holder()} to finish {cell.run_dir.name}", file=sys.stderr)
            claim.acquire()
        try:
            cell.run_dir.write_config(context["config"](cell, context["keys"][id(cell)]))
            if id(cell) in context["shared"]:
                _run_group([cell], context)
            else:
                _run_one(cell, context)
        finally:
            claim.release()


def _progress(total: int, left: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=total - left, desc=desc, unit="sample", disable=not FLAGS.progress,
                file=sys.stderr, dynamic_ncols=True)


def _run_one(cell: Any, context: dict) -> None:
    from kvjax.eval.runner import run_setting
    from kvjax.runtime.compiled_memory import release_if_needed

    with _progress(len(cell.samples), _todo(cell), cell.setting.label) as bar:
        release_if_needed()  # thousands of compiled programs exhaust the process's memory mappings
        run_setting(  # writes metrics.json; the pivot below recomputes scores from the predictions
            model=context["model"],
            encoder=context["encoder"],
            task=cell.task,
            samples=cell.samples,
            setting=cell.setting,
            run_dir=cell.run_dir,
            batch_size=FLAGS.batch_size,
            query_aware=FLAGS.query_aware,
            seed=FLAGS.seed,
            chunk_size=FLAGS.chunk_size,
            mesh=context["mesh"],
            progress=bar.update,
            throttle_s=FLAGS.throttle_s,
        )


def _run_group(cells: list, context: dict) -> None:
    from kvjax.eval import sweep

    total = sum(len(c.samples) for c in cells)
    with _progress(total, sum(_todo(c) for c in cells), f"{len(cells)} cells, shared prefill") as bar:
        sweep.run_queued(
            cells, model=context["model"], encoder=context["encoder"], batch_size=FLAGS.batch_size,
            query_aware=FLAGS.query_aware, seed=FLAGS.seed, progress=bar.update, throttle_s=FLAGS.throttle_s,
        )


def _print_summary(run_dirs: list, write_plot: bool) -> None:
    """The pivot of this sweep's cells and the path of its score-vs-budget plot."""
    from kvjax.eval import report

    runs = report.load_runs(sorted({d.path for d in run_dirs}))
    print(report.render_pivot(runs))
    if write_plot:
        plots, note = report.default_plots(runs, os.path.join(FLAGS.output_dir, "plots"))
        for path in plots:
            print(f"plot: {os.path.abspath(path)}")
        if note:
            print(note)
    where = os.path.abspath(FLAGS.output_dir)
    print(f"results in {where}; render with: python -m kvjax.eval.report {FLAGS.output_dir}")


_OPENED: list = []  # run directories of this process, to count what an interrupted run kept

_OWN_FLAGS = (
    "model",
    "model_dir",
    "method",
    "budget",
    "compression_ratio",
    "method_args",
    "config",
    "task",
    "data_dir",
    "context_length",
    "max_samples",
    "batch_size",
    "dtype",
    "kv_dtype",
    "query_aware",
    "chat_template",
    "question_first",
    "chunk_size",
    "max_new_tokens",
    "mesh",
    "output_dir",
    "seed",
    "skip_malformed",
)


_HELP = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with exit code 2 and a one-line message on bad flags; --help exits 0 (absl's is 1)."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"kvjax.eval: error: {e}\nSee: python -m kvjax.eval --help", file=sys.stderr)
        sys.exit(2)
    except SystemExit as e:
        if e.code == 1 and any(a.split("=", 1)[0] in _HELP for a in argv[1:]):
            sys.exit(0)
        raise


def main(argv: list[str]) -> None:
    from absl import logging

    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep JAX's backend INFO lines out of the output
    if FLAGS.compilation_cache_dir is not None:
        from kvjax.runtime.compile_cache import enable_compilation_cache

        enable_compilation_cache(FLAGS.compilation_cache_dir)
    from kvjax.eval.results import WRITE_ERRNOS, ResultWriteError

    try:
        sys.exit(run(argv))
    except ResultWriteError as e:  # a full disk, a quota: what was written is intact, a rerun resumes
        print(f"kvjax.eval: error: {e} ({_kept_samples()} samples kept in {FLAGS.output_dir})", file=sys.stderr)
        sys.exit(2)
    except KvjaxError as e:
        print(f"kvjax.eval: error: {e}", file=sys.stderr)
        sys.exit(2)
    except PermissionError as e:  # e.g. a read-only --output_dir with samples left to run
        print(f"kvjax.eval: error: cannot write {e.filename}: {e.strerror} (check --output_dir)", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        print(f"kvjax.eval: error: cannot write {e.filename or FLAGS.output_dir}: {e.strerror or e} "
              f"({_kept_samples()} samples kept in {FLAGS.output_dir}; free space and rerun to resume)",
              file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"\nkvjax.eval: interrupted: {_kept_samples()} samples kept in {FLAGS.output_dir}, rerun to resume",
              file=sys.stderr)
        sys.exit(130)


def _kept_samples() -> int:
    total = 0
    for run_dir in _OPENED:
        try:
            total += len(run_dir.records())
        except (KvjaxError, OSError):
            pass
    return total


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
