"""`key_rerotation`: contiguous positions after pruning, around any scoring method (kvpress's
`KeyRerotationPress`; the position re-assignment of StreamingLLM, Section 3.2, applied to any selection).

Keys are stored after RoPE at their original positions, so a pruned cache has gaps: the next query sees its
kept neighbours at the distances they had in the full prompt. Re-rotation closes the gaps. After the base method
kept `m` of an example's `n` prompt tokens in a head, the kept key of rank `r` (in position order) is rotated by
`(n - m + r) - p`, from its position `p` to `n - m + r`: the kept tokens sit at contiguous positions ending just
before the first new token at `n`, so every distance is what it would be in a cache that only ever held them
(kvpress moves them to `0 .. m - 1` and numbers new tokens from `m`; RoPE sees the same relative distances).
`pos` keeps the original positions (which tokens were kept, and the causal order, which re-rotation never
changes: `p <= n - m + r < n`). Heads with different counts (Ada-KV) are packed each on its own.

Re-rotation runs once, after the prompt's last chunk compressed (earlier chunks keep their original positions,
so the rotation is always taken from `p`); generated tokens are appended at their own positions, as usual.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.methods.base import Step, last_position
from kvjax.methods.common import pack_positions
from kvjax.methods.registry import register
from kvjax.methods.wrapper import ScorerWrapper

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class KeyRerotation(ScorerWrapper):
    """A scoring method (`base`, `base_args`) whose kept keys are re-rotated to contiguous positions."""

    name = "key_rerotation"

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        seen = jnp.max(last_position(cache), axis=-1) + 1
        out = self.inner.prefill(cache, q, step)
        if not step.final_chunk:
            return out
        return pack_positions(out, seen, step.inv_freq)
