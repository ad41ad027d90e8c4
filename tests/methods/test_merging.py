"""Merging (kvpress's `MergingPress`): the merged values against a NumPy float64 reference of the merge-on-evict rule,
written from kvpress's description, over the kept set of the base alone; torch's quantile (torch itself, where
installed); the invariants (keys, positions and the values nothing merged into are the base's; a threshold no pair
reaches is the base; a base that re-rotates its keys merges as its own base does)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, generate_and_check, kept, run_prefill

from kvjax import cache as kvc
from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.merging import torch_quantile


def torch_rule_quantile(values: list[float], q: float) -> float:
    """torch's `quantile` (linear): float32 rank `q * (n - 1)` and its two-sided lerp, in float32."""
    ranked = np.sort(np.asarray(values, np.float32))
    rank = np.float32(q) * np.float32(len(ranked) - 1)
    lo, hi = ranked[int(np.floor(rank))], ranked[int(np.ceil(rank))]
    weight = np.float32(rank - np.floor(rank))
    with np.errstate(invalid="ignore"):
        return float(lo + weight * (hi - lo) if weight < 0.5 else hi - (hi - lo) * (np.float32(1) - weight))


def reference_merge(batch: Batch, b: int, k: int, held: list[int], threshold: float, fraction: float) -> dict:
    """Head (b, k)'s merged value per kept position: each evicted pair's nearest kept key by cosine, the threshold
    and fraction gates, weight `max(s, 0) |v_j| / (|v_j| + |v_t| + 1e-6)`, `(v + sum w v_j) / (1 + sum w)`."""
    n = int(batch.lengths[b])
    keys, values = batch.k[b, :n, k].astype(np.float64), batch.v[b, :n, k].astype(np.float64)
    unit = keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), 1e-6)
    evicted = [j for j in range(n) if j not in held]
    sims = {j: max((unit[j] @ unit[i], -i) for i in held) for j in evicted}  # ties: the lowest position
    sims = {j: (float(np.float32(s)), t) for j, (s, t) in sims.items()}  # gated in float32, as kvpress's
    ok = {j: sims[j][0] >= np.float32(threshold) for j in evicted}
    if fraction < 1.0 and evicted:
        cut = torch_rule_quantile([sims[j][0] if ok[j] else -np.inf for j in evicted], 1.0 - fraction)
        ok = {j: ok[j] and sims[j][0] >= cut for j in evicted}
    total = {i: values[i].copy() for i in held}
    weight = dict.fromkeys(held, 0.0)
    for j in (j for j in evicted if ok[j]):
        s, t = sims[j][0], -sims[j][1]
        own, theirs = np.linalg.norm(values[j]), np.linalg.norm(values[t])
        w = max(s, 0.0) * own / (own + theirs + 1e-6)
        total[t] += w * values[j]
        weight[t] += w
    return {i: total[i] / (1.0 + weight[i]) for i in held if weight[i] > 0}


def held_values(cache, b: int, k: int) -> dict:
    values = np.asarray(kvc.values(cache, jnp.float32))[b, k]
    return {int(p): values[s] for s, p in enumerate(np.asarray(cache.pos[b, k])[: int(cache.length[b, k])])}


@pytest.mark.parametrize("args", [{}, {"similarity_threshold": 0.25}, {"merge_fraction": 0.5},
                                  {"similarity_threshold": 0.1, "merge_fraction": 0.75}])
@pytest.mark.parametrize("base", ["knorm", "snapkv"])
def test_merged_values_follow_the_rule(base, args):
    batch = Batch()
    base_args = {"window_size": 4} if base == "snapkv" else {}
    method = methods.get("merging", budget=9, base=base, base_args=base_args, **args)
    out, _, _ = run_prefill(method, batch)
    alone, _, _ = run_prefill(methods.get(base, budget=9, **base_args), batch)
    changed = 0
    for b in range(len(batch.lengths)):
        for k in range(batch.kv):
            held = kept(alone, b, k)
            assert kept(out, b, k) == held
            want, got, plain = reference_merge(batch, b, k, held, **_gates(args)), held_values(out, b, k), \
                held_values(alone, b, k)
            for p in held:
                if p in want:  # stored in bf16: within a unit in the last place
                    np.testing.assert_allclose(got[p], want[p], rtol=2 ** -7, atol=2 ** -7, err_msg=str((b, k, p)))
                    changed += 1
                else:
                    np.testing.assert_array_equal(got[p], plain[p])
            np.testing.assert_array_equal(np.asarray(out.k[b, k]), np.asarray(alone.k[b, k]))
    assert changed > 0


def _gates(args: dict) -> dict:
    return {"threshold": args.get("similarity_threshold", 0.0), "fraction": args.get("merge_fraction", 1.0)}


def test_a_threshold_no_pair_reaches_is_the_base():
    batch = Batch()
    out, _, _ = run_prefill(methods.get("merging", budget=9, similarity_threshold=1.0), batch)
    alone, _, _ = run_prefill(methods.get("knorm", budget=9), batch)
    for leaf in ("k", "v", "pos", "length"):
        np.testing.assert_array_equal(np.asarray(getattr(out, leaf)), np.asarray(getattr(alone, leaf)))


def test_quantile_is_torchs():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    values = rng.uniform(-1, 1, (3, 4, 10)).astype(np.float32)
    values[0, :, :3] = -np.inf  # the pairs under the threshold
    values[1, 1, :7] = -np.inf
    count = np.array([[10, 7, 4, 1], [10, 9, 8, 2], [5, 5, 5, 5]])
    padded = np.where(np.arange(10) < count[..., None], values, np.inf)
    for q in (0.0, 0.1, 0.25, 0.3, 0.5, 0.75, 0.9):
        got = np.asarray(torch_quantile(jnp.asarray(padded), jnp.asarray(count), q))
        for b in range(3):
            for k in range(4):
                row = torch.from_numpy(values[b, k, : count[b, k]].copy())
                want = np.float32(row.quantile(q))
                rule = torch_rule_quantile(values[b, k, : count[b, k]].tolist(), q)
                if np.isnan(want):
                    assert np.isnan(got[b, k]) and np.isnan(rule), (q, b, k, got[b, k])
                    continue
                assert got[b, k] == rule, (q, b, k, got[b, k], rule)
                # torch's lerp is one fused multiply-add: a unit in the last place at most, none at a whole rank
                whole = float(np.float32(q) * np.float32(count[b, k] - 1)).is_integer()
                if np.isinf(want) or whole:
                    assert got[b, k] == want, (q, b, k, got[b, k], want)
                else:
                    assert abs(got[b, k] - want) <= abs(np.spacing(want)), (q, b, k, got[b, k], want)


def test_a_rerotating_base_merges_as_its_own_base():
    batch = Batch()
    rotated, _, _ = run_prefill(methods.get("merging", budget=9, base="key_rerotation", base_args={"base": "knorm"}),
                                batch)
    plain, _, _ = run_prefill(methods.get("merging", budget=9), batch)
    only_rotated, _, _ = run_prefill(methods.get("key_rerotation", budget=9, base="knorm"), batch)
    np.testing.assert_array_equal(np.asarray(rotated.v), np.asarray(plain.v))
    np.testing.assert_array_equal(np.asarray(rotated.k), np.asarray(only_rotated.k))


def test_quantized_cache_merges_the_dequantized_values():
    from kvjax.quant import KVQuant

    batch = Batch()
    method = methods.get("merging", budget=9, merge_fraction=0.75)
    capacity = method.capacity(batch.t, 3)
    plain_in = batch.cache(capacity)
    quant = kvc.quantized(plain_in, KVQuant("int8"))
    step = batch.step(method, capacity)
    out = jax.jit(method.prefill)(quant, batch.qj(), step)
    # the same merge over the dequantized cache, stored again: the codes of the int8 run
    plain = jax.jit(method.prefill)(kvc.dequantized(quant), batch.qj(), step)
    np.testing.assert_array_equal(np.asarray(out.pos), np.asarray(plain.pos))
    np.testing.assert_allclose(np.asarray(kvc.values(out, jnp.float32)), np.asarray(plain.v), atol=0.04, rtol=0.02)


def test_batch_equals_loop():
    batch = Batch(lengths=(30, 17, 24))
    method = methods.get("merging", compression_ratio=0.6, merge_fraction=0.5)
    out, cache, step = run_prefill(method, batch)
    for b in range(len(batch.lengths)):
        one = Batch(lengths=(int(batch.lengths[b]),))
        one.q, one.k, one.v = (x[b : b + 1, : one.t] for x in (batch.q, batch.k, batch.v))
        alone, _, _ = run_prefill(method, one)
        for k in range(batch.kv):
            assert kept(out, b, k) == kept(alone, 0, k)
            got, want = held_values(out, b, k), held_values(alone, 0, k)
            for p in want:
                np.testing.assert_array_equal(got[p], want[p])


def test_sizes_are_the_bases():
    method = methods.get("merging", budget=8, base="pyramidkv", base_args={"window_size": 4})
    assert method.capacity(64, 5) == method.inner.capacity(64, 5)
    assert method.layer_capacities(64, 5, 4) == method.inner.layer_capacities(64, 5, 4) is not None
    assert method.decode_appends_only


@pytest.mark.parametrize("args,field", [
    (dict(), "budget"), (dict(budget=8, similarity_threshold=1.5), "similarity_threshold"),
    (dict(budget=8, merge_fraction=0.0), "merge_fraction"), (dict(budget=8, merge_fraction=1.2), "merge_fraction"),
    (dict(budget=8, base="h2o"), "evicts or observes while decoding"),
])
def test_bad_hyperparameters(args, field):
    with pytest.raises(ConfigError, match=field):
        methods.get("merging", **args)


def test_end_to_end_generate():
    lengths = (40, 23, 31)
    result = generate_and_check(methods.get("merging", budget=7, merge_fraction=0.75), lengths,
                                prompt_kept=lambda layer, b: 7)
    hard = generate_and_check(methods.get("knorm", budget=7), lengths, prompt_kept=lambda layer, b: 7)
    for ours, theirs in zip(result.cache.layers, hard.cache.layers, strict=True):
        np.testing.assert_array_equal(np.asarray(ours.pos), np.asarray(theirs.pos))
        assert not np.array_equal(np.asarray(ours.v), np.asarray(theirs.v))


def test_replace_keeps_the_gates():
    method = methods.get("merging", budget=8, similarity_threshold=0.3, merge_fraction=0.5)
    again = dataclasses.replace(method, budget=9)
    assert (again.similarity_threshold, again.merge_fraction, again.inner.budget) == (0.3, 0.5, 9)
