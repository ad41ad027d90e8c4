"""What the Triton decode kernels share (`gpu_attention`, `gpu_quantized`, `gpu_fused_decode`, `gpu_fused_kivi`;
`gpu_norm` and `gpu_linear` take the tile and compiler helpers): interpret mode off GPU, the tile checks and
defaults, the float32-accumulating dot, one online-softmax step over a window of slots and its mask, and the
split of a head's live blocks over programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from kvjax import tuning
from kvjax.errors import ConfigError
from kvjax.pallas._common import HIGHEST, NEG

Array = jax.Array


def interpret_mode(interpret: bool | None) -> bool:
    """Compiled (Triton) on a GPU backend, Pallas interpret mode elsewhere; a bool forces it."""
    return jax.default_backend() != "gpu" if interpret is None else interpret


def pow2(x: int) -> int:
    """The smallest power of two >= `x` (1 for `x <= 1`)."""
    return 1 << max(0, x - 1).bit_length()


def check_block(op: str, name: str, value: int) -> None:
    """A Triton tile extent `name` of `op`: a power of two of at least 16, else a `ConfigError` naming it."""
    if value < 16 or value & (value - 1):
        raise ConfigError(f"{op}: {name} must be a power of two >= 16 (a Triton tile), got {value}")


#: The shortest contraction Triton's `tt.dot` takes (its frontend asserts K >= 16 for 16- and 32-bit operands; the
#: Pallas lowering does not check). Below it an H200 ran the bfloat16 dot as an m16n8k16 MMA that read each of the
#: D values 16 / D times: every logit of a quantized head's 8-channel (int4) or 4-channel (KIVI-2) plane at
#: head_dim 16 came out 2x / 4x (run 13's compiled test failures, reproduced bit for bit in interpret mode with the
#: logits so scaled: BENCHMARKS.md).
MIN_DOT_K = 16


def dot(a: Array, b: Array, contract_b: int) -> Array:
    """`a [M, D]` with `b` contracted on axis `contract_b` -> `[M, N]` float32. A contraction shorter than
    `MIN_DOT_K` (a quantized plane of a small head) is a broadcast product summed in float32, not a `tt.dot`."""
    if a.shape[1] < MIN_DOT_K:
        af, bf = a.astype(jnp.float32), b.astype(jnp.float32)
        if contract_b == 1:  # b [N, D]
            return jnp.sum(af[:, None, :] * bf[None, :, :], axis=2)
        return jnp.sum(af[:, :, None] * bf[None, :, :], axis=1)  # b [D, N]
    precision = HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def attend_window(carry: tuple[Array, Array, Array], q: Array, k: Array, v: Array, keep: Array
                  ) -> tuple[tuple[Array, Array, Array], Array]:
    """One online-softmax step over a window: q `[Gp, H]`, k / v `[W, H]`, keep `[Gp, W]` (float32 1 / 0).
    Returns the new `(m, l, acc)` and the masked logits (`NEG` where not kept).

    Slots outside the mask may hold anything (a NaN-poisoned cache). Their logits are replaced by `NEG` after
    the `q K` product, by a select on the float mask in the logits' own layout (a boolean `[Gp, W]` mask would
    move between the load and the MMA layouts through shared memory, which Triton cannot allocate for i1:
    "'ttg.local_alloc' op element type bit width must be a multiple of 8", seen on an H200). V is zeroed
    where not finite, in its own layout, so `0 * x` stays 0 in `p V`. (Zeroing K where not finite too cost 192
    of the fused kernel's 929 PTX instructions per thread a 64-slot step, compiled for an H200; the select, 8.)"""
    m, l, acc = carry
    v = jnp.where(jnp.isfinite(v), v, jnp.zeros_like(v))
    s = jnp.where(keep > 0.5, dot(q, k.astype(q.dtype), 1), NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None]) * keep
    corr = jnp.exp(m - m_new)
    acc = acc * corr[:, None] + dot(p.astype(q.dtype), v.astype(q.dtype), 0)
    return (m_new, l * corr + jnp.sum(p, axis=1), acc), s


def keep_mask(ok: Array, gp: int) -> Array:
    """A slot row `[W]` of booleans -> the `[Gp, W]` float32 1 / 0 mask of `attend_window` (cast before the
    broadcast)."""
    return jnp.broadcast_to(jnp.where(ok, 1.0, 0.0).astype(jnp.float32)[None, :], (gp, ok.shape[0]))


def slot_ok(kp: Array, qp: Array, sliding_window: int | None) -> Array:
    """Whether the slots at positions `kp` are visible to the query at `qp` (not a padding row): causal, and within
    `sliding_window` positions of it where given."""
    ok = (kp <= qp) & (qp >= 0)
    if sliding_window is not None:
        ok &= qp - kp < sliding_window
    return ok


def split_bounds(nlive: Array, splits: int, s: Array, head: int = 0) -> tuple[Array, Array]:
    """Blocks `[lo, hi)` of split `s` when a head's `nlive` live blocks are split evenly (`hi <= lo`: none), split 0
    counted as already holding `head` blocks of other work (KIVI's group and ring, which it attends alone). Over
    `s = 0 .. splits - 1` they tile `[0, nlive)` exactly: no dead block is visited."""
    per = jax.lax.div(nlive + head + (splits - 1), splits)
    lo = jnp.clip(s * per - head, 0, nlive)
    return lo, jnp.clip((s + 1) * per - head, lo, nlive)


def initial_state(gp: int, h: int) -> tuple[Array, Array, Array]:
    """The online softmax's `(m, l, acc)` before any slot: `NEG`, 0 and a `[Gp, H]` zero accumulator."""
    return (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, h), jnp.float32))


def split_count(num_splits: int | None, programs: int, blocks: int, quantized: bool = False) -> int:
    """Splits per (example, KV head): `num_splits`, else enough for the current tuning's target programs in all
    (`gpu_target_programs`; over a quantized cache `Tuning.target_programs(True)`); at least 1, at most one per
    block."""
    if num_splits is None:
        num_splits = -(-tuning.current().target_programs(quantized) // programs)
    return max(1, min(num_splits, blocks))


def tile_or_tuned(quantized: bool, block_k: int | None, num_warps: int | None, num_stages: int | None
                  ) -> tuple[int, int, int]:
    """`(block_k, num_warps, num_stages)`: each given value, else the current tuning's for a plain or a quantized
    cache (`kvjax.tuning.Tuning.tile`)."""
    tuned = tuning.current().tile(quantized)
    return tuple(t if x is None else x for t, x in zip(tuned, (block_k, num_warps, num_stages), strict=True))


def compiler_params(num_warps: int | None, num_stages: int | None) -> plgpu.CompilerParams:
    """Triton's warps and stages, the current tuning's `gpu_num_warps` / `gpu_num_stages` where None."""
    knobs = tuning.current()
    return plgpu.CompilerParams(num_warps=knobs.gpu_num_warps if num_warps is None else num_warps,
                                num_stages=knobs.gpu_num_stages if num_stages is None else num_stages)
