"""How the quantized kernels lay out a head's channels in registers: the channel planes of packed codes, and codes
read as int16 pairs of bytes.

Sub-byte codes are packed planar (`kvjax.quant.codes`): byte `i` of a head holds channels `i, i + H / P, ...`, so
a kernel's query and output are split into `P` channel planes, and each dot runs over one plane of the codes. Read
as int16 pairs of bytes (`as_pairs`, a bitcast in XLA), a pair holds the bytes of channels `2n` and `2n + 1`, so
each byte plane splits again into its even (low bytes) and odd (high bytes) channels (`plane_lanes`). These are
the layouts' index maps and their inverses, in XLA (`query_planes`, `planes_to_channels`) and in registers
(`split_planes`, `join_planes`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def as_pairs(data: Array) -> Array:
    """int8 codes `[..., H]` -> the same bytes as int16 `[..., H / 2]`, channels `2i` (low byte) and `2i + 1` (high
    byte) in element `i`: a bitcast in XLA (no copy). Read so, a block is 16-bit in shared memory, which Hopper moves
    into the dots' operand layout with transposing `ldmatrix` (8-bit codes go one byte per load: BENCHMARKS.md)."""
    return jax.lax.bitcast_convert_type(data.reshape(*data.shape[:-1], data.shape[-1] // 2, 2), jnp.int16)


def from_pairs(data: Array, dtype: jnp.dtype = jnp.int8) -> Array:
    """`as_pairs`' inverse: int16 `[..., H / 2]` -> bytes `[..., H]` in `dtype` (int8 codes; uint8 packed codes): a
    bitcast."""
    return jax.lax.bitcast_convert_type(data, dtype).reshape(*data.shape[:-1], data.shape[-1] * 2)


def deinterleave(x: Array) -> list[Array]:
    """`x [..., H]` -> its even and odd channels `[..., H / 2]` (the planes of `as_pairs` codes), in registers
    (a reshape and `jnp.unstack`: Triton's split)."""
    return list(jnp.unstack(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), axis=-1))


def interleave(even: Array, odd: Array) -> Array:
    """`deinterleave`'s inverse: `[..., H / 2]` twice -> `[..., H]`."""
    return jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], even.shape[-1] * 2)


def plane_count(bits: int, pairs: bool) -> int:
    """The channel planes of a kernel's query or output over `bits`-bit codes (1 for 8-bit codes, 16-bit caches),
    twice as many where the codes are read as int16 pairs of bytes (their low and high bytes' planes)."""
    return (8 // bits if bits < 8 else 1) * (2 if pairs else 1)


def plane_lanes(h: int, parts: int, pairs: bool) -> list[Array]:
    """The channels of each of `parts` planes of an `h`-channel head: plane `i` channels `[i h / P, (i + 1) h / P)`
    (bytes of planar packed codes: `kvjax.quant.codes`); read as int16 pairs, plane `2 b + j` the even (`j = 0`,
    low bytes) or odd (`j = 1`, high bytes) channels of block `b` of `2 h / P` channels (the byte plane `b`)."""
    width = h // parts
    steps = jnp.arange(width, dtype=jnp.int32)
    if pairs:
        return [(i // 2) * (2 * width) + (i % 2) + 2 * steps for i in range(parts)]
    return [i * width + steps for i in range(parts)]


def query_planes(q: Array, parts: int, pairs: bool) -> Array:
    """A query `[..., Gp, H]` -> its `parts` channel planes `[..., P, Gp, H / P]` (`plane_lanes`' channels)."""
    h, lead = q.shape[-1], q.shape[:-2]
    if pairs:  # [..., Gp, blocks, H / P, 2] -> [..., blocks, 2, Gp, H / P]
        x = q.reshape(*lead, q.shape[-2], parts // 2, h // parts, 2)
        n = len(lead)
        return x.transpose(*range(n), n + 1, n + 3, n, n + 2).reshape(*lead, parts, q.shape[-2], h // parts)
    return jnp.moveaxis(q.reshape(*q.shape[:-1], parts, h // parts), -2, -3)


def planes_to_channels(acc: Array, pairs: bool) -> Array:
    """`query_planes`' inverse for an output `[..., P, Gp, H / P]` -> `[..., Gp, H]`."""
    lead, parts, gp, width = acc.shape[:-3], *acc.shape[-3:]
    n = len(lead)
    if pairs:  # [..., blocks, 2, Gp, H / P] -> [..., Gp, blocks, H / P, 2]
        x = acc.reshape(*lead, parts // 2, 2, gp, width)
        return x.transpose(*range(n), n + 2, n, n + 3, n + 1).reshape(*lead, gp, parts * width)
    return jnp.moveaxis(acc, -3, -2).reshape(*lead, gp, parts * width)


def split_planes(x: Array, parts: int, pairs: bool) -> list[Array]:
    """A row `[H]` in registers -> its `parts` planes (`plane_lanes`' channels), by splits and Triton's split."""
    count = parts // 2 if pairs else parts
    blocks = jnp.split(x, count) if count > 1 else [x]
    return [y for b in blocks for y in deinterleave(b)] if pairs else blocks


def join_planes(planes: list[Array], pairs: bool) -> list[Array]:
    """`split_planes`' inverse for `[Gp, H / P]` planes in registers -> the head's consecutive channel blocks (read
    as pairs: each block its even and odd planes interleaved; else the planes themselves)."""
    return [interleave(planes[i], planes[i + 1]) for i in range(0, len(planes), 2)] if pairs else list(planes)
