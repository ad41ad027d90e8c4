"""Runs a planned sweep (`kvjax.eval.plan`): checks every cell against the model, opens the run directories, runs
each cell this process can claim (cells sharing a prefill together, `kvjax.eval.shared`), prints the pivot.

    cells = plan.cells(config)
    sweep.dry_run(config, cells)         # --dry_run: the model's architecture read, every cell checked, printed
    sweep.run(config, cells)             # config.dtype resolved ("auto" -> float32 on CPU, bfloat16 elsewhere)

Every refusal comes before the first cell runs and before any run directory is made (`kvjax.eval.checks`). A
finished cell is not claimed: a rerun of a finished sweep writes nothing (it works in a read-only folder).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import jax
from tqdm import tqdm

from kvjax import tasks as task_registry
from kvjax.cli import paths
from kvjax.errors import ConfigError, KvjaxError
from kvjax.eval import checks, plan, report
from kvjax.eval.cell import Cell
from kvjax.eval.config import EvalConfig
from kvjax.eval.plots import default_plots
from kvjax.eval.results import RunDir, model_fingerprint, read_predictions, shard
from kvjax.eval.runner import CellRun, PromptEncoder, check_sample_ids, finish_setting, run_setting
from kvjax.eval.runs import load_runs
from kvjax.eval.shared import MODES, run_group, run_queued, shared_cells  # noqa: F401  (re-exported)
from kvjax.methods import capabilities as caps
from kvjax.models.model import load_model
from kvjax.models.presets import resolve_model_dir
from kvjax.models.tokenizer import load_tokenizer
from kvjax.runtime import sharding
from kvjax.runtime.compiled_memory import release_if_needed

__all__ = ["OPENED", "dry_run", "kept_samples", "resolve_dtype", "run", "shared_cells"]

#: Run directories this process opened, to count what an interrupted or failed run kept (`kept_samples`).
OPENED: list[RunDir] = []


def dry_run(config: EvalConfig, cells: Sequence[Cell]) -> None:
    """Checks every cell against the model's architecture (no weights loaded) and prints the plan."""
    model, note = checks.model_config(config, weights_needed=False)
    checks.check_cells(cells, model, config)
    print(f"model: {config.model}" + (f" ({note})" if note else ""))
    for cell in cells:
        print(cell.label)
    print(f"{len(cells)} runs planned")


def resolve_dtype(config: EvalConfig, cells: Sequence[Cell]) -> tuple[EvalConfig, list[Cell]]:
    """`--dtype=auto` resolved on this backend (float32 on CPU, bfloat16 elsewhere) in the config and every cell's
    key (which stores the dtype it ran in)."""
    if config.dtype != "auto":
        return config, list(cells)
    config = dataclasses.replace(config, dtype="float32" if jax.default_backend() == "cpu" else "bfloat16")
    return config, [dataclasses.replace(c, key=plan.cell_key(c, config)) for c in cells]


def run(config: EvalConfig, cells: Sequence[Cell]) -> list[RunDir]:
    """Runs the sweep; returns its run directories (after printing their pivot and writing the plot)."""
    paths.output_folder("output_dir", config.output_dir, writable=False)  # a finished sweep reruns read-only
    _check_cells_creatable(config.output_dir, [c.key.name() for c in cells])
    architecture, _ = checks.model_config(config, weights_needed=True)
    tokenizer = load_tokenizer(config.model, model_dir=config.model_dir)
    encoder = PromptEncoder(tokenizer, config.chat_template, question_first=config.question_first)
    cells = [_with_tokenizer(c, encoder) for c in cells]
    checks.check_cells(cells, architecture, config)  # every cell, before loading weights or building prompts
    model = load_model(config.model, dtype=config.dtype, model_dir=config.model_dir)
    fingerprint = model_fingerprint(resolve_model_dir(config.model, model_dir=config.model_dir))
    mesh = None
    if config.mesh:
        mesh = sharding.make_mesh(*config.mesh)
        model = sharding.shard_model(model, mesh)
    samples = _load_samples(config, encoder, tokenizer, cells)
    for cell in cells:  # a corrupt predictions line of any cell stops the sweep before anything is written
        read_predictions(glob.glob(os.path.join(glob.escape(os.path.join(config.output_dir, cell.key.name())),
                                                "predictions*.jsonl")))
    runs = _open(config, cells, samples, fingerprint, encoder)
    shared = shared_cells(cells, config.shared_prefill, chunk_size=config.chunk_size, mesh=mesh)
    context = _Context(config, model, encoder, mesh, {id(runs[i]) for i in shared}, fingerprint)
    _run_cells(runs, context)
    _print_summary(config, [r.run_dir for r in runs], write_plot=jax.process_index() == 0)
    return [r.run_dir for r in runs]


def kept_samples() -> int:
    """Samples the run directories this process opened hold (what an interrupted run kept)."""
    total = 0
    for run_dir in OPENED:
        try:
            total += len(run_dir.records())
        except (KvjaxError, OSError):
            pass
    return total


def _with_tokenizer(cell: Cell, encoder: PromptEncoder) -> Cell:
    """A context-replay method (KVzip) gets its repeat prompt from the tokenizer (`ContextReplay.with_tokenizer`)."""
    if cell.method is None or not caps.replays_context(cell.method):
        return cell
    return dataclasses.replace(cell, method=cell.method.with_tokenizer(encoder.tokenizer, encoder.use_template))


def _check_cells_creatable(path: str, names: list[str]) -> None:
    """Run directories can be made in `path` when a cell has none yet (a finished sweep reruns read-only)."""
    if all(os.path.isdir(os.path.join(path, n)) for n in names):
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvjax-probe-", dir=path))
    except OSError as e:
        raise ConfigError(f"--output_dir {path!r}: cannot create run directories in it ({e.strerror or e})") from None


def _load_samples(config: EvalConfig, encoder: PromptEncoder, tokenizer: Any,
                  cells: Sequence[Cell]) -> dict[tuple[str, int], tuple[Any, list]]:
    """Every (task, context length)'s samples, before the first cell runs; a task with none is refused."""
    out: dict[tuple[str, int], tuple[Any, list]] = {}
    for cell in cells:
        key = (cell.task_name, cell.context_length)
        if key in out:
            continue
        options = {"answer_prefix": cell.key.answer_prefix} if cell.key and cell.key.answer_prefix else {}
        task = task_registry.get(cell.task_name, tokenizer=tokenizer, skip_malformed=config.skip_malformed,
                                 **options)
        samples = task.samples(count_tokens=encoder.count_tokens, context_length=cell.context_length,
                               num_samples=max(0, config.max_samples), seed=config.seed, data_dir=config.data_dir)
        if not samples:
            hint = "its data file holds no sample (empty file?)"
            if config.max_samples <= 0:
                hint = f"--max_samples={config.max_samples} makes none for a synthetic task (give > 0), or {hint}"
            raise ConfigError(f"task {cell.task_name!r} at --context_length={cell.context_length} has no "
                              f"samples: {hint}")
        if config.max_new_tokens is not None:
            samples = [dataclasses.replace(s, max_new_tokens=config.max_new_tokens) for s in samples]
        out[key] = (task, samples)
    return out


def _open(config: EvalConfig, cells: Sequence[Cell], samples: dict, fingerprint: str,
          encoder: PromptEncoder) -> list[CellRun]:
    """Each cell's run directory, once every cell is known to run: a refused cell leaves no directory behind.
    Directories that exist are checked first (another model's or setting's results are refused)."""
    for cell in cells:
        if cell.rag_strategy is not None and any(not s.documents for s in samples[_sample_key(cell)][1]):
            raise ConfigError(
                f"--method={cell.method_name} is a multi-context strategy: it needs a task whose samples are "
                f"split into documents (multidoc/*), not {cell.task_name!r}"
            )
    index, count = jax.process_index(), jax.process_count()
    dirs: dict[str, RunDir] = {}
    exists = {c.key.name(): os.path.isdir(os.path.join(config.output_dir, c.key.name())) for c in cells}
    for name in sorted(exists, key=lambda n: not exists[n]):  # the existing ones first: only they can be refused
        run_dir = RunDir(config.output_dir, name, process_index=index, process_count=count)
        cell = next(c for c in cells if c.key.name() == name)
        run_dir.check_model(fingerprint)
        run_dir.check_identity(cell.key)
        task, cell_samples = samples[_sample_key(cell)]
        check_sample_ids(run_dir, task, cell_samples, count_tokens=encoder.count_tokens, seed=config.seed,
                         context_length=cell.context_length, data_dir=config.data_dir)  # records of foreign ids
        OPENED.append(run_dir)
        dirs[name] = run_dir
    return [CellRun(cell, samples[_sample_key(cell)][0], shard(samples[_sample_key(cell)][1], index, count),
                    dirs[cell.key.name()]) for cell in cells]


def _sample_key(cell: Cell) -> tuple[str, int]:
    return cell.task_name, cell.context_length


@dataclasses.dataclass
class _Context:
    """What every cell of one run shares."""

    config: EvalConfig
    model: Any
    encoder: PromptEncoder
    mesh: Any
    shared: set[int]  # ids of the CellRuns that run through a shared prefill
    fingerprint: str


def _cell_config(run: CellRun, ctx: _Context) -> dict[str, Any]:
    """`config.json` of one cell: its key (`cell`), the flags, the model, versions and device."""
    cell, config = run.cell, ctx.config
    return {
        "cell": cell.key.as_dict(),
        "model_fingerprint": ctx.fingerprint,
        "flags": dict(config.recorded_flags),
        "method": cell.method_name,
        "budget": cell.budget,
        "compression_ratio": cell.compression_ratio,
        "query_aware": config.query_aware,
        "method_args": dict(cell.method_args),
        "method_hyperparameters": cell.method.hyperparameters() if cell.method else
        cell.rag_strategy.hyperparameters(),
        "multi_context": cell.rag_strategy is not None,
        "task": cell.task_name,
        "context_length": cell.context_length,
        "model": config.model,
        "model_config": ctx.model.config.to_hf_dict(),
        "dtype": config.dtype,
        "kv_dtype": cell.kv_dtype_name or "model",
        "versions": _versions(),
        "git_commit": _git_commit(),
        "device": {
            "backend": jax.default_backend(),
            "kind": jax.devices()[0].device_kind,
            "count": jax.device_count(),
            "process_count": jax.process_count(),
        },
    }


def _run_cells(runs: list[CellRun], ctx: _Context) -> None:
    """Runs every cell this process can claim; then waits for the cells other processes hold and finishes them
    (nothing, unless their holder died). A finished cell is not claimed: it reruns in a read-only folder."""
    queued, held, deferred = [], [], []
    for run in runs:
        if not run.todo():
            _finish_computed(run, ctx)
            continue
        claim = run.run_dir.claim()
        if not claim.try_acquire():
            print(f"kvjax.eval: {run.run_dir.name} is being run by {claim.holder()}; running the other cells "
                  "first", file=sys.stderr)
            deferred.append((run, claim))
            continue
        held.append(claim)
        run.run_dir.write_config(_cell_config(run, ctx))
        if id(run) in ctx.shared:  # run below, together with the cells it shares a prefill with
            queued.append(run)
            continue
        _run_one(run, ctx)
        claim.release()
    if queued:
        _run_group(queued, ctx)
    for claim in held:
        claim.release()
    for run, claim in deferred:
        if not claim.try_acquire():
            print(f"kvjax.eval: waiting for {claim.holder()} to finish {run.run_dir.name}", file=sys.stderr)
            claim.acquire()
        try:
            if not run.todo():  # its holder finished it: the config.json it wrote describes the records
                _finish_computed(run, ctx)
                continue
            run.run_dir.write_config(_cell_config(run, ctx))
            if id(run) in ctx.shared:
                _run_group([run], ctx)
            else:
                _run_one(run, ctx)
        finally:
            claim.release()


def _finish_computed(run: CellRun, ctx: _Context) -> None:
    """A cell whose samples are all in its directory: its metrics refreshed from the records; its `config.json` (the
    flags, versions, commit and device of the run that computed them) kept, written only where there is none."""
    if run.run_dir.read_config() is None:
        run.run_dir.write_config(_cell_config(run, ctx))
    finish_setting(run.run_dir, run.cell)


def _progress(config: EvalConfig, total: int, left: int, desc: str) -> Any:
    return tqdm(total=total, initial=total - left, desc=desc, unit="sample", disable=not config.progress,
                file=sys.stderr, dynamic_ncols=True)


def _run_one(run: CellRun, ctx: _Context) -> None:
    config = ctx.config
    with _progress(config, len(run.samples), run.todo(), run.cell.label) as bar:
        release_if_needed()  # thousands of compiled programs exhaust the process's memory mappings
        run_setting(  # writes metrics.json; the pivot below recomputes scores from the predictions
            model=ctx.model, encoder=ctx.encoder, task=run.task, samples=run.samples, setting=run.cell,
            run_dir=run.run_dir, batch_size=config.batch_size, query_aware=config.query_aware, seed=config.seed,
            chunk_size=config.chunk_size, mesh=ctx.mesh, progress=bar.update, throttle_s=config.throttle_s,
        )


def _run_group(runs: list[CellRun], ctx: _Context) -> None:
    config = ctx.config
    total = sum(len(r.samples) for r in runs)
    with _progress(config, total, sum(r.todo() for r in runs), f"{len(runs)} cells, shared prefill") as bar:
        run_queued(runs, model=ctx.model, encoder=ctx.encoder, batch_size=config.batch_size,
                   query_aware=config.query_aware, seed=config.seed, progress=bar.update, throttle_s=config.throttle_s)


def _print_summary(config: EvalConfig, run_dirs: list[RunDir], write_plot: bool) -> None:
    """The pivot of this sweep's cells and the path of its score-vs-budget plot."""
    found = load_runs(sorted({d.path for d in run_dirs}))
    print(report.render_pivot(found))
    if write_plot:
        written, note = default_plots(found, os.path.join(config.output_dir, "plots"))
        for path in written:
            print(f"plot: {os.path.abspath(path)}")
        if note:
            print(note)
    where = os.path.abspath(config.output_dir)
    print(f"results in {where}; render with: python -m kvjax.eval.report {config.output_dir}")


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("kvjax", "jax", "jaxlib", "flax", "transformers", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out
