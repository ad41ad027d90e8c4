"""What ``--budget`` / ``--compression_ratio`` mean for the multi-context (RAG) strategies.

Only a strategy with a knob that sets how much of the stored context it keeps (its sparsity) takes them:

* ``samkv``: ``--compression_ratio=r`` removes the share ``r`` of every document's middle blocks: it
  forces SamKV's per-document selection share ``P = 1 - r`` (``p_override``) and turns the cross-document
  filter off (which would keep only ``1/D`` of the selected blocks whatever ``P`` is), so each document
  keeps ``round((1 - r) M)`` of its ``M`` middle blocks in every layer. The instruction prefix and every
  document's initial and local blocks are always kept, so the realised kept share of the context (the
  pivot's ``kept``) is above ``1 - r``. ``--budget`` (a token count) is refused: SamKV's knob is a share.
  SamKV's own defaults (adaptive ``P``, cross-document filter on) are another operating point, often sparser
  than a ratio run.
* ``cacheblend``, ``epic``, ``reuse``, ``recompute``: keep every stored token (no sparsity knob): refused,
  naming the hyperparameter that sets what they recompute instead.
* ``multi_infllm``: its attended set is sinks + local window + top-k blocks, set by its hyperparameters:
  refused, naming them.

Without either flag every strategy runs with its own defaults (SamKV's adaptive ``P``).
"""

from __future__ import annotations

from typing import Any

from kvjax.errors import ConfigError

__all__ = ["REFUSALS", "strategy_args"]

#: Why a strategy takes neither flag, and what to use instead.
REFUSALS = {
    "cacheblend": "it keeps every document token (no sparsity knob); how many it recomputes is "
    "--method_args=cacheblend.recompute_ratio=R",
    "epic": "it keeps every document token (no sparsity knob); how many it recomputes is --method_args=epic.k=K "
    "or epic.recompute_ratio=R",
    "reuse": "it keeps every stored token and recomputes none (no knob)",
    "recompute": "it prefills every context token again (the full-cache ceiling; no knob)",
    "multi_infllm": "it attends sinks + a local window + top-k blocks: set --method_args=multi_infllm.n_init=..., "
    "multi_infllm.n_local=..., multi_infllm.topk=...",
}
_SAMKV_KNOBS = ("p_override", "cross_doc_filter")


def strategy_args(name: str, args: dict[str, Any], budget: int | None, ratio: float | None) -> dict[str, Any]:
    """The hyperparameters of strategy ``name`` for one cell: ``args`` with ``budget`` / ``ratio`` mapped onto
    its knob; ``ConfigError`` (one line) where it has none or ``args`` already set that knob."""
    if budget is None and ratio is None:
        return dict(args)
    flag = f"--budget={budget}" if budget is not None else f"--compression_ratio={ratio:g}"
    if name == "samkv":
        if budget is not None:
            raise ConfigError(f"{flag} has no meaning for samkv: its sparsity knob is a share of each document's "
                              "middle blocks; use --compression_ratio (the share removed)")
        clash = [k for k in _SAMKV_KNOBS if k in args]
        if clash:
            raise ConfigError(f"{flag} sets samkv's {' and '.join(_SAMKV_KNOBS)}, which --method_args sets too "
                              f"({', '.join(f'{k}={args[k]!r}' for k in clash)}): give one of them")
        return {**args, "p_override": 1.0 - float(ratio), "cross_doc_filter": False}
    reason = REFUSALS.get(name, "it has no sparsity knob")
    raise ConfigError(f"{flag} has no meaning for the multi-context strategy {name}: {reason}")
