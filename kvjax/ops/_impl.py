"""The `implementation=` argument every public op takes ("auto" | "xla" | "pallas")."""

from __future__ import annotations

import importlib

from kvjax import tuning
from kvjax.errors import ConfigError

#: Every kernel module, loaded with `kvjax.ops` (~0.15 s) rather than first while a jitted function traces: jax
#: 0.11 defines an option of the trace context when Pallas' TPU module loads (`pallas_fuser_disable_nested_fuse`),
#: and a context that changes during a function's first trace makes its second call trace and compile it again
#: (an H200 paid 6-42 s so per process in run 14: BENCHMARKS.md, "The one-off second call").
KERNEL_MODULES = ("kvjax.pallas", "kvjax.pallas.gpu_attention", "kvjax.pallas.gpu_fused_decode",
                  "kvjax.pallas.gpu_linear", "kvjax.pallas.gpu_norm", "kvjax.pallas.gpu_quantized")
for _name in KERNEL_MODULES:
    importlib.import_module(_name)

IMPLEMENTATIONS = ("auto", "xla", "pallas")

#: Ops with a Pallas kernel in `kvjax.pallas` (Mosaic TPU kernels; interpreted on other backends). On a GPU
#: backend `decode_attention` runs the Triton kernel of `kvjax.pallas.gpu_attention` instead;
#: `block_sparse_decode_attention`, `decode_append_attention` (`kvjax.pallas.gpu_fused_decode`), `rms_norm`
#: (`kvjax.pallas.gpu_norm`) and `linear` (`kvjax.pallas.gpu_linear`) have only a Triton kernel (interpreted off GPU).
PALLAS_OPS = frozenset(
    {"window_scores", "accumulated_scores", "pool1d", "topk_keep", "gather_kept", "decode_attention",
     "page_scores", "representative_scores", "block_sparse_decode_attention", "decode_append_attention", "rms_norm",
     "linear"}
)


def resolve(op: str, implementation: str) -> str:
    """The implementation to run for `op`: "xla" or "pallas".

    "auto" picks the kernel only for an op in the current tuning's `auto_pallas` (`kvjax.tuning`; read
    when traced), else XLA; "pallas" runs the kernel of `kvjax.pallas` (compiled on TPU, in interpret mode
    elsewhere) and raises for ops that have none.
    """
    if implementation == "xla":
        return "xla"
    if implementation == "auto":
        chosen = tuning.current().auto_pallas
        if not chosen <= PALLAS_OPS:
            raise ConfigError(f"tuning auto_pallas names ops without a Pallas kernel: {sorted(chosen - PALLAS_OPS)}; "
                              f"ops with one: {sorted(PALLAS_OPS)}")
        return "pallas" if op in chosen else "xla"
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
