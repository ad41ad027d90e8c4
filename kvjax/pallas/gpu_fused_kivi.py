"""KIVI in the fused decode kernel (`kvjax.pallas.gpu_fused_decode`): split 0's part of a KIVI-2 / KIVI-4 layer.

A KIVI cache (`kvjax.quant.storage`) holds keys quantized per channel over groups of `G` slots, values per token,
and its newest tokens in a full-precision ring of `R + 1` rows. The kernel's splits share the whole groups below
`qlen` (codes read by `gpu_quantized.attend_block`, a block never crossing a group). Split 0 alone then reads the
rest, here, `KIVI_CHUNK` rows at a time:

* **the group at `qlen`**: its codes below `qlen`, ring rows from it. When the step's token leaves more than `R`
  tokens pending, the group is flushed as `kvjax.quant.storage.write_token` does: keys quantized per channel over
  the group (their range taken over its rows first), values per token, written in place with their scales and
  zeros, and attended as their new codes read back;
* **the ring's pending tokens past it** (a gather of their rows).

Everything stays in the codes' channel planes: no concatenation, none to pack. `qlen` moves to the group's end in
the merge kernel (`flushed_qlen` per head), after every split has read it: the other splits read it to count the
whole groups, so a write by split 0 would race with them (jax 0.11's interpreter, which runs the aliased operands
in place, showed it: a later split attended the flushed group a second time)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.pallas import gpu_unpack
from kvjax.pallas._common import NEG
from kvjax.pallas.gpu_common import dot, keep_mask, pow2, slot_ok
from kvjax.pallas.gpu_token_codes import asymmetric_codes, pack_planes
from kvjax.quant import codes

Array = jax.Array


def attend_planes(carry: tuple, q_planes: list[Array], k_planes: list[Array], v_planes: list[Array],
                  keep: Array) -> tuple:
    """`gpu_common.attend_window` with q / k / v split into the codes' channel planes (`[Gp | W, H / P]` each; q in
    the dot dtype, k / v float32 values): `carry` is `(m, l, acc)` with `acc` a tuple of `P` planes, as
    `gpu_quantized.attend_block`'s."""
    m, l, acc = carry
    dtype = q_planes[0].dtype
    clean = lambda x: jnp.where(jnp.isfinite(x), x, 0.0).astype(dtype)  # noqa: E731  (a NaN-poisoned ring row)
    s = sum(dot(qp, clean(kp), 1) for qp, kp in zip(q_planes, k_planes, strict=True))
    s = s * keep + (1.0 - keep) * NEG
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None]) * keep
    corr = jnp.exp(m - m_new)
    acc = tuple(a * corr[:, None] + dot(p.astype(dtype), clean(vp), 0) for a, vp in zip(acc, v_planes, strict=True))
    return m_new, l * corr + jnp.sum(p, axis=1), acc


#: Rows of KIVI's group and ring that split 0 reads, quantizes and attends at a time. Read whole (a group of 64 and
#: a ring of 128 rows, every channel plane in float32), they held more values than a thread's registers and spilled
#: (BENCHMARKS.md, "The fused kernel's registers").
KIVI_CHUNK = 16


def attend_group_and_ring(carry: tuple, refs: list[Array], outs: list[Array], kp_ref: Array,
                          q_planes: list[Array], new_planes: tuple[list[Array], list[Array]], qp: Array,
                          length: Array, slot: Array, old: Array, *, bits: int, group: int, residual: int,
                          sliding_window: int | None) -> tuple:
    """KIVI, split 0: the slots past the whole groups below `qlen`, attended into `carry` (planes), `KIVI_CHUNK`
    rows at a time.

    The group at `qlen` is read (codes below `qlen`, ring rows from it); when the step's token leaves more than
    `residual` pending it is flushed as `kvjax.quant.storage.write_token` does (keys per channel over the group,
    values per token; written in place, `qlen` moved to its end by the merge kernel) and attended as its new codes
    read back, else its codes below `qlen` are attended (a prefix that ended inside a group); then the ring's
    pending tokens past it."""
    k_data, k_scale, k_zero, k_ring, k_qlen, v_data, v_scale, v_zero, v_ring, _ = refs
    capacity, ring = kp_ref.shape[0], residual + 1
    parts = 8 // bits
    gp, width = q_planes[0].shape
    chunk = min(group, KIVI_CHUNK)
    cols = [i * width + jnp.arange(width, dtype=jnp.int32) for i in range(parts)]
    qlen = k_qlen[()]
    start = (qlen // group) * group
    # the group's key scale / zero row (clamped: a head quantized to a capacity that is a group multiple has no
    # group at `qlen`, and a ref read past its rows is not bounds-checked in Triton; a flush never clamps)
    g_row = pl.ds(jnp.minimum(start // group, k_scale.shape[0] - 1), 1)
    k_stats = [(k_scale[g_row, pl.ds(i * width, width)].astype(jnp.float32),
                k_zero[g_row, pl.ds(i * width, width)].astype(jnp.float32)) for i in range(parts)]

    def read(first: Array) -> tuple[Array, Array, list[Array], list[Array]]:
        """Rows `[first, first + chunk)` as they read now: codes below `qlen`, the ring from it (the step's token
        from registers); their ids, clamped ids, and K / V planes `[chunk, H / P]` float32."""
        ids = first + jnp.arange(chunk, dtype=jnp.int32)
        safe = jnp.minimum(ids, capacity - 1)
        k_codes, v_codes = k_data[safe[:, None], cols[0][None, :]], v_data[safe[:, None], cols[0][None, :]]
        coded = (safe < qlen)[:, None]
        fresh = (safe == slot)[:, None]
        ring_rows = jax.lax.rem(safe, ring)
        v_s, v_z = v_scale[safe].astype(jnp.float32)[:, None], v_zero[safe].astype(jnp.float32)[:, None]
        k_vals, v_vals = [], []
        for i, (k_s, k_z) in enumerate(k_stats):
            kc = gpu_unpack.plane(k_codes, i * bits, bits, jnp.float32, asm=False) * k_s + k_z
            vc = gpu_unpack.plane(v_codes, i * bits, bits, jnp.float32, asm=False) * v_s + v_z
            at = (ring_rows[:, None], cols[i][None, :])
            kr = jnp.where(fresh, new_planes[0][i][None, :], k_ring[at].astype(jnp.float32))
            vr = jnp.where(fresh, new_planes[1][i][None, :], v_ring[at].astype(jnp.float32))
            k_vals.append(jnp.where(coded, kc, kr))
            v_vals.append(jnp.where(coded, vc, vr))
        return ids, safe, k_vals, v_vals

    def keep(ids: Array, safe: Array, end: Array) -> Array:
        kp = kp_ref[safe]
        return keep_mask((ids < end) & (ids < old) & (kp >= 0) & slot_ok(kp, qp, sliding_window), gp)

    def chunks(rows: Array) -> Array:
        return jnp.maximum(rows + (chunk - 1), 0) // chunk

    def coded_part(carry: tuple) -> tuple:
        """No flush: the group's codes below `qlen` (none unless a prefix ended inside the group)."""
        def step(j: Array, carry: tuple) -> tuple:
            ids, safe, k_vals, v_vals = read(start + j * chunk)
            return attend_planes(carry, q_planes, k_vals, v_vals, keep(ids, safe, qlen))

        return jax.lax.fori_loop(0, chunks(jnp.minimum(qlen, old) - start), step, carry)

    def flushed(carry: tuple) -> tuple:
        """The group quantized (keys per channel over its rows, values per token), written in place, and attended
        as its new codes read back."""
        def extremes(j: Array, acc: tuple) -> tuple:
            k_vals = read(start + j * chunk)[2]
            return tuple((jnp.minimum(lo, jnp.min(x, axis=0, keepdims=True)),
                          jnp.maximum(hi, jnp.max(x, axis=0, keepdims=True)))
                         for (lo, hi), x in zip(acc, k_vals, strict=True))

        unset = (jnp.full((1, width), jnp.inf, jnp.float32), jnp.full((1, width), -jnp.inf, jnp.float32))
        bounds = jax.lax.fori_loop(0, group // chunk, extremes, (unset,) * parts)
        k_new = [codes.asymmetric_stats(lo, hi, bits) for lo, hi in bounds]  # per channel: scale, zero [1, H / P]

        def step(j: Array, carry: tuple) -> tuple:
            first = start + j * chunk
            ids, safe, k_vals, v_vals = read(first)
            k_q = [asymmetric_codes(x, scale, zero, bits) for x, (scale, zero) in zip(k_vals, k_new, strict=True)]
            v_lo = functools.reduce(jnp.minimum, [jnp.min(x, axis=1) for x in v_vals])  # per token over the head
            v_hi = functools.reduce(jnp.maximum, [jnp.max(x, axis=1) for x in v_vals])
            v_s, v_z = codes.asymmetric_stats(v_lo, v_hi, bits)
            v_sf, v_zf = v_s.astype(jnp.float32)[:, None], v_z.astype(jnp.float32)[:, None]
            v_q = [asymmetric_codes(x, v_sf, v_zf, bits) for x in v_vals]
            rows = pl.ds(first, chunk)
            outs[0][rows, :] = pack_planes(k_q, bits)
            outs[5][rows, :] = pack_planes(v_q, bits)
            outs[6][rows] = v_s
            outs[7][rows] = v_z
            k_back = [q * scale.astype(jnp.float32) + zero.astype(jnp.float32)
                      for q, (scale, zero) in zip(k_q, k_new, strict=True)]
            return attend_planes(carry, q_planes, k_back, [q * v_sf + v_zf for q in v_q],
                                  keep(ids, safe, start + group))

        carry = jax.lax.fori_loop(0, group // chunk, step, carry)
        for i, (scale, zero) in enumerate(k_new):  # after every chunk read the group's old row
            outs[1][g_row, pl.ds(i * width, width)] = scale
            outs[2][g_row, pl.ds(i * width, width)] = zero
        return carry

    # ---- the group at qlen (the flush is static: a capacity within the ring never flushes)
    counted = (qp >= 0).astype(jnp.int32)
    if capacity > residual:
        flush = flushes(length, counted, qlen, residual)
        # a branch, not a select: a step flushes once a group, and only a flushing step pays for the quantization
        carry = jax.lax.cond(flush, flushed, coded_part, carry)
    else:
        flush, carry = jnp.bool_(False), coded_part(carry)
    # ---- the ring's pending tokens past the group
    done = jnp.where(flush, start + group, qlen)  # slots below it are codes after this step

    def pending(j: Array, carry: tuple) -> tuple:
        ids = done + j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        safe = jnp.minimum(ids, capacity - 1)
        rows = jax.lax.rem(safe, ring)
        k_vals = [k_ring[rows[:, None], c[None, :]].astype(jnp.float32) for c in cols]
        v_vals = [v_ring[rows[:, None], c[None, :]].astype(jnp.float32) for c in cols]
        return attend_planes(carry, q_planes, k_vals, v_vals, keep(ids, safe, old))

    return jax.lax.fori_loop(0, jnp.minimum(chunks(old - done), pow2(residual) // chunk), pending, carry)


def flushes(length: Array, counted: Array, qlen: Array, residual: int) -> Array:
    """Whether KIVI's step flushes the group at `qlen`: the `counted` token leaves more than `residual` pending (a
    capacity within the ring never flushes: the callers' static check)."""
    return length + counted - qlen > residual


def flushed_qlen(length: Array, counted: Array, qlen: Array, group: int, residual: int) -> Array:
    """KIVI's `qlen` after the step (the merge kernel's `update`, per head): the end of the group at `qlen` where
    split 0 flushed it, else as it was."""
    return jnp.where(flushes(length, counted, qlen, residual), (qlen // group) * group + group, qlen)

