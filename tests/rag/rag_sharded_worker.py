"""Run by `test_rag_sharded.py` in a subprocess with 8 forced CPU devices (XLA_FLAGS must be set before
JAX starts): every RAG strategy answered with `mesh=` on each mesh against one device, one JSON line out.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/rag/rag_sharded_worker.py [strategy,...] [window]

`window` (the second argument): the tiny Gemma-3-style model of tests/rag/test_rag_sliding_window.py (local layers
with an 8-token window and their own RoPE, a global one) instead of the 2-layer Llama.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # ragdata (tests/rag), tiny (tests)

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from ragdata import DOC_IDS, LAYOUT, PREFIX, QUERY, model_for  # noqa: E402
from tiny import tiny_gemma3  # noqa: E402

from kvjax import rag  # noqa: E402
from kvjax.runtime import sharding  # noqa: E402

MAX_NEW = 4
# Hyperparameters that make each strategy select / recompute a real subset on the 2-layer tiny model.
#: The strategies also run on the 8x1 mesh.
ON_8X1 = ("reuse", "samkv")
STRATEGIES = {
    "reuse": {},
    "recompute": {},
    "cacheblend": {"recompute_ratio": 0.3},
    "epic": {"k": 3},
    "samkv": {},
    "multi_infllm": {"n_init": 4, "n_local": 32, "block_size": 8, "topk": 2, "repr_topk": 2, "window": 32},
}


def _spec(x: jax.Array) -> str:
    return str(getattr(x.sharding, "spec", x.sharding))


def main() -> None:
    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, got {jax.device_count()} (set XLA_FLAGS before JAX starts)")
    only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 and sys.argv[1] else set(STRATEGIES)
    window = len(sys.argv) > 2 and sys.argv[2] == "window"
    # One device; `answer(mesh=...)` places the weights itself.
    model = tiny_gemma3(num_layers=3, window=8, layer_types=("sliding_attention", "full_attention",
                                                             "sliding_attention")) if window else model_for()
    if window:
        # Below the global layer a token's hidden state depends on its last 8 tokens only, alike alone and joined,
        # so at check layer 1 most deviations are float noise and their ranking a tie: check after the global layer.
        STRATEGIES["cacheblend"] = {"recompute_ratio": 0.3, "check_layer": 2}
    kv_heads = model.config.num_kv_heads
    meshes = {f"{d}x{m}": sharding.make_mesh(d, m) for d, m in ((8, 1), (1, kv_heads), (2, 4))}
    one_device_docs = rag.prefill_documents(model, DOC_IDS, layout=LAYOUT)
    mesh_docs = {name: rag.prefill_documents(model, DOC_IDS, layout=LAYOUT, mesh=mesh) for name, mesh in meshes.items()}

    def answer(strategy: str, docs, mesh=None):
        return rag.answer(model, docs, QUERY, prefix=PREFIX, strategy=strategy, strategy_args=STRATEGIES[strategy],
                          max_new_tokens=MAX_NEW, stop_at_eos=False, return_cache=True, mesh=mesh)

    out: list[dict] = []
    for strategy in STRATEGIES:
        if strategy not in only:
            continue
        ref = answer(strategy, one_device_docs)
        # data:8 alone replicates a one-example request as 2x4 does (2 KV heads on model:4): two strategies on it.
        runs = [(name, mesh_docs[name], name) for name in meshes if name != "8x1" or strategy in ON_8X1]
        if strategy == "samkv":  # documents prefilled on one device (or loaded): answer() places them
            runs.append((f"1x{kv_heads}", one_device_docs, f"1x{kv_heads}:one-device-docs"))
        for name, docs, label in runs:
            got = answer(strategy, docs, meshes[name])
            out.append(dict(
                strategy=strategy, mesh=label, ref=ref.tokens.tolist(), got=got.tokens.tolist(),
                logits_diff=float(np.abs(ref.query_logits - got.query_logits).max()),
                kept=[ref.report.kept_tokens, got.report.kept_tokens],
                cache_spec=_spec(got.cache.layers[0].k), devices=len(got.cache.layers[0].k.sharding.device_set),
                layer_specs=sorted({_spec(layer.k) for layer in got.cache.layers}),
                doc_spec=_spec(docs[0].k[0]), doc_layer_specs=sorted({_spec(k) for k in docs[0].k + docs[0].v}),
            ))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
