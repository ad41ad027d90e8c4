"""NumPy float64 references for KVzap, DMS and decode-time compression, written from the papers' definitions.

* KVzap (arXiv 2601.07891): per layer, a surrogate maps the hidden state `h` of a token to one score per KV head,
  `W2 GELU(W1 h + b1) + b2` (exact GELU `x Phi(x)`), or `W h + b` for the linear surrogate.
* DMS (arXiv 2506.05345, dense-prefill form as kvpress runs it): a pair leaves the cache when it is more than
  `window` positions old and its score, given when it entered, is below the threshold.
* Decode-time compression (kvpress `DecodingPress`): after every `interval` decode tokens, keep the `target` best
  scored pairs (ties: lower position).
"""

from __future__ import annotations

import math

import numpy as np


def gelu(x: np.ndarray) -> np.ndarray:
    return x * 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def kvzap_scores(tensors: dict, layer: int, hidden: np.ndarray) -> np.ndarray:
    """`[T, K]` predicted scores of `hidden` `[T, D]` through layer `layer` of a checkpoint's tensors."""
    h = np.asarray(hidden, np.float64)
    if f"layers.{layer}.weight" in tensors:
        w, b = (np.asarray(tensors[f"layers.{layer}.{n}"], np.float64) for n in ("weight", "bias"))
        return h @ w.T + b
    w1, b1, w2, b2 = (np.asarray(tensors[f"layers.{layer}.{n}"], np.float64)
                      for n in ("0.weight", "0.bias", "2.weight", "2.bias"))
    return gelu(h @ w1.T + b1) @ w2.T + b2


def top(scores: np.ndarray, candidates: list[int], m: int) -> list[int]:
    """The `m` best of `candidates` by `scores[p]` (ties: lower position), sorted."""
    return sorted(sorted(candidates, key=lambda p: (-scores[p], p))[:m])


def dms_prefill(scores: np.ndarray, n: int, threshold: float, window: int, cap: int | None = None) -> list[int]:
    """Kept positions of one head after a prompt of `n` tokens (`scores` `[n]`): the last `window` positions and
    every older one scoring at least `threshold`; at most `cap` (the window first, then the best scores)."""
    recent = [p for p in range(n) if p > n - 1 - window]
    passing = [p for p in range(n) if p <= n - 1 - window and scores[p] >= threshold]
    if cap is None or len(recent) + len(passing) <= cap:
        return sorted(recent + passing)
    return sorted(recent + top(scores, passing, max(cap - len(recent), 0)))


def dms_decode(kept: list[int], scores: np.ndarray, new: int, threshold: float, window: int) -> list[int]:
    """One decode step at position `new`: the token joins, and the pair `window` positions older leaves if its
    score is below the threshold."""
    out = kept + [new]
    old = new - window
    if old in out and scores[old] < threshold:
        out.remove(old)
    return sorted(out)


def decoding_step(kept: list[int], scores: np.ndarray, new: int, done: int, interval: int, target: int,
                  protect: set[int] = frozenset()) -> list[int]:
    """One decode step of decode-time compression (kvjax's timing: after `done` earlier decode tokens, before the
    new one attends): compress every pair but the new token to `target` when `done` is a positive multiple of
    `interval` (`protect`: pairs the base always keeps, counted in the target)."""
    if done > 0 and done % interval == 0 and len(kept) > target:
        fixed = [p for p in kept if p in protect]
        rest = [p for p in kept if p not in protect]
        kept = sorted(fixed + top(scores, rest, max(target - len(fixed), 0)))
    return sorted(kept + [new])
