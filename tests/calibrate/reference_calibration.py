"""NumPy float64 references for the calibrations, written from each recipe (not from kvjax's code):

* Q-Filters (arXiv 2503.02812, official make_filters.py): the principal right singular vector of a head's
  uncentred query matrix is the top eigenvector of `Q^T Q`; its sign makes most queries project positively; the
  filter is its negative; a KV head's filter is the mean over its GQA group.
* KVzip+ (arXiv 2601.07891): `s_i = max_j softmax_j(q_j . k / sqrt(d))_i * ||W_O,n v_i|| / ||h_j||` over the
  repeated context's tokens `j`, max over the group, log. Ridge with intercept: least squares on the system
  augmented with `sqrt(alpha) I` rows, after centring.
* kvpress's on-the-fly DuoAttention score: mean pre-RoPE query / key placed at positions `0..P-1`, rotated
  (rotate-half RoPE), the last query's softmax over the `P` keys, the mean of its cumulative sum, group mean.
"""

from __future__ import annotations

import numpy as np


def qfilters(queries: np.ndarray, kv_heads: int) -> np.ndarray:
    """`[K, H]` filters from queries `[S, N, H]`."""
    q = np.asarray(queries, np.float64)
    out = []
    for n in range(q.shape[1]):
        m = q[:, n]
        _, vecs = np.linalg.eigh(m.T @ m)
        v = vecs[:, -1]
        positive = np.mean(m @ v > 0) > 0.5
        out.append(-v if positive else v)
    per_head = np.stack(out)
    return per_head.reshape(kv_heads, -1, per_head.shape[-1]).mean(axis=1)


def softmax_rows(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def kvzip_plus_log(q, k, v, hidden, o, context_start: int, repeat_start: int, length: int) -> np.ndarray:
    """`[length, K]` log KVzip+ scores (float64), by explicit loops over heads and repeat rows."""
    q, k, v, hidden, o = (np.asarray(a, np.float64) for a in (q, k, v, hidden, o))
    n_heads, kv = q.shape[1], k.shape[1]
    group = n_heads // kv
    d = q.shape[-1]
    scores = np.zeros((n_heads, length))
    for n in range(n_heads):
        kh = n // group
        out_norm = np.linalg.norm(v[context_start:context_start + length, kh] @ o[n], axis=-1)
        best = np.zeros(length)
        for r in range(length):
            j = repeat_start + r
            attn = softmax_rows(k[: j + 1, kh] @ q[j, n] / np.sqrt(d))
            cand = attn[context_start:context_start + length] * out_norm / np.linalg.norm(hidden[j])
            best = np.maximum(best, cand)
        scores[n] = best
    return np.log(scores.reshape(kv, group, length).max(axis=1).T)


def ridge(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """`(W [D, K], b [K])` minimising `||y - x W - b||^2 + alpha ||W||^2` (intercept not penalised)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    mx, my = x.mean(0), y.mean(0)
    a = np.concatenate([x - mx, np.sqrt(alpha) * np.eye(x.shape[1])])
    t = np.concatenate([y - my, np.zeros((x.shape[1], y.shape[1]))])
    w = np.linalg.lstsq(a, t, rcond=None)[0]
    return w, my - mx @ w


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE of `x` `[P, heads, H]` at `positions` `[P]` with base `theta` (default rope type)."""
    h = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, h, 2) / h)
    angles = positions[:, None] * inv_freq[None]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None]
    rotated = np.concatenate([-x[..., h // 2:], x[..., : h // 2]], -1)
    return x * cos + rotated * sin


def duo_scores(q_pre: np.ndarray, k_pre: np.ndarray, q_len: int, theta: float) -> np.ndarray:
    """`[K]` on-the-fly DuoAttention scores of one prompt's pre-RoPE queries `[T, N, H]` and keys `[T, K, H]`."""
    qm, km = np.asarray(q_pre, np.float64).mean(0), np.asarray(k_pre, np.float64).mean(0)
    n_heads, kv, d = qm.shape[0], km.shape[0], qm.shape[-1]
    positions = np.arange(q_len, dtype=np.float64)
    keys = rope(np.repeat(km[None], q_len, 0), positions, theta)  # [P, K, H]
    last = rope(qm[None], positions[-1:], theta)[0]  # [N, H]
    area = np.zeros(n_heads)
    for n in range(n_heads):
        attn = softmax_rows(keys[:, n // (n_heads // kv)] @ last[n] / np.sqrt(d))
        area[n] = np.cumsum(attn).mean()
    return area.reshape(kv, -1).mean(axis=1)
