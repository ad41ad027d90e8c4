"""NumPy float64 references of the kvpress-leaderboard scorers, written from their papers' equations with plain
loops over examples, heads and tokens (one example at a time, slot = position)."""

from __future__ import annotations

import math

import numpy as np


def rope_matrix(position: float, inv_freq: np.ndarray) -> np.ndarray:
    """The `[H, H]` RoPE rotation at `position` in the rotate-half layout: dims `i` and `i + H/2` rotate together
    by `position * inv_freq[i]`."""
    half = len(inv_freq)
    r = np.zeros((2 * half, 2 * half))
    for i, f in enumerate(inv_freq):
        a = position * float(f)
        r[i, i], r[i, i + half] = math.cos(a), -math.sin(a)
        r[i + half, i], r[i + half, i + half] = math.sin(a), math.cos(a)
    return r


def expected_attention(q, k, v, n, inv_freq, *, n_future=512, n_sink=4, covariance=True, vnorm=True, eps=0.0,
                       stats=None):
    """Scores `[K, n]` of one example: `q` `[n, N, H]` post-RoPE queries at positions 0..n-1, `k`, `v` `[n, K, H]`.

    Pre-RoPE queries `R_t^T q_t`; mean / covariance over t >= n_sink (`stats`: `(mean [N, H], covariance [N, H, H])`
    given instead, `q` only for its head count); `R = mean_j R_j`, j = n .. n + T - 1;
    logits `mu_bar . k / sqrt(d) + k^T Sigma_bar k / (2 d)`, softmax over the non-sink keys, mean over the group,
    times `||v||`. Sinks get +inf."""
    nq, kvh, h = q.shape[1], k.shape[1], k.shape[2]
    g = nq // kvh
    pre = np.stack([rope_matrix(t, inv_freq).T @ q[t].T for t in range(n)])  # [n, H, N]
    rows = pre[n_sink:n]
    r_bar = sum(rope_matrix(j, inv_freq) for j in range(n, n + n_future)) / n_future
    scores = np.zeros((kvh, n))
    for head in range(nq):
        if stats is None:
            x = rows[:, :, head]  # [m, H]
            mu = x.mean(0)
            sigma = (x - mu).T @ (x - mu) / len(x)
        else:
            mu, sigma = stats[0][head], stats[1][head]
        mu_bar, sigma_bar = r_bar @ mu, r_bar @ sigma @ r_bar.T
        kh = head // g
        logits = np.array([
            mu_bar @ k[j, kh] / math.sqrt(h) + (k[j, kh] @ sigma_bar @ k[j, kh] / (2 * h) if covariance else 0.0)
            for j in range(n_sink, n)
        ])
        p = np.exp(logits - logits.max())
        scores[kh, n_sink:] += p / p.sum() / g
    if vnorm:
        scores[:, n_sink:] = (scores[:, n_sink:] + eps) * np.linalg.norm(v[n_sink:n].transpose(1, 0, 2), axis=-1)
    scores[:, :n_sink] = np.inf
    return scores


def keydiff(k, n):
    """Scores `[K, n]`: minus the cosine of each key with the mean of the head's unit keys."""
    out = np.zeros((k.shape[1], n))
    for kh in range(k.shape[1]):
        keys = k[:n, kh]
        anchor = np.mean([x / np.linalg.norm(x) for x in keys], axis=0)
        for j in range(n):
            out[kh, j] = -keys[j] @ anchor / (np.linalg.norm(keys[j]) * np.linalg.norm(anchor))
    return out


def observed_attention(q, k, n):
    """Scores `[K, n]`: per query head the causal attention column sums over rows i >= j divided by n - j, then
    the mean over the group."""
    nq, kvh, h = q.shape[1], k.shape[1], k.shape[2]
    g = nq // kvh
    out = np.zeros((kvh, n))
    for head in range(nq):
        kh = head // g
        col = np.zeros(n)
        for i in range(n):
            logits = k[: i + 1, kh] @ q[i, head] / math.sqrt(h)
            p = np.exp(logits - logits.max())
            col[: i + 1] += p / p.sum()
        out[kh] += col / (n - np.arange(n)) / g
    return out


def value_output_norms(v, w_o, n):
    """`[K, n]`: per KV head the L1 norm of `v_j W_o[head]` averaged over the group's query heads."""
    nq, kvh = w_o.shape[0], v.shape[1]
    g = nq // kvh
    out = np.zeros((kvh, n))
    for head in range(nq):
        for j in range(n):
            out[head // g, j] += np.abs(v[j, head // g] @ w_o[head]).sum() / g
    return out


def criticalkv_keep(base, norms, budget, first_stage_ratio=0.5, eps=1e-4, at_least_one=True, floor=0):
    """Kept positions of one head: the best `max(floor(ratio * budget), floor)` by `base` (inf = protected), then
    the best `(base + eps) * norm` up to `budget`; ties to the lower position."""
    n = len(base)
    first = int(np.floor(np.float32(budget) * np.float32(first_stage_ratio)))
    if at_least_one and first_stage_ratio > 0:
        first = max(first, min(budget, 1))
    first = max(first, floor)
    protected = [j for j in range(n) if np.isinf(base[j])]
    order = sorted(range(n), key=lambda j: (-base[j], j))
    chosen = set(protected) | set(order[: max(first, len(protected))])
    weighted = {j: (base[j] + eps) * norms[j] for j in range(n) if j not in chosen}
    rest = sorted(weighted, key=lambda j: (-weighted[j], j))[: max(budget - len(chosen), 0)]
    return sorted(chosen | set(rest))


def cur(k, v, n, *, num_sinks=4, leverage_type="kv_product", local=True, window=16):
    """Scores `[K, n]`: squared key / value norms, each normalised within windows of `window` positions,
    combined, normalised per head; sinks +inf."""
    out = np.zeros((k.shape[1], n))
    for kh in range(k.shape[1]):
        lev = []
        for x in (k[:n, kh], v[:n, kh]):
            sq = np.array([row @ row for row in x])
            if local:
                sq = np.array([sq[j] / sq[(j // window) * window: (j // window + 1) * window].sum() for j in range(n)])
            lev.append(sq)
        lk, lv = lev
        s = {"kv_product": lk * lv, "kv_avg": (lk + lv) / 2, "key": lk, "value": lv}[leverage_type]
        out[kh] = s / s.sum()
        out[kh, :num_sinks] = np.inf
    return out


def compactor_chunk_votes(q, k, chunk, partial="fill"):
    """Non-causal chunked attention of one KV head's middle tokens, `q` `[m, G, H]`, `k` `[m, H]` -> `[m]` column
    sums averaged over the group. The tokens are padded with zero vectors to a multiple of `chunk`, as the authors'
    code pads them; a padding query row has every logit 0, so it votes `1 / chunk` for every slot of its chunk.
    `partial`: "kvpress" (every row attends every slot, padding keys at logit 0), "fill" (real rows attend real
    keys only; padding rows vote), "drop" (real rows and keys only)."""
    m, g, h = q.shape
    width = -(-m // chunk) * chunk
    qp = np.concatenate([q, np.zeros((width - m, g, h))])
    kp = np.concatenate([k, np.zeros((width - m, h))])
    out = np.zeros(width)
    for c0 in range(0, width, chunk):
        slots = list(range(c0, c0 + chunk))
        real = [j for j in slots if j < m]
        for i in slots:
            if i >= m and partial == "drop":
                continue
            keys = slots if (partial == "kvpress" or i >= m) else real
            for head in range(g):
                logits = np.array([qp[i, head] @ kp[j] for j in keys])
                p = np.exp(logits - logits.max())
                out[keys] += p / p.sum() / g
    return out[:m]


def compactor(q, k, v, n, inv_freq, *, start=8, end=4, chunk=256, blending=0.5, partial="fill", sketch=None,
              ridge=0.0):
    """Scores `[K, n]`: `blending * z(leverage of the centred pre-RoPE keys) + z(pool3(chunk votes * ||v||))` over
    the middle tokens `[start, n - end)`; the rest +inf. Leverage: exact (`sketch` None; what a square sketch without
    ridge gives) or of the sketched keys `Y = X sketch[kh] / sqrt(S)`, `diag(Y (Y^T Y + ridge I)^{-1} Y^T)`."""
    nq, kvh = q.shape[1], k.shape[1]
    g = nq // kvh
    mid = list(range(start, n - end))
    lev = np.zeros((kvh, len(mid)))
    att = np.zeros((kvh, len(mid)))
    for kh in range(kvh):
        x = np.stack([rope_matrix(j, inv_freq).T @ k[j, kh] for j in mid])
        x = x - x.mean(0)
        if sketch is None:
            lev[kh] = np.diag(x @ np.linalg.pinv(x.T @ x) @ x.T)
        else:
            y = x @ sketch[kh] / math.sqrt(sketch.shape[-1])
            lev[kh] = np.diag(y @ np.linalg.inv(y.T @ y + ridge * np.eye(y.shape[1])) @ y.T)
        att[kh] = compactor_chunk_votes(q[mid, kh * g : (kh + 1) * g], k[mid, kh], chunk, partial)
        att[kh] *= np.linalg.norm(v[mid, kh], axis=-1)
        padded = np.concatenate([[0.0], att[kh], [0.0]])
        att[kh] = (padded[:-2] + padded[1:-1] + padded[2:]) / 3

    def z(x):
        return (x - x.mean()) / x.std(ddof=1)

    out = np.full((kvh, n), np.inf)
    out[:, start : n - end] = blending * z(lev) + z(att)
    return out


def non_causal_attention(q, k, v, n, *, chunk=256, partial="fill"):
    """Scores `[K, n]` of NonCausalAttention (Compactor's second signal alone): per KV head, the chunk votes of all
    `n` tokens from the first (chunks from position 0) times `||v||`, average-pooled over 3 neighbours (zero padded,
    divided by 3); z-scored over every head and token (unbiased std)."""
    kvh = k.shape[1]
    g = q.shape[1] // kvh
    att = np.zeros((kvh, n))
    for kh in range(kvh):
        votes = compactor_chunk_votes(q[:n, kh * g : (kh + 1) * g], k[:n, kh], chunk, partial)
        votes = votes * np.linalg.norm(v[:n, kh], axis=-1)
        padded = np.concatenate([[0.0], votes, [0.0]])
        att[kh] = (padded[:-2] + padded[1:-1] + padded[2:]) / 3
    return (att - att.mean()) / att.std(ddof=1)


def leverage(k, n, inv_freq, sketch, ridge):
    """Scores `[K, n]` of LeverageScore (Compactor's first signal alone): per KV head, the leverage
    `diag(Y (Y^T Y + ridge I)^{-1} Y^T)` of the sketched keys `Y = X sketch[kh] / sqrt(S)`, `X` the pre-RoPE keys of
    all `n` tokens centred over them; z-scored over every head and token (unbiased std)."""
    kvh = k.shape[1]
    lev = np.zeros((kvh, n))
    for kh in range(kvh):
        x = np.stack([rope_matrix(j, inv_freq).T @ k[j, kh] for j in range(n)])
        y = (x - x.mean(0)) @ sketch[kh] / math.sqrt(sketch.shape[-1])
        lev[kh] = np.diag(y @ np.linalg.inv(y.T @ y + ridge * np.eye(y.shape[1])) @ y.T)
    return (lev - lev.mean()) / lev.std(ddof=1)


def kvzip_chunk_scores(q, k_ctx, k_rep, start, end, n_sink, row_weight=None, written=None):
    """KVzip (Kim et al. 2025, Sec. 3): scores `[K, end - start]` of the context positions `[start, end)` from one
    repeat row. `q` `[R, N, H]` the row's post-RoPE queries, `k_rep` `[R, K, H]` its keys, `k_ctx` `[n, K, H]` the
    context's keys (slot = position). Each query attends the sinks `[0, min(n_sink, start))`, the chunk and the row's
    own keys up to itself; the score of a context pair is its largest probability over the group and the rows.

    Weighted variants: each probability times `row_weight[t]` of its row `[R]` (KVzip+: `1 / ||h_t||`; KVgrad: the
    row's objective gradient norm) and `written[head, c]` of its pair `[N, n]` (both: `||v_c W_O[head]||`)."""
    rows, nq, h = q.shape
    kvh = k_ctx.shape[1]
    g = nq // kvh
    sinks = min(n_sink, start)
    out = np.zeros((kvh, end - start))
    for head in range(nq):
        kh = head // g
        fixed = np.concatenate([k_ctx[:sinks, kh], k_ctx[start:end, kh]])
        for t in range(rows):
            keys = np.concatenate([fixed, k_rep[: t + 1, kh]])
            logits = keys @ q[t, head] / math.sqrt(h)
            p = np.exp(logits - logits.max())
            p /= p.sum()
            score = p[sinks : sinks + end - start]
            if row_weight is not None:
                score = score * row_weight[t]
            if written is not None:
                score = score * written[head, start:end]
            out[kh] = np.maximum(out[kh], score)
    return out


def written_norms(v, w_o):
    """`[N, n]` `||v_c W_O[head]||` of each pair through each query head's slice of the output projection (`v`
    `[n, K, H]`, `w_o` `[N, H, D]`)."""
    nq, kvh = w_o.shape[0], v.shape[1]
    return np.stack([np.linalg.norm(v[:, head // (nq // kvh)] @ w_o[head], axis=-1) for head in range(nq)])


def kvzip_replay_rows(prompt, a):
    """The paper's repeat rows of `prompt` under the kvzip arguments `a`: the instruction (later chunks: the
    continuation + the previous chunk's tail), the assistant opening, the chunk; with the context positions each
    reconstructs."""
    n, s0 = len(prompt), min(a["context_start"], len(prompt))
    for i, start in enumerate(range(s0, n, a["chunk_size"])):
        end = min(start + a["chunk_size"], n)
        lead = a["repeat_ids"] if i == 0 else a["continue_ids"] + prompt[max(s0, start - a["tail"]) : start]
        yield lead + a["suffix_ids"] + prompt[start:end], start, end


def kvzip_keep(scores, n, budget, n_sink, cap, layerwise=False, total=None):
    """Kept positions `[L][K]` (sorted) of one example from its scores `[L][K, n]`: sinks (positions below
    `min(n_sink, cap)`) first, then each head's best `cap - sinks`, of which the best `budget * K * L` overall
    (`layerwise`: `budget * K` per layer; `total`, where given, instead) survive; ties: layer, head, then position."""
    sinks = min(n_sink, cap, n)
    layers, kvh = len(scores), scores[0].shape[0]
    entries = []  # (key, layer, head, position): the largest key first
    for layer, s in enumerate(scores):
        for kh in range(kvh):
            for p in range(sinks):
                entries.append((math.inf, layer, kh, p))
            best = sorted(range(sinks, n), key=lambda p, s=s, kh=kh: (-s[kh, p], p))[: max(cap - sinks, 0)]
            entries += [(float(s[kh, p]), layer, kh, p) for p in best]
    groups = [[e for e in entries if e[1] == layer] for layer in range(layers)] if layerwise else [entries]
    total = budget * kvh * (1 if layerwise else layers) if total is None else total
    kept = [[[] for _ in range(kvh)] for _ in range(layers)]
    for group in groups:
        for _, layer, kh, p in sorted(group, key=lambda e: (-e[0], e[1], e[2], e[3]))[:total]:
            kept[layer][kh].append(p)
    return [[sorted(x) for x in row] for row in kept]


def finch_scores(q, k, n, window, normalize=True):
    """Finch's scores `[K, n]` of one example (`q` `[n, N, H]`, `k` `[n, K, H]`, slot = position): each of the last
    `window` rows' causal softmax, times the number of keys the row sees (`i + 1`) with `normalize`, averaged over
    the rows and over the GQA group."""
    nq, kvh, h = q.shape[1], k.shape[1], k.shape[2]
    g = nq // kvh
    w = min(window, n)
    out = np.zeros((kvh, n))
    for head in range(nq):
        kh = head // g
        for i in range(n - w, n):
            logits = k[: i + 1, kh] @ q[i, head] / math.sqrt(h)
            p = np.exp(logits - logits.max())
            p = p / p.sum() * ((i + 1) if normalize else 1.0)
            out[kh, : i + 1] += p / w / g
    return out


def finch_keep(scores, n, budget, window, chunk_length=None):
    """Finch's kept positions of one head (`scores` `[n]`): the question's last `min(window, budget)` positions,
    then the best scores (ties: lower position) of the context before it: over the whole context, or per segment
    of `chunk_length` positions, where a segment of `size` context positions keeps `floor(size * (budget - w) /
    (n - w))`."""
    budget = min(budget, n)
    w = min(window, budget)
    question = list(range(n - w, n))
    if chunk_length is None:
        order = sorted(range(n - w), key=lambda j: (-scores[j], j))
        return sorted(question + order[: budget - w])
    out = question
    for start in range(0, n - w, chunk_length):
        seg = sorted(range(start, min(start + chunk_length, n - w)), key=lambda j: (-scores[j], j))
        out = out + seg[: len(seg) * (budget - w) // (n - w)]
    return sorted(out)


def chunkkv_keep(scores, candidates, protected, budget, chunk):
    """ChunkKV's kept positions of one example, the same in every head: `scores` `[K, n]` the base's token scores,
    `candidates` / `protected` position lists. Chunks `p // chunk` of the candidates score the mean over their
    positions of the head-summed score; the best chunks (ties: lower position) are taken while every better one
    and they fit in `budget - len(protected)`."""
    total = scores.sum(0)
    chunks: dict[int, list[int]] = {}
    for p in candidates:
        chunks.setdefault(p // chunk, []).append(p)
    order = sorted(chunks, key=lambda c: (-np.mean([total[p] for p in chunks[c]]), chunks[c][0]))
    room, out = budget - len(protected), list(protected)
    for c in order:
        if len(chunks[c]) > room:
            break
        out += chunks[c]
        room -= len(chunks[c])
    return sorted(out)


def simlayerkv(q, k, n, *, lazy_threshold=1.0, n_last=1, n_recent=1024, n_initial=4):
    """SimLayerKV on one example (`q` `[T, N, H]`, `k` `[T, K, H]`, `n` prompt tokens): (laziness score, kept
    positions). The last `n_last` rows' causal softmax, averaged over rows and query heads, summed over positions
    `< n_initial` and the `n_recent` positions before those rows; lazy above the threshold (never at 1 or for
    `n <= n_initial + n_recent + n_last`): keeps `< n_initial` and the last `n_recent - n_last` positions."""
    heads, kv = q.shape[1], k.shape[1]
    rows = range(n - n_last, n)
    attention = np.zeros(n)
    for i in rows:
        for h in range(heads):
            logits = np.array([q[i, h] @ k[j, h * kv // heads] for j in range(i + 1)]) / math.sqrt(q.shape[2])
            p = np.exp(logits - logits.max())
            attention[: i + 1] += p / p.sum() / (len(rows) * heads)
    region = [j for j in range(n) if j < n_initial or n - n_last - n_recent <= j < n - n_last]
    score = float(sum(attention[j] for j in region))
    lazy = lazy_threshold < 1.0 and n > n_initial + n_recent + n_last and score > lazy_threshold
    kept = [j for j in range(n) if not lazy or j < n_initial or j >= n - n_recent + n_last]
    return score, kept
def entropy_gated_chunkkv_keep(scores, candidates, protected, budget, chunk, low, eps=1e-8, keep_protected=True):
    """EntropyGatedChunkKV's kept positions of one example, the same in every head: `scores` `[K, n]` the base's
    token scores, `candidates` / `protected` position lists. Protected positions score the largest candidate score
    + 1 in every head (kvpress's SnapKV window) and are kept (`keep_protected`; else chosen as any other, as
    kvpress does). Chunks `p // chunk` score the mean of their
    head-summed scores; their entropy is that of the scores as a distribution (shifted up by a negative minimum),
    over log(size). A chunk at or above the median mean and below the median entropy (lower medians) may keep
    `low` tokens, any other its size, protected ones included; chunks by decreasing mean (ties: lower position)
    take their best tokens while the budget lasts; the best tokens left fill what remains of the budget."""
    scores = np.asarray(scores, np.float64)
    cand, prot = list(candidates), list(protected)
    top = scores[:, cand].max() if cand else 0.0
    s = {j: scores[:, j].sum() for j in cand}
    s.update({j: scores.shape[0] * (top + 1.0) for j in prot})
    chunks: dict[int, list[int]] = {}
    for j in sorted(s):
        chunks.setdefault(j // chunk, []).append(j)
    mean = {i: np.mean([s[j] for j in t]) for i, t in chunks.items()}
    entropy = {}
    for i, t in chunks.items():
        if len(t) == 1:
            entropy[i] = 0.0
            continue
        x = np.array([s[j] for j in t])
        x = x - min(x.min(), 0.0)
        p = x / (x.sum() + eps)
        entropy[i] = float(np.clip(-(p * np.log(p + eps)).sum() / np.log(len(t)), 0.0, 1.0))

    def lower_median(values):
        values = sorted(values)
        return values[(len(values) - 1) // 2]

    mean_median, entropy_median = lower_median(mean.values()), lower_median(entropy.values())
    fixed = set(prot) if keep_protected else set()
    out, room = set(fixed), budget - len(fixed)
    for i in sorted(chunks, key=lambda i: (-mean[i], chunks[i][0])):
        spiky = mean[i] >= mean_median and entropy[i] < entropy_median
        allowance = min(len(chunks[i]), low) if spiky else len(chunks[i])
        own = sorted((j for j in chunks[i] if j not in fixed), key=lambda j: (-s[j], j))
        take = max(0, min(allowance - (len(chunks[i]) - len(own)), room))
        out |= set(own[:take])
        room -= take
    rest = sorted((j for j in s if j not in out), key=lambda j: (-s[j], j))
    return sorted(out | set(rest[:max(room, 0)]))

def capkv(q, k, v, n, inv_freq, *, held=None, n_future=512, n_sink=4, tau=5.0, eps=1e-6, normalize=True):
    """Scores `{position: score}` per KV head of one example: `q` `[n, N, H]` post-RoPE queries at positions
    0..n-1, `k`, `v` `[n, K, H]` by position, `held[kh]` the positions the head holds (default: all n).

    Anchor: the mean over t >= n_sink of the pre-RoPE queries `R_t^T q_t`, times `R = mean_j R_j` (j = n ..
    n + T - 1); per query head `w_i = exp(tau c_i - max_j tau c_j)` over the held non-sink positions, `c_i` the
    clipped cosine of `k_i` and the anchor (or their dot product); `A = I + sum_i (w_i + eps) v_i v_i^T` over
    them; `s_i = w_i v_i^T A^{-1} v_i`, averaged over the group. Sinks get +inf."""
    nq, kvh, h = q.shape[1], k.shape[1], k.shape[2]
    g = nq // kvh
    held = [list(range(n))] * kvh if held is None else held
    pre = np.stack([rope_matrix(t, inv_freq).T @ q[t].T for t in range(n)])  # [n, H, N]
    r_bar = sum(rope_matrix(j, inv_freq) for j in range(n, n + n_future)) / n_future
    scores = [{p: (np.inf if p < n_sink else 0.0) for p in held[kh]} for kh in range(kvh)]
    for head in range(nq):
        kh = head // g
        rest = [p for p in held[kh] if p >= n_sink]
        anchor = r_bar @ pre[n_sink:n, :, head].mean(0)
        align = []
        for p in rest:
            dot = float(k[p, kh] @ anchor)
            if normalize:
                dot = min(max(dot / (np.linalg.norm(k[p, kh]) * np.linalg.norm(anchor)), -1.0), 1.0)
            align.append(tau * dot)
        w = np.exp(np.array(align) - max(align))
        a = np.eye(h)
        for wi, p in zip(w, rest, strict=True):
            a += (wi + eps) * np.outer(v[p, kh], v[p, kh])
        a_inv = np.linalg.inv(a)
        for wi, p in zip(w, rest, strict=True):
            scores[kh][p] += wi * (v[p, kh] @ a_inv @ v[p, kh]) / g
    return scores


def kvcompose_scores(q, k, v, n, *, agg_task="max", agg_group="mean", add_v_norm=False, add_mean_across_heads=True):
    """KVCompose's (kvpress `KVComposePress`) scores `[K, n]` of one layer from a forward over the prompt followed
    by itself (`q` `[2n, N, H]` post-RoPE, `k` / `v` `[2n, K, H]`): each replayed row `t >= n` attends keys
    `[0, t]` (float64 softmax); its probabilities of the context columns are aggregated over the rows (`agg_task`),
    then over each KV head's query heads (`agg_group`); optionally times `||v||`, plus the mean over KV heads."""
    nq, kvh, h = q.shape[1], k.shape[1], k.shape[2]
    g = nq // kvh
    per_head = np.zeros((nq, n))
    for head in range(nq):
        rows = []
        for t in range(n, 2 * n):
            logits = k[: t + 1, head // g] @ q[t, head] / math.sqrt(h)
            p = np.exp(logits - logits.max())
            rows.append((p / p.sum())[:n])
        per_head[head] = np.max(rows, axis=0) if agg_task == "max" else np.mean(rows, axis=0)
    grouped = per_head.reshape(kvh, g, n)
    out = grouped.max(axis=1) if agg_group == "max" else grouped.mean(axis=1)
    if add_v_norm:
        out = out * np.linalg.norm(v[:n], axis=-1).T
    if add_mean_across_heads:
        out = out + out.mean(axis=0, keepdims=True)
    return out


def kvcompose_keep(scores, n, total, cap, *, structured=True, agg_head="mean", lower_bound=0):
    """Kept positions `[L][K]` (sorted) of one example from KVCompose's scores `[L][K, n]`, `total` pairs over all.

    Structured, as kvpress: each head's scores sorted descending, aggregated over heads (`agg_head`) into a layer's
    composite curve; the first `lower_bound` of each curve first; layer 0's curve the largest over layers; entries
    past `cap` out; the best `total` entries give each layer its count, floored at `max(1, lower_bound)` and capped at
    `min(cap, n)`; each head keeps its own best count. Unstructured: each head's best `cap` candidates, its best
    `lower_bound` first, the best `total` over every layer and head. Ties: layer, head, then position (rank)."""
    layers, kvh = len(scores), scores[0].shape[0]
    low = min(lower_bound, cap)
    order = [[sorted(range(n), key=lambda p, s=s, kh=kh: (-s[kh, p], p)) for kh in range(kvh)] for s in scores]
    kept = [[[] for _ in range(kvh)] for _ in range(layers)]
    if not structured:
        entries = []
        for layer, s in enumerate(scores):
            for kh in range(kvh):
                for i, p in enumerate(order[layer][kh][:cap]):
                    entries.append((math.inf if i < low else float(s[kh, p]), layer, kh, i, p))
        for _, layer, kh, _, p in sorted(entries, key=lambda e: (-e[0], e[1], e[2], e[3]))[:total]:
            kept[layer][kh].append(p)
        return [[sorted(x) for x in row] for row in kept]
    curves = []
    for s in scores:
        ranked = np.stack([np.sort(s[kh])[::-1] for kh in range(kvh)])
        curve = ranked.max(axis=0) if agg_head == "max" else ranked.mean(axis=0)
        curves.append(np.where(np.arange(n) < low, math.inf, curve))
    curves[0] = np.max(curves, axis=0)
    entries = [(float(c[i]), layer, i) for layer, c in enumerate(curves) for i in range(min(cap, n))]
    counts = [0] * layers
    for _, layer, _ in sorted(entries, key=lambda e: (-e[0], e[1], e[2]))[:total]:
        counts[layer] += 1
    for layer in range(layers):
        count = min(max(counts[layer], 1, lower_bound), cap, n)
        for kh in range(kvh):
            kept[layer][kh] = sorted(order[layer][kh][:count])
    return kept
def fastkvzip_gate(tensors, layer, h, eps=1e-6):
    """`[K, n]` Fast KVzip gate scores of the attention inputs `h` `[n, D]` through gate `layer` of `tensors` (the
    gate's state-dict entries `layers.{l}.*`), float64, as kvpress's `FastKVzipGate` computes them:
    `1 / (1 + sum_sink exp(logit_base - logit))`, averaged over the query groups."""
    t = {name.split(".", 2)[2]: np.asarray(v, np.float64) for name, v in tensors.items()
         if name.startswith(f"layers.{layer}.")}
    heads, _, sinks, d = t["k_base"].shape
    groups = t["b"].shape[2]

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    h = np.asarray(h, np.float64)
    q = norm((h @ t["q_proj.weight"].T + t["q_proj.bias"]).reshape(len(h), heads, groups, d), t["q_norm.weight"])
    k = norm((h @ t["k_proj.weight"].T).reshape(len(h), heads, d), t["k_norm.weight"])
    out = np.zeros((heads, len(h)))
    for kh in range(heads):
        for g in range(groups):
            logit = np.einsum("nd,nd->n", k[:, kh], q[:, kh, g]) / np.sqrt(d) + t["b"][kh, 0, g]
            base = q[:, kh, g] @ t["k_base"][kh, 0].T / np.sqrt(d)  # [n, S]
            out[kh] += 1.0 / (1.0 + np.exp(base - logit[:, None]).sum(-1)) / groups
    return out


def fastkvzip_window(n, window_ratio=0.02, window_size=4096):
    """kvpress's recent window of a `n`-token context."""
    return max(1, int(n * window_ratio)) if n < 32000 else window_size
def lukv_counts(prune, n):
    """LU-KV's per-head keep counts for one layer (kvpress's float32 arithmetic, plain loops): ideal `x_h = clamp(1 -
    p_h, 0, 1) * n`, the layer's `round(sum x_h)` tokens (clamped to `[K, K n]`) given as `floor(x_h)` plus one to
    each of the heads with the largest fractional parts (ties: lower head), each count clamped to `[1, n]`."""
    heads = len(prune)
    ideal = [np.float32(min(max(np.float32(1.0) - np.float32(p), np.float32(0.0)), np.float32(1.0))) * np.float32(n)
             for p in prune]
    total = min(max(round(float(np.sum(np.array(ideal, np.float32), dtype=np.float32))), heads), heads * n)
    counts = [math.floor(x) for x in ideal]
    left = total - sum(counts)
    for h in sorted(range(heads), key=lambda h: (-(ideal[h] - np.float32(counts[h])), h))[:left]:
        counts[h] += 1
    return [min(max(c, 1), n) for c in counts]


def lukv_keep(scores, n, count, *, sink=4, window=1, base_protected=()):
    """The positions one head keeps: the first `sink` and last `window` positions first (ties: lower position), then
    the base's protected ones, then the best scores (ties: lower position); `count` in all."""
    def tier(j):
        return 2 if j < sink or j >= n - window else 1 if j in base_protected else 0

    order = sorted(range(n), key=lambda j: (-tier(j), -scores[j] if tier(j) == 0 else 0.0, j))
    return sorted(order[:count])
