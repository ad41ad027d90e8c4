"""Pallas kernels for the hot paths, behind `implementation=` on the matching `kvjax.ops` functions.

Each kernel is written for Mosaic TPU (BlockSpecs, scalar prefetch, VMEM scratch) and has an XLA twin
in `kvjax.ops` (or the method module) that is its test oracle. On TPU the kernels compile; elsewhere
(`interpret=None`) they run in Pallas interpret mode: correct, slow, for tests. `implementation="auto"`
picks a kernel only where `kvjax.tuning`'s `auto_pallas` lists it (GPU: the block-sparse decode kernel, the
fused decode step and the RMSNorm; see COMPAT.md). Tile sizes, splits, warps and stages default to the current
tuning's `tpu_*` / `gpu_*` fields. This package never imports `kvjax.ops`; shared helpers live in
`kvjax._kernel_common`.

| kernel                                   | XLA twin                                        |
|------------------------------------------|-------------------------------------------------|
| `scoring.window_scores`                  | `kvjax.ops.scoring.window_scores` (+ `pool1d`)  |
| `scoring.accumulated_scores`             | `kvjax.ops.scoring.accumulated_scores`          |
| `scoring.pool1d`                         | `kvjax.ops.scoring.pool1d`                      |
| `select.threshold_topk`, `topk_keep`     | `kvjax.ops.select.topk_keep` (same kept set)    |
| `select.gather_rows`, `gather_kept`      | `kvjax.ops.gather.gather_kept` / `cache.compact`|
| `decode_attention.decode_attention`      | `kvjax.ops.attention.decode_attention`          |
| `block_scoring.page_scores`              | `kvjax.ops.blocks.page_scores`                  |
| `block_scoring.representative_scores`    | `kvjax.ops.blocks.representative_scores`        |

GPU (Pallas Triton backend, compiled on GPU, interpreted elsewhere), in `kvjax.pallas.gpu_attention`:
`decode_attention` (twin of `kvjax.ops.attention.decode_attention`, which picks it on a GPU backend) and
`block_sparse_decode_attention` (twin of `kvjax.ops.sparse_attention.block_sparse_decode_attention`).
`kvjax.pallas.gpu_quantized.decode_attention` reads quantized caches; `kvjax.pallas.gpu_fused_decode.
decode_append_attention` is one decode step of a layer (RoPE, the in-place cache write, the attention), twin of
`kvjax.ops.fused_decode.decode_append_attention`'s XLA composition. `gpu_norm.rms_norm` and `gpu_linear.linear`
are the RMSNorm and weight-product kernels. Their parts: `gpu_common` (what the Triton kernels share: tiles, the
dot, the online-softmax step, the splits), `gpu_planes` (quantized codes' channel layouts), `gpu_unpack` (codes to
floats by inline PTX), `gpu_rope`, `gpu_token_codes` and `gpu_fused_kivi` (the fused decode kernel's RoPE, new
token's codes and KIVI part).
"""

from kvjax.pallas.block_scoring import page_scores, representative_scores
from kvjax.pallas.decode_attention import decode_attention
from kvjax.pallas.scoring import accumulated_scores, pool1d, window_scores
from kvjax.pallas.select import gather_kept, gather_rows, threshold_topk, topk_keep

__all__ = [
    "accumulated_scores",
    "decode_attention",
    "gather_kept",
    "gather_rows",
    "page_scores",
    "pool1d",
    "representative_scores",
    "threshold_topk",
    "topk_keep",
    "window_scores",
]
