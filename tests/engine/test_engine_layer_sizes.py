"""The engine's slots with per-layer cache sizes grouped by `Tuning.layer_slack` (`stages.cache_layer_capacities`).

Oracle: `generate` of each request alone (`engine_refs.compare`), and each layer's size never larger at a shorter
bucket (the slots are allocated for the longest prompt; each request's cache is prefilled at its own bucket).
"""

from __future__ import annotations

import itertools

import numpy as np
from engine_refs import compare

import kvjax
from kvjax import methods, tuning
from kvjax.engine import Engine, Request
from kvjax.runtime import stages

RATIOS = [0.1, 0.3, 0.45, 0.6, 0.75, 0.9]  # kvjax-tiny's 6 layers, 6 sizes


def test_shorter_prompts_fit_the_engines_slots_and_answer_as_generate_alone():
    """The engine allocates its slots for its longest prompt and inserts each request's cache, prefilled at the
    request's own bucket, into them: a layer's grouped size must never be larger at a shorter bucket."""
    model = kvjax.load_model("kvjax-tiny")
    method = methods.get("per_layer", compression_ratios=RATIOS, base="snapkv")
    buckets = [16, 32, 64, 128, 256, 512, 1024]
    with tuning.override(layer_slack=0.1):  # (merging each bucket's own sizes would give 16 a larger layer than 32)
        sizes = [stages.cache_layer_capacities(method, bucket, 6, 6) for bucket in buckets]
        for shorter, longer in itertools.combinations(sizes, 2):  # each layer's size grows with the bucket
            assert all(a <= b for a, b in zip(shorter, longer, strict=True)), (shorter, longer)
        rng = np.random.default_rng(2)
        requests = [Request(id=f"r{i}", tokens=tuple(rng.integers(5, 2000, n).tolist()), max_new_tokens=6)
                    for i, n in enumerate((30, 9, 22, 5))]  # buckets 32 (the slots') and 16
        engine = Engine(model, method=method, max_prompt_tokens=30, max_new_tokens=6, slots=2, keep_positions=True)
        assert len(set(engine.layout.layer_capacities)) < 6
        done = list(engine.run(requests))
        assert compare(model, method, requests, done) == []
