"""Per-request metrics: the columns of SamKV's Table 1 plus time and memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class RequestReport:
    """What one `kvjax.rag.answer` call kept, recomputed and cost.

    All ratios are over the context tokens (prefix + documents; the query is not counted).

    * `sequence_ratio`: context tokens resident in the decode cache / context tokens (mean over
      layers; SamKV keeps the same count in every layer) — Table 1's "sequence ratio".
    * `recompute_ratio`: distinct context tokens the strategy chose to recompute / context tokens —
      Table 1's "recomputation ratio" (CacheBlend: its selected tokens; its fully recomputed first
      layers are in `layer_recompute_ratio`).
    * `layer_recompute_ratio`: sum over layers of tokens whose K/V were recomputed there /
      (layers x context tokens): the share of a full prefill's K/V work actually redone.
    * `ttft_s`: wall time from the request's start (documents already prefilled) to the first
      token's logits, including the query prefill; the first call of a bucket includes compilation.
    * `cache_bytes`: bytes of the kept context K/V over all layers, in the request cache's storage (a
      quantized format's codes, scales and zero points); `full_cache_bytes`: the same for the whole
      context; `cache_bytes_allocated`: the decode cache's K/V arrays as allocated (static capacity,
      including room for the query and the new tokens).
    """

    strategy: str
    num_documents: int
    context_tokens: int
    query_tokens: int
    kept_tokens: float
    sequence_ratio: float
    recomputed_tokens: int
    recompute_ratio: float
    layer_recompute_ratio: float
    ttft_s: float
    cache_bytes: int
    full_cache_bytes: int
    cache_bytes_allocated: int
    generated_tokens: int
    decode_s: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def markdown_table(reports: Sequence[RequestReport]) -> str:
    """Table 1-style Markdown: one row per strategy, means over its requests."""
    by: dict[str, list[RequestReport]] = {}
    for r in reports:
        by.setdefault(r.strategy, []).append(r)
    lines = [
        "| strategy | requests | sequence ratio | recomputation ratio | layer recompute | TTFT (s) | cache (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rs in by.items():
        n = len(rs)

        def mean(field: str, rs: list[RequestReport] = rs, n: int = n) -> float:
            return sum(getattr(r, field) for r in rs) / n

        lines.append(
            f"| {name} | {n} | {mean('sequence_ratio'):.1%} | {mean('recompute_ratio'):.1%} | "
            f"{mean('layer_recompute_ratio'):.1%} | {mean('ttft_s'):.3f} | {mean('cache_bytes') / 2**20:.2f} |"
        )
    return "\n".join(lines)
