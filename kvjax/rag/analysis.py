"""Offline, query-independent statistics of one document's prefill (SamKV §3.2 and Appendix A.1).

Everything here is a pure jnp function of one layer's post-RoPE queries / keys at the document's own
positions, traced inside the document prefill's layer scan:

* block geometry: the first `init_blocks` blocks and the last `local_blocks * block_size` tokens are
  kept whole; the tokens in between form the *middle* blocks (the last one may be partial);
* pooled vectors: the local-query mean `q_loc` (Eq. 1's `Q_doc-j_loc`), the mean key of every middle
  block and the anchor key (mean over the init + local tokens) used by Eq. 2;
* Appendix A.1: per middle block, the representative token (the largest mean attention received
  from later tokens, the *unimportance* attribute `u`), and the power-law exponent `alpha` of the
  attention that token keeps receiving (`A[r + x, r] ~ c x^-alpha`, least squares in log-log);
  the `max` block (smallest alpha), the `min` block (smallest u) and the PauTa (3-sigma) outliers
  whose representative tokens SamKV recomputes.

Attention probabilities are averaged over query heads and never materialised for more than one
block of query rows at a time.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError

Array = jax.Array
_NEG = -1e30


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """SamKV's block geometry: `init_blocks` + `local_blocks` blocks of `block_size` tokens kept whole."""

    block_size: int = 64
    init_blocks: int = 1
    local_blocks: int = 2

    def __post_init__(self) -> None:
        for name, low in (("block_size", 1), ("init_blocks", 0), ("local_blocks", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"BlockLayout.{name} must be an integer >= {low}, got {value!r}")

    @property
    def keep_tokens(self) -> int:
        """Tokens of a document always kept (init + local), when it is long enough."""
        return (self.init_blocks + self.local_blocks) * self.block_size

    def middle_blocks(self, n: int) -> int:
        """Middle blocks of a document of `n` tokens (host-side)."""
        return max(0, -(-(n - self.keep_tokens) // self.block_size))

    def block_capacity(self, n_pad: int) -> int:
        """Static number of middle-block slots for documents padded to `n_pad` tokens (at least 1)."""
        return max(1, self.middle_blocks(n_pad))

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Geometry:
    """Per-token roles of one padded document (`[N]` arrays) and its middle blocks (`[MB]`)."""

    valid: Array  # token < n
    keep: Array  # init or local token (always kept, recomputed by default)
    middle: Array  # middle token
    qloc: Array  # token pooled into q_loc: the last local_blocks * block_size tokens
    block: Array  # int32 middle-block id of a middle token, -1 otherwise
    block_valid: Array  # [MB] the block exists
    block_start: Array  # [MB] int32 first token of the block
    block_len: Array  # [MB] int32 tokens in the block (0 when invalid)


def geometry(n: Array | int, n_pad: int, layout: BlockLayout) -> Geometry:
    """Token roles of a document of `n` (traced) real tokens padded to `n_pad` (§2.0 of the spec).

    init = `[0, init_blocks * bs)`, local = the last `local_blocks * bs` tokens, middle = between
    them in blocks of `bs` starting right after init; the last middle block may be partial.
    """
    bs = layout.block_size
    t = jnp.arange(n_pad, dtype=jnp.int32)
    n = jnp.asarray(n, jnp.int32)
    init_end = jnp.minimum(n, layout.init_blocks * bs)
    loc_start = jnp.maximum(init_end, n - layout.local_blocks * bs)
    valid = t < n
    middle = valid & (t >= init_end) & (t < loc_start)
    block = jnp.where(middle, (t - init_end) // bs, -1)
    mb = layout.block_capacity(n_pad)
    b = jnp.arange(mb, dtype=jnp.int32)
    start = init_end + b * bs
    length = jnp.clip(loc_start - start, 0, bs)
    return Geometry(
        valid=valid, keep=valid & ~middle, middle=middle, qloc=valid & (t >= n - layout.local_blocks * bs),
        block=block, block_valid=length > 0, block_start=start, block_len=length,
    )


def _masked_mean(x: Array, w: Array) -> Array:
    """Mean of `x` `[T, ...]` over the rows where `w` `[T]` is set (zeros when none)."""
    wf = w.astype(jnp.float32)
    total = jnp.tensordot(wf, x.astype(jnp.float32), axes=(0, 0))
    return total / jnp.maximum(jnp.sum(wf), 1.0)


def block_means(k: Array, block: Array, num_blocks: int) -> Array:
    """Mean key of every middle block: `k` `[T, K, H]`, `block` `[T]` -> `[MB, K, H]` float32."""
    seg = jnp.where(block >= 0, block, num_blocks)
    sums = jax.ops.segment_sum(k.astype(jnp.float32), seg, num_segments=num_blocks + 1)[:num_blocks]
    counts = jax.ops.segment_sum(jnp.ones_like(seg, jnp.float32), seg, num_segments=num_blocks + 1)[:num_blocks]
    return sums / jnp.maximum(counts, 1.0)[:, None, None]


def _attention_mask(q_pos: Array, k_pos: Array, k_valid: Array, window: int | None) -> Array:
    mask = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] >= 0)
    if window is not None:
        mask &= q_pos[:, None] - k_pos[None, :] < window
    return mask


def column_attention(
    q: Array, k: Array, pos: Array, valid: Array, *, sliding_window: int | None = None, block_q: int = 256
) -> tuple[Array, Array]:
    """Mean attention each key receives from later tokens, and every row's log-sum-exp.

    q `[T, N, H]`, k `[T, K, H]` (post-RoPE), pos / valid `[T]`. Probabilities are the model's causal
    softmax averaged over query heads. Returns `col` `[T]` = mean over valid `u` with
    `pos[u] > pos[t]` of `A[u, t]`, and `lse` `[N, T]` (per query head and row), float32.
    """
    t_len, n, h = q.shape
    kv = k.shape[1]
    g = n // kv
    scale = 1.0 / math.sqrt(h)
    bq = min(block_q, t_len)
    pad = -t_len % bq
    qp = jnp.pad(q.astype(jnp.float32), ((0, pad), (0, 0), (0, 0))).reshape(-1, bq, kv, g, h)
    pp = jnp.pad(jnp.where(valid, pos, -1), (0, pad), constant_values=-1).reshape(-1, bq)
    kf = k.astype(jnp.float32)

    def step(colsum: Array, blk: tuple[Array, Array]) -> tuple[Array, Array]:
        qb, pb = blk
        s = jnp.einsum("qkgh,tkh->kgqt", qb, kf) * scale
        mask = _attention_mask(pb, pos, valid, sliding_window)
        s = jnp.where(mask, s, _NEG)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.where(mask, jnp.exp(s - m), 0.0)
        l_sum = jnp.sum(p, axis=-1, keepdims=True)
        lse = (m + jnp.log(jnp.maximum(l_sum, 1e-30)))[..., 0]  # [K, G, bq]
        a = jnp.mean(p / jnp.maximum(l_sum, 1e-30), axis=(0, 1))  # [bq, T]
        later = mask & (pos[None, :] < pb[:, None])
        colsum = colsum + jnp.sum(jnp.where(later, a, 0.0), axis=0)
        return colsum, lse.reshape(n, bq)

    colsum, lse = jax.lax.scan(step, jnp.zeros((t_len,), jnp.float32), (qp, pp))
    lse = jnp.moveaxis(lse, 0, 1).reshape(n, -1)[:, :t_len]
    vpos = jnp.where(valid, pos, -1)
    later_count = jnp.sum(valid[None, :] & (vpos[None, :] > vpos[:, None]), axis=1)
    return colsum / jnp.maximum(later_count, 1).astype(jnp.float32), lse


def representative_tokens(col: Array, block: Array, num_blocks: int) -> tuple[Array, Array]:
    """Per middle block: the token with the largest `col` (A.1) and that value (`u`, unimportance)."""
    member = block[None, :] == jnp.arange(num_blocks, dtype=jnp.int32)[:, None]  # [MB, T]
    scores = jnp.where(member, col[None, :], -jnp.inf)
    return jnp.argmax(scores, axis=1).astype(jnp.int32), jnp.max(scores, axis=1)


def fit_slope(x: Array, y: Array, mask: Array, axis: int = 0) -> tuple[Array, Array]:
    """Least-squares slope of `y` on `x` over `mask`, with centred sums (float32-safe).

    Returns `(slope, ok)`; `ok` is False where fewer than two distinct `x` were given.
    """
    w = mask.astype(jnp.float32)
    x = jnp.where(mask, x, 0.0)
    y = jnp.where(mask, y, 0.0)
    count = jnp.sum(w, axis=axis, keepdims=True)
    safe = jnp.maximum(count, 1.0)
    mx = jnp.sum(w * x, axis=axis, keepdims=True) / safe
    my = jnp.sum(w * y, axis=axis, keepdims=True) / safe
    dx = (x - mx) * w
    sxx = jnp.sum(dx * (x - mx), axis=axis)
    sxy = jnp.sum(dx * (y - my), axis=axis)
    ok = (jnp.squeeze(count, axis) >= 2) & (sxx > 0)
    return jnp.where(ok, sxy / jnp.where(ok, sxx, 1.0), 0.0), ok


def power_law_alpha(
    q: Array, k: Array, lse: Array, pos: Array, valid: Array, rep: Array, *, sliding_window: int | None = None
) -> tuple[Array, Array]:
    """Fitted exponent `alpha` of `A[r + x, r] ~ c x^-alpha` for each representative token `r` (A.1).

    `x` is the distance of the attending token; `A` is the head-averaged probability, clipped at
    1e-12 before the log. Returns `(alpha [MB], ok [MB])`.
    """
    t_len, n, h = q.shape
    kv = k.shape[1]
    g = n // kv
    kr = jnp.take(k, rep, axis=0).astype(jnp.float32)  # [MB, K, H]
    pr = jnp.take(pos, rep)
    s = jnp.einsum("tkgh,bkh->kgtb", q.astype(jnp.float32).reshape(t_len, kv, g, h), kr) / math.sqrt(h)
    p = jnp.mean(jnp.exp(s - lse.reshape(kv, g, t_len)[..., None]), axis=(0, 1))  # [T, MB]
    dist = pos[:, None] - pr[None, :]
    mask = valid[:, None] & (pos[:, None] >= 0) & (dist > 0)
    if sliding_window is not None:
        mask &= dist < sliding_window
    lx = jnp.log(jnp.maximum(dist, 1).astype(jnp.float32))
    ly = jnp.log(jnp.maximum(p, 1e-12))
    slope, ok = fit_slope(lx, ly, mask, axis=0)
    return -slope, ok


def pauta_outliers(alpha: Array, usable: Array, sigma: float = 3.0) -> Array:
    """PauTa criterion, one-sided: blocks with `alpha < mean - sigma * std` (population std)."""
    w = usable.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1.0)
    mean = jnp.sum(w * alpha, axis=-1, keepdims=True) / count
    std = jnp.sqrt(jnp.sum(w * (alpha - mean) ** 2, axis=-1, keepdims=True) / count)
    return usable & (alpha < mean - sigma * std)


def layer_statistics(
    q: Array, k: Array, pos: Array, geo: Geometry, *, sliding_window: int | None = None
) -> dict[str, Array]:
    """Everything SamKV stores for one layer of one document (post-RoPE, local positions)."""
    mb = geo.block_valid.shape[0]
    col, lse = column_attention(q, k, pos, geo.valid, sliding_window=sliding_window)
    rep, unimportance = representative_tokens(col, geo.block, mb)
    alpha, ok = power_law_alpha(q, k, lse, pos, geo.valid, rep, sliding_window=sliding_window)
    usable = geo.block_valid & ok
    return {
        "q_loc": _masked_mean(q, geo.qloc),
        "k_block": block_means(k, geo.block, mb),
        "k_anchor": _masked_mean(k, geo.keep),
        "rep_token": jnp.where(geo.block_valid, rep, -1),
        "unimportance": jnp.where(geo.block_valid, unimportance, jnp.inf),
        "alpha": jnp.where(usable, alpha, jnp.inf),
        "pauta": pauta_outliers(jnp.where(usable, alpha, 0.0), usable),
        "b_max": jnp.argmin(jnp.where(usable, alpha, jnp.inf)).astype(jnp.int32),
        "b_min": jnp.argmin(jnp.where(geo.block_valid, unimportance, jnp.inf)).astype(jnp.int32),
    }
