"""Decode-time compression to a fraction of the tokens seen (kvpress's `CompressionRatioDecodingPress`).

Oracles: Python's own float64 product for the target, `max(1, int(seen * (1 - ratio)))`, over every count of tokens
seen up to a million and random ones up to 2^31 - 1; and a NumPy simulation of kvpress's decode hook (written from
`DecodingPress.forward_hook`: after each decode token attends, count it; once `compression_interval` are counted, or
while the target is one pair, keep the target's best pairs by the base's scores and reset the count), knorm scores
(query-free) with ties to the lower position.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decoding_harness import LENGTHS, NEW, B, K, kept_heads, knorm_scores, run_layer
from reference_kvzap import top

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.compression_ratio_decoding import as_fraction, float64_product_floor, round_up_limits

#: Every ratio in hundredths (25 of them round differently in float64 than in exact arithmetic), eighths, thirds.
RATIOS = [i / 100 for i in range(100)] + [0.875, 0.9375, 1 / 3, 2 / 3, 0.999, 0.3333]


def test_the_target_is_pythons_float64_product():
    seen = np.concatenate([np.arange(1_000_001), np.random.default_rng(0).integers(2**30, 2**31 - 1, 100_000),
                           [2**30 - 1, 2**30, 2**31 - 1]]).astype(np.int32)
    parts = [as_fraction(1.0 - r) for r in RATIOS]
    product = jax.jit(jax.vmap(float64_product_floor, in_axes=(None, 0, 0, 0)))
    numerators, denominators, errors = zip(*parts, strict=True)
    limits = jnp.asarray([round_up_limits(e) for e in errors])
    got = np.asarray(product(jnp.asarray(seen), jnp.asarray(numerators), jnp.asarray(denominators), limits))
    differs = 0
    for row, r in zip(got, RATIOS, strict=True):
        factor = 1.0 - r
        want = np.floor(seen.astype(np.float64) * factor).astype(np.int64)  # IEEE float64, as Python's int * float
        assert [int(int(s) * factor) for s in seen[:1000:37]] == want[:1000:37].tolist()
        assert np.array_equal(row, want), (r, seen[row != want][:5])
        a, d, _ = as_fraction(factor)
        differs += not np.array_equal(want[:1_000_001], seen[:1_000_001].astype(np.int64) * a // d)
    assert differs == 25  # where a decimal product would have been off by one


def test_a_ratio_that_is_no_short_fraction_is_refused():
    with pytest.raises(ConfigError, match="no fraction with a denominator of at most 10,000"):
        methods.get("compression_ratio_decoding", target_compression_ratio=0.123456789)


def _kvpress(scores, n, ratio, interval):
    """kvpress's decode hook over one head (`scores` `[positions]`, the prompt's `n` first): the positions the cache
    holds when each decode token attends (kvjax's cache after that decode step)."""
    kept, count, attended = list(range(n)), 0, []
    for i in range(NEW):
        kept = sorted(kept + [n + i])  # the token is appended, then attends
        attended.append(kept)
        count += 1
        target = max(1, int((n + i + 1) * (1 - ratio)))  # position_ids.max() + 1
        if count >= interval or target <= 1:
            kept = top(scores, kept, target) if len(kept) > target else kept
            count = 0
    return attended


@pytest.mark.parametrize(("ratio", "interval"), [(0.8, 5), (0.9, 4), (0.5, 3)])
def test_knorm_compression_matches_kvpress_hook(ratio, interval):
    """0.8 at an interval of 5 compresses at multiples of 5 tokens, where float64 keeps one pair fewer than the
    exact fraction; at 0.9 the 9-token example's target is one pair until 20 tokens, so it is compressed every step."""
    method = methods.get("compression_ratio_decoding", target_compression_ratio=ratio, compression_interval=interval)
    caches, k = run_layer(method)
    for b in range(B):
        n, scores = int(LENGTHS[b]), knorm_scores(k, b)
        for h in range(K):
            assert kept_heads(caches[0])[b][h] == list(range(n))
            for i, want in enumerate(_kvpress(scores[:, h], n, ratio, interval)):
                assert kept_heads(caches[i + 1])[b][h] == want, (b, h, i)


def test_capacity_is_bounded():
    method = methods.get("compression_ratio_decoding", target_compression_ratio=0.75, compression_interval=512)
    assert method.capacity(32768, 100_000) == int(132768 * 0.25) + 512 + 1  # the target at the last token
    assert method.capacity(1000, 100_000) == int(101000 * 0.25) + 512 + 1
    assert method.capacity(32768, 100) == 32868  # a short generation: the prompt and every new token
    assert methods.get("compression_ratio_decoding", budget=512).capacity(1000, 100_000) == 50_500 + 512 + 1


def test_bad_hyperparameters():
    for ratio in (1.0, -0.1, float("nan")):
        with pytest.raises(ConfigError, match="target_compression_ratio"):
            methods.get("compression_ratio_decoding", target_compression_ratio=ratio)
    with pytest.raises(ConfigError, match="target_size=2048 is not used"):
        methods.get("compression_ratio_decoding", target_size=2048)
    with pytest.raises(ConfigError, match="decodes on its own"):
        methods.get("compression_ratio_decoding", base="h2o")
