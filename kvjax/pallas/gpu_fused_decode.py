"""One decode-attention kernel per layer (Pallas Triton): the new token's RoPE, its write into the cache and the
split-K attention over the cache, in one `pallas_call`.

The twin of what a decode step does for one layer in XLA (`kvjax.ops.fused_decode.decode_append_attention`'s
"xla" path): `kvjax.rope.apply_rope` of the new query and key, `kvjax.cache.append_token` of its key / value
(slot `length`, clipped into the buffer; `pos`, `length` updated), then `kvjax.ops.attention.decode_attention`
over the layer. Here, per program `(example, KV head, split)`:

* **QK-norm and RoPE in registers** (`kvjax.pallas.gpu_rope`): each query row and the key row normed over
  head_dim with the head's weight (Qwen3, Gemma 3; `qk_norm`), rotated (HF rotate-half, `inv_freq` at the token's
  position) and rounded to the model dtype as the decoder block does; the family's query scale (Gemma) after it.
* **The write in place**: split 0 of each (example, KV head) stores the rotated key and the value into slot
  `min(length, C - 1)` and the position into `pos` (the cache buffers are `input_output_aliases` of the call:
  donated, never copied). The length is counted by the merge kernel below (in place), since a split here could
  read a length another split had already updated. A quantized cache (int8, or int4: two codes a byte in
  channel planes, with a zero) gets the token's codes, scale and zero exactly as `kvjax.quant.storage.write_token`
  computes them (`kvjax.pallas.gpu_token_codes`; a code may move by one where XLA and the
  kernel round the RoPE's multiply-add or a division differently). An fp8 cache (e4m3 codes, one power-of-two
  scale per head) gets the token's codes against its head's scale; a head never written (scale 0) takes one from
  the token, which split 0 writes in place. No other split depends on that write: a set scale is rewritten with
  its own value, and a head never written has no earlier tokens for the splits to read it for (their own copy of
  the new token's term is weighted 0: split 0 alone attends the new token).
* **The attention**: the earlier tokens are the slots `[0, min(length, C - 1))` (valid slots are packed at the
  front), so a head's live blocks come from its length (no XLA pass over the slot mask); they are split evenly
  over the splits and read as `kvjax.pallas.gpu_common.attend_window` does (plain K / V) or as
  `kvjax.pallas.gpu_quantized.attend_block` does (int8 / int4 codes; int4 splits the query and the output into the
  codes' two channel planes; int8 values read as int16 pairs of bytes, `Tuning.gpu_int8_pairs`: the output in even
  and odd channels, the token's value codes written as pairs, and with float16 dots the keys too, the query in
  even and odd channels; int4 codes read so too, `Tuning.gpu_int4_pairs`, keys and values: four planes, each byte
  plane's even and odd channels, `gpu_planes.plane_lanes`); a sub-byte cache's (or codes in pairs') query planes
  are loaded by their own channels (`gpu_rope.rotated_query_planes`). The new token is attended from registers,
  never re-read from the slot another program is writing, and first: its logit and value open the online
  softmax, so that the loops carry nothing else. The splits merge in one more kernel
  (`gpu_attention.merge_split_heads`, one program per (example, KV head)), which writes the group's rows in the
  query's dtype and the new length (`length + (position >= 0)`) over the old one.
* **KIVI** (KIVI-2 / KIVI-4: keys per channel over groups of `G` slots, values per token, the newest tokens in a
  full-precision ring of `R + 1` rows, `kvjax.quant.storage`): split 0 writes the token into its slot's ring row.
  The splits share the whole groups below `qlen` (codes read by `attend_block`, a block never crossing a group),
  split 0 taking as many blocks fewer as the rows it attends alone fill (`split_bounds`' `head`);
  split 0 alone then reads the group at `qlen` (and flushes it when the token leaves more than `R` pending) and
  the ring's pending tokens past it (`kvjax.pallas.gpu_fused_kivi`). A head that is full (its token clipped onto
  the last slot) is outside what decode produces: the layer written is XLA's, but where that slot is quantized
  the kernel attends the token from registers and XLA its codes.
* **In-place eviction** (StreamingLLM, DuoAttention's streaming heads; `evict`, decided before the call): the
  token is written into the evicted slot as well as slot `length`, whose position is cleared, the blocks skip the
  evicted slot, and the merge kernel leaves the length as it was: what `kvjax.cache.append_token` then `evict`
  leave. A token that evicts itself is written, cleared and not attended.
* **A sliding-window ring** (`ring`, Gemma 3's local layers; `kvjax.cache.ring_append`): the token goes to slot
  `position % C` over the position that left the window (a padding row writes nothing), the blocks cover the ring
  as the write leaves it and skip that slot, and the merge kernel caps the length at `C`.
* **A gathered slot list** (the retrieval family's compact decode, `slots`): per (example, KV head) `W` slot
  indices (-1: not listed), read by gather loads; a listed slot equal to the new token's slot attends the new
  token (as many times as it is listed, like the twin's gather).

The queries, key and value come as one operand `[B, K, G + 2, H]` (per KV head its G query rows, then the key
row, then the value row: the decoder block's fused q|k|v layout, which the block hands over as its projection left
it, `qkv=`; formed here from q, k and v otherwise). The query group is read with a clamped row gather (rows `>= G`
repeat row `G - 1`; their outputs are dropped): no padding copy. A capacity below 16 slots (tests only) is
padded, which copies the cache.

Compiled for an H200 (`benchmarks/gpu_compile.py`, Llama-3-8B shape), a decode step on this path launches 14
kernels per layer (the XLA path 26): the two norms (two each), the four weight GEMMs, the q|k|v operand (the
projection's split-K sum), this kernel, its merge, the two residual adds and the MLP's activation product; 6 with
the RMSNorm and weight-product kernels (`kvjax.pallas.gpu_norm`, `kvjax.pallas.gpu_linear`), for a bf16, int8,
int4 or KIVI-2 cache alike (the XLA write of int4 and KIVI-2 made 22 and 37).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.errors import ConfigError
from kvjax.pallas._common import NEG, pad_axis, round_up
from kvjax.pallas.gpu_attention import merge_split_heads
from kvjax.pallas.gpu_common import (
    attend_window,
    check_block,
    compiler_params,
    interpret_mode,
    keep_mask,
    pow2,
    slot_ok,
    split_bounds,
    split_count,
    tile_or_tuned,
)
from kvjax.pallas.gpu_fused_kivi import attend_group_and_ring, flushed_qlen
from kvjax.pallas.gpu_planes import as_pairs, from_pairs, join_planes, plane_count, split_planes
from kvjax.pallas.gpu_quantized import attend_block, dots_dtype, reads_key_pairs, reads_pairs, unpacks_with_asm
from kvjax.pallas.gpu_rope import head_normed, rope_rows, rope_terms, rotated_query_planes
from kvjax.pallas.gpu_token_codes import store_token, token_as_stored
from kvjax.quant.storage import QuantizedKV

Array = jax.Array

#: Cache leaves the kernel reads and writes per layout: K's then V's (`leaves` in `decode_append_attention`).
_LEAVES = {"plain": 2, "int8": 4, "fp8": 4, "int4": 6, "kivi": 10}


def layout(k: Array | QuantizedKV) -> str:
    """"plain" (a model-dtype cache), "int8" (per-token symmetric codes, one scale per token and head), "fp8" (e4m3
    codes, one power-of-two scale per head), "int4" (per-token asymmetric codes, two per byte, a scale and a zero
    per token and head) or "kivi" (KIVI-2 / KIVI-4: keys per channel over slot groups, values per token, the newest
    tokens in a full-precision ring)."""
    if not isinstance(k, QuantizedKV):
        return "plain"
    return "kivi" if k.spec.kivi else k.spec.scheme


def supports(k: Array | QuantizedKV, v: Array | QuantizedKV, gathered: bool) -> str | None:
    """None when the kernel takes these K / V stores, else why not (one line)."""
    if isinstance(k, QuantizedKV) != isinstance(v, QuantizedKV):
        return "keys and values must both be quantized or both plain"
    if not isinstance(k, QuantizedKV):
        return None if k.dtype == v.dtype else "keys and values must share a dtype"
    if k.spec != v.spec:
        return f"keys and values must share a quantization, got {k.spec.name} and {v.spec.name}"
    if k.spec.channels(k.head_dim) != k.head_dim:
        return f"a {k.spec.scheme} cache with one scale per head and token (channel_group=None)"
    if k.spec.kivi:
        group = k.spec.group_size
        if k.wraps:
            return "a KIVI sliding-window ring stays on the XLA path"
        if group & (group - 1) or group < 16 or k.capacity < 16:
            return f"KIVI in the fused kernel: group_size a power of two >= 16 and 16+ slots, got {group}"
    if gathered:
        return "the gathered slot list reads a model-dtype cache only"
    return None


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def _kernel(len_ref: Array, qpos_ref: Array, inv_ref: Array, scaling_ref: Array, qkv_ref: Array, kp_ref: Array,
            *refs: Array, store: str, gathered: bool, block_k: int, splits: int,
            sliding_window: int | None, clamp: bool, query_scale: float, group: int, gp: int,
            dot_dtype: jnp.dtype, qk_norm: tuple[float, bool] | None, kivi: tuple[int, int, int] | None,
            evicts: bool, ring: int | None, pairs: bool, key_pairs: bool, unpack_asm: bool) -> None:
    refs = list(refs)
    n_leaves = _LEAVES[store]
    leaves, refs = refs[:n_leaves], refs[n_leaves:]
    slots_ref = refs.pop(0) if gathered else None
    qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if qk_norm is not None else (None, None)
    ev_ref = refs.pop(0) if evicts else None
    o_ref, m_out, l_out, kp_out, *leaves_out = refs
    capacity, h = kp_ref.shape[0], qkv_ref.shape[1]
    half = h // 2
    qp = qpos_ref[()]
    length = len_ref[()]
    if ring is None:
        slot = jnp.clip(length, 0, capacity - 1)  # where `append_token` writes
        old = jnp.minimum(length, capacity - 1)  # slots [0, old) hold the earlier tokens
    else:  # a sliding-window ring (`ring_append`): position p at slot p % C, over the one that left the window
        slot = jax.lax.rem(jnp.maximum(qp, 0), ring)
        old = jnp.minimum(length + 1, ring)  # the ring as the write leaves it; its slot `slot` is the new token
    split = pl.program_id(2)
    # In-place eviction: the token also goes into the evicted slot `into` (slot `slot` is then cleared; `into ==
    # slot`: the token itself was evicted), which the blocks skip. Without one `into` is `slot`.
    evicted = (ev_ref[()] >= 0) if evicts else False
    into = jnp.where(evicted, ev_ref[()], slot) if evicts else slot
    skips = evicts or ring is not None  # the blocks skip slot `into` (the token is attended from registers)

    # ---- RoPE of the new query rows and key, in registers
    lane = jnp.arange(h, dtype=jnp.int32)
    perm = jax.lax.rem(lane + half, h)
    scaling = scaling_ref[0]
    dtype = qkv_ref.dtype
    bits = {"int8": 8, "fp8": 8, "int4": 4, "kivi": kivi[0] if kivi else 0}.get(store, 16)
    # sub-byte codes: the query and the output in the codes' channel planes (`kvjax.quant.codes`' planar packing)
    rows = jnp.minimum(jnp.arange(gp, dtype=jnp.int32), group - 1)  # the group, its last row repeated up to Gp
    q_planes = rotated_query_planes(qkv_ref, qn_ref, inv_ref, rows, qp, scaling, plane_count(bits, key_pairs),
                                    pairs=key_pairs, qk_norm=qk_norm, query_scale=query_scale)  # [Gp, H / P] each
    k_row, k_perm = qkv_ref[group, :], qkv_ref[group, perm]
    if qk_norm is not None:
        (k_row,), (k_perm,) = head_normed([k_row], [k_perm], [kn_ref[...]], [kn_ref[perm]], *qk_norm, dtype)
    cos, sin = rope_terms(lane, qp, inv_ref, scaling, h)
    k_new = rope_rows(k_row, k_perm, cos, sin).astype(dtype).astype(jnp.float32)
    v_new = qkv_ref[group + 1, :].astype(jnp.float32)

    # ---- the new token as stored (and as the attention reads it back)
    written, k_att, v_att, k_scale, k_zero = token_as_stored(store, k_new, v_new, leaves, qp, dot_dtype, pairs=pairs,
                                                             key_pairs=key_pairs)

    @pl.when((split == 0) & (qp >= 0) if ring is not None else split == 0)  # a ring drops a padding row's token
    def _write() -> None:
        if evicts:  # `kvjax.cache.append_token` then `evict`: the token in both slots, slot `slot` cleared
            kp_out[slot] = jnp.where(evicted, -1, qp)
            kp_out[into] = jnp.where(evicted & (into == slot), -1, qp)
            store_token(leaves_out, written, into)
        else:
            kp_out[slot] = qp
        if store == "kivi":  # the ring row of the slot (`write_token`)
            ring_row = jax.lax.rem(slot, kivi[2] + 1)
            leaves_out[3][ring_row, :] = written[0]
            leaves_out[8][ring_row, :] = written[1]
            return
        store_token(leaves_out, written, slot)

    if store == "fp8":  # the heads' scales, set where never written even by a padding row (`write_token`)
        @pl.when(split == 0)
        def _scales() -> None:
            leaves_out[1][()] = written[1]
            leaves_out[3][()] = written[3]

    # ---- split-K attention over the earlier tokens
    qd = q_planes[0].astype(dot_dtype)  # the plain cache's query (one plane)
    quantized = store != "plain"
    out_planes = plane_count(bits, pairs)  # the values' planes: read as pairs, each byte plane's even and odd
    stores = None  # attend_block's (k codes, scale, zero, v codes, scale, zero)
    if store in ("int8", "fp8"):
        stores = (leaves[0], leaves[1], None, leaves[2], leaves[3], None)
    elif store == "int4":
        stores = tuple(leaves)
    elif store == "kivi":
        stores = (leaves[0], leaves[1], leaves[2], leaves[5], leaves[6], leaves[7])
    q_sum = sum(jnp.sum(x, axis=1) for x in q_planes) if bits < 8 else jnp.zeros((gp,), jnp.float32)
    k_layout, v_layout = {"int8": ("sym", "sym"), "fp8": ("fp8", "fp8"), "int4": ("asym", "asym"),
                          "kivi": ("group", "asym")}.get(store, (None, None))

    def attend(carry: tuple, start: Array, keep: Array, k_rows: Array | None, v_rows: Array | None) -> tuple:
        if quantized:
            return attend_block(carry, q_planes, q_sum, stores, start, keep, k_layout=k_layout, v_layout=v_layout,
                                bits=bits, group=kivi[1] if kivi else block_k, dot_dtype=dot_dtype,
                                unpack_asm=unpack_asm)
        return attend_window(carry, qd, k_rows, v_rows, keep)[0]

    # ---- the new token, from registers, opens the online softmax: the loops below then carry nothing else across
    # (attended after them, its query and value stayed live through them: BENCHMARKS.md). Split 0 attends it; with
    # a gathered list each split as often as its entries list its slot.
    if gathered:
        lo, hi = split_bounds(jnp.int32(slots_ref.shape[0] // block_k), splits, split)
        listed_here = lambda j, n: n + jnp.sum(jnp.where(slots_ref[pl.ds(j * block_k, block_k)] == slot, 1.0, 0.0))  # noqa: E731
        mult = jax.lax.fori_loop(lo, hi, listed_here, jnp.float32(0.0))
    else:
        mult = (split == 0).astype(jnp.float32)
    mult = mult * (qp >= 0).astype(jnp.float32)
    if evicts:  # a token that evicted itself is not in the cache
        mult = mult * (1.0 - (evicted & (into == slot)).astype(jnp.float32))
    k_planes = split_planes(k_att, len(q_planes), key_pairs)
    s_new = sum(jnp.sum(x.astype(dot_dtype).astype(jnp.float32) * y[None, :], axis=1)
                for x, y in zip(q_planes, k_planes, strict=True))
    if k_scale is not None:
        s_new = s_new * k_scale.astype(jnp.float32)
    if k_zero is not None:
        s_new = s_new + q_sum * k_zero.astype(jnp.float32)
    seen = jnp.minimum(mult, 1.0)
    v_planes = split_planes(v_att, out_planes, pairs)
    acc_new = tuple(jnp.broadcast_to(mult * x[None, :], (gp, x.shape[0])) for x in v_planes)
    opened = (s_new * seen + (1.0 - seen) * NEG, jnp.broadcast_to(mult, (gp,)),
              acc_new if quantized else acc_new[0])

    if gathered:
        def body(j: Array, carry: tuple) -> tuple:
            start = pl.multiple_of(j * block_k, block_k)
            idx = slots_ref[pl.ds(start, block_k)]
            listed = idx >= 0
            safe = jnp.clip(idx, 0, capacity - 1)
            kp = kp_ref[safe]
            ok = listed & (idx < old) & (kp >= 0) & slot_ok(kp, qp, sliding_window)
            return attend(carry, start, keep_mask(ok, gp), leaves[0][safe, :], leaves[1][safe, :])

        m, l, acc = jax.lax.fori_loop(lo, hi, body, opened)
    else:
        def body(j: Array, carry: tuple) -> tuple:
            start = pl.multiple_of(j * block_k, block_k)
            if clamp:  # the last block of a capacity that is no block multiple ends at the capacity
                nominal, start = start, jnp.minimum(start, capacity - block_k)
            slot_ids = start + jnp.arange(block_k, dtype=jnp.int32)
            kp = kp_ref[pl.ds(start, block_k)]
            ok = (slot_ids < old) & (kp >= 0) & slot_ok(kp, qp, sliding_window)
            if clamp:
                ok &= slot_ids >= nominal
            if skips:  # the evicted token's (a ring: the departed token's) slot holds the new one
                ok &= slot_ids != into
            rows_ = pl.ds(start, block_k)
            k_rows = None if quantized else leaves[0][rows_, :]
            v_rows = None if quantized else leaves[1][rows_, :]
            return attend(carry, start, keep_mask(ok, gp), k_rows, v_rows)

        head = 0  # blocks' worth of rows split 0 attends besides its blocks
        if store == "kivi":  # the splits take the whole key groups below qlen; split 0 the rest
            blocks = jax.lax.div(jax.lax.div(leaves[4][()], kivi[1]) * kivi[1], block_k)
            head = -(-(kivi[1] + pow2(kivi[2])) // block_k)  # the group at qlen and the ring's pending rows
        else:
            blocks = jax.lax.div(old + (block_k - 1), block_k)
        lo, hi = split_bounds(blocks, splits, split, head)
        m, l, acc = jax.lax.fori_loop(lo, hi, body, opened)
        if store == "kivi":
            new_planes = [jnp.split(x, len(q_planes)) for x in (k_att, v_att)]
            pending = functools.partial(
                attend_group_and_ring, refs=leaves, outs=leaves_out, kp_ref=kp_ref,
                q_planes=[x.astype(dot_dtype) for x in q_planes], new_planes=new_planes, qp=qp, length=length,
                slot=slot, old=old, bits=bits, group=kivi[1], residual=kivi[2], sliding_window=sliding_window)
            m, l, acc = jax.lax.fori_loop(0, (split == 0).astype(jnp.int32), lambda _, c: pending(c), (m, l, acc))
    blocks = join_planes(acc if quantized else (acc,), pairs)
    if len(blocks) == 1:
        o_ref[...] = blocks[0]
    else:
        width = h // len(blocks)
        for i, block in enumerate(blocks):
            o_ref[:, pl.ds(i * width, width)] = block
    m_out[...] = m
    l_out[...] = l


def _cache_leaves(k: Array | QuantizedKV, v: Array | QuantizedKV, store: str) -> list[Array]:
    """The `_LEAVES[store]` arrays of the layer's K / V that the kernel reads and writes, K's then V's."""
    if store == "plain":
        return [k, v]
    if store == "kivi":  # per role: codes, scale, zero (keys `[B, K, C / G, H]`, values `[B, K, C]`), ring, qlen
        return [k.data, k.scale, k.zero, k.residual, k.qlen, v.data, v.scale[..., 0], v.zero[..., 0], v.residual,
                v.qlen]
    if store == "fp8":  # codes, then the head's scale [B, K]
        return [k.data, k.scale, v.data, v.scale]
    # codes, then the per-token scale (and zero) as [B, K, C]
    return [x[..., 0] if i else x for qa in (k, v) for i, x in enumerate((qa.data, qa.scale, qa.zero))
            if x is not None]


def _from_leaves(k: Array | QuantizedKV, v: Array | QuantizedKV, store: str,
                 leaves: list[Array]) -> tuple[Array | QuantizedKV, Array | QuantizedKV]:
    """`_cache_leaves`' inverse: the layer's K / V holding the kernel's written `leaves`."""
    if store == "plain":
        return leaves[0], leaves[1]
    if store == "kivi":
        return tuple(qa.replace(data=xs[0], scale=xs[1] if qa is k else xs[1][..., None],
                                zero=xs[2] if qa is k else xs[2][..., None], residual=xs[3], qlen=xs[4])
                     for qa, xs in ((k, leaves[:5]), (v, leaves[5:])))
    if store == "fp8":
        return tuple(qa.replace(data=xs[0], scale=xs[1]) for qa, xs in ((k, leaves[:2]), (v, leaves[2:])))
    half = len(leaves) // 2
    return tuple(qa.replace(data=xs[0], scale=xs[1][..., None], **({"zero": xs[2][..., None]} if len(xs) > 2 else {}))
                 for qa, xs in ((k, leaves[:half]), (v, leaves[half:])))


def decode_append_attention(
    q: Array,
    k_new: Array,
    v_new: Array,
    position: Array,
    inv_freq: Array,
    k: Array | QuantizedKV,
    v: Array | QuantizedKV,
    pos: Array,
    length: Array,
    *,
    scaling: float | Array = 1.0,
    query_scale: float = 1.0,
    sliding_window: int | None = None,
    slots: Array | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    int8_pairs: bool | None = None,
    int4_pairs: bool | None = None,
    unpack_asm: bool | None = None,
    f16_dots: bool | None = None,
    interpret: bool | None = None,
    qkv: Array | None = None,
    qk_norm: tuple[Array, Array, float, bool] | None = None,
    evict: Array | None = None,
    ring: bool = False,
) -> tuple[Array, Array | QuantizedKV, Array | QuantizedKV, Array, Array]:
    """One decode step of one layer: q `[B, N, H]` and k_new `[B, K, H]` before RoPE, v_new `[B, K, H]`,
    `position` `[B]` (-1: a padding row), the layer's `inv_freq` `[H / 2]`, its cache `k` / `v` `[B, K, C, H]`
    (or int8 / int4 `QuantizedKV` stores, one scale per token and head; fp8, one per head; KIVI), `pos`
    `[B, K, C]`, `length` `[B, K]`;
    `scaling` the RoPE's attention factor (a float or a traced scalar), `query_scale` the family's (static);
    `slots` `[B, K, W]` (-1: unused) attends only those slots. `qkv` `[B, K, G + 2, H]`: the same q, k_new and
    v_new in the fused layout the kernel reads, where the caller holds them so (the decoder block's q|k|v
    projection), else formed here. `qk_norm` `(q_weight [H], k_weight [H], eps, plus_one)`: q and k come before
    their QK-norm, which the kernel applies (in q's dtype) before RoPE. `evict` `[B, K]` int32: the slot whose token
    the new one replaces (`kvjax.cache.append_token` then `evict`: the token written there too, slot `length`
    cleared, the length unchanged), -1 where none (given only for a counted token). `ring`: the layer is a
    sliding-window ring (`kvjax.cache.ring_append`: the token at slot `position % C`, a padding row's not written,
    the length capped at `C`). Returns `(out [B, N, H] in q's
    dtype, k, v, pos, length)` with the new token written (the cache leaves are aliased in place: donate them).
    `block_k` (slots per block), `num_warps`, `num_stages` and the program target default to the current tuning's
    `gpu_*` fields (`kvjax.tuning`; a quantized cache's tile: `Tuning.tile(quantized=True)`), `int8_pairs` (an int8
    cache's value codes read and written as int16 pairs, `gpu_planes.as_pairs`) to its `gpu_int8_pairs`,
    `int4_pairs` (an int4 cache's codes read so) to its `gpu_int4_pairs`, `unpack_asm` (codes converted by
    `gpu_unpack`'s assembly when compiled) to its `gpu_unpack_asm`, `f16_dots` (an int8 / fp8 cache of a bf16 model
    attended with float16 dots, `gpu_quantized.dots_dtype`) to its `gpu_f16_dots`."""
    block_k, num_warps, num_stages = tile_or_tuned(isinstance(k, QuantizedKV), block_k, num_warps, num_stages)
    check_block("decode_append_attention", "block_k", block_k)
    batch, n, h = q.shape
    kv, c = pos.shape[1], pos.shape[2]
    gathered = slots is not None
    why = supports(k, v, gathered)
    if why:
        raise ConfigError(f"decode_append_attention: {why}")
    if h % 2 or (not interpret_mode(interpret) and h & (h - 1)):
        raise ConfigError(f"decode_append_attention: head_dim must be even (a power of two compiled), got {h}")
    if n % kv:
        raise ConfigError(f"decode_append_attention: {n} query heads are not a multiple of {kv} KV heads")
    store = layout(k)
    if (evict is not None or ring) and (store == "kivi" or gathered):
        raise ConfigError("decode_append_attention: in-place eviction and a ring take a plain or per-token "
                          "quantized cache, not KIVI (which requantizes its groups) nor a gathered slot list")
    if evict is not None and ring:
        raise ConfigError("decode_append_attention: a ring evicts by its slot rule, not `evict`")
    group = n // kv
    gp = max(16, pow2(group))
    kivi = None
    if store == "kivi":
        kivi = (k.spec.bits, k.spec.group_size, k.spec.residual)
        block_k = min(block_k, k.spec.group_size)  # a block never crosses a key group
    leaves = _cache_leaves(k, v, store)
    # int8 value codes (with float16 dots the key codes too) and int4 codes as int16 pairs of bytes (bitcasts)
    pairs = store in ("int8", "int4") and reads_pairs(k, int8_pairs, int4_pairs)
    key_pairs = store in ("int8", "int4") and reads_key_pairs(k, int8_pairs, f16_dots, int4_pairs)
    v_data = {"int8": 2, "int4": 3}.get(store)
    if pairs:
        leaves[v_data] = as_pairs(leaves[v_data])
    if key_pairs:
        leaves[0] = as_pairs(leaves[0])
    dots = dots_dtype(k, f16_dots) if isinstance(k, QuantizedKV) else (
        k.dtype if k.dtype in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32))
    # A capacity below one block: the block shrinks to it (a power of two >= 16), else the cache is padded.
    c_pad = c
    if c < block_k:
        if c >= 16:
            block_k = _pow2_floor(c)
        else:
            block_k, c_pad = 16, 16
    if c_pad != c:  # the slot axis of every per-slot leaf (not fp8's per-head scale)
        leaves = [pad_axis(x, 2, c_pad, 0) if x.ndim > 2 else x for x in leaves]
        pos_in = pad_axis(pos, 2, c_pad, -1)
    else:
        pos_in = pos
    clamp = c_pad % block_k != 0 and store != "kivi"  # KIVI's blocks all lie below its whole groups
    # One operand for the group's queries, key and value (`kvjax.models.block`'s fused q|k|v layout), which the
    # kernel reads by rows: XLA makes it in one fusion (with the projection's split-K sum) instead of three slices.
    if qkv is None:
        qkv = jnp.concatenate([q.reshape(batch, kv, group, h), k_new[:, :, None], v_new[:, :, None]], axis=2)
    elif qkv.shape != (batch, kv, group + 2, h) or qkv.dtype != q.dtype:
        raise ConfigError(f"decode_append_attention: qkv must be {q.dtype} {(batch, kv, group + 2, h)}, got "
                          f"{qkv.dtype} {qkv.shape}")
    operands = [length.astype(jnp.int32), position.astype(jnp.int32), inv_freq.astype(jnp.float32),
                jnp.asarray(scaling, jnp.float32).reshape(1), qkv, pos_in.astype(jnp.int32), *leaves]
    head = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, hd, s: (b, hd) + (0,) * len(shape))  # noqa: E731
    leaf_specs = [head(*x.shape[2:]) for x in leaves]
    in_specs = [head(), pl.BlockSpec((None,), lambda b, hd, s: (b,)), pl.BlockSpec((h // 2,), lambda b, hd, s: (0,)),
                pl.BlockSpec((1,), lambda b, hd, s: (0,)), head(group + 2, h), head(c_pad), *leaf_specs]
    if gathered:
        width = round_up(max(slots.shape[2], 1), block_k)
        operands.append(pad_axis(slots.astype(jnp.int32), 2, width, -1))
        in_specs.append(head(width))
        blocks = width // block_k
    else:
        blocks = -(-c_pad // block_k)
    if qk_norm is not None:
        if qk_norm[0].shape != (h,) or qk_norm[1].shape != (h,):
            raise ConfigError(f"decode_append_attention: QK-norm weights must be [{h}], got {qk_norm[0].shape} and "
                              f"{qk_norm[1].shape}")
        operands += [qk_norm[0], qk_norm[1]]
        in_specs += [pl.BlockSpec((h,), lambda b, hd, s: (0,))] * 2
    if evict is not None:
        operands.append(evict.astype(jnp.int32))
        in_specs.append(head())
    splits = split_count(num_splits, batch * kv, blocks, quantized=store != "plain")
    part = lambda *shape: pl.BlockSpec((None, None, None, *shape), lambda b, hd, s: (b, hd, s) + (0,) * len(shape))  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((batch, kv, splits, gp, h), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv, splits, gp), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv, splits, gp), jnp.float32),
                 jax.ShapeDtypeStruct(pos_in.shape, jnp.int32),
                 *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)]
    out_specs = [part(gp, h), part(gp), part(gp), head(c_pad), *leaf_specs]
    first_leaf = 6  # operands: length, position, inv_freq, scaling, qkv, pos, *leaves
    aliases = {5: 3, **{first_leaf + i: 4 + i for i in range(len(leaves))}}
    kernel = functools.partial(_kernel, store=store, gathered=gathered, block_k=block_k, splits=splits,
                               sliding_window=sliding_window, clamp=clamp, query_scale=float(query_scale),
                               group=group, gp=gp, dot_dtype=dots,
                               qk_norm=None if qk_norm is None else (float(qk_norm[2]), bool(qk_norm[3])),
                               kivi=kivi, evicts=evict is not None, ring=c if ring else None, pairs=pairs,
                               key_pairs=key_pairs,
                               unpack_asm=unpacks_with_asm(not interpret_mode(interpret), unpack_asm))
    acc, m, l, new_pos, *new_leaves = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(batch, kv, splits), in_specs=in_specs, out_specs=out_specs,
        input_output_aliases=aliases, compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret_mode(interpret), name="kvjax_gpu_decode_append_attention",
    )(*operands)
    # KIVI's `qlen` moves in the merge kernel, after every split read it (a capacity within the ring never flushes)
    flushing = store == "kivi" and c_pad > kivi[2]
    qlens = (new_leaves[4], new_leaves[9]) if flushing else ()
    out, new_length, *qlens = merge_split_heads(
        acc, m, l, group, q.dtype, length=length, position=position, evict=evict, cap=c if ring else None,
        heads=qlens, update=functools.partial(flushed_qlen, group=kivi[1], residual=kivi[2]) if flushing else None,
        interpret=interpret)
    if flushing:
        new_leaves[4], new_leaves[9] = qlens
    if pairs:
        new_leaves[v_data] = from_pairs(new_leaves[v_data], v.data.dtype)
    if key_pairs:
        new_leaves[0] = from_pairs(new_leaves[0], k.data.dtype)
    out = out.reshape(batch, n, h)
    if c_pad != c:
        new_pos, new_leaves = new_pos[:, :, :c], [x[:, :, :c] if x.ndim > 2 else x for x in new_leaves]
    new_k, new_v = _from_leaves(k, v, store, new_leaves)
    return out, new_k, new_v, new_pos, new_length
