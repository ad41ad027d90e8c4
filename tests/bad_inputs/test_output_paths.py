"""`kvjax.cli.paths`: the folders and files the command lines write, refused in one line naming the flag and the
path before any model loads (`kvjax.eval`, its leaderboard, `kvjax.calibrate` and `kvjax.run` call it)."""

import os

import pytest

from kvjax.cli import paths
from kvjax.errors import ConfigError


def test_a_missing_folder_is_made_with_its_parents(tmp_path):
    target = tmp_path / "a" / "b"
    paths.output_folder("out_dir", str(target))
    assert target.is_dir()
    paths.output_folder("out_dir", str(target))  # an existing folder is fine


@pytest.mark.parametrize("where", ["a file", "inside a file", "in /proc", "in /sys"])
def test_a_folder_that_cannot_be_a_folder_is_refused(tmp_path, where):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me\n")
    target = {"a file": str(a_file), "inside a file": str(a_file / "out"), "in /proc": "/proc/self/kvjax_out",
              "in /sys": "/sys/kvjax_no_such_dir"}[where]
    with pytest.raises(ConfigError) as e:
        paths.output_folder("output_dir", target)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"--output_dir={target!r}")
    assert ("is a file, not a folder" if where == "a file" else "cannot be created") in message
    assert a_file.read_text() == "keep me\n"


def test_a_folder_nothing_can_be_written_in(tmp_path, monkeypatch):
    """Refused where the caller writes at once; a caller that may rerun read-only (a finished sweep) passes."""
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match=r"--out='.*' cannot be written in \(permission denied\)"):
        paths.output_folder("out", str(tmp_path))
    paths.output_folder("out", str(tmp_path), writable=False)


def test_an_output_file(tmp_path):
    new = tmp_path / "jobs" / "answers.jsonl"
    paths.output_file("output", str(new))
    assert new.parent.is_dir() and not new.exists()  # its folder made, the file itself left to the writer
    new.write_text("{}\n")
    paths.output_file("output", str(new))  # an existing file is appended to (resumed)
    assert new.read_text() == "{}\n"
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        paths.output_file("output", str(tmp_path))
    with pytest.raises(ConfigError, match=r"--output='.*notes.txt/out.jsonl': its folder is a file, not a folder"):
        (tmp_path / "notes.txt").write_text("x")
        paths.output_file("output", str(tmp_path / "notes.txt" / "out.jsonl"))
