"""CaM (kvpress's `CAMPress`): cache merging while decoding.

Oracle: a NumPy float64 simulation of kvpress's press written from its definition, step by step through the real
decode layer (`kvjax.runtime.step`): each step's attention (softmax of the new query over the cache, mean over the
group) added to a running sum per head; every `compression_interval` steps, once the cache holds more than
`target_size`, the base's scores (KNorm: query-free) averaged over the heads keep the best `target_size` slots, the
best `k` evicted ones (ties: the later first) are merged into the `merge_budget` kept slots after them with the
probability `clamp(A_i / mean(A_window), 0, 1)` (the draws: kvjax's counter-based hash, an input here), and the
rest go. Kept positions, values and running sums are compared after every step; then batching, the engine's
inactive rows, generate end to end and the refusals.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import generate_and_check

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, per_example_budget
from kvjax.methods.common import token_uniform
from kvjax.runtime import step

B, N, K, H = 3, 4, 2, 16
G = N // K
LENGTHS = np.array([20, 9, 24])
T, NEW = 24, 11
INV_FREQ = 1.0 / (10000.0 ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T + NEW, N, H)).astype(np.float32)
    k = rng.normal(size=(B, T + NEW, K, H)).astype(np.float32)
    v = rng.normal(size=(B, T + NEW, K, H)).astype(np.float32)
    return q, k, v


def _run(method, inputs, active=None):
    """Prefill, then NEW decode steps through the real layer step; the layer after each step."""
    q, k, v = (jnp.asarray(x) for x in inputs)
    capacity = method.capacity(T, NEW)
    spec = CacheSpec(batch=B, kv_heads=K, capacity=capacity, num_heads=N, head_dim=H, num_layers=2,
                     dtype=jnp.float32)
    cache = step.init_cache(method, spec).layer(0)
    positions = np.arange(T)[None].repeat(B, 0)
    positions = jnp.asarray(np.where(positions < LENGTHS[:, None], positions, -1), jnp.int32)
    budget = jnp.asarray(per_example_budget(method, LENGTHS))
    _, cache = step.prefill_layer(method, cache, q[:, :T], k[:, :T], v[:, :T], positions, budget, layer=0,
                                  inv_freq=INV_FREQ, num_layers=2)
    decode = jax.jit(lambda c, qi, ki, vi, pos, live: step.decode_layer(
        method, c, qi, ki, vi, pos, budget, layer=0, inv_freq=INV_FREQ, num_layers=2, active=live))
    caches = []
    for i in range(NEW):
        pos = jnp.asarray((LENGTHS + i)[:, None], jnp.int32)
        r = slice(T + i, T + i + 1)
        _, cache = decode(cache, q[:, r], k[:, r], v[:, r], pos, active)
        assert cache.capacity == capacity
        caches.append(cache)
    return caches


def _draw(seed: int, head: int, position: int) -> float:
    pos = jnp.full((1, K, 1), position, jnp.int32)
    return float(token_uniform(seed, jnp.int32(0), pos)[0, head, 0])


def reference(inputs, b, interval, target, budget_m, seed):
    """kvpress's CAMPress on example b over KNorm, float64: per step `(positions, values [n, K, H], sums [n, K])`."""
    q, k, v = (x.astype(np.float64) for x in inputs)
    n = int(LENGTHS[b])
    rows = {p: p for p in range(n)}  # position -> input row
    held = list(range(n))
    values = {p: v[b, p].copy() for p in held}
    sums = {p: np.zeros(K) for p in held}
    steps, out = 0, []
    for i in range(NEW):
        p = n + i
        rows[p] = T + i
        held.append(p)
        values[p], sums[p] = v[b, T + i].copy(), np.zeros(K)
        for head in range(N):
            logits = np.array([k[b, rows[x], head // G] @ q[b, T + i, head] for x in held]) / math.sqrt(H)
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            for x, w in zip(held, probs, strict=True):
                sums[x][head // G] += w / G
        steps += 1
        if (steps >= interval and len(held) > target) or target <= 1:  # CAMPress: `or q_len >= target_size`
            score = {x: float(np.mean([-np.linalg.norm(k[b, rows[x], kh]) for kh in range(K)])) for x in held}
            kept = sorted(sorted(held, key=lambda x: (-score[x], x))[:target])
            evicted = [x for x in held if x not in kept]
            merged = sorted(evicted, key=lambda x: (-score[x], -x))[:steps]
            for m in merged:
                start = sum(x < m for x in kept)
                window = kept[start : start + budget_m]
                if not window:
                    continue
                for kh in range(K):
                    mean = sum(sums[x][kh] for x in window) / len(window)
                    ratio = sums[m][kh] / mean if mean > 0 else (1.0 if sums[m][kh] > 0 else 0.0)
                    if _draw(seed, kh, m) < min(max(ratio, 0.0), 1.0):
                        for x in window:
                            values[x][kh] += values[m][kh] / len(window)
            held, steps = kept, 0
            values = {x: values[x] for x in held}
            sums = {x: sums[x] for x in held}
        out.append((list(held), np.stack([values[x] for x in held]), np.stack([sums[x] for x in held])))
    return out


def _layer_of(cache, b):
    n = int(cache.length[b, 0])
    assert (np.asarray(cache.length[b]) == n).all()  # every head holds the same slots
    pos = np.asarray(cache.pos[b, :, :n])
    assert (pos == pos[0]).all()
    return pos[0].tolist(), np.asarray(cache.v[b, :, :n]).transpose(1, 0, 2), np.asarray(cache.score[b, :, :n]).T


@pytest.mark.parametrize("interval,target,budget_m,seed", [(3, 10, 4, 0), (1, 12, 2, 5), (4, 14, 32, 1), (3, 1, 2, 0)])
def test_matches_kvpress_merge_then_evict(interval, target, budget_m, seed):
    method = methods.get("cam", compression_interval=interval, target_size=target, merge_budget=budget_m, seed=seed)
    inputs = _inputs()
    caches = _run(method, inputs)
    merges = 0
    for b in range(B):
        want = reference(inputs, b, interval, target, budget_m, seed)
        for i, (cache, (positions, values, sums)) in enumerate(zip(caches, want, strict=True)):
            got_pos, got_values, got_sums = _layer_of(cache, b)
            assert got_pos == positions, (b, i)
            np.testing.assert_allclose(got_sums, sums, rtol=1e-5, atol=1e-6, err_msg=f"{b} {i}")
            np.testing.assert_allclose(got_values, values, rtol=1e-5, atol=1e-5, err_msg=f"{b} {i}")
        merges += int(np.sum(np.abs(want[-1][1] - inputs[2][b, [r if r < LENGTHS[b] else T + r - LENGTHS[b]
                                                               for r in want[-1][0]]]) > 1e-6))
    assert merges > 0  # some values were merged into (the draws are not all misses)


def test_engine_rows_left_alone_and_batch_equals_loop():
    """A row the engine leaves inactive keeps its layer bit for bit while others compress; each row of a batch is
    the row run alone."""
    method = methods.get("cam", compression_interval=2, target_size=10, merge_budget=3)
    inputs = _inputs(1)
    live = _run(method, inputs, active=jnp.asarray([True, False, True]))
    plain = _run(method, inputs)
    first = _run(method, inputs, active=jnp.asarray([True, True, True]))
    for a, c in zip(first, plain, strict=True):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    frozen = _run(method, inputs, active=jnp.asarray([False, False, False]))[0]
    held = int(frozen.length[1, 0])  # (an inactive row's token is written, uncounted, past its length)
    for cache, alone in zip(live, plain, strict=True):
        for name in ("k", "v", "pos", "length", "score"):
            got, want = np.asarray(getattr(cache, name))[1], np.asarray(getattr(frozen, name))[1]
            if name in ("k", "v"):
                got, want = got[:, :held], want[:, :held]
            np.testing.assert_array_equal(got, want)
            for row in (0, 2):
                np.testing.assert_array_equal(np.asarray(getattr(cache, name))[row],
                                              np.asarray(getattr(alone, name))[row])


def test_capacity_and_generate():
    method = methods.get("cam", compression_interval=4, target_size=12, merge_budget=4)
    assert method.capacity(40, 30) == 40 + 4 and method.capacity(8, 30) == 12 + 4 and method.capacity(8, 5) == 13
    generate_and_check(methods.get("cam", compression_interval=8, target_size=12))  # no compression in 4 steps
    over_snapkv = methods.get("cam", base="snapkv", base_args={"window_size": 2}, budget=16, compression_interval=8,
                              target_size=14)
    generate_and_check(over_snapkv, prompt_kept=lambda layer, b: 16)
    # 11 tokens fed back: compressed to 12 after the 4th and the 8th, then 3 more, which are all held
    from tiny import tiny_model

    import kvjax

    model = tiny_model(dtype=jnp.bfloat16, num_heads=8, num_kv_heads=2, num_layers=2)
    prompts = [np.random.default_rng(n).integers(0, 96, size=n).tolist() for n in (40, 23, 31)]
    result = kvjax.generate(model, prompts, method=method, max_new_tokens=12, return_cache=True)
    for layer in result.cache.layers:
        assert (np.asarray(layer.length) == 15).all()
        for b, n in enumerate((40, 23, 31)):
            held = np.asarray(layer.pos[b])[:, :15]
            assert all(len(set(row.tolist())) == 15 and {n + 8, n + 9, n + 10} <= set(row.tolist()) for row in held)


def test_refusals():
    with pytest.raises(ConfigError, match="merge_budget"):
        methods.get("cam", merge_budget=0)
    with pytest.raises(ConfigError, match="compression_interval"):
        methods.get("cam", compression_interval=0)
    with pytest.raises(ConfigError, match="decodes on its own"):
        methods.get("cam", base="h2o", budget=8)
    with pytest.raises(ConfigError, match="reads attention_lse"):
        methods.get("cam", base="observed_attention")
    with pytest.raises(ConfigError, match="keeps statistics"):
        methods.get("cam", base="expected_attention")
