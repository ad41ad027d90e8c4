"""Decode-time compression (kvpress's `DecodingPress`) over any scorer.

Oracle: a NumPy float64 reference (tests/methods/reference_kvzap.py): after every `compression_interval` decode
tokens the pairs other than the new token are cut back to `target_size` by the base's scores (knorm here:
query-free, so the reference needs no attention), ties to the lower position; invariants for the query ring (the
last `query_buffer_size` decode queries, oldest first) and the bounded capacity.
"""

import numpy as np
import pytest
from decoding_harness import LENGTHS, NEW, B, K, kept_heads, knorm_scores, run_layer
from reference_kvzap import decoding_step, top

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.decoding import QUERY_POS


@pytest.mark.parametrize("budget", [None, 8])
def test_knorm_compression_every_interval(budget):
    interval, target = 3, 10
    method = methods.get("decoding", base="knorm", compression_interval=interval, target_size=target, budget=budget)
    caches, k = run_layer(method)
    for b in range(B):
        n, scores = int(LENGTHS[b]), knorm_scores(k, b)
        for h in range(K):
            kept = list(range(n)) if budget is None else top(scores[:, h], list(range(n)), min(budget, n))
            assert kept_heads(caches[0])[b][h] == kept, (b, h)
            for i in range(NEW):
                kept = decoding_step(kept, scores[:, h], n + i, i, interval, target)
                assert kept_heads(caches[i + 1])[b][h] == kept, (b, h, i)


def test_query_ring_holds_the_last_decode_queries():
    method = methods.get("decoding", base="snapkv", base_args={"window_size": 2}, compression_interval=4,
                         target_size=12, query_buffer_size=3)
    caches, _ = run_layer(method)
    ring = np.asarray(caches[-1].state[QUERY_POS])  # [B, W], written at (step % W)
    for b in range(B):
        last = [int(LENGTHS[b]) + i for i in range(NEW - 3, NEW)]
        assert sorted(ring[b].tolist()) == last
    # the snapkv base keeps its window (the newest stored positions) and the new token through every compression
    for i, cache in enumerate(caches[1:]):
        for b in range(B):
            for h in range(K):
                assert int(LENGTHS[b]) + i in kept_heads(cache)[b][h]


def test_capacity_is_bounded():
    method = methods.get("decoding", compression_interval=512, target_size=2048)
    assert method.capacity(32768, 100_000) == 2048 + 512 + 1 + (32768 - 2048)
    assert method.capacity(1000, 100_000) == 2048 + 512 + 1
    assert method.capacity(1000, 10) == 1010
    assert methods.get("decoding", budget=512).capacity(32768, 100_000) == 2048 + 512 + 1


def test_bad_hyperparameters():
    with pytest.raises(ConfigError, match="compression_interval"):
        methods.get("decoding", compression_interval=0)
    with pytest.raises(ConfigError, match="decodes on its own"):
        methods.get("decoding", base="h2o")
