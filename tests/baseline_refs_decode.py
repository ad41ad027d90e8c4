"""Naive NumPy references (float64, loops) for the decode-time / attention-pattern baselines (h2o,
tova, nacl, quest, lm_infinite), written from the papers, and `DecodeRun`, a driver that runs a
method's hooks over a one-layer cache the way the runtime does (prefill; then per token: append,
`decode`, attend, `observe`)."""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from baseline_refs import Batch, kept, softmax, top_positions

from kvjax import cache as kvc
from kvjax.methods import capabilities as caps
from kvjax.methods import per_example_budget
from kvjax.methods.base import CacheSpec, Step
from kvjax.ops.attention import decode_attention
from kvjax.rope import apply_rope


def rope_inv_freq(head_dim: int, theta: float = 10000.0) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)


def rope_np(x: np.ndarray, pos, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of `x` `[..., H]` at positions `pos` (broadcast over `x[..., 0]`), float64."""
    ang = np.asarray(pos, np.float64)[..., None] * inv_freq
    ang = np.concatenate([ang, ang], axis=-1)
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def rounded(x: np.ndarray, dtype) -> np.ndarray:
    """`x` as stored in `dtype`, back in float64 (the references see exactly the stored values)."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


def protocol_step(method, cache, q, k, v, pos, *, budget, layer, inv_freq, num_layers, rotate, dtype):
    """One decode token through a method's hooks as the runtime does: append, `decode`, attend over
    the valid slots, `observe`. q `[B, N, H]`, k / v `[B, K, H]` (raw when `rotate`), pos `[B]`."""
    pos2 = pos[:, None]

    def embed(x):
        x = jnp.asarray(x, jnp.float32)
        return (apply_rope(x, pos2, inv_freq) if rotate else x).astype(dtype)

    q, k = embed(q[:, None]), embed(k[:, None])
    cache = kvc.append(cache, k, jnp.asarray(v[:, None], dtype), pos2)
    step = Step(positions=pos2, budget=budget, layer=jnp.int32(layer), inv_freq=inv_freq,
                capacity=cache.capacity, num_layers=num_layers)
    cache = method.decode(cache, q, step)
    out, probs = decode_attention(q[:, 0], pos, cache.k, cache.v, cache.pos, kvc.valid_mask(cache),
                                  return_weights=True)
    if caps.observes_attention(method):
        cache = method.observe(cache, probs, step)
    return cache, out


class DecodeRun:
    """Prefill `batch` through `method`, then `steps` decode tokens with random q / k / v.

    With `inv_freq`, `batch.q / k` and the decode q / k are **raw** (pre-RoPE): the driver rotates
    them at their positions as a model does. Records the cache after prefill (`prefilled`) and after
    every step (`caches[t]`, after `observe`), and the attention outputs `outs[t]` `[B, N, H]`.
    """

    def __init__(self, method, batch: Batch, steps: int, *, layer: int = 0, num_layers: int = 4,
                 inv_freq: np.ndarray | None = None, seed: int = 1):
        b, n, kv, h = len(batch.lengths), batch.n, batch.kv, batch.h
        rng = np.random.default_rng(seed)
        self.method, self.batch, self.steps = method, batch, steps
        self.q = rounded(rng.standard_normal((steps, b, n, h)), batch.dtype)
        self.k = rounded(rng.standard_normal((steps, b, kv, h)), batch.dtype)
        self.v = rounded(rng.standard_normal((steps, b, kv, h)), batch.dtype)
        self.positions = batch.lengths[None, :] + np.arange(steps)[:, None]  # [S, B]
        rotate = inv_freq is not None
        freq = jnp.asarray(rope_inv_freq(h) if inv_freq is None else inv_freq, jnp.float32)
        self.capacity = capacity = method.capacity(batch.t, steps + 1)
        spec = CacheSpec(batch=b, kv_heads=kv, capacity=capacity, num_heads=n, head_dim=h, num_layers=1,
                         dtype=batch.dtype)
        cache = kvc.init(b, kv, capacity, h, batch.dtype, score=method.uses_score, attend=method.uses_attend,
                         state=method.init_cache_state(spec))
        self.budget = budget = jnp.asarray(per_example_budget(method, batch.lengths))
        dtype = batch.dtype
        ppos = jnp.asarray(batch.pos)

        def embed(x):  # [B, T, heads, H]
            x = jnp.asarray(x, jnp.float32)
            return (apply_rope(x, jnp.maximum(ppos, 0), freq) if rotate else x).astype(dtype)

        cache = kvc.append(kvc.extend(cache, batch.t), embed(batch.k), jnp.asarray(batch.v, dtype), ppos)
        step = Step(positions=ppos, budget=budget, layer=jnp.int32(layer), inv_freq=freq, capacity=capacity,
                    num_layers=num_layers)
        self.prefill_in = cache
        self.prefilled = jax.jit(method.prefill)(cache, embed(batch.q), step)
        self.options = dict(layer=layer, inv_freq=freq, num_layers=num_layers, rotate=rotate, dtype=dtype)
        one = jax.jit(lambda c, q, k, v, pos: protocol_step(method, c, q, k, v, pos, budget=budget, **self.options))
        self.caches, self.outs = [], []
        c = self.prefilled
        for t in range(steps):
            c, out = one(c, *self.inputs(t))
            self.caches.append(c)
            self.outs.append(np.asarray(out, np.float64))

    def inputs(self, t: int) -> tuple:
        return (jnp.asarray(self.q[t]), jnp.asarray(self.k[t]), jnp.asarray(self.v[t]),
                jnp.asarray(self.positions[t], jnp.int32))

    def kept_after(self, t: int, b: int, k: int) -> list[int]:
        """Sorted positions of head (b, k) after step `t` (-1: after prefill); checks no duplicates."""
        return kept(self.prefilled if t < 0 else self.caches[t], b, k)

    def key(self, b: int, k: int, p: int) -> np.ndarray:
        """The (raw, as drawn) key of head (b, k) at position p."""
        n = int(self.batch.lengths[b])
        return self.batch.k[b, p, k] if p < n else self.k[p - n, b, k]

    def value(self, b: int, k: int, p: int) -> np.ndarray:
        n = int(self.batch.lengths[b])
        return self.batch.v[b, p, k] if p < n else self.v[p - n, b, k]

    def assert_vmap_equals_batch(self, t: int = 0) -> None:
        """Decode step t: the batched step equals `jax.vmap` of the one-example step (padding-safe,
        per-example budgets)."""
        method, opts = self.method, self.options

        def single(c, q, k, v, pos, budget):
            add = jax.tree.map(lambda x: x[None], (c, q, k, v, pos, budget))
            c1, out = protocol_step(method, *add[:5], budget=add[5], **opts)
            return jax.tree.map(lambda x: x[0], (c1, out))

        start = self.prefilled if t == 0 else self.caches[t - 1]
        got_c, got_out = jax.jit(jax.vmap(single))(start, *self.inputs(t), self.budget)
        np.testing.assert_allclose(np.asarray(got_out, np.float64), self.outs[t], atol=1e-6)
        for a, b in zip(jax.tree.leaves(got_c), jax.tree.leaves(self.caches[t]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@functools.lru_cache(maxsize=2)
def full_run(lengths: tuple = (40, 23, 31), steps: int = 5) -> DecodeRun:
    """The uncompressed `full` method over `Batch(lengths)` and the same decode inputs as any other
    `DecodeRun` of that batch (shared across test files: one compile)."""
    from kvjax import methods

    return DecodeRun(methods.get("full"), Batch(lengths=lengths), steps)


def assert_full_attention(run: DecodeRun) -> None:
    """Every step attended all tokens (nothing evicted) and its output equals the `full` method's."""
    full = full_run(tuple(int(n) for n in run.batch.lengths), run.steps)
    for t in range(run.steps):
        np.testing.assert_allclose(run.outs[t], full.outs[t], atol=1e-6)
        for b, n in enumerate(run.batch.lengths):
            assert all(run.kept_after(t, b, k) == list(range(n + t + 1)) for k in range(run.batch.kv))


def generate_rolling(method, lengths, *, max_new: int, held: Callable[[int], int], num_layers: int = 2,
                     seed: int = 0):
    """End to end through `kvjax.generate` on a tiny bf16 GQA model (8 query / 2 KV heads): the decode
    step traces once, no head holds a position twice, and every layer / head holds exactly
    `held(b)` tokens at the end. Returns (result, model, prompts)."""
    from tiny import tiny_model

    import kvjax
    from kvjax.runtime.generate import TRACE_COUNTS

    model = tiny_model(dtype=jnp.bfloat16, num_heads=8, num_kv_heads=2, num_layers=num_layers)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in lengths]
    # Methods whose decode only appends share `full`'s decode program: start from an empty jit cache so
    # this call traces it (exactly once) whatever an earlier test compiled.
    importlib.import_module("kvjax.runtime.generate")._decode_loop.clear_cache()
    before = TRACE_COUNTS["decode_step"]
    result = kvjax.generate(model, prompts, method=method, max_new_tokens=max_new, return_cache=True,
                            stop_at_eos=False)
    assert TRACE_COUNTS["decode_step"] - before == 1, "the decode step must trace exactly once"
    assert result.tokens.shape == (len(lengths), max_new)
    stacked = result.cache.stacked()  # [L, ...]
    pos = np.asarray(stacked.pos)
    for layer in range(num_layers):
        for b in range(len(lengths)):
            for k in range(pos.shape[2]):
                row = pos[layer, b, k]
                got = row[row >= 0].tolist()
                assert len(set(got)) == len(got), (layer, b, k)
                assert len(got) == held(b), (layer, b, k, len(got), held(b))
                assert int(np.asarray(stacked.length)[layer, b, k]) == held(b)
    return result, model, prompts


def attend_np(qs: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Softmax attention of query rows `[G, H]` over `keys` / `values` `[L, H]`, float64."""
    sc = 1.0 / math.sqrt(qs.shape[-1])
    return np.stack([softmax(keys @ q * sc) @ values for q in qs])


# ---- H2O -------------------------------------------------------------------------------------------


def accumulated_reference(batch: Batch, b: int, kvh: int) -> np.ndarray:
    """H2O's accumulated attention after prefill, by position: the sum over every prompt row of its
    causal softmax probability, averaged over the GQA group."""
    n, g, h = int(batch.lengths[b]), batch.n // batch.kv, batch.h
    out = np.zeros(n)
    for i in range(n):
        for hq in range(kvh * g, (kvh + 1) * g):
            out[: i + 1] += softmax(batch.k[b, : i + 1, kvh] @ batch.q[b, i, hq] / math.sqrt(h)) / g
    return out


def h2o_reference(run: DecodeRun, b: int, kvh: int, limit: int, window: int) -> list[list[int]]:
    """Kept positions of head (b, kvh) after prefill and after every step (H2O Algorithm 1).

    Accumulated score = sum over every query row that saw the token of its softmax probability,
    averaged over the GQA group; keep the `window` most recent + the top others; at decode the new
    token attends, its row is added, and the lowest non-recent token goes (ties: latest position).
    """
    batch = run.batch
    n, g, h = int(batch.lengths[b]), batch.n // batch.kv, batch.h
    heads = range(kvh * g, (kvh + 1) * g)
    sc = 1.0 / math.sqrt(h)
    score = dict(enumerate(accumulated_reference(batch, b, kvh).tolist()))
    held = list(range(n))
    if n > limit:
        recent = [p for p in held if p > n - 1 - window]
        held = sorted(recent + top_positions({p: score[p] for p in held if p not in recent}, limit - len(recent)))
    history = [held]
    for t in range(run.steps):
        r = n + t
        held = held + [r]
        score[r] = 0.0
        keys = np.stack([run.key(b, kvh, p) for p in held])
        for hq in heads:
            for p, w in zip(held, softmax(keys @ run.q[t, b, hq] * sc), strict=True):
                score[p] += w / g
        if len(held) > limit:
            victim = min((p for p in held if p <= r - window), key=lambda p: (score[p], -p))
            held = [p for p in held if p != victim]
        history.append(sorted(held))
    return history


# ---- TOVA ------------------------------------------------------------------------------------------


def tova_reference(run: DecodeRun, b: int, limit: int, head_reduce: str = "all",
                   protect_last: bool = False) -> list[list[list[int]]]:
    """Kept positions per KV head of example b after prefill and after every step (TOVA): the current
    query's softmax row averaged over the heads ("all": every query head of the layer; "group": the
    KV head's group) ranks the tokens; the lowest goes while the cache is over `limit`."""
    batch = run.batch
    n, kv, g, h = int(batch.lengths[b]), batch.kv, batch.n // batch.kv, batch.h
    sc = 1.0 / math.sqrt(h)

    def scores(held: list[list[int]], qrow: np.ndarray, key_of) -> list[dict[int, float]]:
        per = []
        for k in range(kv):
            keys = np.stack([key_of(k, p) for p in held[k]])
            rows = [softmax(keys @ qrow[hq] * sc) for hq in range(k * g, (k + 1) * g)]
            per.append(dict(zip(held[k], np.mean(rows, axis=0), strict=True)))
        if head_reduce == "group":
            return per
        assert all(sorted(held[k]) == sorted(held[0]) for k in range(kv))
        avg = {p: float(np.mean([per[k][p] for k in range(kv)])) for p in held[0]}
        return [avg] * kv

    held = [list(range(n)) for _ in range(kv)]
    s = scores(held, batch.q[b, n - 1], lambda k, p: batch.k[b, p, k])
    keep = min(limit, n)
    for k in range(kv):
        cands = {p: v for p, v in s[k].items() if not (protect_last and p == n - 1)}
        held[k] = sorted(top_positions(cands, keep - int(protect_last)) + ([n - 1] if protect_last else []))
    history = [[sorted(x) for x in held]]
    for t in range(run.steps):
        r = n + t
        held = [x + [r] for x in held]
        s = scores(held, run.q[t, b], lambda k, p: run.key(b, k, p))
        for k in range(kv):
            if len(held[k]) > limit:
                victim = min((p for p in held[k] if not (protect_last and p == r)), key=lambda p: (s[k][p], -p))
                held[k] = [p for p in held[k] if p != victim]
        history.append([sorted(x) for x in held])
    return history


# ---- NACL ------------------------------------------------------------------------------------------


def nacl_reference(votes: np.ndarray, uniforms: np.ndarray, n: int, budget: int, *, window: int, sink: int,
                   random_ratio: float, temperature: float) -> list[int]:
    """NACL's one-shot selection on one head: protected sinks + the last `window` (proxy) tokens, the
    top proxy scores, then `floor(random_ratio * free)` tokens sampled without replacement with
    probability softmax(score / T) (Gumbel-top-k with the given uniforms)."""
    if budget >= n:
        return list(range(n))
    w = min(window, budget)
    protected = [p for p in range(n) if p < sink or p > n - 1 - w]
    free = max(budget - len(protected), 0)
    n_random = int(np.floor(np.float32(random_ratio) * np.float32(free)))
    rest = {p: float(votes[p]) for p in range(n) if p not in protected}
    top = top_positions(rest, free - n_random)
    gumbel = {p: rest[p] / temperature - math.log(-math.log(float(uniforms[p]))) for p in rest if p not in top}
    return sorted(protected + top + top_positions(gumbel, budget - len(protected) - len(top)))


# ---- Quest -----------------------------------------------------------------------------------------


def quest_reference(keys: np.ndarray, values: np.ndarray, qs: np.ndarray, limit: int, *, page: int,
                    dense: bool, always_last_page: bool = True, group_reduce: str = "mean"):
    """One Quest decode step on one KV head whose slots hold positions 0..L-1 in order: the attended
    positions and the attention output `[G, H]` over them.

    Page bound per query head: `sum_c max(q_c min_c, q_c max_c)` over the page's element-wise key
    min / max; group mean; the current page + the top `limit // page - 1` others."""
    length = keys.shape[0]
    if dense or length <= limit:
        chosen_pos = list(range(length))
    else:
        pages = -(-length // page)
        bound = {}
        for p in range(pages):
            lo, hi = keys[p * page : (p + 1) * page].min(0), keys[p * page : (p + 1) * page].max(0)
            per_head = [np.maximum(q * lo, q * hi).sum() for q in qs]
            bound[p] = float(np.mean(per_head) if group_reduce == "mean" else np.max(per_head))
        current, n_sel = (length - 1) // page, max(limit // page, 1)
        if always_last_page:
            chosen = [current] + top_positions({p: v for p, v in bound.items() if p != current}, n_sel - 1)
        else:
            chosen = top_positions(bound, n_sel)
        chosen_pos = [j for j in range(length) if j // page in chosen]
    return chosen_pos, attend_np(qs, keys[chosen_pos], values[chosen_pos])


# ---- LM-Infinite -----------------------------------------------------------------------------------


def lm_infinite_reference(run: DecodeRun, t: int, b: int, kvh: int, *, n_global: int, n_local: int,
                          max_distance: int, inv_freq: np.ndarray):
    """Lambda-shaped attention of step t's query (position r) on head (b, kvh), from raw keys: the
    `n_global` first and the `n_local` latest tokens, each key seen at distance min(r - p, ceiling).
    Returns (attended positions, output `[G, H]`)."""
    g = run.batch.n // run.batch.kv
    r = int(run.positions[t, b])
    held = [p for p in range(r + 1) if p < n_global or p > r - n_local]
    keys = np.stack([rope_np(run.key(b, kvh, p), r - min(r - p, max_distance), inv_freq) for p in held])
    values = np.stack([run.value(b, kvh, p) for p in held])
    qs = rope_np(run.q[t, b, kvh * g : (kvh + 1) * g], r, inv_freq)
    return held, attend_np(qs, keys, values)
