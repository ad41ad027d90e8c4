"""`benchmarks/device_gpu.sh`'s own plumbing, on the CPU: what a run without the `verdict` stage brings back.

The full smoke (`SMOKE=1 bash benchmarks/device_gpu.sh`, every stage on tiny shapes) takes minutes and is run by
hand before a GPU session; this checks in seconds the part every command shares: the stage log, the packed
results, and the script's exit status when no `bars.md` / `choices.md` was written.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_without_verdict_exits_zero_and_packs_its_log(tmp_path: Path) -> None:
    returned, stages = tmp_path / "returned", tmp_path / "stages"
    stages.mkdir()
    env = {**os.environ, "OUT": str(returned), "TMPDIR": str(stages), "STAGES": "env", "SMOKE": "1",
           "PY": sys.executable}
    done = subprocess.run(["bash", "benchmarks/device_gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in returned.iterdir()) == ["log.txt", "results.tgz"]
    assert [p.name[:len("kvjax_stages.")] for p in stages.iterdir()] == ["kvjax_stages."]  # its work folder, here
    log = (returned / "log.txt").read_text()
    assert "== env: rc " in log and "== done at " in log
    with tarfile.open(returned / "results.tgz") as packed:
        assert "./log.txt" in packed.getnames()
