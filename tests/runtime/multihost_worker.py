"""One process of the two-process `jax.distributed` test in `test_sharding.py` (CPU, gloo collectives).

Launched with JAX_COORDINATOR_ADDRESS, KVJAX_NUM_PROCESSES, KVJAX_PROCESS_ID and two forced CPU devices:
generation on a mesh of this process's devices and on one mesh over both processes equals one device.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax.runtime import sharding  # noqa: E402


def main() -> None:
    from tiny import tiny_model

    started = sharding.maybe_initialize_distributed()
    model = tiny_model(num_heads=8, num_kv_heads=4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, n).tolist() for n in (40, 33, 57, 60)]
    args = dict(method="snapkv", method_args=dict(budget=24, window_size=8), max_new_tokens=4, stop_at_eos=False)
    ref = kvjax.generate(model, prompts, **args)
    local = sharding.make_mesh(1, 2)  # this process's two devices
    got_local = kvjax.generate(sharding.shard_model(model, local), prompts, mesh=local, **args)
    both = sharding.make_mesh(2, 2, devices=jax.devices())  # data across the processes
    got_global = kvjax.generate(sharding.shard_model(model, both), prompts, mesh=both, **args)
    print(json.dumps(dict(
        initialized=started, process_index=jax.process_index(), process_count=jax.process_count(),
        device_count=jax.device_count(), local=np.array_equal(ref.tokens, got_local.tokens),
        global_mesh=np.array_equal(ref.tokens, got_global.tokens), multi_process=both.is_multi_process,
    )))


if __name__ == "__main__":
    main()
