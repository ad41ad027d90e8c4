"""Golden outputs of the generation paths, frozen before the per-layer layout refactor (issue 43).

Every case runs one public entry point on the tiny random model and returns greedy tokens and the kept
positions of the final cache (per layer, example and KV head, sorted), plus RAG logits where the path
gives them. `python tests/golden_cases.py` writes `tests/fixtures/golden/golden.json` from the code as it
is; `tests/test_golden.py` compares the current code against that file. The cases cover every registered
method (ragged batch of three), chunked prefill, questions (query-aware and retrieval), the shared-prefill
replay, a sliding-window model and the RAG strategies.
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Callable

import numpy as np
import pytest
from kvzap_weights import FIXTURE as KVZAP
from learned_files import duo_pattern, ea_stats_dir, fastkvzip_gates, lukv_curve, qfilter_dir
from tiny import random_prompts, tiny_model

import kvjax
from kvjax import methods

GOLDEN = pathlib.Path(__file__).parent / "fixtures" / "golden" / "golden.json"

#: The methods that the tests looping over every method run in `make test` (CI): one per kind of runtime path (the
#: full cache; one-shot scoring; in-place decode eviction; an attention observer reading the prefill's log-sum-exp;
#: retrieval with cross-layer state; a context replay; the hidden-state and output-projection inputs; the general
#: decode path; per-layer capacities; a per-head mask from a learned pattern). The others are marked `slow`:
#: `make test-all` runs every method.
REPRESENTATIVE = frozenset({"full", "snapkv", "tova", "h2o", "actqkv", "kvzip", "kvzap", "criticalkv", "decoding",
                            "pyramidkv", "duo_attention"})


#: A smaller set, for the loops whose per-method part is not the method's own runtime path (the example's command
#: line, int8 storage under a method, another model family).
FEW = frozenset({"snapkv", "tova", "actqkv", "kvzap", "decoding"})


def every_method(names, ci: frozenset[str] = REPRESENTATIVE) -> list:
    """`names` sorted, as parameters: those outside `ci` marked `slow`."""
    return [pytest.param(name, marks=() if name in ci else pytest.mark.slow) for name in sorted(names)]


SMALL = dict(n_init=2, n_local=8, block_size=4, window=8, repr_topk=2)
#: Every registered method with hyperparameters small enough for 40-token prompts.
METHODS: dict[str, dict] = {
    "full": {},
    "snapkv": {"budget": 12, "window_size": 4},
    "adakv": {"budget": 12, "base_args": {"window_size": 4}},
    "pyramidkv": {"budget": 12, "window_size": 4},
    "knorm": {"budget": 12},
    "random": {"budget": 12},
    "streaming_llm": {"budget": 10},
    "lm_infinite": {"budget": 12, "n_global": 4},
    "h2o": {"budget": 12},
    "tova": {"budget": 12},
    "nacl": {"budget": 12, "window_size": 4},
    "sagekv": {"budget": 12},
    "sagekv_union": {"budget": 12},
    "ahakv": {"budget": 12},
    "lagkv": {"budget": 12, "sink_size": 2, "lag_size": 4},
    "quest": {"budget": 12, "page_size": 4, "dense_layers": 1},
    "infllm": {"topk": 2, **SMALL},
    "qllm": {"topk": 2, **SMALL},
    "actqkv": {"topk": 2, **SMALL},
    "expected_attention": {"budget": 12},
    "keydiff": {"budget": 12},
    "observed_attention": {"budget": 12},
    "criticalkv": {"budget": 12, "base_args": {"window_size": 4}},
    "criticaladakv": {"budget": 12, "base_args": {"window_size": 4}},
    "cur": {"budget": 12},
    "leverage": {"budget": 12},
    "simlayerkv": {"lazy_threshold": 0.3, "n_recent": 8, "n_initial": 2},
    "capkv": {"budget": 12},
    "compactor": {"budget": 12, "chunk_size": 8},
    "non_causal_attention": {"budget": 12, "chunk_size": 8},
    "chunk": {"compression_ratio": 0.7, "chunk_length": 16, "base": "keydiff"},
    "block": {"budget": 12, "block_size": 8, "base_args": {"window_size": 4}},
    "per_layer": {"compression_ratios": [0.5, 0.8], "base": "keydiff"},
    "key_rerotation": {"budget": 12, "base": "knorm"},
    "merging": {"budget": 12, "merge_fraction": 0.75},
    "kvzap": {"budget": 12, "weights": str(KVZAP)},
    "dms": {"threshold": 0.0, "sliding_window_size": 4, "decoding": True, "base_args": {"weights": str(KVZAP)}},
    "decoding": {"compression_interval": 4, "target_size": 12, "query_buffer_size": 4},
    # over SnapKV, whose scores read the query ring (KNorm's ties of repeated tokens: tests/engine/test_engine.py)
    "compression_ratio_decoding": {"compression_interval": 4, "target_compression_ratio": 0.7, "query_buffer_size": 4,
                                   "base": "snapkv", "base_args": {"window_size": 2}},
    "cam": {"compression_interval": 4, "target_size": 12, "query_buffer_size": 4, "merge_budget": 4},
    # generated files for 2 layers x 2 KV heads (head_dim 16): tests/learned_files.py
    "duo_attention": {"patterns": duo_pattern(2, 2), "head_compression_ratio": 0.75},
    "qfilter": {"budget": 12, "filters": qfilter_dir(2, 2, 16)},
    "lukv": {"compression_ratio": 0.6, "curve": lukv_curve(2, 2)},
    "expected_attention_stats": {"budget": 12, "n_future_positions": 16, "stats": ea_stats_dir(2, 4, 16)},
    "kvzip": {"budget": 12, "chunk_size": 16, "repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10]},
    "kvgrad": {"budget": 12, "chunk_size": 16, "repeat_ids": [5, 6, 7], "continue_ids": [8, 9], "suffix_ids": [10]},
    "kvcompose": {"budget": 12},
    "fastkvzip": {"budget": 12, "window_ratio": 0.1, "gates": fastkvzip_gates(2, 64, 2)},
    "finch": {"budget": 12, "window_size": 4},
    "chunkkv": {"budget": 12, "chunk_size": 3, "base_args": {"window_size": 4}},
    "entropy_gated_chunkkv": {"budget": 12, "chunk_size": 3, "low_entropy_chunk_length": 1,
                              "base_args": {"window_size": 4}},
}
#: Layers of the model a method's generate case runs on, where not 3 (`per_layer` gives one ratio per layer, the
#: learned-file methods a file per layer count; they share their arguments with the two-layer model of
#: tests/test_example_own_model.py; KVzap's generated weights, tests/kvzap_weights.py, are for the two-layer model).
LAYERS = {"per_layer": 2, "kvzap": 2, "dms": 2, "duo_attention": 2, "qfilter": 2, "fastkvzip": 2, "lukv": 2,
          "expected_attention_stats": 2}
PROMPTS = (31, 12, 40)  # ragged batch
QUESTIONS = (5, 0, 7)  # one example without a question
NEW_TOKENS = 9


def layer_positions(cache) -> list[np.ndarray]:
    """Each layer's `pos` `[B, K, C]`, whatever the model cache's layout (stacked `[L, ...]` or per layer)."""
    if hasattr(cache, "layers"):
        return [np.asarray(layer.pos) for layer in cache.layers]
    pos = np.asarray(cache.pos)
    return [pos[i] for i in range(pos.shape[0])]


def kept(cache) -> list:
    """`[L][B][K]` sorted kept positions."""
    return [[[sorted(int(p) for p in head if p >= 0) for head in row] for row in pos] for pos in layer_positions(cache)]


def _generate(name: str, *, chunk_size=None, questions=False, sliding_window=None, layers=3, args=None) -> dict:
    overrides = {"num_layers": layers}
    if sliding_window is not None:
        overrides.update(model_type="mistral", sliding_window=sliding_window)
    model = tiny_model(**overrides)
    q = random_prompts(11, QUESTIONS) if questions else None
    method = methods.get(name, **(METHODS[name] if args is None else args))
    out = kvjax.generate(model, random_prompts(7, PROMPTS), method=method, max_new_tokens=NEW_TOKENS,
                         return_cache=True, chunk_size=chunk_size, question_ids=q)
    return {"tokens": out.tokens.tolist(), "num_tokens": out.num_tokens.tolist(), "kept": kept(out.cache)}


def _shared(name: str) -> dict:
    from kvjax.runtime import decode, shared_prefill

    model = tiny_model(num_layers=3)
    method = methods.get(name, **METHODS[name])
    rec = shared_prefill.record(model, random_prompts(7, PROMPTS), question_ids=random_prompts(11, QUESTIONS),
                                layer_inputs=shared_prefill.recorded_inputs([method]))
    state = shared_prefill.prefill_from(model, rec, method, max_new_tokens=NEW_TOKENS)
    tokens, count, cache = decode(model, state, max_new_tokens=NEW_TOKENS)
    return {"tokens": np.asarray(tokens).tolist(), "num_tokens": np.asarray(count).tolist(), "kept": kept(cache)}


def _rag(strategy: str, args: dict | None = None) -> dict:
    sys.path.insert(0, str(pathlib.Path(__file__).parent / "rag"))
    from ragdata import PREFIX, QUERY, documents, model_for

    from kvjax import rag

    out = rag.answer(model_for(2), documents(2), QUERY, prefix=PREFIX, strategy=strategy, strategy_args=args,
                     max_new_tokens=6, return_cache=True)
    return {"tokens": out.tokens.tolist(), "kept": kept(out.cache),
            "query_logits": np.round(np.asarray(out.query_logits, np.float64), 6).tolist()}


#: Methods whose prefill runs chunk by chunk (the others take the whole prompt, or have their own window).
CHUNKED = ("full", "snapkv", "adakv", "knorm", "streaming_llm", "lm_infinite", "h2o", "tova", "sagekv", "ahakv",
           "quest", "duo_attention", "finch", "chunkkv", "simlayerkv", "entropy_gated_chunkkv", "fastkvzip",
           "lukv", "merging", "expected_attention_stats")
QUERY_AWARE = ("snapkv", "adakv", "pyramidkv", "sagekv", "quest", "infllm", "qllm", "actqkv", "h2o", "finch",
               "chunkkv", "entropy_gated_chunkkv")
SHARED = ("snapkv", "h2o", "tova", "knorm", "ahakv")
SLIDING = ("full", "snapkv", "streaming_llm", "h2o")
RAG = {
    "reuse": None, "recompute": None, "cacheblend": {"recompute_ratio": 0.3}, "epic": None, "samkv": None,
    "multi_infllm": None,
}


def cases() -> dict[str, Callable[[], dict]]:
    out: dict[str, Callable[[], dict]] = {}
    for name in METHODS:
        out[f"generate/{name}"] = lambda n=name: _generate(n, layers=LAYERS.get(n, 3))
    for name in CHUNKED:
        out[f"chunked/{name}"] = lambda n=name: _generate(n, chunk_size=16, layers=LAYERS.get(n, 3))
    partitions = {"retention": 0.5, "sink_size": 2, "lag_size": 4}  # LagKV's chunked prefill needs its partition mode
    out["chunked/lagkv_partition"] = lambda: _generate("lagkv", chunk_size=16, args=partitions)
    for name in QUERY_AWARE:
        out[f"question/{name}"] = lambda n=name: _generate(n, questions=True)
    for name in SHARED:
        out[f"shared/{name}"] = lambda n=name: _shared(n)
    for name in SLIDING:
        out[f"sliding/{name}"] = lambda n=name: _generate(n, sliding_window=16)
    for name, args in RAG.items():
        out[f"rag/{name}"] = lambda n=name, a=args: _rag(n, a)
    return out


def main(prefixes: list[str]) -> None:
    """Freezes every case (or, given case-name prefixes, only those, keeping the rest of the file)."""
    results = json.loads(GOLDEN.read_text()) if prefixes and GOLDEN.exists() else {}
    for case, run in cases().items():
        if prefixes and not any(case.startswith(p) for p in prefixes):
            continue
        try:
            results[case] = run()
        except Exception as e:  # a path that refuses these inputs: freeze the refusal too
            results[case] = {"error": f"{type(e).__name__}: {e}"}
        print(case, "error" if "error" in results[case] else "ok", flush=True)
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(results, sort_keys=True, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
