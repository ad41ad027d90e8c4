"""`qllm`: InfLLM retrieval with a question-aware probe (Q-LLM, Li et al., 2024), as ActQKV's code runs it.

Every block score gets a question term: `score_b = sim(probe, rep_b) + question_weight * cos(qv, rep_b)`
(spec 2.3). The question vector `qv` `[Hq * D]` is Q-LLM's: the question sits *inside* the prompt,
and per query head the `repr_topk` question tokens with the largest local score (the attention they
received from the tokens that follow them, less than `n_local` behind) have their fixed-position
(global) queries averaged (spec 2.1, "question vector"). It is taken once per layer, at the end of the
first prefill window after which more than `n_local` tokens have been processed (the official timing);
the term applies from the next window on.

How the method sees the question: pass it as `question_ids` to `kvjax.generate` / `prefill`. The
runtime lays the prompt out as question + context + question (the official prompts open with the
question and repeat it at the end) and gives the method the question length (`mark_question`); the
global queries of the first `min(n_local, capacity)` positions are kept in `state["qq"]` until then.
Without `question_ids` there is no question term (`qllm` = InfLLM with cosine scoring and these
defaults).

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

from kvjax.cache import KVCache
from kvjax.methods.base import CacheSpec, Step
from kvjax.methods.block_memory import BlockRetrieval, global_queries, similarity
from kvjax.methods.registry import register
from kvjax.validation import check_number

Array = jax.Array


def question_vector(qq: Array, ls: Array, lengths: Array, repr_topk: int) -> Array:
    """Q-LLM's question vector -> `[B, Hq * D]` float32.

    qq `[B, S, Hq * D]`: the global queries of positions `0..S-1`; ls `[B, Hq, C]` the local scores;
    lengths `[B]` the question span `[0, q)`. Per head, the global queries of the `repr_topk` span tokens
    with the largest local score (ties: lower position) are averaged.
    """
    b, size, d = qq.shape
    n = ls.shape[1]
    pos = jnp.arange(size)
    tok = jnp.where(pos[None, None] < lengths[:, None, None], ls[:, :, :size], -jnp.inf)
    vals, top = jax.lax.top_k(tok, min(repr_topk, size))  # [B, N, r]
    ok = vals > -jnp.inf
    heads = qq.reshape(b, size, n, d // n).transpose(0, 2, 1, 3)  # [B, N, S, H]
    chosen = jnp.take_along_axis(heads, top[..., None], axis=2)
    count = jnp.maximum(jnp.sum(ok, axis=-1), 1).astype(jnp.float32)
    qv = jnp.sum(jnp.where(ok[..., None], chosen, 0.0), axis=2) / count[..., None]
    return qv.reshape(b, d)


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
        check_number(self.name, "question_weight", self.question_weight, 0)

    def question_slots(self, capacity: int) -> int:
        """Positions whose global queries are kept for the question vector: `min(n_local, capacity)`."""
        return min(self.n_local, capacity)

    def extra_state(self, spec: CacheSpec) -> dict[str, Any]:
        d = spec.num_heads * spec.head_dim
        return {
            "qv": jnp.zeros((spec.batch, d), jnp.float32),
            "qv_set": jnp.zeros((spec.batch,), bool),
            "q_len": jnp.zeros((spec.batch,), jnp.int32),
            "qq": jnp.zeros((spec.batch, self.question_slots(spec.capacity), d), jnp.float32),
        }

    def question_scores(self, rep: Array, state: dict, decode: bool) -> Array | None:
        active = self.question_decode if decode else self.question_prefill
        if not active or self.question_weight == 0:
            return None
        cos = similarity(state["qv"], rep, "cosine")
        return self.question_weight * jnp.where(state["qv_set"][:, None], cos, 0.0)

    def mark_question(self, cache: KVCache, lengths: Array) -> KVCache:
        """The prompt opens with a question of `lengths` `[B]` tokens (one layer's cache)."""
        q_len = cache.state["q_len"]
        return cache.replace(state={**cache.state, "q_len": jnp.broadcast_to(lengths.astype(q_len.dtype), q_len.shape)})

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Keeps the window's global queries of the question's positions; once more than `n_local` tokens
        have gone through, sets `qv` from the question span's local scores."""
        length = cache.length[:, 0]
        cache = super().prefill(cache, q, step)
        state = dict(cache.state)
        batch, t, n, h = q.shape
        x = global_queries(q, step.positions, step.inv_freq, self.retrieval_position).reshape(batch, t, n * h)
        size = state["qq"].shape[1]
        rows = jnp.where(step.positions >= 0, step.positions, size)  # past the kept positions: dropped
        qq = jax.vmap(lambda acc, i, v: acc.at[i].set(v, mode="drop"))(state["qq"], rows, x)
        fire = ~state["qv_set"] & (state["q_len"] > 0) & (length > self.n_local)
        qv = question_vector(qq, state["ls"], state["q_len"], self.repr_topk)
        state.update(qq=qq, qv=jnp.where(fire[:, None], qv, state["qv"]), qv_set=state["qv_set"] | fire)
        return cache.replace(state=state)
