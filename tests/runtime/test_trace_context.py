"""A jitted function's second call must not trace and compile it again. jax keys its compile cache by the trace
context, and jax 0.11 adds an option to that context when Pallas' TPU module first loads
(`pallas_fuser_disable_nested_fuse`). Loaded while the decode loop traced its first kernel, it made the loop's second
call compile again, once per process: 6-42 s on an H200 in run 14 (BENCHMARKS.md). `kvjax.ops._impl` loads every
kernel module up front; both checks run in a fresh process, where nothing has loaded them before. On jax 0.10.2
(here) that option does not exist; `make test-jax-next` runs them on 0.11.2, where they fail without the preload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, pkgutil, importlib, sys
sys.path.insert(0, {tests!r})
import jax
from jax._src import config
gen = importlib.import_module("kvjax.runtime.generate")
from kvjax import methods, tuning
from kvjax.ops import fused_decode as fd
from tiny import random_prompts, tiny_model

before = list(config.trace_context_names())
compiles = []
COMPILE = "/jax/core/compile/backend_compile_duration"
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: compiles.append(event) if event == COMPILE else None)
model = tiny_model()
counts = {{}}
with tuning.override(auto_pallas=tuning.current().auto_pallas | {{fd.OP}}):
    for call in ("first", "second"):
        fresh = gen.prefill(model, random_prompts(0, (12, 9)), method=methods.get("full"), max_new_tokens=4)
        start = len(compiles)
        traced = gen.TRACE_COUNTS["decode_step"]
        gen.decode(model, fresh, max_new_tokens=4, stop_at_eos=False)
        counts[call] = dict(compiles=len(compiles) - start, traces=gen.TRACE_COUNTS["decode_step"] - traced)
import kvjax
for module in pkgutil.walk_packages(kvjax.__path__, "kvjax."):
    if not module.name.endswith("__main__"):
        importlib.import_module(module.name)
importlib.import_module("jax.experimental.pallas.ops.tpu.flash_attention")  # kvjax.ops.attention's TPU prefill
added = [n for n in config.trace_context_names() if n not in before]
print(json.dumps(dict(counts=counts, added=added, jax=jax.__version__)))
"""


def _child() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(ROOT / "tests"))], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_decode_loop_compiles_once_and_no_kernel_module_changes_the_trace_context_later():
    """From a fresh process: the decode loop with the fused kernel (interpret mode here) compiles on its first call
    and not on its second, and no kvjax module (nor the TPU flash attention it loads when traced) loaded after the
    runtime adds an option to the trace context."""
    result = _child()
    first, second = result["counts"]["first"], result["counts"]["second"]
    assert first["traces"] >= 1 and first["compiles"] >= 1, result
    assert second == {"traces": 0, "compiles": 0}, result
    assert result["added"] == [], result
