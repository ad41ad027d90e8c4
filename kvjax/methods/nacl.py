"""`nacl`: NACL, "A General and Effective KV Cache Eviction Framework for LLMs at Inference Time"
(Chen et al., ACL 2024), the one-shot hybrid eviction at the end of the encoding phase.

Per layer and KV head, after the prompt has attended (budget `B` tokens):

1. Protected: the first `sink_size` tokens and the last `window_size` tokens. The last
   `window_size` tokens are also the **proxy tokens** (the question / task description at the end
   of the prompt).
2. Proxy-Tokens Eviction: each token's score is the attention the proxy queries give it, summed
   over the proxy rows (`ops.scoring.window_scores`, causal, float32; GQA: mean over the group). Of
   the free budget `F = B - protected`, `F - R` tokens are the top scores (ties: lower position).
3. Random Eviction: the remaining `R = floor(random_ratio * F)` tokens are sampled head-wise
   **without replacement** from the other candidates with probability `softmax(score / temperature)`
   (the official code samples `softmax(score)` with `np.random.choice(replace=False)`). Sampling
   is the Gumbel-top-k trick, `score / T + Gumbel` with the uniforms hashed from `(seed, layer, KV
   head, position)` (`kvjax.methods.random.token_uniform`), so a run is deterministic per seed, each
   head draws differently, and `vmap` over the batch equals a loop.

Nothing is evicted during decoding (capacity `B + max_new`), as in the paper.

Defaults: `random_ratio=0.37` is the official code's split (12% of the sequence by proxy score, 7%
at random: 7 / 19 of the non-protected budget); `window_size=32` is the recent / proxy window of
AhaKV's comparison (B = 1000, recent 32); `sink_size=0` (the official code protects 256 sinks at
128K tokens; set it for long prompts). Deviation: the official code lets the proxy rows see each
other non-causally (one flash call without a causal mask); here they are causal like the model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import Step
from kvjax.methods.common import token_uniform
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.ops.gather import keep_top
from kvjax.ops.scoring import window_scores
from kvjax.ops.select import keep_mask, protect_regions, topk_keep
from kvjax.validation import check_choice, check_int, check_number, check_ratio

Array = jax.Array

#: Mixed into the seed so NACL's draws differ from the `random` method's at the same seed.
SEED_SALT = 0x4E41434C


def gumbel_keys(scores: Array, uniforms: Array, temperature: float) -> Array:
    """Keys whose top-k is a sample without replacement with probabilities `softmax(scores / T)`."""
    u = jnp.clip(uniforms.astype(jnp.float32), 2.0**-25, 1.0 - 2.0**-24)
    return scores.astype(jnp.float32) / temperature - jnp.log(-jnp.log(u))


@register
@dataclasses.dataclass(frozen=True)
class NACL(ScoringMethod):
    """Proxy-token scores (last `window_size` queries) + seeded random eviction (`random_ratio`)."""

    name = "nacl"

    window_size: int = 32
    sink_size: int = 0
    random_ratio: float = 0.37
    temperature: float = 1.0
    seed: int = 0
    group_reduce: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "window_size", self.window_size, 1)
        check_int(self.name, "sink_size", self.sink_size, 0)
        check_int(self.name, "seed", self.seed, 0)
        check_choice(self.name, "group_reduce", self.group_reduce, ("mean", "max"))
        check_ratio(self.name, "random_ratio", self.random_ratio)
        check_number(self.name, "temperature", self.temperature, above=0)
        if self.budget is not None and self.sink_size + self.window_size >= self.budget:
            raise ConfigError(
                f"{self.name}: sink_size + window_size = {self.sink_size + self.window_size} must be smaller "
                f"than budget={self.budget} (the budget counts the protected tokens)"
            )

    def protected(self, cache: KVCache, budget: Array, step: Step) -> Array:
        """Sinks + the proxy window, never more than the budget (a small ratio budget keeps the window)."""
        window = jnp.minimum(self.window_size, budget)
        sink = jnp.minimum(self.sink_size, budget - window)
        return protect_regions(cache, sink=sink, recent=window, last=False)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        """Proxy-token scores: attention of the last `window_size` queries, summed per key."""
        stored = kvc.stored_mask(cache)
        votes = window_scores(
            q, step.positions, kvc.keys(cache), cache.pos, stored,
            window=self.window_size, row_reduce="sum", group_reduce=self.group_reduce,
        )
        return jnp.where(stored, votes, 0.0)

    def random_count(self, free: Array) -> Array:
        """Tokens of a free (non-protected) budget chosen by random eviction."""
        return jnp.floor(jnp.float32(self.random_ratio) * free.astype(jnp.float32)).astype(jnp.int32)

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        stored = kvc.stored_mask(cache)
        budget = step.budget[:, None]  # [B, 1]
        protect = self.protected(cache, step.budget, step)
        proxy = self.scores(cache, q, step, protect)
        free = jnp.maximum(budget - jnp.sum(protect, axis=-1), 0)  # [B, K]
        # Proxy-Tokens Eviction: protected tokens + the best `free - R` scores.
        idx, count = topk_keep(
            proxy, stored, budget - self.random_count(free), capacity=cache.capacity, protect=protect,
            positions=cache.pos,
        )
        chosen = keep_mask(idx, count, cache.capacity)
        # Random Eviction: R more, sampled from the rest with probability softmax(score / T).
        uniforms = token_uniform(self.seed ^ SEED_SALT, step.layer, cache.pos)
        keys = gumbel_keys(proxy, uniforms, self.temperature)
        return keep_top(cache, keys, step.budget, capacity=step.capacity, protect=chosen)
