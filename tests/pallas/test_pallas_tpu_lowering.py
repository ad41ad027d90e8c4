"""Every kernel lowers for TPU (Mosaic) from this CPU host: `jax.export` with `platforms=["tpu"]` runs the
Pallas -> Mosaic lowering, which catches primitives without a TPU rule, dtype limits and block shapes
that break the (8, 128) tiling rules. It does not run libtpu's final compile (layouts, VMEM fit).

Shapes are Llama-3-8B-like per KV head (head_dim 128, bf16, GQA 4:1 and 7:1) at 1K slots, blocks of
128 / 256 slots. If the installed jax cannot lower for TPU from CPU at all, the module-level probe below
records the platform error once and the tests skip with it (any other failure fails)."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from kvjax.pallas import block_scoring, scoring, select
from kvjax.pallas.decode_attention import decode_attention


def _probe() -> str | None:
    """None when a minimal Pallas kernel exports for TPU; else the platform error."""

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))
    try:
        jax.export.export(jax.jit(f), platforms=["tpu"])(jax.ShapeDtypeStruct((8, 128), jnp.float32))
    except (NotImplementedError, ValueError) as e:  # no Mosaic TPU lowering registered in this jaxlib
        if "tpu" not in str(e).lower() and "mosaic" not in str(e).lower():
            raise
        return f"jax {jax.__version__} cannot lower Pallas for TPU from {jax.default_backend()}: {e}"
    return None


TPU_EXPORT_ERROR = _probe()
pytestmark = pytest.mark.skipif(TPU_EXPORT_ERROR is not None, reason=str(TPU_EXPORT_ERROR))

B, T, K, C, H = 2, 256, 2, 1024, 128
S = jax.ShapeDtypeStruct
BF, F32, I32, BOOL = jnp.bfloat16, jnp.float32, jnp.int32, jnp.bool_


def _lowers(fn, *args) -> None:
    module = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in module


@pytest.mark.parametrize("g", [4, 7])
def test_scoring_kernels_lower(g):
    n = K * g
    args = [S((B, T, n, H), BF), S((B, T), I32), S((B, K, C, H), BF), S((B, K, C), I32), S((B, K, C), BOOL)]
    _lowers(functools.partial(scoring.window_scores, window=32, block_k=256, interpret=False), *args)
    _lowers(functools.partial(scoring.window_scores, window=32, group_reduce="max", pool=(7, "avg"), block_k=256,
                              interpret=False), *args)
    _lowers(functools.partial(scoring.accumulated_scores, group_reduce=None, block_q=128, block_k=256,
                              interpret=False), *args)
    _lowers(functools.partial(scoring.pool1d, kernel=7, kind="max", interpret=False), S((B, K, C), F32))


def test_selection_kernels_lower():
    _lowers(functools.partial(select.threshold_topk, capacity=256, interpret=False),
            S((16, C), I32), S((16,), I32), S((16, C), I32))
    _lowers(functools.partial(select.gather_rows, interpret=False), S((B, K, C, H), BF), S((B, K, C, H), BF),
            S((B, K, 256), I32))


@pytest.mark.parametrize("g,per_query_head", [(4, False), (7, True)])
def test_decode_attention_kernel_lowers(g, per_query_head):
    valid = S((B, K, g, C) if per_query_head else (B, K, C), BOOL)
    args = [S((B, K * g, H), BF), S((B,), I32), S((B, K, C, H), BF), S((B, K, C, H), BF), S((B, K, C), I32), valid]
    _lowers(functools.partial(decode_attention, block_k=256, num_splits=2,
                              return_weights=per_query_head, sliding_window=512 if per_query_head else None,
                              interpret=False), *args)


def test_block_scoring_kernels_lower():
    def pages(q, lo, hi, n):
        return block_scoring.page_scores(q, lo, hi, num_pages=n, group_reduce="mean", block_pages=128,
                                         interpret=False)

    def reps(p, r, n):
        return block_scoring.representative_scores(p, r, num_blocks=n, kind="cosine", interpret=False)

    _lowers(pages, S((B, K, 4, H), BF), S((B, K, 256, H), BF), S((B, K, 256, H), BF), S((B, K), I32))
    _lowers(reps, S((B, 32 * H), F32), S((B, 256, 32 * H), BF), S((B,), I32))


@pytest.mark.parametrize("g", [4, 7])
def test_prefill_attention_tpu_flash_kernel_lowers(g):
    """`prefill_attention(implementation="pallas")`: the Pallas TPU flash-attention kernel of jax, with the
    position mask as its bias, lowers for TPU (numerics need a TPU: not run here)."""
    from kvjax.ops.attention import prefill_attention

    n = K * g
    args = [S((B, T, n, H), BF), S((B, T), I32), S((B, K, C, H), BF), S((B, K, C, H), BF), S((B, K, C), I32),
            S((B, K, C), BOOL)]
    _lowers(functools.partial(prefill_attention, implementation="pallas", block_q=128), *args)
