"""`python -m kvjax.demo --help` describes the demo and runs nothing (issue 60: it ran the whole demo)."""

import sys

import pytest

from kvjax import demo


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["-h"], 0), (["--methods=snapkv"], 2)])
def test_help_runs_nothing_and_an_unknown_argument_is_one_line(argv, code, monkeypatch, capsys):
    def no_generation(*args, **kwargs):
        raise AssertionError("the demo ran")

    monkeypatch.setattr(demo, "generate", no_generation)
    monkeypatch.setattr(sys, "argv", ["python -m kvjax.demo", *argv])  # as `python -m kvjax.demo ARGS` calls it
    with pytest.raises(SystemExit) as exit_:
        demo.main()
    assert exit_.value.code == code
    out, err = capsys.readouterr()
    if code == 0:
        assert out.startswith("usage: python -m kvjax.demo") and "random tiny model" in out and not err
    else:
        assert err.count("\n") == 1 and "unrecognized arguments: --methods=snapkv" in err
