"""The sweep plan: every cell of one eval invocation, a pure function of its `EvalConfig`.

    cells = plan.cells(config)      # [Cell]: methods x amounts x swept --method_args x kv_dtype x task x length

A cell is one method (built with its arguments and amount, so a bad hyperparameter is refused here, before any
model loads), one `--kv_dtype`, task and context length; its `key` (`CellKey`, kvjax/eval/cell.py) names its run
directory. A repeated method, amount, value or length adds no cell. Nothing here reads the flags, loads a model
or touches a device (`--dry_run` prints this plan); the checks against the model are `kvjax.eval.checks`'.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax import methods, rag
from kvjax.cli.parse import AMOUNT_KEYS, each_value, scoped_args
from kvjax.errors import ConfigError
from kvjax.eval.cell import Cell, CellKey, data_dir_for
from kvjax.eval.config import EvalConfig
from kvjax.eval.rag_amounts import strategy_args

__all__ = ["amounts", "cell_key", "cells"]


def cells(config: EvalConfig) -> list[Cell]:
    """Every cell of the sweep, each once, in the order: method (as given), swept argument values, amount, kv_dtype,
    task, context length."""
    method_args = dict(config.method_args)
    unknown_scopes = {k.split(".", 1)[0] for k in method_args if "." in k} - set(config.methods)
    if unknown_scopes:
        raise ConfigError(f"--method_args scopes {sorted(unknown_scopes)} name no method of "
                          f"--method={list(config.methods)}")
    out: dict[tuple, Cell] = {}
    for name in dict.fromkeys(config.methods):
        for args in each_value(scoped_args(method_args, name)):
            for budget, ratio in _amounts_of(name, args, method_args, config):
                method, strategy = _build(name, args, budget, ratio)
                margs = tuple(sorted(args.items()))
                for kv_dtype in config.kv_dtypes:
                    for task in config.tasks:
                        if strategy is not None and not task.startswith("multidoc/"):
                            raise ConfigError(
                                f"--method={name} is a multi-context strategy: it needs a task whose samples are "
                                f"split into documents (multidoc/*), not {task!r}")
                        for length in config.context_lengths:
                            cell = Cell(name, method, task, length, budget, ratio, margs, strategy, kv_dtype)
                            key = (name, budget, ratio, _frozen(margs), task, length, kv_dtype)
                            out.setdefault(key, _with_key(cell, config))
    return list(out.values())


def _amounts_of(name: str, args: dict[str, Any], method_args: dict[str, Any],
                config: EvalConfig) -> list[tuple[int | None, float | None]]:
    """`amounts` of one method; the full cache takes none (an unscoped amount is --budget's: ignored by it)."""
    if name != "full":
        return amounts(name, args, list(config.budgets), list(config.ratios))
    for key in AMOUNT_KEYS:
        if key in args and f"full.{key}" not in method_args:
            args.pop(key)
    return [(None, None)]


def amounts(name: str, args: dict[str, Any], budgets: list[int],
            ratios: list[float]) -> list[tuple[int | None, float | None]]:
    """The (budget, ratio) cells of method `name`. A budget or ratio in its --method_args is its cell's (and pops
    out of `args`), refused together with --budget / --compression_ratio, which would silently override it."""
    given = {k: args.pop(k) for k in AMOUNT_KEYS if k in args}
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
    out: list[tuple[int | None, float | None]] = [(b, None) for b in budgets] + [(None, r) for r in ratios]
    return out or [(None, None)]


def _build(name: str, args: dict[str, Any], budget: int | None, ratio: float | None) -> tuple[Any, Any]:
    """(method, None), or (None, strategy) for a multi-context strategy: built, so its arguments are checked."""
    if name in rag.available():
        return None, rag.get_strategy(name, **strategy_args(name, args, budget, ratio))
    kwargs = dict(args)
    if budget is not None:
        kwargs["budget"] = budget
    if ratio is not None:
        kwargs["compression_ratio"] = ratio
    return methods.get(name, **kwargs), None


def cell_key(cell: Cell, config: EvalConfig) -> CellKey:
    """The identity of one cell (kvjax/eval/cell.py): every setting that changes its results. `config.dtype` is
    the key's as given (the CLI resolves "auto" before it plans a run)."""
    return CellKey(
        model=config.model,
        method=cell.method_name,
        task=cell.task_name,
        context_length=cell.context_length,
        budget=cell.budget,
        compression_ratio=cell.compression_ratio,
        method_args=dict(cell.method_args),
        seed=config.seed,
        query_aware=config.query_aware,
        question_first=config.question_first,
        dtype=config.dtype,
        chat_template=config.chat_template,
        kv_dtype=cell.kv_dtype,
        chunk_size=None if cell.rag_strategy is not None else config.chunk_size,  # RAG prefills documents whole
        max_new_tokens=config.max_new_tokens,
        data_dir=data_dir_for(cell.task_name, config.data_dir),
        answer_prefix=_answer_prefix(cell.task_name, config),
    )


def _answer_prefix(task: str, config: EvalConfig) -> str | None:
    """`--answer_prefix` for a task that takes it; None for the task's own (the default, and every other task)."""
    if config.answer_prefix == "task" or task not in config.answer_prefix_tasks:
        return None
    return config.answer_prefix


def _with_key(cell: Cell, config: EvalConfig) -> Cell:
    return dataclasses.replace(cell, key=cell_key(cell, config))


def _frozen(value: Any) -> Any:
    """`value` with its dicts and lists as tuples, so method arguments such as `base_args={...}` key a cell."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value
