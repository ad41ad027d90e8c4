"""The sweep plan (kvjax/eval/plan.py) as a pure function of an `EvalConfig`, built here without flags.

Oracles: the product of the swept values enumerated independently (methods x swept arguments x amounts x
kv_dtype x task x length, in the documented order, repeats dropped); and the run directories the old CLI wrote,
archived under docs/leaderboard/runs/: every archived kvjax-tiny cell is a cell the plan makes for the leaderboard
config that ran it, under the same directory name and with the same stored key.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import runpy
import tarfile

import pytest

from kvjax.cli.parse import Alternatives
from kvjax.errors import ConfigError
from kvjax.eval import plan
from kvjax.eval.config import EvalConfig, from_values
from kvjax.quant import parse_kv_dtype

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNS = ROOT / "docs" / "leaderboard" / "runs"
INT8, KIVI2 = parse_kv_dtype("int8"), parse_kv_dtype("kivi2")


def _cells(**fields):
    return plan.cells(EvalConfig(dtype="float32", **fields))


def test_sweeps_methods_amounts_arguments_kv_dtypes_tasks_and_lengths():
    config = dict(methods=("full", "snapkv", "streaming_llm", "snapkv"), budgets=(64, 128, 64), ratios=(0.5,),
                  method_args={"snapkv.window_size": Alternatives((8, 16)), "streaming_llm.sink_size": 4},
                  kv_dtypes=(None, INT8, KIVI2), tasks=("passkey", "ruler/vt"), context_lengths=(512, 1024))
    cells = _cells(**config)
    want = []
    for name, args in (("full", {}), ("snapkv", {"window_size": 8}), ("snapkv", {"window_size": 16}),
                       ("streaming_llm", {"sink_size": 4})):
        amounts = [(None, None)] if name == "full" else [(64, None), (128, None), (None, 0.5)]
        for (budget, ratio), kv, task, length in itertools.product(amounts, (None, "int8", "kivi2"),
                                                                   ("passkey", "ruler/vt"), (512, 1024)):
            want.append((name, budget, ratio, tuple(sorted(args.items())), kv, task, length))
    got = [(c.method_name, c.budget, c.compression_ratio, c.method_args, c.kv_dtype_name, c.task_name,
            c.context_length) for c in cells]
    assert got == want
    assert len({c.key.name() for c in cells}) == len(cells)  # every cell its own directory
    for cell in cells:  # each built with its amount and arguments; the key holds the same values
        assert cell.key.method == cell.method_name and cell.key.budget == cell.budget
        assert cell.key.kv_dtype == cell.kv_dtype_name and cell.key.task == cell.task_name
        if cell.method_name == "snapkv":
            assert cell.method.window_size == dict(cell.method_args)["window_size"]
            assert (cell.method.budget, cell.method.compression_ratio) == (cell.budget, cell.compression_ratio)


def test_an_amount_in_method_args_is_the_cells():
    cells = _cells(methods=("snapkv", "lagkv"), method_args={"snapkv.budget": 48, "lagkv.compression_ratio": 0.5},
                   tasks=("passkey",))
    assert [(c.method_name, c.budget, c.compression_ratio, c.method_args) for c in cells] == [
        ("snapkv", 48, None, ()), ("lagkv", None, 0.5, ())]
    with pytest.raises(ConfigError, match="give the amount in one place"):
        _cells(methods=("snapkv",), budgets=(64,), method_args={"budget": 48})


@pytest.mark.parametrize("fields,needle", [
    (dict(methods=("snapkv",), budgets=(64,), method_args={"lagkv.lag_size": 8}), "lagkv"),
    (dict(methods=("snapkv",), budgets=(64,), method_args={"windw": 8}), "windw"),
    (dict(methods=("samkv",), tasks=("passkey",)), "multidoc"),
    (dict(methods=("samkv",), budgets=(64,)), "--budget=64"),
])
def test_refusals(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        _cells(**fields)


def test_the_config_refuses_what_no_cell_could_run():
    with pytest.raises(ConfigError, match="--question_first"):
        EvalConfig(methods=("snapkv",), question_first=True)
    with pytest.raises(ConfigError, match="--batch_size=3 is not a multiple"):
        EvalConfig(batch_size=3, mesh=(2, 1))
    assert EvalConfig(methods=("samkv",)).tasks == ("multidoc/synthetic",)  # the strategies' default task
    with pytest.raises(ConfigError, match=r"--answer_prefix must be one of \['task', 'needle'\], got 'echo'"):
        EvalConfig(answer_prefix="echo")
    with pytest.raises(ConfigError, match="--answer_prefix=needle applies to RULER's niah tasks; --task=ruler/vt"):
        EvalConfig(answer_prefix="needle", tasks=("ruler/vt",))


def test_the_needle_answer_prefix_keys_the_niah_cells_only():
    """The tasks that take it carry it in their key (a directory of their own); the others keep their own prefix
    and their key is the one a run without the flag makes (the same directory)."""
    tasks = ("ruler/niah_single_1", "ruler/vt")
    plain = {c.task_name: c.key for c in plan.cells(EvalConfig(methods=("full",), tasks=tasks))}
    needle = {c.task_name: c.key for c in plan.cells(EvalConfig(methods=("full",), tasks=tasks,
                                                                answer_prefix="needle"))}
    niah = "ruler/niah_single_1"
    assert needle[niah].answer_prefix == "needle" and plain[niah].answer_prefix is None
    assert needle[niah].name() != plain[niah].name() and "__answer-needle__" in needle[niah].name()
    assert needle["ruler/vt"] == plain["ruler/vt"] and needle["ruler/vt"].answer_prefix is None
    assert "answer_prefix" not in plain[niah].as_dict()  # archived keys keep their digests


def _archived_cells(archive: pathlib.Path) -> dict[str, dict]:
    """Each archived run directory's stored key (config.json's `cell`), by directory name."""
    out = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.name.endswith("/config.json"):
                out[member.name.split("/")[1]] = json.load(tar.extractfile(member))["cell"]
    return out


def _planned(config_file: str, args: list[str]) -> dict[str, dict]:
    get_config = runpy.run_path(str(ROOT / "configs" / config_file))["get_config"]
    out = {}
    for arg in args:  # kvjax-tiny ran on a CPU: --dtype=auto resolved to float32
        config = dataclasses.replace(from_values(get_config(arg).to_dict()), dtype="float32")
        out.update({c.key.name(): c.key.as_dict() for c in plan.cells(config)})
    return out


def test_archived_kvjax_tiny_cells_are_planned_under_their_names(monkeypatch):
    monkeypatch.chdir(ROOT)  # the learned files' paths are relative, as `make leaderboard` gives them
    runs = runpy.run_path(str(ROOT / "configs" / "leaderboard.py"))["runs"]
    planned = _planned("leaderboard.py", runs("kvjax-tiny"))
    archived = _archived_cells(RUNS / "kvjax-tiny-1k.runs.tar.xz")
    assert len(archived) == 1126 and set(archived) <= set(planned)  # 1006, then KVzip+'s and KVgrad's 60 each
    assert all(planned[name] == key for name, key in archived.items())
    # The quantized-cache panel: exactly the planned cells, each format's cells named as they were.
    planned = _planned("leaderboard_kv_dtype.py", ["kvjax-tiny"])
    archived = _archived_cells(RUNS / "kvjax-tiny-1k-kv_dtype.runs.tar.xz")
    assert archived == planned and len(archived) == 780
