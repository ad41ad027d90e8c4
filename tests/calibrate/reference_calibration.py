"""NumPy float64 references for the calibrations, written from each recipe (not from kvjax's code):

* Q-Filters (arXiv 2503.02812, official make_filters.py): the principal right singular vector of a head's
  uncentred query matrix is the top eigenvector of `Q^T Q`; its sign makes most queries project positively; the
  filter is its negative; a KV head's filter is the mean over its GQA group.
* KVzip+ (arXiv 2601.07891): `s_i = max_j softmax_j(q_j . k / sqrt(d))_i * ||W_O,n v_i|| / ||h_j||` over the
  repeated context's tokens `j`, max over the group, log. Ridge with intercept: least squares on the system
  augmented with `sqrt(alpha) I` rows, after centring.
* KVzap-MLP (kvpress `kvzap/train.py`): `W2 gelu(W1 h + b1) + b2` per layer with the exact (erf) GELU; loss the
  mean squared error over the batch's pairs, layers and heads; gradients by hand (backpropagation, GELU'(u) =
  Phi(u) + u phi(u)), clipped to global norm 1 (scaled by `1 / norm` when the norm exceeds it), then torch's
  AdamW: moments with bias correction, `p <- p - lr (m_hat / (sqrt(v_hat) + eps) + wd p)`.
* kvpress's on-the-fly DuoAttention score: mean pre-RoPE query / key placed at positions `0..P-1`, rotated
  (rotate-half RoPE), the last query's softmax over the `P` keys, the mean of its cumulative sum, group mean.
"""

from __future__ import annotations

import math

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


_erf = np.vectorize(math.erf)


def gelu(u: np.ndarray) -> np.ndarray:
    return 0.5 * u * (1 + _erf(u / math.sqrt(2)))


def mlp_forward(p: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(pre-activation [n, L, M], output [n, L, K])` of the stacked per-layer MLPs `p` (`[L, in, out]`)."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    pre = np.einsum("nld,ldm->nlm", np.asarray(x, np.float64), p["w1"]) + p["b1"]
    return pre, np.einsum("nlm,lmk->nlk", gelu(pre), p["w2"]) + p["b2"]


def mlp_grads(p: dict, x: np.ndarray, y: np.ndarray) -> tuple[float, dict]:
    """`(loss, gradients)` of the mean squared error over every pair, layer and head of the batch `x`, `y`."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    pre, out = mlp_forward(p, x)
    loss = float(np.mean((out - y) ** 2))
    d_out = 2 * (out - y) / out.size
    act = gelu(pre)
    d_act = np.einsum("nlk,lmk->nlm", d_out, np.asarray(p["w2"], np.float64))
    d_pre = d_act * (0.5 * (1 + _erf(pre / math.sqrt(2))) + pre * np.exp(-pre ** 2 / 2) / math.sqrt(2 * math.pi))
    grads = {"w1": np.einsum("nld,nlm->ldm", x, d_pre), "b1": d_pre.sum(0),
             "w2": np.einsum("nlm,nlk->lmk", act, d_out), "b2": d_out.sum(0)}
    return loss, grads


def adamw_step(p: dict, grads: dict, state: dict, lr: float, weight_decay: float = 0.01, clip: float = 1.0,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> tuple[dict, dict, float]:
    """One clipped AdamW step; `state` holds `t`, `m`, `v` (empty dict at first). Returns the global gradient norm
    before clipping too."""
    norm = math.sqrt(sum(float(np.sum(g ** 2)) for g in grads.values()))
    scale = clip / norm if norm > clip else 1.0
    t = state.get("t", 0) + 1
    new_p, m, v = {}, {}, {}
    for k, g in grads.items():
        g = g * scale
        m[k] = betas[0] * state.get("m", {}).get(k, 0.0) + (1 - betas[0]) * g
        v[k] = betas[1] * state.get("v", {}).get(k, 0.0) + (1 - betas[1]) * g * g
        m_hat, v_hat = m[k] / (1 - betas[0] ** t), v[k] / (1 - betas[1] ** t)
        w = np.asarray(p[k], np.float64)
        new_p[k] = w - lr * (m_hat / (np.sqrt(v_hat) + eps) + weight_decay * w)
    return new_p, {"t": t, "m": m, "v": v}, norm
