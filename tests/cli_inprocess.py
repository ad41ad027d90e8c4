"""Run `python -m kvjax.eval` (and `kvjax.eval.report` / `kvjax.eval.leaderboard`) inside the test process.

A fresh interpreter per CLI call cost most of the eval tests' time (importing JAX, compiling the tiny model's
programs again); here the same entry points run with the same argv and the result comes back as a
`subprocess.CompletedProcess` (exit code, stdout, stderr), so the tests' assertions are unchanged. Tests whose
point needs a real process (a kill, Ctrl-C, two processes sharing an output folder, a memory limit, `--help`,
`--compilation_cache_dir`) keep spawning one.

The eval CLI's path is `_parse_flags` then `main`, as `absl.app.run` calls them; absl's flags are reset to their
defaults first so one call's flags never leak into the next. An exception that would escape the CLI is printed
as a traceback to the captured stderr with exit code 1, as the interpreter would.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import traceback


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=__import__("sys").stderr)
    return 1


def _call(name: str, body, args: list[str], cwd) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    code = 0
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                result = body()
                code = result if isinstance(result, int) else 0
            except SystemExit as e:
                code = _exit_code(e)
            except BaseException:  # noqa: B036 - what an uncaught exception does to a process
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(old)
    return subprocess.CompletedProcess([name, *args], code, out.getvalue(), err.getvalue())


def run_eval(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """`python -m kvjax.eval *args`, in this process."""
    from kvjax.eval import __main__ as cli

    def body():
        cli.FLAGS.unparse_flags()
        cli._OPENED.clear()
        argv = cli._parse_flags(["kvjax.eval", *args])
        cli.main(argv)

    return _call("kvjax.eval", body, list(args), cwd)


def run_report(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """`python -m kvjax.eval.report *args`, in this process."""
    from kvjax.eval import report

    return _call("kvjax.eval.report", lambda: report.main(list(args)), list(args), cwd)


def run_leaderboard(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """`python -m kvjax.eval.leaderboard *args`, in this process."""
    from kvjax.eval import leaderboard

    return _call("kvjax.eval.leaderboard", lambda: leaderboard.main(list(args)), list(args), cwd)


_ENTRY = {"kvjax.eval": run_eval, "kvjax.eval.report": run_report, "kvjax.eval.leaderboard": run_leaderboard}


def run_cmd(cmd: list, cwd=None, **_subprocess_kwargs) -> subprocess.CompletedProcess:
    """A drop-in for `subprocess.run([sys.executable, "-m", <module>, *args], capture_output=True, text=True,
    env=..., timeout=...)`: the module's entry point runs in this process (env: this process's, whose PYTHONPATH
    and JAX_PLATFORMS the tests' env only repeated; timeout: none)."""
    import sys

    assert cmd[:2] == [sys.executable, "-m"] and cmd[2] in _ENTRY, cmd[:3]
    return _ENTRY[cmd[2]](*[str(a) for a in cmd[3:]], cwd=cwd)
