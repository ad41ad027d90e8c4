"""Naive NumPy references (float64, loops) for the scoring / selection ops and baseline methods,
written from the papers' definitions, plus a random right-padded GQA batch to feed them."""

from __future__ import annotations

import importlib
import math

import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.methods.base import Step


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def window_votes(q, q_pos, k, k_pos, k_valid, window, row_reduce="sum", group_reduce="mean", scale=None):
    """Per key: softmax probabilities of the example's `window` latest valid query rows."""
    b, t, n, h = q.shape
    kv, c = k.shape[1], k.shape[2]
    g = n // kv
    out = np.zeros((b, n, c))
    for bi in range(b):
        rows = sorted((ti for ti in range(t) if q_pos[bi, ti] >= 0), key=lambda ti: q_pos[bi, ti])[-window:]
        for ti in rows:
            sc = 1 / math.sqrt(h) if scale is None else np.broadcast_to(scale, (b, t))[bi, ti]
            for ni in range(n):
                ki = ni // g
                ok = k_valid[bi, ki] & (k_pos[bi, ki] <= q_pos[bi, ti])
                if ok.any():
                    out[bi, ni, ok] += softmax((k[bi, ki][ok] @ q[bi, ti, ni]) * sc)
        if row_reduce == "mean":
            out[bi] /= max(len(rows), 1)
    grouped = out.reshape(b, kv, g, c)
    if group_reduce == "mean":
        return grouped.mean(2)
    if group_reduce == "max":
        return grouped.max(2)
    return out


def pool(x: np.ndarray, kernel: int, kind: str) -> np.ndarray:
    """PyTorch avg_pool1d(count_include_pad=True) / max_pool1d with padding kernel // 2."""
    half = kernel // 2
    fill = 0.0 if kind == "avg" else -np.inf
    padded = np.concatenate([np.full(x.shape[:-1] + (half,), fill), x, np.full(x.shape[:-1] + (half,), fill)], -1)
    out = np.empty(x.shape)
    for j in range(x.shape[-1]):
        win = padded[..., j : j + kernel]
        out[..., j] = win.sum(-1) / kernel if kind == "avg" else win.max(-1)
    return out


def top_positions(scores: dict[int, float], count: int) -> list[int]:
    """The `count` best positions by score, ties to the lower position; sorted."""
    return sorted(sorted(scores, key=lambda p: (-scores[p], p))[:count])


def snapkv_keep(votes_row: np.ndarray, n: int, budget: int, window: int, kernel: int, pooling: str) -> list[int]:
    """SnapKV on one head of one example: `votes_row[j]` for positions j < n (slot = position)."""
    budget = min(budget, n)
    if budget >= n:
        return list(range(n))
    w = min(window, budget)
    prefix = n - w
    pooled = pool(votes_row[:prefix], kernel, pooling)
    chosen = top_positions({j: pooled[j] for j in range(prefix)}, budget - w)
    return sorted(chosen + list(range(prefix, n)))


def kept(cache, b: int, k: int) -> list[int]:
    """Sorted positions held by head (b, k) of a one-layer cache, checking there is no duplicate."""
    length = int(cache.length[b, k])
    pos = np.asarray(cache.pos[b, k])
    assert (pos[length:] == -1).all() and (pos[:length] >= 0).all()
    held = pos[:length].tolist()
    assert len(set(held)) == len(held), f"duplicate slots in head {(b, k)}: {held}"
    return sorted(held)


def assert_same_set(got: list[int], want: list[int], scores: dict[int, float] | None = None, tol: float = 1e-5):
    """Equal sets; with `scores`, a swap between near-tied tokens (float rounding) is tolerated."""
    if got == want:
        return
    assert len(got) == len(want), (got, want)
    if scores is None:
        raise AssertionError(f"kept {got}, expected {want}")
    extra, missing = set(got) - set(want), set(want) - set(got)
    cutoff = min(scores[p] for p in want if p in scores)
    for p in extra | missing:
        assert abs(scores[p] - cutoff) <= tol * max(1.0, abs(cutoff)), (got, want, p, scores[p], cutoff)


def assert_keeps_reference_top(out, lengths, scores_of, budget: int, tol: float = 1e-4) -> None:
    """Every head of `out` keeps the `budget` best of the reference scores `scores_of(b, n)` `[K, n]` of example `b`
    (length `n`; ties: the lower position; infinite scores are the protected tokens), up to near ties."""
    for b, n in enumerate(lengths):
        scores = scores_of(b, int(n))
        for k in range(scores.shape[0]):
            row = {j: scores[k, j] for j in range(int(n))}
            want = sorted(sorted(row, key=lambda j: (-row[j], j))[:budget])
            assert_same_set(kept(out, b, k), want, {j: v for j, v in row.items() if np.isfinite(v)}, tol=tol)


class Batch:
    """A right-padded GQA batch (8 query heads on 2 KV heads by default) in a one-layer cache."""

    def __init__(self, lengths=(40, 23, 31), n=8, kv=2, h=16, dtype=jnp.bfloat16, seed=0):
        rng = np.random.default_rng(seed)
        self.lengths = np.asarray(lengths)
        b, t = len(lengths), int(max(lengths))
        self.t, self.n, self.kv, self.h = t, n, kv, h
        self.pos = np.where(np.arange(t)[None] < self.lengths[:, None], np.arange(t)[None], -1).astype(np.int32)
        # bf16 storage: the references see exactly the stored values.
        self.q = np.asarray(jnp.asarray(rng.standard_normal((b, t, n, h)), dtype).astype(jnp.float32))
        self.k = np.asarray(jnp.asarray(rng.standard_normal((b, t, kv, h)), dtype).astype(jnp.float32))
        self.v = np.asarray(jnp.asarray(rng.standard_normal((b, t, kv, h)), dtype).astype(jnp.float32))
        self.dtype = dtype

    def cache(self, capacity: int):
        """The cache a prefill hook receives: `capacity` + T slots with the prompt appended."""
        c = kvc.init(len(self.lengths), self.kv, capacity, self.h, self.dtype)
        return kvc.append(kvc.extend(c, self.t), jnp.asarray(self.k), jnp.asarray(self.v), jnp.asarray(self.pos))

    def step(self, method, capacity: int, layer: int = 0, num_layers: int = 4) -> Step:
        from kvjax.methods import per_example_budget

        return Step(
            positions=jnp.asarray(self.pos), budget=jnp.asarray(per_example_budget(method, self.lengths)),
            layer=jnp.int32(layer), inv_freq=jnp.ones(self.h // 2, jnp.float32), capacity=capacity,
            num_layers=num_layers,
        )

    def qj(self):
        return jnp.asarray(self.q, self.dtype)

    def votes(self, window, group_reduce="mean", row_reduce="sum"):
        """SnapKV votes `[B, K, T]` (summed over the window rows, or averaged: `row_reduce="mean"`) by slot =
        position."""
        kp = np.broadcast_to(np.maximum(self.pos, 0)[:, None], (len(self.lengths), self.kv, self.t))
        valid = np.broadcast_to((self.pos >= 0)[:, None], kp.shape)
        return window_votes(self.q, self.pos, self.k.transpose(0, 2, 1, 3), kp, valid, window, row_reduce,
                            group_reduce)


def ref_adaptive(scores, valid, protect, positions, budget, cap, floor, counts_protected=False):
    """Ada-KV's allocation for one example, from the paper's description: each head keeps its best
    `floor * (budget - P)` candidates (at least one), the rest of the layer's budget goes to the best
    remaining candidates across heads, no head above `cap` slots. Returns slots per head.
    `counts_protected`: kvpress's safeguard, `floor * budget` slots (at least one) of which the `P` protected
    ones are the first."""
    kv = scores.shape[0]
    n_prot = [int((protect[k] & valid[k]).sum()) for k in range(kv)]
    cand = [[j for j in range(scores.shape[1]) if valid[k, j] and not protect[k, j]] for k in range(kv)]
    base = [max(budget - n_prot[k], 0) for k in range(kv)]
    avail = [min(len(cand[k]), max(cap - n_prot[k], 0)) for k in range(kv)]
    total = min(sum(base), sum(avail))
    guard = []
    for k in range(kv):
        share = budget if counts_protected else base[k]
        g = int(np.floor(np.float32(floor) * np.float32(share)))
        if floor > 0:
            g = max(g, min(share, 1))
        if counts_protected:
            g = max(g - n_prot[k], 0)
        guard.append(min(g, avail[k]))
    rest = []
    for k in range(kv):
        order = sorted(cand[k], key=lambda j: (-scores[k, j], positions[k, j]))
        rest += [(-scores[k, j], positions[k, j], k) for j in order[guard[k] : avail[k]]]
    chosen = sorted(rest)[: total - sum(guard)]
    return [n_prot[k] + guard[k] + sum(1 for e in chosen if e[2] == k) for k in range(kv)]


# ---- method-level helpers ---------------------------------------------------------------------


def run_prefill(method, batch: Batch, *, layer: int = 0, num_layers: int = 4, max_new: int = 3):
    """The method's prefill hook on the batch's one-layer cache; returns (out, in, step)."""
    import jax

    capacity = method.capacity(batch.t, max_new)
    cache = batch.cache(capacity)
    step = batch.step(method, capacity, layer, num_layers)
    return jax.jit(method.prefill)(cache, batch.qj(), step), cache, step


def assert_kept_top_of_scores(method, cache, q, step, out) -> None:
    """The kept unprotected slots of every head score at least as high as every evicted one."""
    budget = method.layer_budget(cache, step)
    protect = method.protected(cache, budget, step)
    scores = np.asarray(method.scores(cache, q, step, protect))
    protect = np.zeros(scores.shape, bool) if protect is None else np.asarray(protect)
    pos = np.asarray(cache.pos)
    for b in range(pos.shape[0]):
        for k in range(pos.shape[1]):
            held = set(kept(out, b, k))
            stored = [j for j in range(pos.shape[2]) if pos[b, k, j] >= 0]
            assert all(pos[b, k, j] in held for j in stored if protect[b, k, j])
            ins = [scores[b, k, j] for j in stored if pos[b, k, j] in held and not protect[b, k, j]]
            outs = [scores[b, k, j] for j in stored if pos[b, k, j] not in held]
            if ins and outs:
                assert min(ins) >= max(outs), (b, k, min(ins), max(outs))


def assert_batch_equals_loop(method, batch: Batch, *, layer: int = 0) -> None:
    """The batched hook, `jax.vmap` of the one-example hook and a Python loop agree per example."""
    import jax

    from kvjax.cache import KVCache

    out, cache, step = run_prefill(method, batch, layer=layer)

    def one(c: KVCache, q, positions, budget):
        c1 = jax.tree.map(lambda x: x[None], c)
        s1 = Step(positions=positions[None], budget=budget[None], layer=step.layer, inv_freq=step.inv_freq,
                  capacity=step.capacity, num_layers=step.num_layers, out_proj=step.out_proj)
        return jax.tree.map(lambda x: x[0], method.prefill(c1, q[None], s1))

    args = (cache, batch.qj(), step.positions, step.budget)
    vmapped = jax.jit(jax.vmap(one))(*args)
    single = jax.jit(one)
    for b in range(len(batch.lengths)):
        loop = single(*jax.tree.map(lambda x, b=b: x[b], args))
        for k in range(batch.kv):
            want = sorted(np.asarray(loop.pos[k])[: int(loop.length[k])].tolist())
            assert kept(out, b, k) == want and kept(vmapped, b, k) == want, (b, k)


def assert_keeps_everything(method, batch: Batch) -> None:
    """budget >= prompt: the hook is the identity and attention over the cache equals full."""
    import jax

    from kvjax.ops.attention import decode_attention

    out, cache, step = run_prefill(method, batch)
    for b in range(len(batch.lengths)):
        for k in range(batch.kv):
            assert kept(out, b, k) == list(range(int(batch.lengths[b])))
    q = jax.random.normal(jax.random.key(0), (len(batch.lengths), batch.n, batch.h), jnp.float32)
    qpos = jnp.asarray(batch.lengths, jnp.int32)
    full = decode_attention(q, qpos, cache.k, cache.v, cache.pos, kvc.valid_mask(cache))
    comp = decode_attention(q, qpos, out.k, out.v, out.pos, kvc.valid_mask(out))
    np.testing.assert_allclose(np.asarray(comp), np.asarray(full), atol=1e-6)


def prompt_kept(cache, b: int, n: int, layers: list[int] | None = None) -> list:
    """`[L][K]` sorted prompt positions (below `n`) example `b` of a model cache holds, per layer (`layers`: those
    only) and KV head."""
    chosen = range(len(cache.layers)) if layers is None else layers
    return [[sorted(int(p) for p in head if 0 <= p < n) for head in np.asarray(cache.layers[i].pos)[b]]
            for i in chosen]


def assert_generate_batch_equals_loop(model, method, prompts, *, max_new_tokens: int = 5,
                                      layers: list[int] | None = None) -> None:
    """`kvjax.generate` of a ragged batch equals each prompt alone: the same tokens and kept prompt positions."""
    import kvjax

    together = kvjax.generate(model, prompts, method=method, max_new_tokens=max_new_tokens, return_cache=True)
    for b, prompt in enumerate(prompts):
        alone = kvjax.generate(model, [prompt], method=method, max_new_tokens=max_new_tokens, return_cache=True)
        np.testing.assert_array_equal(together.tokens[b], alone.tokens[0])
        assert prompt_kept(together.cache, b, len(prompt), layers) == prompt_kept(alone.cache, 0, len(prompt), layers)


def generate_and_check(
    method, lengths=(40, 23, 31), *, max_new=5, num_layers=2, prompt_kept=None, seed=0, chunk_size=None,
    check_heads=True,
):
    """End to end through `kvjax.generate` on a tiny bf16 GQA model (8 query / 2 KV heads).

    Checks the decode step traced once, that no head holds a position twice, that every head got
    the `max_new - 1` tokens fed back, and (with `check_heads`) that every layer and head holds
    exactly `prompt_kept(layer, example)` prompt tokens.
    Returns the result.
    """
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
    result = kvjax.generate(
        model, prompts, method=method, max_new_tokens=max_new, return_cache=True, chunk_size=chunk_size
    )
    assert TRACE_COUNTS["decode_step"] - before == 1, "the decode step must trace exactly once"
    assert result.tokens.shape == (len(lengths), max_new)
    pos = [np.asarray(layer.pos) for layer in result.cache.layers]  # per layer [B, K, C] (C: the layer's own)
    assert len(pos) == num_layers and max(p.shape[-1] for p in pos) == result.cache.capacity
    for layer in range(num_layers):
        for b, n in enumerate(lengths):
            want = prompt_kept(layer, b) if prompt_kept else n
            for k in range(pos[layer].shape[1]):
                row = pos[layer][b, k]
                held = row[row >= 0]
                assert len(set(held.tolist())) == len(held)
                if check_heads:
                    assert int((held < n).sum()) == want, (layer, b, k, int((held < n).sum()), want)
                assert sorted(held[held >= n].tolist()) == list(range(n, n + max_new - 1))
    return result
