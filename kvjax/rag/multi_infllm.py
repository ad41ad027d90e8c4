"""`multi_infllm`: InfLLM's block retrieval applied to the concatenated documents as one context (SamKV's
Multi-InfLLM baseline).

InfLLM forms its block memory while it streams the prompt window by window: each block's
representative keys are the ones that received the most attention from the *local window of the
joint prompt*. An isolated document prefill does not produce those scores, so the stored document
caches cannot seed InfLLM's memory: this baseline streams the concatenated context and the query
through `kvjax.methods.infllm` (`kvjax.runtime.generate.prefill`), then decodes with its retrieval.
It saves decode-time attention (sinks + local window + top-k blocks), not prefill compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax import methods as kvm
from kvjax.errors import ConfigError
from kvjax.methods.base import Method
from kvjax.rag.base import Strategy, register


@register
@dataclasses.dataclass(frozen=True)
class MultiInfLLM(Strategy):
    """InfLLM (`kvjax.methods.infllm`) over `[prefix][doc_1]...[doc_D][query]`; its hyperparameters."""

    name = "multi_infllm"
    n_init: int = 128
    n_local: int = 4096
    block_size: int = 128
    topk: int = 16
    repr_topk: int = 4
    window: int = 512

    def __post_init__(self) -> None:
        self.method()  # validates the hyperparameters (and that infllm exists) before anything runs

    def method(self) -> Method:
        if "infllm" not in kvm.available():
            raise ConfigError("multi_infllm needs the 'infllm' method, which this kvjax does not register")
        return kvm.get("infllm", n_init=self.n_init, n_local=self.n_local, block_size=self.block_size,
                       topk=self.topk, repr_topk=self.repr_topk, window=self.window)

    def build(self, config: Any, weights: dict, rope: tuple, req: Any) -> Any:
        raise ConfigError("multi_infllm runs through kvjax.rag.answer (it streams the prompt through InfLLM)")
