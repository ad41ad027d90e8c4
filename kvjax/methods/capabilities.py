"""Capabilities: what a method declares beyond the base protocol, and the runtime dispatches on.

The base protocol (`kvjax.methods.base.Method`) is a budget and two hooks, `prefill` and `decode`. That is all
an ordinary one-shot scorer needs (`ScoringMethod`: one `scores` function). A method that needs more from the
runtime mixes in the capability that says so; the runtime (`kvjax.runtime.step`) asks for it with the predicates
below, never by probing attributes:

* `InPlaceEviction` (StreamingLLM): the runtime appends the new token and evicts the slot `decode_eviction`
  picks, both written in place (no copy of the layer).
* `AttentionObserver` (H2O, TOVA, AhaKV, the InfLLM family): each decode step's attention probabilities go
  to `observe`.
* `QueryHeadMask` (SAGE-KV): decode attention gets a per-query-head visibility mask (`query_mask`).
* `Retrieval` (InfLLM, Q-LLM, ActQKV, Quest): prefill chunks let the method set the attend mask first
  (`before_prefill_attention`); decode attends a compact gathered set of slots (`decode_slots`).
* `AttentionRewrite` (InfLLM's positional scheme): prefill attention and decode keys come from the method.
* `QuestionReader` (Quest, the InfLLM family): `question_ids` go through the method's hooks as the end of the
  prompt (and, with `encodes_question`, before the context too: Q-LLM's layout).
* `ContextReplay` (KVzip): after an uncompressed prefill, the runtime feeds the method's replay rows (a repeat
  prompt + the context again, chunk by chunk) through the model, each layer's attention reports to `replay_scores`,
  and `replay_compress` then compacts every layer at once (a selection across layers). A method may score in the
  prompt pass itself (`prompt_scorer`) and have no replay rows (Fast KVzip's gates).

Each capability may switch itself off per instance (`StreamingLLM(rerotate=True)` cannot evict in place), so
the predicates check the switch as well as the class.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax

from kvjax.cache import KVCache

Array = jax.Array


class AttentionObserver:
    """Decode hands the step's attention probabilities to `observe` (H2O-style accumulators)."""

    def observe(self, cache: KVCache, weights: Array, step: Any) -> KVCache:
        """After a decode step attended: `weights` `[B, K, G, C]` float32 probabilities per slot."""
        return cache


class InPlaceEviction:
    """Decode = append the new token, then remove at most one slot per head, chosen from positions and lengths
    alone (`decode_eviction`). The runtime does both in place (`kvjax.cache.append_token`, `evict`); `decode`
    must stay equal to that (the general path, for a method whose `evicts_in_place` is off)."""

    @property
    def evicts_in_place(self) -> bool:
        return True

    def decode_eviction(self, cache: KVCache, step: Any) -> tuple[Array, Array]:
        """(`[B, K]` slot, `[B, K]` bool whether to evict) after the new token was appended; only `pos`, `length`
        and the capacity of `cache` may be read."""
        raise NotImplementedError


class QueryHeadMask:
    """Decode attention sees a per-query-head mask instead of one mask per KV head."""

    def query_mask(self, cache: KVCache, num_query_heads: int) -> Array | None:
        """`[B, K, G, C]` per-query-head visibility (None: every query head of a group sees the same slots)."""
        return None


class Retrieval:
    """Retrieval methods: prefill chunks see the method before they attend, decode attends a compact set.

    At prefill, `before_prefill_attention` writes the `attend` mask from the chunk's own queries. At decode the
    runtime writes the new token in place, `decode_slots` lists the `[B, K, W]` slots to attend (W static,
    independent of the context), the runtime gathers their K / V and attends over them alone, and writes back
    only the layer's `state` and `attend`. Equal to the general path (`decode`, a masked attention over the
    whole cache, `observe`) up to float summation order; `gathers_at_decode` off forces the latter.
    """

    @property
    def gathers_at_decode(self) -> bool:
        return True

    @property
    def decode_dense_layers(self) -> int:
        """The first this many layers attend their whole cache through `decode_dense` and the masked attention
        (Quest's dense layers); their K / V are still written in place."""
        return 0

    def before_prefill_attention(self, cache: KVCache, q: Array, step: Any) -> KVCache:
        """After a prefill chunk was appended, before it attends (`capacity + T` slots). Default: no-op."""
        return cache

    def decode_slots(self, cache: KVCache, q: Array, step: Any, take: Any) -> tuple[KVCache, Array, Array]:
        """(the layer with `state` / `attend` advanced as `decode` would, slots `[B, K, W]` int32 in `[0, C)`,
        `[B, K, W]` bool which of them to attend). The new token is already appended. `take(slots)` reads
        `(k, v, pos)` at `[B, K, S]` slots of this layer from its buffers."""
        raise NotImplementedError

    def decode_dense(self, cache: KVCache, q: Array, step: Any, take: Any) -> KVCache:
        """`decode` in one of the `decode_dense_layers` (known dense there: a method may skip its selection)."""
        return self.decode(cache, q, step)

    def slot_keys(self, k: Array, pos: Array, q: Array, step: Any) -> Array:
        """The keys the attention scores, from the gathered `k` `[B, K, W, H]` at `pos` `[B, K, W]` (InfLLM's
        positions re-rotate far keys). Default: as stored."""
        return k

    def observe_slots(self, cache: KVCache, weights: Array, slots: Array, pos: Array, ok: Array,
                      step: Any) -> KVCache:
        """With `AttentionObserver`: `observe` from the compact attention's float32 probabilities `[B, K, G, W]`
        over `slots` (holding positions `pos`; `ok`: attended), all `[B, K, W]`."""
        return cache


class AttentionRewrite:
    """The method computes prefill attention itself and chooses the keys decode attends (InfLLM's positions)."""

    @property
    def rewrites_attention(self) -> bool:
        return True

    def prefill_attention(self, cache: KVCache, q: Array, step: Any) -> tuple[Array, KVCache]:
        """The chunk's attention output `[B, T, N, H]` and the cache."""
        raise NotImplementedError

    def decode_keys(self, cache: KVCache, q: Array, step: Any) -> Array:
        """The keys the decode query attends (`[B, K, C, H]`); default the stored post-RoPE keys."""
        return cache.k

    def max_attended_distance(self) -> int | None:
        """The largest query-key RoPE distance attention ever sees (None: up to the whole sequence). A bound below
        the model's `max_position_embeddings` lets the runtime take prompts longer than the model window."""
        return None


class QuestionReader:
    """`question_ids` go through the method's own hooks as the end of the prompt (retrieval methods read it
    there) instead of being appended uncompressed after the compressed context. With `encodes_question` the
    question also opens the prompt (question + context + question, Q-LLM's layout) and `mark_question` gets
    each example's question length before the prefill."""

    encodes_question: ClassVar[bool] = False

    def mark_question(self, cache: KVCache, lengths: Array) -> KVCache:
        """Only with `encodes_question`: the prompt opens with a question of `lengths` `[B]` tokens (one layer's
        cache, before the prefill; the runtime marks every layer). Default: no-op."""
        return cache


class ContextReplay:
    """The method scores the prompt by having the model read it again (KVzip's context reconstruction).

    The runtime prefills the prompt uncompressed (every slot kept, in position order), then for each replay chunk
    of `replay_rows` runs the rows through the model: at every layer the rows attend the prompt's cache and their
    own earlier tokens, and `replay_scores` reads their queries and keys; nothing the rows write stays in the cache.
    After the last chunk, `replay_compress` gets every layer at once and returns them compacted to `capacity`.

    The runtime calls exactly these members: `replay_width` (before tracing), `prompt_scorer`, `replay_rows`,
    `replay_scores`, `replay_compress`; the eval CLI calls `with_tokenizer`.

    `prompt_scorer` (Fast KVzip): the uncompressed prompt pass runs that method's hooks instead of keeping every
    token plainly; they keep every token too and write the method's scores into `cache.score`. With no replay rows
    (`replay_rows` returns none) the prompt pass is the only one, and `replay_compress` selects across layers from
    its scores.

    `replay_objective` (KVgrad): each chunk is also differentiated. The rows' objective is the sum of squares of the
    last layer's output over the real rows, and `replay_scores` gets, as `step.replay_gradient` `[B, R]`, each row's
    norm of the objective's gradient with respect to the layer's attention output (after its output projection).
    """

    #: Whether `replay_scores` reads `step.replay_gradient` (the runtime then differentiates each replay chunk).
    replay_objective: ClassVar[bool] = False

    def replay_width(self, context: int) -> int:
        """Tokens of one replay row for prompts of up to `context` tokens: the runtime refuses a prompt whose rows
        would reach past the model's context (`kvjax.runtime.replay.check`) before anything is traced."""
        raise NotImplementedError

    def prompt_scorer(self) -> Any:
        """The method (`kvjax.methods.base.Method`) whose hooks the uncompressed prompt pass runs: it must keep every
        token (return the layer at `step.capacity` slots, which holds the whole prompt) and may write `cache.score`.
        Default None: the `full` method."""
        return None

    def replay_rows(self, tokens: Any, lengths: Any) -> list[tuple[Any, Any, Any]]:
        """Host-side chunks `(rows [B, R] int32, row lengths [B], spans [B, 2])` for prompts `tokens` `[B, T]`
        of `lengths` `[B]`: each chunk's token rows (R static over the chunks) and the prompt positions
        `[start, end)` they reconstruct (an example without work in a chunk: length 0, empty span)."""
        raise NotImplementedError

    def replay_scores(self, cache: KVCache, q: Array, k: Array, positions: Array, span: Array, step: Any) -> KVCache:
        """One layer of one replay chunk: the rows' post-RoPE queries `q` `[B, R, N, H]` and keys `k` `[B, R, K, H]`
        at `positions` `[B, R]` (-1: padding), `span` `[B, 2]`; returns the layer (same capacity) with its scores."""
        raise NotImplementedError

    def replay_compress(self, layers: tuple[KVCache, ...], budget: Array, capacity: int) -> tuple[KVCache, ...]:
        """Every managed layer after the last replay chunk -> each compacted into `capacity` slots."""
        raise NotImplementedError

    def with_tokenizer(self, tokenizer: Any, chat_template: bool) -> Any:
        """The method with whatever its replay rows take from the tokenizer (KVzip's repeat prompt), for prompts
        built with (`chat_template`) or without the tokenizer's chat template. Default: unchanged."""
        return self


# ---- the predicates the runtime dispatches on ------------------------------------------------------------

def observes_attention(method: Any) -> bool:
    return isinstance(method, AttentionObserver)


def evicts_in_place(method: Any) -> bool:
    return isinstance(method, InPlaceEviction) and method.evicts_in_place


def masks_query_heads(method: Any) -> bool:
    return isinstance(method, QueryHeadMask)


def gathers(method: Any) -> bool:
    return isinstance(method, Retrieval) and method.gathers_at_decode


def rewrites_attention(method: Any) -> bool:
    return isinstance(method, AttentionRewrite) and method.rewrites_attention


def question_in_prompt(method: Any) -> bool:
    return isinstance(method, QuestionReader)


def encodes_question(method: Any) -> bool:
    return isinstance(method, QuestionReader) and method.encodes_question


def edits_mask_before_attention(method: Any) -> bool:
    """Whether the method changes the cache's masks before a prefill chunk attends (`before_prefill_attention`)."""
    own = type(method).before_prefill_attention if isinstance(method, Retrieval) else None
    return own is not None and own is not Retrieval.before_prefill_attention


def replays_context(method: Any) -> bool:
    return isinstance(method, ContextReplay)


def differentiates_replay(method: Any) -> bool:
    return isinstance(method, ContextReplay) and method.replay_objective


def max_attended_distance(method: Any) -> int | None:
    return method.max_attended_distance() if isinstance(method, AttentionRewrite) else None


def query_mask(method: Any, cache: KVCache, num_query_heads: int) -> Array | None:
    return method.query_mask(cache, num_query_heads) if isinstance(method, QueryHeadMask) else None
