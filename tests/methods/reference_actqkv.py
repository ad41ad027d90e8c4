"""Naive NumPy oracles for InfLLM / Q-LLM / ActQKV, written from `shared/specs/actqkv.md` (2.1-2.4).

float64, loops over tokens, heads and blocks, no vectorisation tricks. `simulate` runs the whole
retrieval scheme (windows, sinks, block formation from local scores, probes, question term, top-k,
attention) on a one-layer decoder and returns its logits, an end-to-end oracle for the JAX methods.
"""

from __future__ import annotations

import math

import numpy as np

from kvjax.models.loader import flatten

# ---------------------------------------------------------------------------------------------------
# Stage 1: activation-aware probe (Eq. 7-9)
# ---------------------------------------------------------------------------------------------------


def running_stats(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 8: elementwise mean and unbiased variance of every query vector so far `[n, d]`."""
    x = np.asarray(vectors, np.float64)
    mean = x.mean(axis=0)
    var = x.var(axis=0, ddof=1) if x.shape[0] > 1 else np.zeros(x.shape[1])
    return mean, var


def activation_probe(window: np.ndarray, mean: np.ndarray, var: np.ndarray, rel_eps: float = 0.01):
    """Eq. 7 and 9 for one window `[T, d]` (valid rows only) -> (probe `[d]`, weights `[T]`)."""
    x = np.asarray(window, np.float64)
    den = np.maximum(var + rel_eps * var.mean(), 1e-12)
    norms = []
    for row in x:
        phi = [(row[i] - mean[i]) ** 2 / den[i] for i in range(len(row))]  # Eq. 7
        norms.append(sum(abs(p) for p in phi))  # ||phi_j||_1
    total = sum(norms)
    if total > 0 and math.isfinite(total):
        w = np.array([v / total for v in norms])  # Eq. 9 weights
    else:
        w = np.full(len(norms), 1.0 / len(norms))
    probe = np.zeros(x.shape[1])
    for wj, row in zip(w, x, strict=True):
        probe += wj * row
    return probe, w


# ---------------------------------------------------------------------------------------------------
# Blocks: representatives, scores, selection
# ---------------------------------------------------------------------------------------------------


def representative(k_raw: np.ndarray, ls: np.ndarray, r: int) -> np.ndarray:
    """One block: `k_raw` `[K, bs, D]` un-rotated keys, `ls` `[N, bs]` local scores -> `[N * D]`."""
    kv, _, d = k_raw.shape
    n = ls.shape[0]
    g = n // kv
    out = []
    for h in range(n):
        order = sorted(range(ls.shape[1]), key=lambda j, h=h: (-ls[h, j], j))[:r]
        out.append(np.mean([k_raw[h // g, j] for j in order], axis=0))
    return np.concatenate(out).reshape(n * d)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (max(np.linalg.norm(a), 1e-6) * max(np.linalg.norm(b), 1e-6)))


def block_scores(probe, reps, kind="cosine", qv=None, question_weight=0.0) -> np.ndarray:
    """Spec 2.3: `sim(probe, rep_b) (+ w_q cos(qv, rep_b))` per block."""
    out = []
    for rep in reps:
        s = cosine(probe, rep) if kind == "cosine" else float(np.dot(probe, rep))
        if qv is not None and question_weight:
            s += question_weight * cosine(qv, rep)
        out.append(s)
    return np.array(out)


def top_blocks(scores: np.ndarray, k: int) -> list[int]:
    """Indices of the `k` best scores, ties broken by the lower index."""
    return sorted(sorted(range(len(scores)), key=lambda b: (-scores[b], b))[:k])


# ---------------------------------------------------------------------------------------------------
# Stage 2: dynamic cut-off (Eq. 11-12)
# ---------------------------------------------------------------------------------------------------


def normalized_entropy(scores: np.ndarray) -> float:
    """Eq. 11 of softmax(scores), divided by log n (0 for n < 2)."""
    s = np.asarray(scores, np.float64)
    if len(s) < 2:
        return 0.0
    p = np.exp(s - s.max())
    p /= p.sum()
    return float(-sum(pi * math.log(pi) for pi in p if pi > 0) / math.log(len(s)))


def dcm_budgets(thetas, later_means, total, n, k_min, k_max, cold=None) -> list[int]:
    """Eq. 12 layer by layer: `B_l = round(Theta_l / (Theta_l + sum_{j>l} mean_j) * B_kv)`, clamped.

    `later_means[j]`: the history mean of layer j (None: no history -> uniform split).
    """
    num_layers = len(thetas)
    remaining = total
    out = []
    for layer in range(num_layers):
        later = [later_means[j] for j in range(layer + 1, num_layers)]
        if any(m is None for m in later) or (cold is not None and cold[layer]):
            share = 1.0 / (num_layers - layer)
        else:
            denom = thetas[layer] + sum(later)
            share = thetas[layer] / denom if denom > 0 else 1.0 / (num_layers - layer)
        b = int(np.round(share * remaining))
        hi = n if k_max is None else min(n, k_max)
        b = min(max(b, min(n, k_min, remaining)), hi)  # the floor never spends budget that is not left
        out.append(b)
        remaining -= b
    return out


# ---------------------------------------------------------------------------------------------------
# End-to-end: one-layer decoder with block retrieval
# ---------------------------------------------------------------------------------------------------


def question_vector(ls: np.ndarray, global_queries: list[np.ndarray], r: int) -> np.ndarray:
    """Q-LLM: per head `n`, the mean global query (`[Hq * D]` rows, head slice) of the `r` question tokens
    with the largest local score `ls[n, j]` (ties: lower position) -> `[Hq * D]`."""
    n_heads = ls.shape[0]
    q = len(global_queries)
    parts = []
    for n in range(n_heads):
        top = sorted(range(q), key=lambda j, n=n: (-ls[n, j], j))[:r]
        parts.append(np.mean([global_queries[j].reshape(n_heads, -1)[n] for j in top], axis=0))
    return np.concatenate(parts)


def rope(x: np.ndarray, pos: int, inv_freq: np.ndarray) -> np.ndarray:
    """HF rotate-half RoPE of `x` `[..., H]` at position `pos`."""
    ang = pos * np.asarray(inv_freq, np.float64)
    ang = np.concatenate([ang, ang])
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x) + eps)


def simulate(weights: dict, config, inv_freq, prompt, rest, *, n_init, n_local, block_size, topk, repr_topk,
             window, similarity="dot", global_position=None, question=None, question_weight=0.0,
             question_decode=False, probe="mean", stats_eps=0.01, position_scheme="exact") -> dict:
    """Logits after the last prompt token and after each token of `rest` (teacher forced), one layer.

    `prompt` already opens and ends with the question (as the runtime feeds it to Q-LLM); `question`
    (token list) builds Q-LLM's question vector: once the processed length exceeds `n_local`, per head,
    the mean global query of the `repr_topk` tokens of the opening span `[0, q)` with the largest local
    score (the attention received from the tokens after them). `position_scheme="infllm"`
    (InfLLM Sec. 3.1): a key `n_local` or more behind the query scores as its un-rotated key against the
    query rotated to `global_position`; nearer keys keep the true distance. Returns `logits` (list),
    the final local scores `ls` `[N, positions]`, representatives `reps` and the last selection.
    """
    w = {k: np.asarray(v, np.float64) for k, v in flatten(weights).items()}  # one layer: `layers.0.<name>`
    eps = config.rms_norm_eps
    n_heads, kv_heads, hd = config.num_heads, config.num_kv_heads, config.head_dim
    g = n_heads // kv_heads
    pg = n_local - 1 if global_position is None else global_position
    head = w["embed"].T if config.tie_word_embeddings else w["lm_head"]

    fused = w["layers.0.qkv"]  # [D, K, G + 2, H]: per KV head its G queries (head kv * G + g), key, value
    wq = fused[:, :, :g].reshape(fused.shape[0], n_heads, hd)
    wk, wv = fused[:, :, g], fused[:, :, g + 1]
    w_gate, w_up = w["layers.0.gate_up"][:, 0], w["layers.0.gate_up"][:, 1]

    def qkv(tok):
        h = _rms(w["embed"][tok], w["layers.0.attn_norm"], eps)
        q = np.einsum("d,dnh->nh", h, wq)
        k = np.einsum("d,dkh->kh", h, wk)
        v = np.einsum("d,dkh->kh", h, wv)
        return q, k, v

    def finish(tok, attn):
        x = w["embed"][tok] + np.einsum("nh,nhd->d", attn, w["layers.0.o"])
        hh = _rms(x, w["layers.0.mlp_norm"], eps)
        gate, up = hh @ w_gate, hh @ w_up
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w["layers.0.down"]
        return _rms(x, w["final_norm"], eps) @ head

    def attend(p, keys_pos, q_rot, k_rot, v, ls, q_far=None, k_far=None):
        out = np.zeros((n_heads, hd))
        for n in range(n_heads):
            logits = np.array([
                (q_far[n] @ k_far[j][n // g] if q_far is not None and p - j >= n_local else q_rot[n] @ k_rot[j][n // g])
                for j in keys_pos
            ]) / math.sqrt(hd)
            prob = np.exp(logits - logits.max())
            prob /= prob.sum()
            for pj, j in zip(prob, keys_pos, strict=True):
                out[n] += pj * v[j][n // g]
                if ls is not None and p - j < n_local:
                    ls[n][j] += pj
        return out

    qv = None
    tokens = list(prompt) + list(rest)
    raw = [qkv(t) for t in tokens]
    k_rot = [rope(k, j, inv_freq) for j, (_, k, _) in enumerate(raw)]
    vals = [v for _, _, v in raw]
    ls = np.zeros((n_heads, len(tokens)))
    reps: list[np.ndarray] = []
    seen: list[np.ndarray] = []

    def gq(j):
        return rope(raw[j][0], pg, inv_freq).reshape(-1)

    def form(upto_start):
        target = max(0, (upto_start - n_local - n_init) // block_size)
        while len(reps) < target:
            b = len(reps)
            span = range(n_init + b * block_size, n_init + (b + 1) * block_size)
            kraw = np.stack([raw[j][1] for j in span], axis=1)  # [K, bs, D]
            reps.append(representative(kraw, ls[:, list(span)], repr_topk))

    def chosen(probe_vec, use_question):
        scores = block_scores(probe_vec, reps, similarity, qv if use_question else None, question_weight)
        return set(top_blocks(scores, min(topk, len(reps))))

    k_raw = [k for _, k, _ in raw]

    def far(p):
        """(global query of p, un-rotated keys) under InfLLM's scheme, else (None, None)."""
        if position_scheme != "infllm":
            return None, None
        return rope(raw[p][0], pg, inv_freq), k_raw

    def visible(p, sel):
        frontier = n_init + len(reps) * block_size
        return [j for j in range(p + 1) if j < n_init or j >= frontier or (j - n_init) // block_size in sel]

    out = []
    sel: set[int] = set()
    n_prompt = len(prompt)
    for s in range(0, n_prompt, window):
        e = min(s + window, n_prompt)
        win = np.stack([gq(j) for j in range(s, e)])
        if probe == "activation":
            seen.extend(win)
            mean, var = running_stats(np.stack(seen))
            probe_vec, _ = activation_probe(win, mean, var, stats_eps)
        else:
            probe_vec = win.mean(axis=0)
        sel = chosen(probe_vec, True)
        for p in range(s, e):
            attn = attend(p, visible(p, sel), rope(raw[p][0], p, inv_freq), k_rot, vals, ls, *far(p))
            if p == n_prompt - 1:
                out.append(finish(tokens[p], attn))
        form(e)
        if qv is None and question is not None and len(question) and e > n_local:
            qv = question_vector(ls, [gq(j) for j in range(len(question))], repr_topk)
    for p in range(n_prompt, len(tokens) - 1):
        form(p)
        sel = chosen(gq(p), question_decode)
        attn = attend(p, visible(p, sel), rope(raw[p][0], p, inv_freq), k_rot, vals, ls, *far(p))
        out.append(finish(tokens[p], attn))
    return {"logits": out, "ls": ls, "reps": reps, "selected": sorted(sel), "qv": qv}
