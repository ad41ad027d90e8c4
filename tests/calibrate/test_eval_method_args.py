"""The eval CLI passes the calibrated files: a dict-valued method argument (`dms`'s `base_args` naming the KVzap
file and its `model_type`) stays one `--method_args` item, from the command line and from a config file."""

from __future__ import annotations

import pathlib

from cli_inprocess import run_eval

import kvjax
from kvjax import methods
from kvjax.eval.__main__ import _flatten_method_args, _split, parse_method_args
from kvjax.runtime.shared_prefill import shares_prefill

KVZAP = str(pathlib.Path(kvjax.__file__).parent / "assets" / "calibration" / "kvjax-tiny" / "kvzap-linear")


def test_split_keeps_brackets_and_quotes():
    assert _split("a, b,,c") == ["a", "b", "c"]
    assert _split("x={'a':'1,2','b':[3,4]},y=(5,6),z='p,q'") == ["x={'a':'1,2','b':[3,4]}", "y=(5,6)", "z='p,q'"]


def test_dict_method_args_round_trip():
    spec = f"dms.threshold=-4.0,dms.base_args={{'weights':'{KVZAP}','model_type':'linear'}},qfilter.filters=/d/x_qfilt"
    args = parse_method_args(spec)
    assert args == {"dms.threshold": -4.0, "dms.base_args": {"weights": KVZAP, "model_type": "linear"},
                    "qfilter.filters": "/d/x_qfilt"}
    config = {"dms": {"threshold": -4.0, "base_args": {"weights": KVZAP, "model_type": "linear"}}, "seed": 1}
    assert parse_method_args(",".join(_flatten_method_args(config))) == {
        "dms.threshold": -4.0, "dms.base_args": {"weights": KVZAP, "model_type": "linear"}, "seed": 1}


def test_dry_run_builds_dms_over_the_calibrated_kvzap(tmp_path):
    result = run_eval("--model=kvjax-tiny", "--task=ruler/niah_single_1", "--context_length=1024", "--method=dms",
                      f"--method_args=threshold=-4.0,base_args={{'weights':'{KVZAP}','model_type':'linear'}}",
                      f"--output_dir={tmp_path}", "--dry_run")
    assert result.returncode == 0, result.stderr


def test_hidden_state_methods_never_share_a_prefill():
    """A sweep runs dms-over-kvzap cells beside others: the shared-prefill recording keeps no hidden states, so
    they must take their own prefill (they failed the whole sweep before)."""
    dms = methods.get("dms", threshold=-4.0, base_args={"weights": KVZAP, "model_type": "linear"})
    kvzap = methods.get("kvzap", weights=KVZAP, model_type="linear", compression_ratio=0.5)
    assert dms.uses_hidden_states and not shares_prefill(dms)
    assert not shares_prefill(kvzap)
    assert shares_prefill(methods.get("snapkv", compression_ratio=0.5))
