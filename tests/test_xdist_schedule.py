"""tests/xdist_schedule.py, the suite's `-n` schedule, on a generated suite in a pytest subprocess (two workers):
a module fixture is built once; a worker that crashes is replaced, the test it crashed in runs once more (the
Makefile's `--reruns 1 --only-rerun "crashed while running"`), and every other test runs exactly once."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SUITE = {
    "conftest.py": "from xdist_schedule import pytest_xdist_make_scheduler  # noqa: F401\n",
    "pytest.ini": "[pytest]\n",
    "log.py": """
        import os, pathlib

        def note(name):
            with open(pathlib.Path(__file__).with_name("runs.log"), "a") as f:
                f.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")
    """,
    "test_shared.py": """
        import time
        import pytest
        from log import note

        @pytest.fixture(scope="module")
        def built():
            note("built:shared")

        @pytest.mark.parametrize("i", range(6))
        def test_shared(built, i):
            note(f"test_shared[{i}]")
            time.sleep(0.2)
    """,
    "test_crash.py": """
        import os, pathlib
        import pytest
        from log import note

        @pytest.fixture(scope="module")
        def built():
            note("built:crash")

        def test_crashes_once(built):
            note("test_crashes_once")
            marker = pathlib.Path(__file__).with_name("crashed_once")
            if not marker.exists():
                marker.touch()
                os.abort()

        def test_crashes_always(built):
            note("test_crashes_always")
            os.abort()

        @pytest.mark.parametrize("i", range(3))
        def test_after_the_crashes(built, i):
            note(f"test_after_the_crashes[{i}]")
    """,
    "test_alone.py": """
        import time
        import pytest
        from log import note

        @pytest.mark.parametrize("i", range(8))
        def test_alone(i):
            note(f"test_alone[{i}]")
            time.sleep(0.1)
    """,
}


def test_module_fixtures_are_built_once_and_a_crashed_test_runs_once_more(tmp_path):
    for name, text in SUITE.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(tmp_path)]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", "--reruns", "1",
                           "--only-rerun", "crashed while running"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1 and "1 failed, 18 passed, 2 rerun" in summary, proc.stdout[-3000:]
    assert "test_crash.py::test_crashes_always" in proc.stdout.split("short test summary")[-1]
    runs = [line.split() for line in (tmp_path / "runs.log").read_text().splitlines()]
    counts = collections.Counter(name for name, _ in runs)
    assert counts["built:shared"] == 1  # six tests, one worker
    workers = {name: {w for n, w in runs if n.startswith(name)} for name in ("test_shared", "built:shared")}
    assert workers["test_shared"] == workers["built:shared"]
    assert counts["test_crashes_once"] == 2 and counts["test_crashes_always"] == 2  # once more each, no third time
    others = {n: c for n, c in counts.items() if not n.startswith(("built:", "test_crashes"))}
    assert len(others) == 6 + 3 + 8 and set(others.values()) == {1}, counts
