"""configs/leaderboard_gemma3.py: issue 58's two panels on Gemma 3 270M, one command each. Each panel lists the
issue's tasks, samples, methods and ratios, and every cell's method builds with its arguments (in Python, nothing
traced, no model needed); KVzap's run finds its learned files or stops with one line naming them and the command
that writes them."""

from __future__ import annotations

import pathlib
import runpy

import pytest
from kvzap_weights import write_kvzap

from kvjax import methods

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = runpy.run_path(str(ROOT / "configs" / "leaderboard_gemma3.py"))
get_config = CONFIG["get_config"]

# Issue 58, "Quality panels".
ISSUE = {
    "4k": dict(tasks={"niah_single_1", "niah_multikey_1", "niah_multivalue", "vt"}, samples=20, length="4096",
               ratios=[0.5, 0.75, 0.875, 0.9375],
               methods={"full", "lagkv", "sagekv", "ahakv", "actqkv", "snapkv", "streaming_llm", "h2o", "tova",
                        "pyramidkv", "kvzip", "dms", "expected_attention", "compactor"}),
    "16k": dict(tasks={"niah_single_1", "niah_multikey_1"}, samples=10, length="16384", ratios=[0.75, 0.9375],
                methods={"full", "snapkv", "streaming_llm", "lagkv", "sagekv", "kvzip"}),
}


def _args(text: str) -> dict[str, str]:
    """`method.key=value` pairs of a config's method_args (values kept as text)."""
    out = {}
    for item in filter(None, text.split(",dms.") if text.startswith("dms.") else text.split(",")):
        key, _, value = item.removeprefix("dms.").partition("=")
        out[key.split(".")[-1]] = value
    return out


@pytest.mark.parametrize("panel", ["4k", "16k"])
def test_each_panel_is_the_issues_and_builds(panel, tmp_path):
    want = ISSUE[panel]
    write_kvzap(tmp_path / "kvzap-linear", layers=2, input_dim=64, output_dim=2, hidden_dim=None)
    modes = ["", "kvzip"] + (["actqkv", f"kvzap,calibration_dir={tmp_path}"] if panel == "4k" else [])
    seen = set()
    for mode in modes:
        cfg = get_config(f"{panel}/{mode}" if mode else panel)
        assert cfg.model == "gemma3-270m" and not cfg.query_aware and cfg.context_length == want["length"]
        assert cfg.answer_prefix == "needle"  # the layout the base model follows (docs/models.md)
        assert {t.removeprefix("ruler/") for t in cfg.task.split(",")} == want["tasks"]
        assert cfg.max_samples == want["samples"] and cfg.output_dir == "results/leaderboard/gemma3-270m"
        names = cfg.method.split(",")
        seen.update(names)
        if cfg.compression_ratio:
            assert [float(r) for r in cfg.compression_ratio.split(",")] == want["ratios"]
            for name in names:
                for ratio in want["ratios"]:
                    if name != "full":
                        assert methods.get(name, compression_ratio=ratio).name == name
        elif names == ["actqkv"]:  # per-step budgets: the tokens each ratio keeps of 4096
            assert [int(b) for b in cfg.budget.split(",")] == [round(4096 * (1 - r)) for r in want["ratios"]]
            for budget in cfg.budget.split(","):
                methods.get("actqkv", budget=int(budget), n_local=int(_args(cfg.method_args)["n_local"]))
        else:  # KVzap under DMS, one cell per threshold
            assert names == ["dms"] and str(tmp_path / "kvzap-linear") in cfg.method_args
    assert seen == want["methods"]


def test_kvzap_without_its_files_names_them_and_the_command(tmp_path):
    with pytest.raises(ValueError, match=r"kvzap_linear needs .*kvzap-linear .*python -m kvjax\.calibrate "
                                         r"--method=kvzap --model=gemma3-270m"):
        get_config(f"4k/kvzap,calibration_dir={tmp_path}")
    with pytest.raises(ValueError, match="unknown Gemma 3 panel '8k'"):
        get_config("8k")
