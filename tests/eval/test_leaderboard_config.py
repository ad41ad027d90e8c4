"""configs/leaderboard.py: every run of every model parses, names registered methods only, and each method builds
with its arguments at every ratio (constructed in Python, nothing traced), as the eval CLI would build it; the
learned-file runs find their files under the calibration directory or stop with a one-line error naming it."""

from __future__ import annotations

import pathlib
import runpy

import numpy as np
import pytest
from kvzap_weights import write_kvzap
from learned_files import filters, head_scores

from kvjax import methods
from kvjax.cli import parse
from kvjax.methods.duo_attention import write_attention_pattern
from kvjax.methods.qfilter import write_qfilters

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = runpy.run_path(str(ROOT / "configs" / "leaderboard.py"))
get_config, runs = CONFIG["get_config"], CONFIG["runs"]
MODELS = ("kvjax-tiny", "smollm2-135m", "qwen3-8b")
# kvpress 0.5.5's evaluation/leaderboard.sh, loop 1 and loop 2 (adakv_snapkv = kvjax's adakv at its default base).
KVPRESS_LOOP_1 = ("random", "knorm", "snapkv", "expected_attention", "streaming_llm", "tova", "observed_attention",
                  "qfilter", "pyramidkv", "lagkv", "keydiff", "adakv_compactor", "cur", "kvzip")
KVPRESS_LOOP_2 = ("snapkv", "adakv", "finch", "chunkkv")


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """A calibration directory per model with generated files in the published layouts (any dimensions: the
    methods check them against the model only when one is loaded)."""
    root = tmp_path_factory.mktemp("calibration")
    for model in MODELS:
        d = root / model
        write_qfilters(d / f"{model}_qfilt", filters(2, 2, 16))
        write_kvzap(d / "kvzap-mlp", layers=2, input_dim=64, output_dim=2)
        write_kvzap(d / "kvzap-linear", layers=2, input_dim=64, output_dim=2, hidden_dim=None)
        write_attention_pattern(d / "duo_attention", head_scores(2, 2), sink_size=4, recent_size=64,
                                model_name=model)
    return root


def _cells(cfg) -> list[tuple[str, float | None, dict]]:
    """(method, ratio, arguments) of every cell of a config, arguments scoped as the CLI scopes them."""
    args = parse.parse_method_args(cfg.method_args)
    names = cfg.method.split(",")
    assert {k.split(".", 1)[0] for k in args if "." in k} <= set(names), "a scope names no method of the run"
    ratios = [float(r) for r in cfg.compression_ratio.split(",")] if cfg.compression_ratio else [None]
    return [(name, None if name == "full" else r, each) for name in names for r in ratios
            for each in parse.each_value(parse.scoped_args(args, name))]


@pytest.mark.parametrize("model", MODELS)
def test_every_run_builds_its_methods(model, calibration):
    built = set()
    for arg in runs(model):
        cfg = get_config(f"{arg},calibration_dir={calibration / model}")
        assert cfg.model == model and cfg.output_dir == f"results/leaderboard/{model}"
        assert cfg.task.count("ruler/") == 10 and cfg.context_length == CONFIG["LENGTHS"][model]
        for name, ratio, kwargs in _cells(cfg):
            assert name in methods.available(), name
            kwargs = dict(kwargs) if ratio is None else {**kwargs, "compression_ratio": ratio}
            method = methods.get(name, **kwargs)  # validates every hyperparameter in Python
            built.add((name, tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k != "compression_ratio"))))
            assert method.name == name
    assert len(built) >= 30


def test_the_plain_run_holds_kvpress_loop_1_and_the_earlier_methods():
    cfg = get_config("smollm2-135m")
    names = cfg.method.split(",")
    assert len(names) == len(set(names))
    learned = {"qfilter"}  # its own run (needs a calibration file)
    assert set(KVPRESS_LOOP_1) - {"adakv_compactor"} - learned <= set(names)
    assert set(CONFIG["OLDER_METHODS"].split(",")) <= set(names)  # archived SmolLM2 cells keep their identity
    assert parse.parse_method_args(cfg.method_args) == {} and not cfg.query_aware
    assert cfg.compression_ratio == "0.25,0.5,0.75,0.875,0.9375,0.96875"


def test_single_setting_runs_carry_kvpress_settings():
    def args(mode):
        cfg = get_config(f"kvjax-tiny/{mode}")
        (name, _, kwargs), *_ = _cells(cfg)
        return name, kwargs

    # kvpress's adakv_compactor = AdaKVPress(CompactorPress()); its leaderboard's expected_attention entry =
    # AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)).
    assert args("adakv_compactor") == ("adakv", {"base": "compactor"})
    assert args("adakv_expected_attention") == ("adakv", {"base": "expected_attention",
                                                          "base_args": {"epsilon": 0.01}})
    assert args("lagkv_kvpress") == ("lagkv", {"sink_size": 4, "lag_size": 128})  # LagKVPress's n_sink, lag_size
    assert args("lagkv_official") == ("lagkv", {"sink_size": 16, "lag_size": 1024})
    aware = get_config("kvjax-tiny/query_aware")
    assert aware.query_aware and tuple(aware.method.split(",")) == KVPRESS_LOOP_2
    aware_args = parse.parse_method_args(aware.method_args)
    assert parse.scoped_args(aware_args, "chunkkv") == {"chunk_size": 20}  # chunk_length=20
    assert parse.scoped_args(aware_args, "finch") == {}


def test_learned_runs_read_the_calibration_directory(calibration):
    d = calibration / "kvjax-tiny"
    q = get_config(f"kvjax-tiny/qfilter,calibration_dir={d}")
    assert parse.parse_method_args(q.method_args) == {"qfilter.filters": str(d / "kvjax-tiny_qfilt")}
    duo = get_config(f"kvjax-tiny/duo_attention,calibration_dir={d}")
    assert duo.compression_ratio == "0.25,0.5,0.75,0.875"  # kvpress's --head_compression_ratio sweep
    surrogates = {}
    for kind in ("linear", "mlp"):  # kvpress's kvzap_linear / kvzap_mlp: DMSPress(KVzapPress(model_type=kind))
        zap = get_config(f"kvjax-tiny/kvzap_{kind}=-4.5,calibration_dir={d}")
        assert zap.compression_ratio is None and zap.method == "dms"
        surrogates[kind] = {"weights": str(d / f"kvzap-{kind}"), "model_type": kind}
        assert parse.parse_method_args(zap.method_args) == {"dms.base": "kvzap", "dms.threshold": -4.5,
                                                      "dms.base_args": surrogates[kind]}
        # Without a threshold: the whole sweep in one run (one cell per threshold, one shared prefill).
        sweep = _cells(get_config(f"qwen3-8b/kvzap_{kind},calibration_dir={d}"))
        assert [(n, r, a["threshold"], a["base_args"]) for n, r, a in sweep] == [
            ("dms", None, t, {"weights": str(d / f"kvzap-{kind}"), "model_type": kind}) for t in (-3, -4, -5, -6)]
    assert [a for a in runs("qwen3-8b") if "kvzap" in a] == ["qwen3-8b/kvzap_linear", "qwen3-8b/kvzap_mlp"]
    both = _cells(get_config(f"qwen3-8b/kvzap,calibration_dir={d}"))
    assert [(a["threshold"], a["base_args"]["model_type"]) for _, _, a in both] == [
        (t, kind) for t in (-3, -4, -5, -6) for kind in ("linear", "mlp")]


@pytest.mark.parametrize("mode", ["qfilter", "duo_attention", "kvzap_linear=-3", "kvzap_mlp=-3", "kvzap_mlp", "kvzap"])
def test_missing_calibration_file_is_one_line_naming_it(mode, tmp_path):
    with pytest.raises(ValueError) as err:
        get_config(f"kvjax-tiny/{mode},calibration_dir={tmp_path}")
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message and "kvjax-tiny" in message
    default = CONFIG["CALIBRATION_DIR"].format(model="smollm2-135m")
    if not any(pathlib.Path(d.format(model="smollm2-135m")).exists() for d in CONFIG["CALIBRATION_DIRS"]):
        with pytest.raises(ValueError, match=default):
            get_config(f"smollm2-135m/{mode}")


@pytest.mark.parametrize("arg, match", [("gpt-5", "unknown leaderboard model"), ("kvjax-tiny/nope", "unknown "
                                        "leaderboard mode"), ("kvjax-tiny/kvzap_mlp=low", "not a number"),
                                        ("kvjax-tiny,foo=1", "unknown leaderboard option")])
def test_bad_arguments(arg, match):
    with pytest.raises(ValueError, match=match):
        get_config(arg)


def test_listing_runs_as_a_script(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["leaderboard.py", "kvjax-tiny"])
    runpy.run_path(str(ROOT / "configs" / "leaderboard.py"), run_name="__main__")
    listed = capsys.readouterr().out.split()
    assert listed == runs("kvjax-tiny") and listed[0] == "kvjax-tiny" and np.all(["kvjax-tiny" in a for a in listed])


def test_listing_available_runs_as_a_script(calibration, capsys, monkeypatch):
    d = calibration / "kvjax-tiny"
    monkeypatch.setattr("sys.argv", ["leaderboard.py", "kvjax-tiny", "--available", f"--calibration_dir={d}"])
    runpy.run_path(str(ROOT / "configs" / "leaderboard.py"), run_name="__main__")
    assert capsys.readouterr().out.split() == CONFIG["available_runs"]("kvjax-tiny", str(d))
    monkeypatch.setattr("sys.argv", ["leaderboard.py", "gpt-5"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "configs" / "leaderboard.py"), run_name="__main__")
    assert exit_.value.code == 2 and "invalid choice: 'gpt-5'" in capsys.readouterr().err


def test_without_a_calibration_dir_the_gitignored_one_is_found(calibration, tmp_path, monkeypatch):
    """`make calibrate-smollm2` writes to results/calibration/<model>; `make leaderboard` finds it there when the
    committed directory does not exist, and the committed one wins where both do."""
    import shutil

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="kvjax/assets/calibration/smollm2-135m/smollm2-135m_qfilt"):
        get_config("smollm2-135m/qfilter")
    shutil.copytree(calibration / "smollm2-135m", tmp_path / "results" / "calibration" / "smollm2-135m")
    q = get_config("smollm2-135m/qfilter")
    assert parse.parse_method_args(q.method_args) == {
        "qfilter.filters": "results/calibration/smollm2-135m/smollm2-135m_qfilt"}
    assert CONFIG["available_runs"]("smollm2-135m") == runs("smollm2-135m")
    shutil.copytree(calibration / "smollm2-135m", tmp_path / "kvjax" / "assets" / "calibration" / "smollm2-135m")
    q = get_config("smollm2-135m/qfilter")
    assert parse.parse_method_args(q.method_args) == {
        "qfilter.filters": "kvjax/assets/calibration/smollm2-135m/smollm2-135m_qfilt"}


def test_available_runs_skip_missing_learned_files(calibration, tmp_path, capsys):
    expected = runs("kvjax-tiny", str(tmp_path))
    free = 2 + len(CONFIG["SINGLE"])  # the file-free runs: the two loops and the single-method modes
    assert CONFIG["available_runs"]("kvjax-tiny", str(tmp_path)) == expected[:free]
    skipped = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in skipped] == [f"skipped {a}" for a in expected[free:]]
    assert all(str(tmp_path) in line for line in skipped)
    d = calibration / "kvjax-tiny"
    full = CONFIG["available_runs"]("kvjax-tiny", str(d))
    assert [a.split(",")[0] for a in full] == runs("kvjax-tiny", str(d))
    assert all(a.endswith(f",calibration_dir={d}") == (i >= free) for i, a in enumerate(full))


def test_kvzap_thresholds_are_the_calibrations_quantiles(calibration, tmp_path):
    """A calibrated model sweeps its own log-score quantiles (25 / 50 / 75 / 87.5% pruned, as the committed
    kvjax-tiny file records them); without them, kvpress's Qwen3-8B thresholds."""
    import json

    committed = ROOT / CONFIG["CALIBRATION_DIR"].format(model="kvjax-tiny") / "kvzap-linear" / "config.json"
    quantiles = json.loads(committed.read_text())["kvjax_calibration"]["target_quantiles"]
    expected = tuple(round(quantiles[q], 2) for q in ("0.25", "0.5", "0.75", "0.875"))
    assert expected == tuple(sorted(expected)) and CONFIG["thresholds"]("kvjax-tiny") == expected
    sweep = parse.parse_method_args(get_config("kvjax-tiny/kvzap_linear").method_args)["dms.threshold"]
    assert sweep == expected
    assert CONFIG["thresholds"]("kvjax-tiny", str(calibration / "kvjax-tiny")) == (-3, -4, -5, -6)  # no quantiles
    assert CONFIG["thresholds"]("smollm2-135m", str(tmp_path)) == (-3, -4, -5, -6)  # no file
