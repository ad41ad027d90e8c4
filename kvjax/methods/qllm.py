"""`qllm`: InfLLM retrieval with a question-aware probe (Q-LLM, Li et al., 2024), as ActQKV's code runs it.

Every block score gets a question term: `score_b = sim(probe, rep_b) + question_weight * cos(qv, rep_b)`
(spec 2.3), where the question vector `qv` `[Hq * D]` is, per query head, the mean of the
fixed-position (global) queries of the `repr_topk` question tokens that received the most attention
within the question (spec 2.1, "question vector").

How the method sees the question: pass it as `question_ids` to `kvjax.generate` / `prefill`. Before
the context, the runtime runs the question alone (positions `0..q-1`, as in the official prompts that
open with the question) and `encode_question` stores `qv` per layer; the question is then also
prefilled as the end of the prompt, window by window like the context. Without `question_ids` there
is no question term (`qllm` = InfLLM with cosine scoring and these defaults).

Defaults: the mean-pooling baseline of ActQKV's ablation (the ActQKV configuration with mean pooling
and a fixed top-k): 64 sinks, 512 local tokens, windows of 256, blocks of 64, top-23 blocks,
4 representative tokens, cosine scoring, question weight 4; the question term is used for the
prompt (context and question windows), not for generated tokens (`question_decode=False`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Step
from kvjax.methods.block_memory import BlockRetrieval, global_queries, local_scores, similarity
from kvjax.methods.registry import register

Array = jax.Array


def question_vector(q: Array, positions: Array, ls: Array, inv_freq: Array, global_position: int,
                    repr_topk: int) -> tuple[Array, Array]:
    """Q-LLM's question vector from the question's own pass -> (`[B, Hq * D]` float32, `[B]` has one).

    q `[B, T, N, H]` post-RoPE question queries at `positions` `[B, T]` (slot = position), `ls`
    `[B, N, C]` the local attention each question token received. Per head, the global queries of
    the `repr_topk` tokens with the largest `ls` (ties: lower position) are averaged.
    """
    b, t, n, h = q.shape
    valid = positions >= 0
    tok = jnp.take_along_axis(ls, jnp.clip(positions, 0, ls.shape[-1] - 1)[:, None, :], axis=2)
    tok = jnp.where(valid[:, None, :], tok, -jnp.inf)
    vals, top = jax.lax.top_k(tok, min(repr_topk, t))  # [B, N, r]
    chosen_ok = vals > -jnp.inf
    qg = global_queries(q, positions, inv_freq, global_position).transpose(0, 2, 1, 3)  # [B, N, T, H]
    chosen = jnp.take_along_axis(qg, top[..., None], axis=2)
    count = jnp.maximum(jnp.sum(chosen_ok, axis=-1), 1).astype(jnp.float32)
    qv = jnp.sum(jnp.where(chosen_ok[..., None], chosen, 0.0), axis=2) / count[..., None]
    return qv.reshape(b, n * h), jnp.any(valid, axis=-1)


@register
@dataclasses.dataclass(frozen=True)
class QLLM(BlockRetrieval):
    """InfLLM + question term in the block score; see the module docstring."""

    name = "qllm"
    encodes_question = True

    n_init: int = 64
    n_local: int = 512
    block_size: int = 64
    topk: int = 23
    window: int = 256
    similarity: str = "cosine"
    question_weight: float = 4.0
    question_prefill: bool = True
    question_decode: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.question_weight, int | float) or self.question_weight < 0:
            raise ConfigError(f"{self.name}: question_weight must be a number >= 0, got {self.question_weight!r}")

    def extra_state(self, spec: CacheSpec) -> dict[str, Any]:
        return {
            "qv": jnp.zeros((spec.batch, spec.num_heads * spec.head_dim), jnp.float32),
            "qv_set": jnp.zeros((spec.batch,), bool),
        }

    def question_scores(self, rep: Array, state: dict, decode: bool) -> Array | None:
        active = self.question_decode if decode else self.question_prefill
        if not active or self.question_weight == 0:
            return None
        cos = similarity(state["qv"], rep, "cosine")
        return self.question_weight * jnp.where(state["qv_set"][:, None], cos, 0.0)

    def encode_question(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Question pre-pass: stores this layer's question vector `qv` and `qv_set`."""
        ls = local_scores(q, step.positions, cache.k, cache.pos, kvc.valid_mask(cache), self.n_local)
        qv, has = question_vector(q, step.positions, ls, step.inv_freq, self.retrieval_position, self.repr_topk)
        state = dict(cache.state)
        state.update(qv=jnp.where(has[:, None], qv, state["qv"]), qv_set=state["qv_set"] | has)
        return kvc.truncate(cache.replace(state=state), step.capacity)
