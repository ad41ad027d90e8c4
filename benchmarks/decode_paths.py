"""In-place vs general decode path, process CPU time per step (a loaded machine's wall clock is noise).

    cd benchmarks && python decode_paths.py 4096

`full`, StreamingLLM (budget 1024: append + in-place eviction) and LagKV (budget 1024,
`compress_decode=False`: append only) on the `small` model, each decoded 32 steps from the same
prefilled cache by its in-place program and by the general one (`decode.general_decode_path`),
alternated, 5 repeats after a warm-up; medians of process CPU and wall time per step.
"""

import dataclasses
import importlib
import statistics
import sys
import time

import bench_util as bu
import jax
import jax.numpy as jnp
import numpy as np
from decode import general_decode_path

from kvjax import methods as kvm

gen = importlib.import_module("kvjax.runtime.generate")
model = bu.random_model(bu.model_config("small"), "float32")
ctx = int(sys.argv[1])
new = 33
ids = np.random.default_rng(ctx).integers(0, 1024, (1, ctx))
cases = {"full": kvm.get("full"), "streaming_llm": kvm.get("streaming_llm", budget=1024),
         "lagkv": kvm.get("lagkv", **bu.method_args("lagkv", 1024, ctx), compress_decode=False)}
states = {}
for n, m in cases.items():
    states[n] = gen.prefill(model, ids, method=m, max_new_tokens=new, chunk_size=1024 if n == "streaming_llm" else None)
    states[n + "/general"] = dataclasses.replace(states[n], method=general_decode_path(m))


def run(s):
    fresh = dataclasses.replace(s, cache=jax.tree.map(jnp.copy, s.cache))
    jax.block_until_ready(fresh.cache)
    c, w = time.process_time(), time.perf_counter()
    jax.block_until_ready(gen.decode(model, fresh, max_new_tokens=new, stop_at_eos=False)[2])
    return time.process_time() - c, time.perf_counter() - w


for s in states.values():
    run(s)
res = {k: [] for k in states}
for _ in range(5):
    for k, s in states.items():
        res[k].append(run(s))
for k, v in res.items():
    cpu = statistics.median([a for a, _ in v]) / (new - 1) * 1e3
    wall = statistics.median([b for _, b in v]) / (new - 1) * 1e3
    print(f"T={ctx} {k:24s} cpu {cpu:7.3f} ms/step  wall {wall:7.3f} ms/step", flush=True)
