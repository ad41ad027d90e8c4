"""Issue 56's equality case: 24 requests of mixed lengths (64-2,000 tokens on kvjax-tiny) through an engine of 4
slots give each request the greedy tokens and kept positions of `generate` of its prompt alone (a float near-tie
excepted, and named). Answers end at the model's own EOS.

CI runs a representative set (an evicting observer with per-example decode state; a compressing method over KIVI-4
storage). `KVJAX_ENGINE_EQUALITY=all` runs every registered method, int8 and KIVI-4 storage and a sliding-window model
(docs/engine.md records that run): `KVJAX_ENGINE_EQUALITY=all pytest tests/engine/test_engine_job.py`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from engine_refs import compare
from golden_cases import METHODS
from learned_files import for_model
from tiny import tiny_gemma3

from kvjax import methods
from kvjax.engine import Engine, Request
from kvjax.models.model import load_model

REQUESTS, SLOTS, NEW = 24, 4, 24
ALL = os.environ.get("KVJAX_ENGINE_EQUALITY") == "all"
CASES = ([(name, None, "kvjax-tiny") for name in sorted(METHODS)]
         + [(name, kv, "kvjax-tiny") for name in ("snapkv", "tova", "streaming_llm") for kv in ("int8", "kivi4")]
         + [(name, None, "sliding") for name in ("full", "snapkv", "tova", "streaming_llm")]) if ALL else \
    [("tova", None, "kvjax-tiny"), pytest.param("snapkv", "kivi4", "kvjax-tiny", marks=pytest.mark.slow)]


def _args(name: str, config) -> dict:
    args = for_model(name, METHODS[name], config.num_layers, config.num_kv_heads, config.head_dim, config.hidden_size,
                     config.num_heads)
    if name == "decoding":  # over SnapKV: KNorm's exact ties of repeated tokens' keys (tests/engine/test_engine.py)
        args.update(base="snapkv", base_args={"window_size": 2})
    if name == "per_layer":
        args["compression_ratios"] = [0.5, 0.8, 0.6, 0.7, 0.5, 0.8][:config.num_layers]
    return args


def _requests(vocab: int) -> list[Request]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(64, 2001, REQUESTS)
    return [Request(id=f"q{i}", tokens=tuple(rng.integers(3, vocab, n).tolist()), max_new_tokens=NEW)
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("name,kv_dtype,model_name", CASES)
def test_24_requests_through_4_slots_match_generate_alone(name, kv_dtype, model_name):
    if model_name == "sliding":
        model = tiny_gemma3(num_layers=3, window=64, max_position_embeddings=4096, eos_token_ids=(39,))
        args = METHODS[name]
    else:
        model = load_model("kvjax-tiny")
        args = _args(name, model.config)
    method = methods.get(name, **args)
    requests = _requests(model.config.vocab_size)
    engine = Engine(model, method=method, max_prompt_tokens=max(len(r.tokens) for r in requests),
                    max_new_tokens=NEW, slots=SLOTS, kv_dtype=kv_dtype, keep_positions=True)
    done = list(engine.run(requests))
    assert len(done) == REQUESTS
    ties = compare(model, method, requests, done, kv_dtype=kv_dtype)
    print(f"{name} {kv_dtype or 'model'} {model_name}: {REQUESTS} requests, {len(ties)} near-ties {ties}")
    assert len(ties) <= 2, ties
