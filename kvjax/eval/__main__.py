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
(`kvjax.eval.plots.default_plots`) is written to `<output_dir>/plots/`; render saved runs with
`python -m kvjax.eval.report <output_dir>`. Nothing is downloaded: synthetic tasks are generated offline,
benchmark tasks read their published JSONL files from `--data_dir`.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from kvjax.cli import flags as shared_flags
from kvjax.cli import parse
from kvjax.cli.refuse import refuse
from kvjax.errors import ConfigError, KvjaxError
from kvjax.eval import config as eval_config
from kvjax.eval import plan, sweep
from kvjax.eval.results import WRITE_ERRNOS, ResultWriteError
from kvjax.runtime import sharding
from kvjax.runtime.compile_cache import enable_compilation_cache

FLAGS = flags.FLAGS
NAME = "kvjax.eval"

# --model --model_dir --dtype --method --method_args --budget --compression_ratio --kv_dtype --chat_template --mesh
shared_flags.define_shared(FLAGS)
flags.adopt_module_key_flags(shared_flags)  # listed by --help with the eval's own
config_flags.DEFINE_config_file(
    "config", None,
    "Python file with get_config() returning an ml_collections.ConfigDict of these flags; path.py:arg calls "
    "get_config(arg); --config.<flag>=... overrides one of its values (flags given on the command line win).",
    lock_config=False,
)
flags.DEFINE_string(
    "task", None,
    "Task name or group, or a comma list (see kvjax.tasks.available()). Default: ruler/niah_single_1, or "
    "multidoc/synthetic when --method names a multi-context strategy.",
)
flags.DEFINE_string("data_dir", None,
                    "Directory with benchmark files in their published formats (LongBench JSONL, ...).")
flags.DEFINE_string(
    "context_length", eval_config.DEFAULT_CONTEXT_LENGTH,
    "Target prompt length in tokens for synthetic tasks (truncation limit for file-based ones); a comma list sweeps.",
)
flags.DEFINE_integer(
    "max_samples", 20, "Samples per task (<= 0: every sample of a file-based task; synthetic tasks need > 0)."
)
flags.DEFINE_integer("batch_size", 1, "Prompts generated together (padded to the longest).")
flags.DEFINE_boolean(
    "query_aware", False,
    "Compress the context together with the question (default: compress the "
    "context alone, then feed the question, as kvpress's query-agnostic setting).",
)
flags.DEFINE_boolean(
    "question_first", False,
    "Also state the question at the top of the prompt, before the context (the 'query-aware "
    "contextualization' of Liu et al., 2023). Small instruct models need it to read a long prompt as a "
    "retrieval task under their chat template. It puts the question inside the context that methods "
    "compress, so it needs --query_aware unless every method is 'full'.",
)
flags.DEFINE_string(
    "answer_prefix", "task",
    "The text RULER's niah tasks end their prompt with, which the answer continues: 'task' (RULER's own, 'The "
    "special magic numbers for <key> mentioned in the provided text are') or 'needle' (the needle's own opening, "
    "'One of the special magic numbers for <key> is:'), for base models that answer RULER's paraphrase with "
    "anything but the needle (Gemma 3 270M). Other tasks keep their own.",
)
flags.DEFINE_integer(
    "chunk_size", None,
    "Prefill the context chunk by chunk (bounded memory for compressing methods); capped at the prompt's length.",
)
flags.DEFINE_integer("max_new_tokens", None, "Tokens generated per answer (default: the task's own answer length).")
flags.DEFINE_string("output_dir", "results", "Where run directories are written.")
flags.DEFINE_integer("seed", 0, "Seed for synthetic data and sampling.")
flags.DEFINE_boolean("skip_malformed", False, "Skip malformed JSONL lines with a warning instead of stopping.")
flags.DEFINE_float("throttle_s", 0.0, "Sleep after each sample, >= 0 (rate limiting; tests use it to interrupt a run).")
flags.DEFINE_boolean("progress", True, "Show a progress bar.")
flags.DEFINE_string(
    "compilation_cache_dir", None,
    "JAX's persistent compilation cache (default $KVJAX_COMPILATION_CACHE_DIR, else ~/.cache/kvjax/jax; 'off': none).",
)
flags.DEFINE_enum(
    "shared_prefill", "auto", ["auto", "yes", "no"],
    "One prefill forward per batch for every one-shot cell of a (task, length) (kvjax/eval/shared.py): auto = when "
    "two or more cells qualify; yes = always (a cell then gives the same predictions alone as in a sweep); no = never.",
)
flags.DEFINE_boolean(
    "dry_run", False,
    "Validate the flags / config against the model's architecture (no weights loaded) and print the planned runs.",
)

_OPENED = sweep.OPENED  # run directories of this process, to count what an interrupted run kept


def run(argv: list[str]) -> int:
    """The CLI body: config -> plan -> run; raises KvjaxError for bad input (main turns it into exit code 2)."""
    if len(argv) > 1:
        raise ConfigError(f"unexpected positional arguments {argv[1:]}; every option is a --flag")
    config = eval_config.from_flags(FLAGS)
    cells = plan.cells(config)
    if config.dry_run:
        sweep.dry_run(config, cells)
        return 0
    sharding.maybe_initialize_distributed()  # multi-process launches (docs/scale.md), before any device use
    sweep.run(*sweep.resolve_dtype(config, cells))
    return 0


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with exit code 2 and a one-line message on bad flags (a --config file that fails to load
    included); --help exits 0 (absl's is 1)."""
    try:
        return parse.parse_flags(FLAGS, argv, NAME, describe=lambda e: _one_line(e, argv))
    except Exception as e:  # noqa: BLE001 - past absl's parsers: a --config file's own code
        if _config_arg(argv) is None:
            raise
        refuse(NAME, f"--config {_config_arg(argv)!r} failed to load: {type(e).__name__}: {e}")


def _config_arg(argv: list[str]) -> str | None:
    args = [a.split("=", 1)[1] for a in argv[1:] if a.startswith(("--config=", "-config="))]
    return args[-1] if args else None


def _one_line(error: flags.Error, argv: list[str]) -> str:
    """absl's message; for a --config file whose get_config raised (config_flags puts the traceback in the
    message), its last line: the exception."""
    text = str(error)
    if "Error whilst parsing config file" not in text:
        return text
    last = [line for line in text.splitlines() if line.strip()][-1].strip()
    return f"--config {_config_arg(argv)!r} failed to load: {last}"


def main(argv: list[str]) -> None:
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep JAX's backend INFO lines out of the output
    if FLAGS.compilation_cache_dir is not None:
        enable_compilation_cache(FLAGS.compilation_cache_dir)
    try:
        sys.exit(run(argv))
    except ResultWriteError as e:  # a full disk, a quota: what was written is intact, a rerun resumes
        refuse(NAME, f"{e} ({sweep.kept_samples()} samples kept in {FLAGS.output_dir})")
    except KvjaxError as e:
        refuse(NAME, e)
    except PermissionError as e:  # e.g. a read-only --output_dir with samples left to run
        refuse(NAME, f"cannot write {e.filename}: {e.strerror} (check --output_dir)")
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        refuse(NAME, f"cannot write {e.filename or FLAGS.output_dir}: {e.strerror or e} "
                     f"({sweep.kept_samples()} samples kept in {FLAGS.output_dir}; free space and rerun to resume)")
    except KeyboardInterrupt:
        print(f"\n{NAME}: interrupted: {sweep.kept_samples()} samples kept in {FLAGS.output_dir}, rerun to resume",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
