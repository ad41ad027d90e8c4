"""Per-layer cache sizes grouped into a few (`Tuning.layer_slack`, `stages.merge_sizes`, `cache_layer_capacities`).

Oracles: for the merge, every choice among the layers' own sizes, enumerated (the fewest values within the slack,
then the least total, each layer at the smallest chosen value that holds it); for the runtime, the same generation
with every layer at its own size (`layer_slack=0`): the same tokens and, layer by layer, the same kept positions,
while the prefill compiles one program per distinct size. The engine's side: tests/engine/test_engine_layer_sizes.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from learned_files import lukv_curve

import kvjax
from kvjax import cache as kvc
from kvjax import methods, tuning
from kvjax.engine import slots
from kvjax.errors import ConfigError
from kvjax.methods.wrapper import ScorerWrapper
from kvjax.runtime import stages
from kvjax.runtime.forward import TRACE_COUNTS


def _brute_force(sizes: tuple[int, ...], slack: float) -> tuple[int, int]:
    """(fewest values, least total with that many) over every choice of values among `sizes` within the slack."""
    values = sorted(set(sizes))
    for count in range(1, len(values) + 1):
        totals = [sum(min(c for c in chosen if c >= s) for s in sizes)
                  for chosen in itertools.combinations(values, count) if chosen[-1] == values[-1]]
        fitting = [t for t in totals if t <= sum(sizes) * (1 + slack)]
        if fitting:
            return count, min(fitting)
    raise AssertionError("every value on its own always fits")


@pytest.mark.parametrize("seed", range(40))
def test_the_merge_takes_the_fewest_sizes_within_the_slack(seed):
    rng = np.random.default_rng(seed)
    sizes = tuple(int(s) for s in rng.integers(1, 60, size=int(rng.integers(1, 12))))
    for slack in (0.0, 0.01, 0.05, 0.1, 0.3, 1.0, 10.0):
        merged = stages.merge_sizes(sizes, slack)
        assert set(merged) <= set(sizes) and sum(merged) <= sum(sizes) * (1 + slack)
        assert all(m == min(c for c in set(merged) if c >= s) for m, s in zip(merged, sizes, strict=True))
        assert (len(set(merged)), sum(merged)) == _brute_force(sizes, slack), (sizes, slack, merged)


def test_no_slack_or_one_size_stays_as_it_is():
    assert stages.merge_sizes((5, 3, 7, 9), 0.0) == (5, 3, 7, 9)
    assert stages.merge_sizes((5, 5, 5), 0.5) == (5, 5, 5)
    assert stages.merge_sizes((5, 3, 7, 9), 1.0) == (9, 9, 9, 9)  # 36 slots <= 2 x 24
    assert stages.merge_sizes((10, 10, 11), 0.07) == (11, 11, 11)  # 33 <= 31 x 1.07
    assert stages.merge_sizes((10, 10, 11), 0.06) == (10, 10, 11)  # 33 > 31 x 1.06


@pytest.mark.parametrize("bad", [-0.1, float("inf"), float("nan"), "0.1", True])
def test_a_bad_layer_slack_is_refused(bad):
    with pytest.raises(ConfigError, match="layer_slack must be a finite number >= 0"):
        tuning.Tuning(layer_slack=bad)


# kvjax-tiny has 6 layers: six distinct sizes each.
CASES = {
    "per_layer": dict(compression_ratios=[0.1, 0.3, 0.45, 0.6, 0.75, 0.9], base="snapkv"),
    "lukv": dict(compression_ratio=0.5, curve=lukv_curve(6, 2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_merged_sizes_keep_the_same_tokens_and_compile_one_prefill_per_size(name):
    model = kvjax.load_model("kvjax-tiny")
    method = methods.get(name, **CASES[name])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 2000, size=n).tolist() for n in (300, 211, 257)]
    new = 11  # a generation length no other test uses: its capacities compile programs of their own
    exact_sizes = method.layer_capacities(512, new, 6)
    assert len(set(exact_sizes)) == 6

    slack = 0.1
    groups = stages.merge_sizes(method.layer_capacities(stages.GROUPING_PROMPT, 0, 6), slack)
    want = tuple(max(e for e, h in zip(exact_sizes, groups, strict=True) if h == g) for g in groups)
    assert 1 < len(set(want)) < 6 and sum(want) <= sum(exact_sizes) * (1 + slack)
    before = TRACE_COUNTS["prefill"]
    with tuning.override(layer_slack=slack):
        merged = kvjax.generate(model, prompts, method=method, max_new_tokens=new, return_cache=True)
    merged_traces = TRACE_COUNTS["prefill"] - before
    before = TRACE_COUNTS["prefill"]
    with tuning.override(layer_slack=0):
        exact = kvjax.generate(model, prompts, method=method, max_new_tokens=new, return_cache=True)
    exact_traces = TRACE_COUNTS["prefill"] - before

    caps = tuple(layer.capacity for layer in merged.cache.layers)
    assert caps == want
    assert tuple(layer.capacity for layer in exact.cache.layers) == exact_sizes
    assert merged_traces == len(set(want)) and exact_traces == 6  # (another tuning is another program: all six)
    np.testing.assert_array_equal(merged.tokens, exact.tokens)
    assert kvc.positions_kept(merged.cache) == kvc.positions_kept(exact.cache)


def test_the_engine_allocates_its_slots_at_the_merged_sizes():
    config = kvjax.load_model("kvjax-tiny").config
    method = methods.get("per_layer", **CASES["per_layer"])
    with tuning.override(layer_slack=0.5):
        layout = slots.layout(config, method, None, "float32", slots=2, max_prompt_tokens=300,
                              max_question_tokens=0, max_new_tokens=7, chunk_size=None)
        want = stages.cache_layer_capacities(method, layout.bucket, 7, 6)
    assert layout.layer_capacities == want and len(set(want)) < 6



SKIPPING = {  # layers left uncompressed keep the whole prompt; the others are allocated at their budget
    "knorm": (dict(budget=64, skip_layers=2), None),
    "lagkv-l2": (dict(variant="l2", sink_size=4, lag_size=32), 64),  # layers 0 and 1 skipped, chunks of 64
    "lagkv": (dict(skip_layers=(1, 4), compression_ratio=0.5, sink_size=4, lag_size=32), None),
}


def _uniform(method: methods.Method) -> methods.Method:
    """`method` with every layer allocated at its capacity, the largest layer's (the allocation before per-layer
    sizes)."""
    cls = type(method)
    uniform = type(f"Uniform{cls.__name__}", (cls,), {"layer_capacities": lambda self, *args: None})
    return uniform(**method.hyperparameters())


def _own_and_uniform(method: methods.Method, lengths: tuple[int, ...], seed: int, new: int, chunk: int | None = None):
    """`generate` on kvjax-tiny with each layer at its own size, and again with every layer at the largest."""
    model = kvjax.load_model("kvjax-tiny")
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(5, 2000, size=n).tolist() for n in lengths]
    return tuple(kvjax.generate(model, prompts, method=m, max_new_tokens=new, return_cache=True, chunk_size=chunk)
                 for m in (method, _uniform(method)))


@pytest.mark.parametrize("case", list(SKIPPING))
def test_skipped_layers_alone_take_the_whole_prompt(case):
    args, chunk = SKIPPING[case]
    method = methods.get(case.split("-")[0], **args)
    own, every = _own_and_uniform(method, (300, 140, 257), seed=2, new=6, chunk=chunk)
    skipped = set(method.resolved_skip_layers if case.startswith("lagkv") else range(method.skip_layers))
    caps = [layer.capacity for layer in own.cache.layers]
    assert all(layer.capacity == method.capacity(512, 6) for layer in every.cache.layers)
    assert [c == method.capacity(512, 6) for c in caps] == [i in skipped for i in range(6)]
    assert sum(caps) < 0.75 * 6 * method.capacity(512, 6)
    np.testing.assert_array_equal(own.tokens, every.tokens)
    assert kvc.positions_kept(own.cache) == kvc.positions_kept(every.cache)


WRAPPED = {  # scorer wrappers keep the wrapped method's layer budgets, so they take its per-layer sizes
    "criticalkv": dict(budget=96, base="pyramidkv", base_args={"window_size": 8}),
    "chunkkv": dict(budget=96, base="pyramidkv", base_args={"window_size": 8}, chunk_size=8),
    "entropy_gated_chunkkv": dict(budget=96, base="pyramidkv", base_args={"window_size": 8}),
    "key_rerotation": dict(budget=64, base="knorm", base_args={"skip_layers": 2}),
    "adakv": dict(budget=96, base="pyramidkv", base_args={"window_size": 8}),  # Ada-Pyramid (Ada-KV's paper)
    "criticaladakv": dict(budget=96, base="pyramidkv", base_args={"window_size": 8}),
    "decoding": dict(budget=96, base="pyramidkv", base_args={"window_size": 8}, target_size=48,
                     compression_interval=2, query_buffer_size=2),  # compressed back to 48 every 2 new tokens
    "compression_ratio_decoding": dict(budget=96, base="pyramidkv", base_args={"window_size": 8},
                                       target_compression_ratio=0.9, compression_interval=2, query_buffer_size=2),
    "merging": dict(budget=96, base="pyramidkv", base_args={"window_size": 8}),
}


@pytest.mark.parametrize("name", list(WRAPPED))
def test_scorer_wrappers_take_the_wrapped_methods_layer_sizes(name):
    method = methods.get(name, **WRAPPED[name])
    own, every = _own_and_uniform(method, (300, 90, 257), seed=3, new=5)
    caps = tuple(layer.capacity for layer in own.cache.layers)
    assert caps == stages.cache_layer_capacities(method, 512, 5, 6) and len(set(caps)) > 1
    sizes, inner = method.layer_capacities(512, 5, 6), method.inner.layer_capacities(512, 5, 6)
    if isinstance(method, ScorerWrapper) or name == "merging":  # the wrapped method's sizes
        assert sizes == inner
    elif name in ("decoding", "compression_ratio_decoding"):  # its bound over each layer's prompt part: + 5 tokens,
        target = method.largest_target(512 + 5)  # or back to its target every 2 (48; a tenth of the tokens seen)
        assert sizes == tuple(min(k + 5, max(k, target) + 3) for k in method.inner.layer_capacities(512, 0, 6))
    else:  # Ada-KV: each layer's head cap, above its base's size
        assert all(s >= i for s, i in zip(sizes, inner, strict=True)) and sizes != inner
    assert max(caps) == method.capacity(512, 5) == every.cache.capacity and sum(caps) < 6 * max(caps)
    np.testing.assert_array_equal(own.tokens, every.tokens)
    assert kvc.positions_kept(own.cache) == kvc.positions_kept(every.cache)
