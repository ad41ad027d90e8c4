"""Every `python -m kvjax...` command refuses bad arguments the same way: exit code 2 and one stderr line,
`<program>: error: <what is wrong>`, naming the bad value.

Before, the argparse commands (the report, the leaderboard, the archive) printed their usage over several lines
first, the absl ones a second `See:` line, `kvjax.train` absl's `FATAL` with exit code 1, and a flag that did not
convert read `invalid literal for int() with base 10`. Each case below calls the entry point as its `python -m`
does (in this process, but for `kvjax.train`, whose absl flags share the global registry with the eval's).
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import subprocess
import sys

import pytest

from kvjax.cli import refuse

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _in_process(call) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = call()
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def _absl(module, argv: list[str]):
    def call():
        module.FLAGS.unparse_flags()
        module.main(module._parse_flags([module.NAME, *argv]))

    return call


def _argparse(module, argv: list[str]):
    return lambda: module.main(argv)


def _entry(program: str, argv: list[str]):
    from kvjax import __main__ as kvjax_main
    from kvjax import demo, run
    from kvjax.calibrate import __main__ as calibrate
    from kvjax.eval import __main__ as eval_cli
    from kvjax.eval import archive, leaderboard, report
    from kvjax.models import gguf_assemble

    absl = {"kvjax.eval": eval_cli, "kvjax.run": run}
    argparse = {"kvjax.eval.report": report, "kvjax.eval.leaderboard": leaderboard, "kvjax.eval.archive": archive,
                "kvjax.calibrate": calibrate, "kvjax.demo": demo, "kvjax.models.gguf_assemble": gguf_assemble,
                "kvjax": kvjax_main}
    if program in absl:
        return _absl(absl[program], argv)
    return _argparse(argparse[program], argv)


CASES = [  # (program as the line names it, the entry point, argv, what the line must say)
    ("kvjax.eval", "kvjax.eval", ["--batch_size=abc"], "--batch_size=abc: not an integer"),
    ("kvjax.eval", "kvjax.eval", ["--no_such_flag=1"], "Unknown command line flag 'no_such_flag'"),
    ("kvjax.run", "kvjax.run", ["--slots=abc"], "--slots=abc: not an integer"),
    ("kvjax.run", "kvjax.run", ["--temperature=warm"], "--temperature=warm: not a number"),
    ("kvjax.eval.report", "kvjax.eval.report", [], "the following arguments are required: dirs"),
    ("kvjax.eval.report", "kvjax.eval.report", ["results", "--format=xml"], "invalid choice: 'xml'"),
    ("kvjax.eval.leaderboard", "kvjax.eval.leaderboard", [], "the following arguments are required: paths"),
    ("kvjax.eval.archive pack", "kvjax.eval.archive", ["pack"], "the following arguments are required: src, --out"),
    ("kvjax.calibrate", "kvjax.calibrate", ["--method=qfilter", "--model=kvjax-tiny", "--out=x", "--samples=many"],
     "argument --samples: invalid int value: 'many'"),
    ("kvjax.demo", "kvjax.demo", ["--budget=8"], "unrecognized arguments: --budget=8"),
    ("kvjax.models.gguf_assemble", "kvjax.models.gguf_assemble", [], "give one preset, one of smollm2-135m"),
    ("kvjax.models.gguf_assemble", "kvjax.models.gguf_assemble", ["qwen2.5-7b"],
     "'qwen2.5-7b' is not a GGUF preset; the GGUF presets are smollm2-135m"),
    ("kvjax", "kvjax", ["eval", "--help"], "takes no arguments, got 'eval --help'"),
]


@pytest.mark.parametrize("program,entry,argv,says", CASES, ids=[f"{c[1]} {' '.join(c[2])}" for c in CASES])
def test_a_bad_argument_is_one_line_and_exit_2(program, entry, argv, says):
    code, err = _in_process(_entry(entry, argv))
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"{program}: error: ") and says in line, line
    assert "Traceback" not in err and "usage:" not in line, line


def test_train_refuses_a_bad_flag_in_one_line_with_exit_2():
    """A process of its own: `kvjax.train` defines its flags in absl's global registry, beside the eval's."""
    proc = subprocess.run([sys.executable, "-m", "kvjax.train", "--steps=abc"], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)), timeout=300)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == "kvjax.train: error: --steps=abc: not an integer (python -m kvjax.train --help)", line


def test_gguf_assemble_help_exits_0():
    code, _ = _in_process(_entry("kvjax.models.gguf_assemble", ["--help"]))
    assert code == 0


def test_python_m_kvjax_lists_every_entry_point():
    """`python -m kvjax` lists exactly the modules that run as `python -m` (a `__main__` guard in kvjax's source),
    so a new command cannot go unlisted."""
    from kvjax import __main__ as kvjax_main

    package = ROOT / "kvjax"
    guarded = set()
    for path in package.rglob("*.py"):
        if 'if __name__ == "__main__":' in path.read_text():
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            guarded.add(module.removesuffix(".__main__"))
    assert set(kvjax_main.COMMANDS) == guarded - {"kvjax"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert kvjax_main.main([]) == 0
    listed = [line.split()[0] for line in out.getvalue().splitlines()[1:]]
    assert listed == list(kvjax_main.COMMANDS)


def test_the_line_folds_a_message_of_several_lines_and_plains_python_words():
    assert refuse.error_line("kvjax.x", "first\n   second\n\n third ") == "kvjax.x: error: first second third"
    assert refuse.flag_message("flag --slots=abc: invalid literal for int() with base 10: 'abc'") == \
        "--slots=abc: not an integer"
    assert refuse.flag_message("flag --top_p=x: could not convert string to float: 'x'") == "--top_p=x: not a number"
    assert refuse.flag_message("Unknown command line flag 'x'") == "Unknown command line flag 'x'"
