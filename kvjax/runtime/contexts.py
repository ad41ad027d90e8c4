"""Compress a context once, ask it many questions: in this process, or from a file in a later one.

`compress_context` runs a prompt's prefill up to its compression (kvpress's query-agnostic setting: the method
never sees a question) and keeps the compressed cache, sized for questions of up to `max_question_tokens` and
answers of up to `max_new_tokens`. `ask` answers a batch of questions from it: each question is fed uncompressed
after the compressed context and the answers decoded, as `generate(..., question_ids=...)` does, on a copy, so the
context stays as it was for the next batch. `save_context` / `load_context` keep it in one safetensors file of the
compressed cache's real size, with the model's fingerprint, the method and its hyperparameters, and a SHA-256 of
every array, so a context made by another model, or a damaged file, is refused instead of answering wrongly.

A method that reads the question inside its prompt (the retrieval family, Q-LLM: `QuestionReader`) compresses the
context differently for each question, so it has no question-free context to keep, and is refused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import CheckpointError, ConfigError, KvjaxError
from kvjax.methods import capabilities as caps
from kvjax.methods.base import Method, per_example_budget
from kvjax.models.fingerprint import fingerprint_of, model_summary
from kvjax.quant.spec import KVQuant
from kvjax.runtime import sharding, stages
from kvjax.runtime.generate import GenerationResult, decode
from kvjax.validation import as_bool, as_int, token_ids


@dataclasses.dataclass
class CompressedContext:
    """A context prefilled and compressed once (`compress_context`), ready for `ask`."""

    tokens: np.ndarray  # [N] int32: the context's token ids
    plan: stages.PrefillPlan  # the prompt's plan (batch 1), its cache sized for the questions and answers below
    cache: Any  # the compressed ModelCache, batch 1
    last_hidden: Any  # [1, D] the hidden state at the context's last token
    max_question_tokens: int
    fingerprint: str  # `kvjax.models.fingerprint` of the model that made it
    mesh: Any = None  # the one-process `jax.sharding.Mesh` its cache is placed on (None: one device)

    @property
    def method(self) -> Method:
        return self.plan.method

    @property
    def budget(self) -> np.ndarray:
        """`[1]` int32 tokens the method keeps of the context (what its prefill was given)."""
        return per_example_budget(self.plan.method, self.plan.lengths)

    @property
    def max_new_tokens(self) -> int:
        return self.plan.max_new_tokens

    @property
    def nbytes(self) -> int:
        """Bytes the compressed cache holds (what it costs in memory, and on disk)."""
        return self.cache.nbytes


def _question_bucket(max_question_tokens: int) -> int:
    return stages.bucket_length(max_question_tokens) if max_question_tokens > 0 else 0


def check_context_mesh(mesh: Any) -> None:
    """Refuses what a context cannot be placed on: anything but a one-process mesh with kvjax's axes, or None."""
    sharding.check_mesh(mesh)
    if mesh is not None and mesh.is_multi_process:
        raise ConfigError("a compressed context is kept and saved whole by one process; it does not run on a mesh "
                          "that spans processes")


def context_plan(model: Any, tokens: Any, *, method: str | Method, method_args: dict | None, max_new_tokens: int,
                 max_question_tokens: int, chunk_size: int | None, kv_dtype: str | KVQuant | None,
                 mesh: Any = None) -> stages.PrefillPlan:
    """The prompt's plan with its cache and rings sized for a question of `max_question_tokens` and an answer of
    `max_new_tokens` (every input checked before anything is traced)."""
    check_context_mesh(mesh)
    method = stages.resolve_method(method, method_args)
    if caps.question_in_prompt(method):
        raise ConfigError(f"{method.name} reads the question inside its prompt, so its compressed context depends on "
                          "the question: it has no question-free context to keep (use kvjax.generate with "
                          "question_ids)")
    max_question_tokens = as_int(max_question_tokens, "max_question_tokens", minimum=0)
    if not isinstance(tokens, Sequence | np.ndarray) or isinstance(tokens, str | bytes) or (
            len(tokens) and not np.isscalar(tokens[0])):
        raise ConfigError("the context must be one list of token ids (tokenizer.encode(text)), got "
                          f"{type(tokens).__name__}")
    ids = token_ids(tokens, "the context", model.config.vocab_size)  # named as the caller's argument
    if not ids.size:
        raise KvjaxError("the context is empty: it needs at least one token")
    plan = stages.plan(model.config, [ids.tolist()], method=method, max_new_tokens=max_new_tokens,
                       chunk_size=chunk_size, kv_dtype=kv_dtype, mesh=mesh)
    longest = int(plan.lengths.max())
    stages.check_context(method, longest + max_question_tokens + plan.max_new_tokens, longest + max_question_tokens,
                         model.config.max_position_embeddings)
    return dataclasses.replace(plan, rope_length=longest + max_question_tokens,
                               ring_context=plan.bucket + _question_bucket(max_question_tokens) + plan.max_new_tokens)


def compress_context(model: Any, tokens: Sequence[int], *, method: str | Method, max_new_tokens: int,
                     max_question_tokens: int = 256, method_args: dict | None = None, chunk_size: int | None = None,
                     kv_dtype: str | KVQuant | None = None, mesh: Any = None) -> CompressedContext:
    """Prefills `tokens` (one context) and compresses it with `method`, once.

    The cache is sized for questions of up to `max_question_tokens` and answers of up to `max_new_tokens`, the
    most `ask` takes. `chunk_size`, `kv_dtype` and `mesh` (one process's devices: the KV heads on `model`, `ask`'s
    questions on `data`) as `kvjax.prefill`'s. A context-replay method (KVzip) pays its second pass here only.
    """
    plan = context_plan(model, tokens, method=method, method_args=method_args, max_new_tokens=max_new_tokens,
                         max_question_tokens=max_question_tokens, chunk_size=chunk_size, kv_dtype=kv_dtype,
                         mesh=mesh)
    run = stages.through_prompt(model, plan, mesh)
    return CompressedContext(tokens=plan.tokens[0, : int(plan.lengths[0])].astype(np.int32), plan=plan, cache=run.cache,
                             last_hidden=run.last_hidden, max_question_tokens=int(max_question_tokens),
                             fingerprint=fingerprint_of(model), mesh=mesh)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _rows(batched: tuple[bool, ...], rows: int, leaves: tuple[Any, ...]) -> tuple[Any, ...]:
    """Every leaf of a one-row cache as `rows` rows (a constant without the batch axis copied as it is): the
    question pass and decode write and donate these, never the context's own buffers."""
    return tuple(jnp.repeat(x, rows, axis=0) if b else jnp.copy(x) for x, b in zip(leaves, batched, strict=True))


def batch_leaves(model: Any, context: CompressedContext) -> tuple[bool, ...]:
    """Which leaves of the context's cache (in `jax.tree.leaves` order) have the batch axis first."""
    plan = context.plan
    return stages.batch_leaves(lambda batch: stages.init_cache(
        plan.method, model.config, batch, plan.capacity, model.dtype, plan.quant, context=plan.context,
        layer_capacities=plan.layer_capacities))


def ask(model: Any, context: CompressedContext, questions: Sequence[Sequence[int]], *,
        max_new_tokens: int | None = None, seed: int = 0, temperature: float = 0.0, top_p: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None, stop_at_eos: bool = True,
        return_cache: bool = False) -> GenerationResult:
    """Answers each question (token lists, one row each; an empty one continues the context) from `context`.

    The same tokens as `kvjax.generate(model, [context tokens], question_ids=[question], method=...)` for each
    question, without compressing the context again. `max_new_tokens`: at most the context's (its default).
    """
    check_model(model, context)
    as_bool(stop_at_eos, "stop_at_eos")
    return_cache = as_bool(return_cache, "return_cache")
    q_tokens, q_lengths = stages.token_batch(questions, None, allow_empty=True, name="questions")
    token_ids(q_tokens[np.arange(q_tokens.shape[1])[None] < q_lengths[:, None]], "questions",
              model.config.vocab_size)
    too_long = np.flatnonzero(q_lengths > context.max_question_tokens)
    if too_long.size:
        i = int(too_long[0])
        raise ConfigError(f"question {i} has {int(q_lengths[i])} tokens; this context was compressed for questions of "
                          f"up to max_question_tokens={context.max_question_tokens}")
    new = context.max_new_tokens if max_new_tokens is None else as_int(max_new_tokens, "max_new_tokens", minimum=1)
    if new > context.max_new_tokens:
        raise ConfigError(f"max_new_tokens={new} exceeds the {context.max_new_tokens} new tokens this context was "
                          "compressed for (compress_context's max_new_tokens)")
    rows = int(q_tokens.shape[0])
    plan = context.plan
    asked = dataclasses.replace(
        plan, tokens=np.repeat(plan.tokens, rows, 0), positions=np.repeat(plan.positions, rows, 0),
        lengths=np.repeat(plan.lengths, rows), question=q_tokens if q_lengths.max() > 0 else None,
        question_lengths=q_lengths if q_lengths.max() > 0 else None,
        question_bucket=stages.bucket_length(int(q_lengths.max())) if q_lengths.max() > 0 else 0)
    leaves, tree = jax.tree.flatten((context.cache, context.last_hidden))
    batched = batch_leaves(model, context) + (True,)
    cache, last_hidden = jax.tree.unflatten(tree, _rows(batched, rows, tuple(leaves)))
    budget, weights, mesh = np.repeat(context.budget, rows), model.weights(), context.mesh
    if mesh is not None:  # the questions' rows on `data`, as `stages.allocate` places a batch's
        put = stages.placer(mesh)
        weights, cache = sharding.shard_weights(weights, mesh), sharding.shard_cache(cache, mesh)
        last_hidden, budget = put(last_hidden), put(budget)
    run = stages.Prefilling(cache=cache, last_hidden=last_hidden, lengths=asked.lengths, budget=budget,
                            weights=weights, rope=model.rope(plan.rope_length), mesh=mesh)
    state = stages.after_prompt(model, asked, run)
    tokens, count, cache = decode(model, state, max_new_tokens=new, seed=seed, temperature=temperature, top_p=top_p,
                                  eos_token_id=eos_token_id, stop_at_eos=stop_at_eos)
    return GenerationResult(tokens=tokens, num_tokens=count, prompt_lengths=state.prompt_lengths,
                            cache=cache if return_cache else None)


def check_model(model: Any, context: CompressedContext) -> None:
    """Refuses (`CheckpointError`) a context that another model, config or dtype made."""
    fp = fingerprint_of(model)
    if context.fingerprint != fp:
        raise CheckpointError(f"this compressed context was made by a different model or config (fingerprint "
                              f"{context.fingerprint[:12]} != {fp[:12]} of this model: "
                              f"{model_summary(model.config, model.dtype)}); compress the context again with it")
