"""The `implementation=` argument every public op takes ("auto" | "xla" | "pallas")."""

from __future__ import annotations

import jax

from kvjax.errors import ConfigError

IMPLEMENTATIONS = ("auto", "xla", "pallas")

#: Ops with a Pallas kernel in `kvjax.pallas` (Mosaic TPU kernels; interpreted on other backends). On a GPU
#: backend `decode_attention` runs the Triton kernel of `kvjax.pallas.gpu_attention` instead, and
#: `block_sparse_decode_attention` has only that kernel (interpreted off GPU).
PALLAS_OPS = frozenset(
    {"window_scores", "accumulated_scores", "pool1d", "topk_keep", "gather_kept", "decode_attention",
     "page_scores", "representative_scores", "block_sparse_decode_attention"}
)

#: Per backend, the ops for which "auto" picks the kernel: only where it is tested compiled *and* measured
#: faster than XLA there (BENCHMARKS.md, "Pallas kernels"). GPU (H200, jax 0.11.2, Llama-3-8B heads, bf16):
#: the block-sparse kernel is 1.3x / 1.7x / 3.2x its XLA reference at 8K / 32K / 128K cached tokens; the
#: dense decode kernel is 0.85x / 1.01x / 1.04x XLA, not a win, so dense decode stays on XLA. No TPU
#: measurement exists, and on CPU "auto" stays XLA (interpret mode is for correctness only).
AUTO_PALLAS: dict[str, frozenset[str]] = {"gpu": frozenset({"block_sparse_decode_attention"})}

#: Per backend, the path `prefill_attention(implementation="auto")` takes for 16-bit inputs when no
#: log-sum-exp is asked for (else the blockwise XLA path). GPU: `jax.nn.dot_product_attention` (cuDNN),
#: measured 1.9x the XLA path at 8K and 32K tokens with Llama-3-8B heads in bf16 on an H200 and equal
#: to it within 5e-3 (BENCHMARKS.md, "Pallas kernels").
AUTO_PREFILL: dict[str, str] = {"gpu": "dot_product_attention"}

#: Backends where `causal_prefix_attention(implementation="auto")` (a one-shot prefill from position 0)
#: makes one causal `jax.nn.dot_product_attention` call (cuDNN flash attention on GPU) for 16-bit inputs;
#: elsewhere it takes `prefill_attention`'s "auto" path. GPU (H200, jax 0.11.2, Llama-3-8B heads, bf16): the
#: one call is 4.4x / 5.6x / 6.5x the per-block masked cuDNN path at 4K / 8K / 32K tokens and equal to the
#: XLA reference within 5e-3; a 32K `full` prefill of an 8B-shaped model 4.03 -> 1.25 s (BENCHMARKS.md,
#: "One causal call per layer").
AUTO_CAUSAL_PREFIX: set[str] = {"gpu"}


def resolve(op: str, implementation: str) -> str:
    """The implementation to run for `op`: "xla" or "pallas".

    "auto" picks the kernel only on a backend listed for `op` in `AUTO_PALLAS`, else XLA; "pallas" runs
    the kernel of `kvjax.pallas` (compiled on TPU, in interpret mode elsewhere) and raises for ops that
    have none.
    """
    if implementation == "xla":
        return "xla"
    if implementation == "auto":
        return "pallas" if op in AUTO_PALLAS.get(jax.default_backend(), frozenset()) else "xla"
    if implementation == "pallas":
        if op in PALLAS_OPS:
            return "pallas"
        raise ConfigError(
            f"{op}: implementation='pallas' is not available (no Pallas kernel for this op); "
            "use implementation='auto' or 'xla'"
        )
    raise ConfigError(
        f"{op}: implementation must be one of {', '.join(map(repr, IMPLEMENTATIONS))}, "
        f"got {implementation!r}"
    )
