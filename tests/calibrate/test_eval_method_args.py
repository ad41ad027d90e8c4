"""The eval CLI passes the calibrated files: a dict-valued method argument (`dms`'s `base_args` naming the KVzap
file and its `model_type`) stays one `--method_args` item, from the command line and from a config file."""

from __future__ import annotations

import pathlib

import pytest
from cli_inprocess import run_eval

import kvjax
from kvjax import methods
from kvjax.cli import parse
from kvjax.errors import ConfigError
from kvjax.runtime.shared_prefill import shares_prefill

KVZAP = str(pathlib.Path(kvjax.__file__).parent / "assets" / "calibration" / "kvjax-tiny" / "kvzap-linear")


def test_split_keeps_brackets_and_quotes():
    assert parse.split("a, b,,c") == ["a", "b", "c"]
    assert parse.split("x={'a':'1,2','b':[3,4]},y=(5,6),z='p,q'") == ["x={'a':'1,2','b':[3,4]}", "y=(5,6)", "z='p,q'"]


def test_dict_method_args_round_trip():
    spec = f"dms.threshold=-4.0,dms.base_args={{'weights':'{KVZAP}','model_type':'linear'}},qfilter.filters=/d/x_qfilt"
    args = parse.parse_method_args(spec)
    assert args == {"dms.threshold": -4.0, "dms.base_args": {"weights": KVZAP, "model_type": "linear"},
                    "qfilter.filters": "/d/x_qfilt"}
    config = {"dms": {"threshold": -4.0, "base_args": {"weights": KVZAP, "model_type": "linear"}}, "seed": 1}
    assert parse.parse_method_args(",".join(parse.flatten_method_args(config))) == {
        "dms.threshold": -4.0, "dms.base_args": {"weights": KVZAP, "model_type": "linear"}, "seed": 1}


def test_bar_separated_values_sweep_one_key():
    args = parse.parse_method_args("dms.threshold=-3|-4.5|-3,x='a|b',y=[1|2],base_args={'m':'p|q'}|{'m':'r'},z=1")
    assert args == {"dms.threshold": (-3, -4.5), "x": "a|b", "y": "[1|2]", "base_args": ({"m": "p|q"}, {"m": "r"}),
                    "z": 1}
    assert isinstance(args["dms.threshold"], parse.Alternatives) and not isinstance(args["x"], parse.Alternatives)
    assert [a["base_args"] for a in parse.each_value(args)] == [{"m": "p|q"}, {"m": "r"}] * 2
    assert [a["dms.threshold"] for a in parse.each_value(args)] == [-3, -3, -4.5, -4.5]
    with pytest.raises(ConfigError, match="empty value"):
        parse.parse_method_args("dms.threshold=-3||-4")


def test_dry_run_plans_one_cell_per_swept_value(tmp_path):
    result = run_eval("--model=kvjax-tiny", "--task=ruler/niah_single_1", "--context_length=1024", "--method=dms",
                      f"--method_args=threshold=-4.0|-5.0,base_args={{'weights':'{KVZAP}','model_type':'linear'}}",
                      f"--output_dir={tmp_path}", "--dry_run")
    assert result.returncode == 0, result.stderr
    planned = [line for line in result.stdout.splitlines() if line.startswith("dms [")]
    assert len(planned) == 2 and "threshold=-4.0]" in planned[0] and "threshold=-5.0]" in planned[1]
    bad = run_eval("--model=kvjax-tiny", "--method=dms", "--method_args=threshold=-4.0|", "--dry_run")
    assert bad.returncode == 2 and "empty value" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_dry_run_builds_dms_over_the_calibrated_kvzap(tmp_path):
    result = run_eval("--model=kvjax-tiny", "--task=ruler/niah_single_1", "--context_length=1024", "--method=dms",
                      f"--method_args=threshold=-4.0,base_args={{'weights':'{KVZAP}','model_type':'linear'}}",
                      f"--output_dir={tmp_path}", "--dry_run")
    assert result.returncode == 0, result.stderr


def test_hidden_state_methods_share_a_prefill():
    """dms-over-kvzap cells run beside others from one recording that keeps the layers' hidden states
    (tests/runtime/test_shared_prefill.py checks the replay against each method's own prefill)."""
    dms = methods.get("dms", threshold=-4.0, base_args={"weights": KVZAP, "model_type": "linear"})
    kvzap = methods.get("kvzap", weights=KVZAP, model_type="linear", compression_ratio=0.5)
    assert "hidden" in dms.layer_inputs and shares_prefill(dms) and shares_prefill(kvzap)
    assert not shares_prefill(dms, chunk_size=64)
