"""tests/slow_tests.txt names tests that exist: a renamed test or parameter would otherwise drop out of it silently and
run in `make test` again (or, renamed back, never run anywhere but `make test-all`)."""

import ast
import pathlib
import re

from conftest import slow_test_ids

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_listed_test_exists():
    assert slow_test_ids(), "tests/slow_tests.txt lists no test"
    for node in sorted(slow_test_ids()):
        path, _, name = node.partition("::")
        function = re.sub(r"\[.*\]$", "", name)
        assert (ROOT / path).is_file(), node
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert function in names, f"{node}: no test {function} in {path}"
