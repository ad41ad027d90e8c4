"""`infllm`: training-free block-memory retrieval (Xiao et al., 2024), the base of Q-LLM and ActQKV.

The context is prefilled window by window; every window and decode step attends the `n_init` sinks,
the recent tokens (local window + not-yet-formed remainder) and the `topk` memory blocks whose
representative keys best match the probe query: the mean of the window's queries (the decode token's
query at decode), scored by dot product as InfLLM does. Machinery: `kvjax.methods.block_memory`.

Defaults: InfLLM's Llama-3 configuration (`config/llama-3-inf-llm.yaml`): 128 sinks, 4096 local
tokens, blocks of 128, top-16 blocks, 4 representative tokens, windows of 512 tokens.
"""

from __future__ import annotations

import dataclasses

from kvjax.methods.block_memory import BlockRetrieval
from kvjax.methods.registry import register


@register
@dataclasses.dataclass(frozen=True)
class InfLLM(BlockRetrieval):
    """Sinks + local window + top-k blocks by mean-pooled probe; see the module docstring."""

    name = "infllm"
