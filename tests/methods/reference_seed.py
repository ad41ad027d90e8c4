"""Naive NumPy oracles for the seed-paper methods, written from `shared/specs/{lagkv,sagekv,ahakv}.md`.

Loops over heads, partitions and tokens, float64, no vectorisation tricks: slow and obvious on
purpose. A cache is modelled as the sorted list of kept positions per head; the K/V of position `p`
is `k[h, p]` / `v[h, p]` of the full stream.
"""

from __future__ import annotations

import math

import numpy as np

# ---------------------------------------------------------------------------------------------------
# LagKV (spec 3.2-3.5)
# ---------------------------------------------------------------------------------------------------


def lagkv_token_scores(x: np.ndarray, ref: np.ndarray, variant: str = "lag", eps: float = 1e-6) -> np.ndarray:
    """Score of the L tokens of partition `x` `[L, d]` against reference `ref` `[L, d]` (one modality)."""
    x = np.asarray(x, np.float64)
    if variant == "l2":
        return np.array([-math.sqrt(sum(float(c) ** 2 for c in row)) for row in x])
    if variant == "local":
        ref = x
    ref = np.asarray(ref, np.float64)
    length, dim = x.shape
    sds = []
    for t in range(length):
        xbar = []
        for ch in range(dim):
            lo, hi = min(ref[:, ch]), max(ref[:, ch])
            den = hi - lo
            if eps > 0:
                den = max(den, eps)
            xbar.append((x[t, ch] - lo) / den)
        mean = sum(xbar) / dim
        sds.append(math.sqrt(sum((c - mean) ** 2 for c in xbar) / (dim - 1)))
    top = max(sds)
    ex = [math.exp(s - top) for s in sds]
    return np.array([e / sum(ex) for e in ex])


def lagkv_partition_score(k_part, k_ref, v_part, v_ref, *, variant="lag", value_weight=1.0, eps=1e-6):
    """Eq. 11: key score + value_weight * value score."""
    score = lagkv_token_scores(k_part, k_ref, variant, eps)
    if value_weight:
        score = score + value_weight * lagkv_token_scores(v_part, v_ref, variant, eps)
    return score


def _top_m(score: np.ndarray, m: int) -> list[int]:
    """Indices of the m best scores; ties to the lower index."""
    order = sorted(range(len(score)), key=lambda t: (-score[t], t))
    return sorted(order[:m])


def lagkv_call(cache: list[list[int]], parts: int, n_seen: int, k, v, *, sink, lag, keep,
               variant="lag", value_weight=1.0, eps=1e-6) -> tuple[list[list[int]], int]:
    """One compression call (spec 3.3) on a per-head cache of positions: compress every partition
    at or after `parts` whose successor is complete among the first `n_seen` tokens."""
    complete = (n_seen - sink) // lag if n_seen >= sink else 0
    todo = max(0, complete - 1 - parts)
    out = []
    for h, positions in enumerate(cache):
        kept = list(positions)
        for q in range(parts, parts + todo):
            lo = sink + q * lag
            x = list(range(lo, lo + lag))
            ref = list(range(lo + lag, lo + 2 * lag))
            score = lagkv_partition_score(k[h, x], k[h, ref], v[h, x], v[h, ref],
                                          variant=variant, value_weight=value_weight, eps=eps)
            chosen = {x[t] for t in _top_m(score, keep)}
            kept = [p for p in kept if not (lo <= p < lo + lag) or p in chosen]
        out.append(sorted(kept))
    return out, parts + todo


def lagkv_oneshot(k, v, n: int, *, sink, lag, keep, variant="lag", value_weight=1.0, eps=1e-6):
    """Kept positions per head after one-shot compression of the first `n` tokens."""
    cache = [list(range(n)) for _ in range(k.shape[0])]
    out, _ = lagkv_call(cache, 0, n, k, v, sink=sink, lag=lag, keep=keep, variant=variant,
                        value_weight=value_weight, eps=eps)
    return out


def lagkv_stream(k, v, chunks: list[int], *, sink, lag, keep, decode_tokens=0, variant="lag", value_weight=1.0,
                 eps=1e-6):
    """Feeds the stream as prefill `chunks` (sizes; one compression call after each, over every token
    seen) then `decode_tokens` single tokens (each call deferred: it considers every token but the
    newest, which is how the decode hook runs before the new token attends). Returns the final cache
    and the largest length ever held (counting what was appended before its call)."""
    cache, parts, n, peak = [[] for _ in range(k.shape[0])], 0, 0, 0
    for size, defer in [(c, False) for c in chunks] + [(1, True)] * decode_tokens:
        cache = [c + list(range(n, n + size)) for c in cache]
        n += size
        peak = max(peak, len(cache[0]))
        cache, parts = lagkv_call(cache, parts, n - 1 if defer else n, k, v, sink=sink, lag=lag, keep=keep,
                                  variant=variant, value_weight=value_weight, eps=eps)
    return cache, peak


def lagkv_budget(k, v, n: int, budget: int, *, sink, lag, variant="lag", value_weight=1.0, eps=1e-6):
    """kvpress-style global selection (spec 3.6, LagKVPress): sink and window score 1, each partition
    token its within-partition rank / L, the top `budget` kept (protected first, ties: lower position)."""
    complete = (n - sink) // lag if n >= sink else 0
    out = []
    for h in range(k.shape[0]):
        key = {p: math.inf for p in range(n)}
        for q in range(max(0, complete - 1)):
            lo = sink + q * lag
            x = list(range(lo, lo + lag))
            ref = list(range(lo + lag, lo + 2 * lag))
            score = lagkv_partition_score(k[h, x], k[h, ref], v[h, x], v[h, ref],
                                          variant=variant, value_weight=value_weight, eps=eps)
            order = sorted(range(lag), key=lambda t: (-score[t], t))
            for rank, t in enumerate(order):
                key[x[t]] = (lag - 1 - rank) / lag
        protected = sum(1 for p in range(n) if key[p] == math.inf)
        count = min(n, max(budget, protected))
        ranked = sorted(range(n), key=lambda p: (-key[p], p))
        out.append(sorted(ranked[:count]))
    return out


def lagkv_length(n: int, sink: int, lag: int, keep: int) -> int:
    """Eq. 12 (with m = keep): cache length after one-shot compression of n tokens."""
    if n < sink + 2 * lag:
        return n
    return sink + keep * ((n - sink) // lag - 1) + lag + (n - sink) % lag


# ---------------------------------------------------------------------------------------------------
# SAGE-KV (spec 3.2-3.4, 4)
# ---------------------------------------------------------------------------------------------------


def pow2floor(x: int) -> int:
    p = 0 if x < 1 else 1
    while p * 2 <= x:
        p *= 2
    return p


def sagekv_split(budget: int, groups: int) -> tuple[int, int, int]:
    """(S, k, R): S = B // 4, k = pow2floor(B / 2G), R = B - S - G k (Appendix A.2)."""
    s = budget // 4
    k = pow2floor(budget // (2 * groups))
    return s, k, budget - s - groups * k


def sagekv_select(q_last, k, n: int, *, sink, topk, recent, groups):
    """Per query head h: (kept positions it attends, its own top-k selection).

    q_last `[N, d]`, k `[K, n, d]`. Candidates `[S, n - 1 - R)`, scored by q . k (ranking only).
    """
    out = []
    for h in range(q_last.shape[0]):
        g = h // groups
        cand = list(range(sink, max(sink, n - 1 - recent)))
        logits = {j: float(np.dot(np.asarray(q_last[h], np.float64), np.asarray(k[g, j], np.float64)))
                  for j in cand}
        chosen = sorted(sorted(cand, key=lambda j: (-logits[j], j))[:topk])
        shared = set(range(min(sink, n))) | set(range(max(0, n - 1 - recent), n))
        out.append((sorted(shared | set(chosen)), chosen))
    return out


def sagekv_paper_visible(q_last, k, n: int, decoded: int, *, sink, topk, recent, groups) -> list[list[int]]:
    """Per query head, the positions it attends after `decoded` generated tokens, any prompt length `n`
    (paper Steps 1-4): regions S = [0, sink), E = [sink, n-1-recent), R = [n-1-recent, n-1), P_N = n-1;
    head h keeps its top `topk` of E by q_last[h] . k (ties: lower position); the reduced cache
    Concat(S, E_topk, R, P_N) is built for every prompt, and each generated token enters the window of
    R + P_N (R + 1 slots, none of them in S), whose oldest token leaves once it holds more than R + 1."""
    out = []
    for h in range(q_last.shape[0]):
        g = h // groups
        regions_s = [j for j in range(sink) if j < n]
        regions_e = [j for j in range(sink, n - 1 - recent)]
        scored = sorted(regions_e, key=lambda j: (-float(np.dot(np.asarray(q_last[h], np.float64),
                                                                 np.asarray(k[g, j], np.float64))), j))
        window = [j for j in range(max(sink, n - 1 - recent), n)]
        for t in range(decoded):
            window.append(n + t)
            if len(window) > recent + 1:
                window.pop(0)
        out.append(sorted(regions_s + scored[:topk] + window))
    return out


def attention_np(q, keys, values) -> np.ndarray:
    """Softmax(q . k / sqrt(d)) @ V for one query `[d]` over `[m, d]` keys, float64."""
    q = np.asarray(q, np.float64)
    logits = [float(np.dot(q, np.asarray(kk, np.float64))) / math.sqrt(len(q)) for kk in keys]
    top = max(logits)
    w = [math.exp(s - top) for s in logits]
    z = sum(w)
    return sum((wi / z) * np.asarray(vv, np.float64) for wi, vv in zip(w, values, strict=True))


# ---------------------------------------------------------------------------------------------------
# AhaKV (spec 3.2-3.6)
# ---------------------------------------------------------------------------------------------------


def sg_lambda(i: float, k: float, d: int) -> float:
    """Eq. 12 with the clamp: sqrt(2 ln(i / k) / d), 0 when i <= k."""
    return math.sqrt(2.0 * max(math.log(i / k), 0.0) / d) if i > 0 else 0.0


def ahakv_scores(q, k, v, n: int, *, budget, recent, kernel=5, groups=1, scale_on="raw_qk", sg=True,
                 value_prior=True, group_reduce="mean"):
    """F_hat `[K, n]`: recent accumulation over the last `recent` rows (SG-softmax per row, causal),
    reduced over each group, times the max-normalised avg-pooled squared value norm.

    q `[N, n, d]` (post-RoPE queries of every prompt row), k, v `[K, n, d]`.
    """
    num_q, _, d = q.shape
    kv = k.shape[0]
    rows = list(range(max(0, n - recent), n))
    out = np.zeros((kv, n))
    for g in range(kv):
        per_head = []
        for h in range(g * groups, (g + 1) * groups):
            f = [0.0] * n
            for p in rows:
                lam = sg_lambda(p + 1, budget, d) if sg else 1.0 / math.sqrt(d)
                if sg and scale_on == "scaled_qk":
                    lam /= math.sqrt(d)
                logits = [lam * float(np.dot(np.asarray(q[h, p], np.float64), np.asarray(k[g, j], np.float64)))
                          for j in range(p + 1)]
                top = max(logits)
                w = [math.exp(s - top) for s in logits]
                z = sum(w)
                for j in range(p + 1):
                    f[j] += w[j] / z
            per_head.append(f)
        if group_reduce == "mean":
            fk = [sum(col) / groups for col in zip(*per_head, strict=True)]
        else:
            fk = [max(col) for col in zip(*per_head, strict=True)]
        if value_prior:
            nu = [float(np.sum(np.asarray(v[g, j], np.float64) ** 2)) for j in range(n)]
            half = kernel // 2
            gam = [sum(nu[j + o] for o in range(-half, half + 1) if 0 <= j + o < n) / kernel for j in range(n)]
            top = max(gam)
            gbar = [x / top if top > 0 else 1.0 for x in gam]
        else:
            gbar = [1.0] * n
        out[g] = [a * b for a, b in zip(gbar, fk, strict=True)]
    return out


def ahakv_select(scores: np.ndarray, n: int, *, budget, recent) -> list[list[int]]:
    """Per head: the recent `[n - recent, n)` plus the top `budget - recent` earlier tokens."""
    if n <= budget:
        return [list(range(n)) for _ in range(scores.shape[0])]
    out = []
    for row in scores:
        cand = list(range(0, n - recent))
        chosen = sorted(cand, key=lambda j: (-row[j], j))[: budget - recent]
        out.append(sorted(chosen + list(range(n - recent, n))))
    return out


# ---------------------------------------------------------------------------------------------------
# Test harness (JAX side): a random right-padded batch written into a cache, and a hook's Step
# ---------------------------------------------------------------------------------------------------


def make_cache(method, k, v, lengths, *, capacity=None, extra=None, dtype=None):
    """A cache as the runtime hands it to `method.prefill`: `capacity` slots (default: the method's
    capacity for this prompt and one new token) extended by the prompt, the prompt appended.

    k, v: `[B, K, T, d]` NumPy; lengths: per example. Returns (cache, positions `[B, T]`).
    """
    import jax.numpy as jnp

    from kvjax import cache as kvc

    b, kv, t, d = k.shape
    cap = method.capacity(t, 1) if capacity is None else capacity
    pos = np.where(np.arange(t)[None] < np.asarray(lengths)[:, None], np.arange(t)[None], -1).astype(np.int32)
    cache = kvc.init(b, kv, cap, d, dtype or jnp.float32, score=method.uses_score, attend=method.uses_attend,
                     state=method.init_state(b, kv, cap))
    cache = kvc.append(kvc.extend(cache, t if extra is None else extra),
                       jnp.asarray(k.transpose(0, 2, 1, 3)), jnp.asarray(v.transpose(0, 2, 1, 3)), jnp.asarray(pos))
    return cache, pos


def make_step(method, positions, capacity, lengths=None, *, layer=0, final_chunk=True, num_layers=1):
    """The `Step` a hook gets (budgets resolved per example from `lengths`)."""
    import jax.numpy as jnp

    from kvjax.methods.base import Step, per_example_budget

    positions = np.asarray(positions, np.int32)
    if lengths is None:
        lengths = (positions >= 0).sum(-1)
    budget = per_example_budget(method, np.asarray(lengths))
    return Step(positions=jnp.asarray(positions), budget=jnp.asarray(budget), layer=jnp.int32(layer),
                inv_freq=jnp.ones((2,), jnp.float32), capacity=capacity, num_layers=num_layers,
                final_chunk=final_chunk)


def kept_positions(cache, b, h):
    """Sorted kept positions of example b, KV head h (one layer)."""
    pos = np.asarray(cache.pos)[b, h]
    n = int(np.asarray(cache.length)[b, h])
    return sorted(int(p) for p in pos[:n] if p >= 0)


def e2e_model():
    """The tiny random model with 8 query heads on 2 KV heads (GQA 4:1) every end-to-end test uses,
    so the compiled programs are shared across the seed-method test files."""
    from tiny import tiny_model

    return tiny_model(num_heads=8, num_kv_heads=2)


def e2e_prompts(seed: int, lengths=(45, 36, 60)) -> list[list[int]]:
    """Three prompts of different lengths in one shape bucket (64), right-padded by the runtime."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 96, n).tolist() for n in lengths]
