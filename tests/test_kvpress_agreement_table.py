"""benchmarks/kvpress_agreement.py's table of methods: every row's kvjax side is a method kvjax builds (kvpress is
not a test dependency, so its side is checked where the measurement runs). A per-sample window gets a stand-in
length; the rows reading files the benchmark generates (learned files, KVzap weights) are left to it."""

from __future__ import annotations

import pathlib
import sys

import pytest

from kvjax import methods

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import kvpress_agreement as agreement  # noqa: E402

#: Rows whose kvjax arguments name files generated at run time (`learned_files`, `--kvzap_weights`).
GENERATED = {agreement.LEARNED, "KVZAP"}


def _uses_generated(args) -> bool:
    if isinstance(args, dict):
        return any(_uses_generated(v) for v in args.values())
    return isinstance(args, str) and args in GENERATED


BUILT_HERE = sorted(row for row, (_, _, _, args) in agreement.METHODS.items() if not _uses_generated(args))


def test_the_table_is_mostly_built_here():
    assert len(BUILT_HERE) >= 40 and len(BUILT_HERE) < len(agreement.METHODS)


@pytest.mark.parametrize("row", BUILT_HERE)
def test_every_row_builds_its_kvjax_method(row):
    _, _, name, args = agreement.METHODS[row]
    method = methods.get(name, **agreement.for_sample(args, 16))
    assert method.name == name
