"""DMS threshold eviction (arXiv 2506.05345, kvpress's dense-prefill `DMSPress`) over any scorer.

Oracle: NumPy float64 references (tests/methods/reference_kvzap.py): the kept pairs of each head are the last
`window` positions and every older pair whose entry score reaches the threshold, at prefill and after every decode
step; per-head lengths are stored (different heads hold different counts, packed at the front).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from kvzap_weights import FIXTURE, kvzap_tensors
from reference_kvzap import dms_decode, dms_prefill, kvzap_scores

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, per_example_budget
from kvjax.runtime import step

B, N, K, H, D = 3, 4, 2, 16, 64
LENGTHS = np.array([30, 12, 40])
T, NEW = 40, 6
INV_FREQ = 1.0 / (10000.0 ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))


def _heads(cache):
    pos, length = np.asarray(cache.pos), np.asarray(cache.length)
    return [[sorted(pos[b, h][: length[b, h]].tolist()) for h in range(K)] for b in range(B)]


def _scenario(method, seed=0):
    """Prefill a ragged batch through layer 1 then `NEW` decode steps; (caches after each, inputs)."""
    rng = np.random.default_rng(seed)
    spec = CacheSpec(batch=B, kv_heads=K, capacity=method.capacity(T, NEW), num_heads=N, head_dim=H, num_layers=2,
                     dtype=jnp.float32)
    cache = step.init_cache(method, spec).layer(1)
    q = jnp.asarray(rng.normal(size=(B, T + NEW, N, H)), jnp.float32)
    k = rng.normal(size=(B, T + NEW, K, H)).astype(np.float32) * rng.uniform(0.5, 2.0, size=(B, T + NEW, K, 1))
    v = jnp.asarray(rng.normal(size=(B, T + NEW, K, H)), jnp.float32)
    hidden = rng.normal(size=(B, T + NEW, D)).astype(np.float32)
    positions = np.arange(T)[None].repeat(B, 0)
    positions = jnp.asarray(np.where(positions < LENGTHS[:, None], positions, -1), jnp.int32)
    budget = jnp.asarray(per_example_budget(method, LENGTHS))
    kj = jnp.asarray(k)
    _, cache = step.prefill_layer(method, cache, q[:, :T], kj[:, :T], v[:, :T], positions, budget, layer=1,
                                  inv_freq=INV_FREQ, num_layers=2, hidden=jnp.asarray(hidden[:, :T]))
    caches = [cache]
    for i in range(NEW):
        # decode token i of each example sits at position LENGTHS[b] + i; its inputs are row T + i
        pos = jnp.asarray((LENGTHS + i)[:, None], jnp.int32)
        r = slice(T + i, T + i + 1)
        _, cache = step.decode_layer(method, cache, q[:, r], kj[:, r], v[:, r], pos, budget, layer=1,
                                     inv_freq=INV_FREQ, num_layers=2, hidden=jnp.asarray(hidden[:, r]))
        caches.append(cache)
    return caches, k, hidden


def _entry_scores(b, k, hidden, base):
    """`[positions, K]` float64 entry scores of example b (prompt rows, then the decode rows)."""
    n = int(LENGTHS[b])
    rows = np.concatenate([np.arange(n), T + np.arange(NEW)])
    if base == "kvzap":
        return kvzap_scores(kvzap_tensors(2, 64, 2, 8, seed=0), 1, hidden[b, rows])
    return -np.linalg.norm(k[b, rows].astype(np.float64), axis=-1)  # knorm: [positions, K]


@pytest.mark.parametrize("base,threshold,budget", [("kvzap", 0.0, None), ("kvzap", 0.3, 16), ("knorm", -3.9, None)])
def test_prefill_and_decode_match_the_reference(base, threshold, budget):
    window = 6
    args = {"weights": str(FIXTURE)} if base == "kvzap" else {}
    method = methods.get("dms", base=base, base_args=args, threshold=threshold, sliding_window_size=window,
                         decoding=True, budget=budget)
    caches, k, hidden = _scenario(method)
    lengths_seen = set()
    for b in range(B):
        n = int(LENGTHS[b])
        scores = _entry_scores(b, k, hidden, base)
        for h in range(K):
            want = dms_prefill(scores[:, h], n, threshold, window, cap=None if budget is None else min(budget, n))
            assert _heads(caches[0])[b][h] == want, (b, h)
            lengths_seen.add(len(want))
            for i in range(NEW):
                want = dms_decode(want, scores[:, h], n + i, threshold, window)
                assert _heads(caches[i + 1])[b][h] == want, (b, h, i)
    assert len(lengths_seen) > 2  # heads really hold different lengths
    for cache in caches:  # stored, not masked: valid slots packed at the front
        slots = np.arange(cache.capacity)
        assert ((np.asarray(cache.pos) >= 0) == (slots < np.asarray(cache.length)[..., None])).all()


def test_prefill_only_by_default():
    method = methods.get("dms", base_args={"weights": str(FIXTURE)}, threshold=0.0, sliding_window_size=6)
    assert method.decode_appends_only
    caches, k, hidden = _scenario(method)
    for i in range(1, NEW + 1):  # decode only appends
        for b in range(B):
            for h in range(K):
                assert _heads(caches[i])[b][h] == sorted(_heads(caches[0])[b][h] + list(LENGTHS[b] + np.arange(i)))


def test_threshold_below_every_score_keeps_everything():
    method = methods.get("dms", base="knorm", threshold=-1e9, sliding_window_size=4, decoding=True)
    caches, _, _ = _scenario(method)
    assert [[len(h) for h in row] for row in _heads(caches[-1])] == [[int(n) + NEW] * K for n in LENGTHS]


def test_bad_hyperparameters():
    with pytest.raises(ConfigError, match=r"threshold \(pairs scoring below it are evicted\) must be a finite number"):
        methods.get("dms", base="knorm")
    with pytest.raises(ConfigError, match="sliding_window_size"):
        methods.get("dms", base="knorm", threshold=0.0, sliding_window_size=-1)
    with pytest.raises(ConfigError, match="pass budget to dms itself"):
        methods.get("dms", base="knorm", threshold=0.0, base_args={"budget": 4})


@pytest.mark.parametrize("name,args", [
    ("dms", {"threshold": 0.0, "sliding_window_size": 4, "decoding": True, "base_args": {"weights": str(FIXTURE)}}),
    ("kvzap", {"budget": 8, "weights": str(FIXTURE)}),
    ("decoding", {"base": "kvzap", "base_args": {"weights": str(FIXTURE)}, "compression_interval": 2,
                  "target_size": 6}),
])
def test_generate_compiles_once_per_bucket(name, args):
    """A ragged batch through `kvjax.generate` (hidden states from the model's own layers), then other prompt lengths
    of the same bucket: no new program."""
    from tiny import random_prompts, tiny_model

    import kvjax
    from kvjax.runtime import TRACE_COUNTS

    model = tiny_model(num_layers=2)
    out = kvjax.generate(model, random_prompts(3, (20, 9, 27)), method=name, method_args=args, max_new_tokens=5,
                         return_cache=True)
    assert out.tokens.shape[0] == 3
    before = TRACE_COUNTS["decode_step"], TRACE_COUNTS["prefill"]
    kvjax.generate(model, random_prompts(4, (25, 18, 30)), method=name, method_args=args, max_new_tokens=5)
    assert (TRACE_COUNTS["decode_step"], TRACE_COUNTS["prefill"]) == before


def test_chunked_prefill_keeps_what_one_shot_keeps():
    """Entry scores do not depend on the chunking and a pair out of the window stays out, so prefilling in chunks of
    16 keeps, per head, exactly the one-shot set (the reference's)."""
    method = methods.get("dms", base_args={"weights": str(FIXTURE)}, threshold=0.2, sliding_window_size=6)
    rng = np.random.default_rng(4)
    spec = CacheSpec(batch=B, kv_heads=K, capacity=method.capacity(48, 0), num_heads=N, head_dim=H, num_layers=2,
                     dtype=jnp.float32)
    cache = step.init_cache(method, spec).layer(1)
    q = jnp.asarray(rng.normal(size=(B, 48, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, 48, K, H)), jnp.float32)
    hidden = rng.normal(size=(B, 48, D)).astype(np.float32)
    budget = jnp.asarray(per_example_budget(method, LENGTHS))
    for start in range(0, 48, 16):
        part = slice(start, start + 16)
        positions = np.arange(start, start + 16)[None].repeat(B, 0)
        positions = jnp.asarray(np.where(positions < LENGTHS[:, None], positions, -1), jnp.int32)
        _, cache = step.prefill_layer(method, cache, q[:, part], k[:, part], k[:, part], positions, budget, layer=1,
                                      inv_freq=INV_FREQ, num_layers=2, final_chunk=start + 16 >= 48,
                                      hidden=jnp.asarray(hidden[:, part]))
    tensors = kvzap_tensors(2, 64, 2, 8, seed=0)
    for b in range(B):
        n = int(LENGTHS[b])
        scores = kvzap_scores(tensors, 1, hidden[b, :n])
        for h in range(K):
            assert _heads(cache)[b][h] == dms_prefill(scores[:, h], n, 0.2, 6), (b, h)
