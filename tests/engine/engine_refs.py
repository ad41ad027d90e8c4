"""The engine's oracle: `kvjax.generate` of each prompt alone, and the comparison the equality tests share.

A request's engine output must equal `generate([prompt], question_ids=[question], max_new_tokens=...)` run alone:
the same greedy tokens (EOS / stop id included) and, per layer and KV head, the same kept positions of its final
cache. The only allowed difference is a float near-tie: where the tokens first differ, the reference's top-2 logit
margin is under `NEAR_TIE` (then the two programs' last-bit rounding can pick either token, and everything after it
differs legitimately). The margin is computed by replaying the reference's decode step by step
(`reference_margins`), only when the tokens differ, and the test reports each such request by name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from golden_cases import kept

import kvjax
from kvjax import tuning
from kvjax.runtime import forward
from kvjax.runtime.generate import decode_program_key

NEAR_TIE = 1e-4


@dataclasses.dataclass
class Reference:
    tokens: list[int]
    positions: list  # [layer][KV head] sorted kept positions


def reference(model, method, request, *, kv_dtype=None, chunk_size=None, eos=None) -> Reference:
    """`generate` of one request alone (greedy), cut at its count."""
    out = kvjax.generate(model, [list(request.tokens)], method=method, max_new_tokens=request.max_new_tokens,
                         question_ids=[list(request.question)] if request.question else None, return_cache=True,
                         kv_dtype=kv_dtype, chunk_size=chunk_size, eos_token_id=eos)
    n = int(out.num_tokens[0])
    return Reference(out.tokens[0][:n].tolist(), [layer[0] for layer in kept(out.cache)])


def reference_margins(model, method, request, tokens: list[int], *, kv_dtype=None, chunk_size=None) -> list[float]:
    """The reference's top-2 logit margin at each step of generating `tokens` (the reference's own), replayed one
    decode step at a time from its prefill (the decode loop's body, outside the loop)."""
    state = kvjax.prefill(model, [list(request.tokens)], method=method, max_new_tokens=request.max_new_tokens,
                          question_ids=[list(request.question)] if request.question else None, kv_dtype=kv_dtype,
                          chunk_size=chunk_size)
    logits, cache = state.logits, state.cache
    lengths = np.asarray(state.prompt_lengths, np.int32)
    step = jax.jit(lambda cache, token, pos: forward.decode_step(
        model.config, model.weights(), state.rope or model.rope(), decode_program_key(state.method), cache, token,
        pos, state.budget))
    margins = []
    for i, token in enumerate(tokens):
        top = np.sort(np.asarray(logits[0], np.float64))[-2:]
        margins.append(float(top[1] - top[0]))
        if i + 1 < len(tokens):
            with tuning.use(tuning.current()):
                logits, cache = step(cache, jnp.asarray([token], jnp.int32), jnp.asarray(lengths + i, jnp.int32))
    return margins


def compare(model, method, requests, completions, *, kv_dtype=None, chunk_size=None, eos=None) -> list[str]:
    """Checks every completion against its reference; returns the near-ties (request id and margin) it allowed."""
    by_id = {c.id: c for c in completions}
    assert sorted(by_id, key=str) == sorted((r.id for r in requests), key=str)
    ties = []
    for request in requests:
        got, want = by_id[request.id], reference(model, method, request, kv_dtype=kv_dtype, chunk_size=chunk_size,
                                                 eos=eos)
        if got.tokens == want.tokens:
            assert got.positions == want.positions, f"{method.name} request {request.id}: kept positions differ"
            continue
        first = next((i for i, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=False)) if a != b),
                     min(len(got.tokens), len(want.tokens)))
        margins = reference_margins(model, method, request, want.tokens, kv_dtype=kv_dtype, chunk_size=chunk_size)
        margin = margins[min(first, len(margins) - 1)]
        assert margin < NEAR_TIE, (f"{method.name} request {request.id}: tokens differ at step {first} where the "
                                   f"reference's top-2 margin is {margin:.3g}: {got.tokens} vs {want.tokens}")
        ties.append(f"{method.name}:{request.id}@{first} (margin {margin:.2g})")
    return ties
