"""The persistent compilation cache: on by default in `prefill` / `generate`, its directory user-chosen
(`KVJAX_COMPILATION_CACHE_DIR`), off on request. Each run is a fresh process, as a user's next request."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys
import jax
from jax import monitoring
from tiny import tiny_model
import kvjax

hits = []
monitoring.register_event_listener(lambda e, **_: hits.append(e) if e == "/jax/compilation_cache/cache_hits" else None)
model = tiny_model(num_layers=2)
out = kvjax.generate(model, [[1, 2, 3, 4, 5, 6, 7]], method="snapkv", method_args=dict(budget=4, window_size=2),
                     max_new_tokens=3, stop_at_eos=False)
print(json.dumps(dict(hits=len(hits), dir=jax.config.jax_compilation_cache_dir, tokens=out.tokens.tolist())))
"""


def _run(env_value: str) -> dict:
    tests = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, KVJAX_COMPILATION_CACHE_DIR=env_value,
               PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_second_process_loads_the_programs_from_the_cache(tmp_path):
    cache = tmp_path / "jax_cache"
    cold = _run(str(cache))
    assert cold["dir"] == str(cache) and cold["hits"] == 0
    assert any(cache.iterdir()), "the first process must write its programs"
    warm = _run(str(cache))
    assert warm["hits"] >= 2, warm  # prefill and the decode loop at least
    assert warm["tokens"] == cold["tokens"]
    off = _run("off")
    assert off["dir"] is None and off["hits"] == 0 and off["tokens"] == cold["tokens"]


def test_a_home_relative_directory_is_expanded_not_made_under_the_working_directory(tmp_path, monkeypatch):
    """`--compilation_cache_dir=~/x` reaches kvjax with its `~` (the shell expands none after `=`): it made a folder
    literally named `~` in the working directory, as KVJAX_COMPILATION_CACHE_DIR=~/x (expanded) did not."""
    import jax

    from kvjax.runtime.compile_cache import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    try:
        used = enable_compilation_cache("~/jax_cache")
        assert used == str(tmp_path / "home" / "jax_cache") == jax.config.jax_compilation_cache_dir
        assert (tmp_path / "home" / "jax_cache").is_dir() and not (tmp_path / "~").exists()
    finally:
        enable_compilation_cache(before)
    assert jax.config.jax_compilation_cache_dir == before
