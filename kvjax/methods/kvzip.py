"""`kvzip`: KVzip, "Query-Agnostic KV Cache Compression with Context Reconstruction" (Kim et al., 2025,
arXiv 2505.23416).

A KV pair matters if the model needs it to reproduce the context. After the prompt is prefilled (uncompressed),
the model is asked to repeat it: a repeat prompt ("Repeat the previous context exactly.", the chat template's
assistant opening) followed by the context tokens again is run over the prompt's cache. Each cached pair's score
is the largest attention any repeat query of its KV group gives it (max over the group's query heads and the
repeat tokens), from a softmax over the attention sinks, the chunk of context being reconstructed and the repeat
tokens themselves (the paper's chunked scoring). Sinks (the first `n_sink` positions) are always kept; the other
slots compete for the budget.

Budget allocation (the paper's non-uniform head budget; kvpress's `KVzipPress` default `layerwise=False`): the
scores of every layer and KV head of an example compete in one ranking, so the example keeps its best
`budget * kv_heads * layers` pairs wherever they fall; `layerwise=True` gives every layer the same total
(`budget * kv_heads`, still shared by its heads). A head is capped at `ceil(budget * max_head_share)` slots
(the cache's static per-head capacity; kvjax allocates the compressed cache at that size, so memory really
shrinks), and the capped heads' overflow goes to the next-best pairs elsewhere (the best allocation under the cap).
kvpress masks instead of dropping and is uncapped: a large `max_head_share` matches it.

Chunked reconstruction (`chunk_size`, 2048 as the paper and kvpress): the context is repeated in chunks, each run
separately over the prompt's cache (the first with the repeat prompt, the next ones with "Repeat the part of the
previous context exactly, starting with" + the previous chunk's last `tail` tokens), so the repeat pass holds at
most one chunk's extra keys and a `[chunk, sinks + 2 * chunk]` score block per head. Prefill cost: the prompt's
forward plus a forward of about the prompt's length again (each chunk's rows attend the whole prompt) and the
score blocks; the paper and kvpress state 2-3x one prefill. Measured here on a shared, overloaded 2-core CPU
(SmolLM2-135M, 1024-token prompt, docs/methods.md): 8.2x one uncompressed prefill with `chunk_size=2048`, 5.2x
with 512 (the replay rows are padded to a power of two, 2048 here, and attend through the blockwise kernel).
Tokens before `context_start` (a chat template's opening) are not repeated and keep score 0.

KVzip+ (`kvzip_plus_normalization=True`; Jeblick and Jegou, 2026, arXiv 2601.07891, the normalisation kvpress's
`KVzipPress` names the same and its leaderboard runs as `kvzip_plus`): each repeat row's probabilities are divided
by the norm of the row's attention input `||h||`, and each pair's by query head multiplied by what it writes into
the residual stream, `||v W_O||` (that head's slice of the output projection), before the max over rows and group.

The repeat prompt is token ids (`repeat_ids`, `continue_ids`, `suffix_ids`): `prompt_ids(tokenizer)` builds
them from a Hugging Face tokenizer as the official code does. With none given the context is repeated bare.

Runtime: the method has the `ContextReplay` capability; `kvjax.generate` prefills uncompressed, runs the replay
chunks (`kvjax.runtime.replay`) and compacts every layer at once. Through the plain per-layer step API (no replay)
the `prefill` hook scores each slot by the prompt's own queries instead (the context reading itself), per layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.chat import has_chat_template, user_turn
from kvjax.errors import ConfigError
from kvjax.methods.base import Method, Step
from kvjax.methods.capabilities import ContextReplay
from kvjax.methods.common import head_cap, keep_masks, self_read_probs
from kvjax.methods.registry import register
from kvjax.ops.scoring import projected_value_norms
from kvjax.validation import check_number

Array = jax.Array

REPEAT_TEXT = "\n\nRepeat the previous context exactly."
CONTINUE_TEXT = "\n\nRepeat the part of the previous context exactly, starting with"


def _ids(value: Any, name: str) -> tuple[int, ...]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, list | tuple) or not all(isinstance(i, int | np.integer) and i >= 0 for i in value):
        raise ConfigError(f"kvzip: {name} must be a list of non-negative token ids, got {value!r}")
    return tuple(int(i) for i in value)


def prompt_ids(tokenizer: Any, chat_template: bool = True) -> dict[str, Any]:
    """`repeat_ids`, `continue_ids`, `suffix_ids` and `context_start` for a Hugging Face tokenizer: the repeat
    instructions, then the chat template's end of a user turn and assistant opening (a newline without a template,
    or for prompts built without it: `chat_template=False`); `context_start`: the template's tokens before a user
    message (not repeated)."""
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    opening, suffix = user_turn(tokenizer) if chat_template and has_chat_template(tokenizer) else ("", "\n")
    return dict(repeat_ids=encode(REPEAT_TEXT), continue_ids=encode(CONTINUE_TEXT), suffix_ids=encode(suffix),
                context_start=len(encode(opening)))


#: Replay rows scored at a time (their softmax over sinks, chunk and rows is held for a block only).
REPLAY_ROW_BLOCK = 256


@register
@dataclasses.dataclass(frozen=True)
class KVzip(Method, ContextReplay):
    """Context-reconstruction scores (see the module docstring): `n_sink` (4), `chunk_size` (2048), `layerwise`
    (False: one ranking over all layers), `max_head_share` (2.0, per-head cap in units of the budget), the repeat
    prompt's `repeat_ids` / `continue_ids` / `suffix_ids` (`prompt_ids(tokenizer)`), `tail` (8 tokens of the
    previous chunk), `context_start` (0: tokens before it are not repeated), `kvzip_plus_normalization` (False:
    KVzip; True: KVzip+, probabilities over `||h||` of the row, times `||v W_O||` of the pair)."""

    name = "kvzip"
    uses_score = True

    n_sink: int = 4
    chunk_size: int = 2048
    layerwise: bool = False
    max_head_share: float = 2.0
    repeat_ids: Any = ()
    continue_ids: Any = ()
    suffix_ids: Any = ()
    tail: int = 8
    context_start: int = 0
    kvzip_plus_normalization: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.compresses:
            raise ConfigError(f"{self.name}: needs budget= (tokens) or compression_ratio=")
        for field in ("n_sink", "tail", "context_start"):
            value = getattr(self, field)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{self.name}: {field} must be a non-negative integer, got {value!r}")
        if not isinstance(self.chunk_size, int | np.integer) or isinstance(self.chunk_size, bool) \
                or self.chunk_size <= 0:
            raise ConfigError(f"{self.name}: chunk_size must be a positive integer, got {self.chunk_size!r}")
        if not isinstance(self.layerwise, bool):
            raise ConfigError(f"{self.name}: layerwise must be True or False, got {self.layerwise!r}")
        if not isinstance(self.kvzip_plus_normalization, bool):
            raise ConfigError(f"{self.name}: kvzip_plus_normalization must be True or False, "
                              f"got {self.kvzip_plus_normalization!r}")
        if self.kvzip_plus_normalization:  # KVzip+ reads the rows' attention input and the layer's W_O
            object.__setattr__(self, "layer_inputs", frozenset({"hidden", "out_proj"}))
        check_number(self.name, "max_head_share", self.max_head_share, 1)
        for field in ("repeat_ids", "continue_ids", "suffix_ids"):
            object.__setattr__(self, field, _ids(getattr(self, field), field))

    # ---- sizes -----------------------------------------------------------------------------------
    def head_capacity(self, prompt_len: int) -> int:
        """Static per-head slots for the prompt: `min(ceil(budget * max_head_share), prompt_len)`."""
        return min(head_cap(self.prompt_budget(prompt_len), self.max_head_share), prompt_len)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.head_capacity(prompt_len) + max_new_tokens

    def _caps(self, budget: Array) -> Array:
        return head_cap(budget, self.max_head_share)

    def replay_width(self, context: int) -> int:
        """Tokens of one replay row for contexts of up to `context` tokens (repeat prompt + one chunk)."""
        head = max(len(self.repeat_ids), len(self.continue_ids) + self.tail) + len(self.suffix_ids)
        return head + min(self.chunk_size, max(context - self.context_start, 1))

    # ---- the replay (ContextReplay) -------------------------------------------------------------
    def replay_rows(self, tokens: Any, lengths: Any) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        starts = np.minimum(self.context_start, lengths)
        width = self.replay_width(int(lengths.max()))
        chunks = max(1, int(np.max(-(-(lengths - starts) // self.chunk_size))))
        out = []
        for i in range(chunks):
            rows = np.zeros((len(lengths), width), np.int32)
            row_lengths = np.zeros(len(lengths), np.int32)
            spans = np.zeros((len(lengths), 2), np.int32)
            for b, (n, s0) in enumerate(zip(lengths, starts, strict=True)):
                start, end = s0 + i * self.chunk_size, min(s0 + (i + 1) * self.chunk_size, n)
                if start >= end:
                    continue
                lead = list(self.repeat_ids) if i == 0 else \
                    list(self.continue_ids) + tokens[b, max(s0, start - self.tail) : start].tolist()
                row = lead + list(self.suffix_ids) + tokens[b, start:end].tolist()
                rows[b, : len(row)] = row
                row_lengths[b], spans[b] = len(row), (start, end)
            out.append((rows, row_lengths, spans))
        return out

    def replay_scores(self, cache: KVCache, q: Array, k: Array, positions: Array, span: Array, step: Any) -> KVCache:
        batch, rows, num_heads, dim = q.shape
        kv_heads, capacity = cache.pos.shape[1], cache.pos.shape[2]
        group = num_heads // kv_heads
        width, sinks = min(self.chunk_size, capacity), min(self.n_sink, capacity)
        start, end = span[:, 0], span[:, 1]
        keys = kvc.keys(cache, jnp.float32)
        # The chunk's slots (prefill keeps slot = position) and the sinks before it.
        chunk_pos = start[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, W]
        chunk_slot = jnp.clip(chunk_pos, 0, capacity - 1)
        chunk_k = jnp.take_along_axis(keys, chunk_slot[:, None, :, None], axis=2)  # [B, K, W, H]
        chunk_ok = (chunk_pos < end[:, None])[:, None] & \
            (jnp.take_along_axis(cache.pos, jnp.broadcast_to(chunk_slot[:, None], (batch, kv_heads, width)), 2)
             == chunk_pos[:, None])
        sink_ok = (jnp.arange(sinks) < start[:, None])[:, None] & kvc.stored_mask(cache)[..., :sinks]
        own_k = jnp.swapaxes(k, 1, 2).astype(jnp.float32)  # [B, K, R, H]
        real = positions >= 0
        row_scale = self._row_scale(step, real)  # [B, R]: 1 / ||h|| (KVzip+), else 1
        qg = jnp.moveaxis(q.astype(jnp.float32).reshape(batch, rows, kv_heads, group, dim), 1, 3)  # [B, K, G, R, H]
        scale = 1.0 / math.sqrt(dim)
        # Rows in blocks: each row's softmax is its own, so blocks change nothing but the memory (SmolLM2-135M, 10
        # rows of 2K: the whole [B, K, G, R, S] float32 probabilities would be ~3 GB per array, a block of 256 ~0.4).
        block = min(rows, REPLAY_ROW_BLOCK) if rows % min(rows, REPLAY_ROW_BLOCK) == 0 else rows

        def block_best(best: Array, start: Array) -> tuple[Array, None]:
            q_rows = jax.lax.dynamic_slice_in_dim(qg, start, block, axis=3)  # [B, K, G, b, H]
            real_rows = jax.lax.dynamic_slice_in_dim(real, start, block, axis=1)[:, None, None, :, None]
            causal = (jnp.arange(rows)[None, :] <= (start + jnp.arange(block))[:, None])[None] & real[:, None, :]

            def logits(kk: Array, ok: Array) -> Array:  # ok broadcastable to [B, K, G, b, S]
                return jnp.where(ok, jnp.einsum("bkgrh,bksh->bkgrs", q_rows, kk) * scale, -jnp.inf)

            parts = jnp.concatenate([
                logits(keys[:, :, :sinks], sink_ok[:, :, None, None, :]),
                logits(chunk_k, chunk_ok[:, :, None, None, :]),
                logits(own_k, causal[:, None, None]),
            ], axis=-1)
            probs = jax.nn.softmax(jnp.where(real_rows, parts, 0.0), axis=-1)
            weight = jax.lax.dynamic_slice_in_dim(row_scale, start, block, axis=1)[:, None, None, :, None]
            chunk_probs = jnp.where(real_rows, probs[..., sinks : sinks + width] * weight, 0.0)
            return jnp.maximum(best, jnp.max(chunk_probs, axis=3)), None

        starts = jnp.arange(0, rows, block, dtype=jnp.int32)  # probabilities are >= 0: start the max at 0
        best, _ = jax.lax.scan(block_best, jnp.zeros((batch, kv_heads, group, width), jnp.float32), starts)
        if self._weighs_values:  # each query head's ||v W_O|| of the chunk's pairs
            chunk_v = jnp.take_along_axis(kvc.values(cache), chunk_slot[:, None, :, None], axis=2)  # [B, K, W, H]
            best = best * projected_value_norms(chunk_v, step.out_proj, ord=2)
        best = jnp.max(best, axis=2)  # [B, K, W]
        slots = jnp.arange(capacity, dtype=jnp.int32)
        offset = slots[None, None] - start[:, None, None]
        in_span = (offset >= 0) & (slots[None, None] < end[:, None, None]) & (cache.pos == slots)
        value = jnp.take_along_axis(best, jnp.clip(offset, 0, width - 1), axis=-1)
        return cache.replace(score=jnp.where(in_span, value, cache.score))

    @property
    def _weighs_values(self) -> bool:
        """Whether a pair's score is multiplied by `||v W_O||` of its query head (KVzip+)."""
        return self.kvzip_plus_normalization

    def _row_scale(self, step: Step, real: Array) -> Array:
        """`[B, R]` float32 weight of each query row: `1 / ||h||` of its attention input (KVzip+), else 1."""
        if not self.kvzip_plus_normalization:
            return jnp.ones(real.shape, jnp.float32)
        norms = jnp.linalg.norm(step.hidden.astype(jnp.float32), axis=-1)
        return jnp.where(real, 1.0 / jnp.where(real, norms, 1.0), 0.0)

    def replay_compress(self, layers: tuple[KVCache, ...], budget: Array, capacity: int) -> tuple[KVCache, ...]:
        keep = keep_masks(tuple(x.score for x in layers), tuple(kvc.stored_mask(x) for x in layers),
                          tuple(x.pos for x in layers), budget, self._caps(budget), self.n_sink, self.layerwise)
        return tuple(kvc.keep_where(x, m, capacity) for x, m in zip(layers, keep, strict=True))

    def with_tokenizer(self, tokenizer: Any, chat_template: bool) -> KVzip:
        """The paper's repeat prompt from `tokenizer` (`prompt_ids`) unless ids were given."""
        if self.repeat_ids or self.continue_ids or self.suffix_ids:
            return self
        return dataclasses.replace(self, **prompt_ids(tokenizer, chat_template))

    # ---- the plain step API (no replay) ----------------------------------------------------------
    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        """Without a replay: each slot's score is the largest causal attention a prompt query of its group gives it
        (the prompt reading itself; KVzip+ normalises it as the replay does), then this layer keeps its
        `budget * kv_heads` best (heads share it)."""
        probs, real = self_read_probs(cache, q, step)
        probs = probs * self._row_scale(step, real)[:, None, None, :, None]
        best = jnp.max(probs, axis=3)  # [B, K, G, C]
        if self._weighs_values:
            best = best * projected_value_norms(kvc.values(cache), step.out_proj, ord=2)
        cache = cache.replace(score=jnp.maximum(cache.score, jnp.max(best, axis=2)))
        keep = keep_masks((cache.score,), (kvc.stored_mask(cache),), (cache.pos,), step.budget,
                          jnp.minimum(self._caps(step.budget), step.capacity), self.n_sink, True)
        return kvc.keep_where(cache, keep[0], step.capacity)


__all__ = ["KVzip", "keep_masks", "prompt_ids"]
