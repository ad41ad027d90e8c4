"""`leverage`: approximate leverage scores of the pre-RoPE keys, the query-agnostic half of Compactor ("Calibrated
Query-Agnostic KV Cache Compression with Approximate Leverage Scores", Chari and Van Durme, 2025; kvpress's
`LeverageScorePress`).

A key matters to attention when no mixture of the other keys reproduces it: a query can then single it out. The
statistical leverage of a row of a matrix measures exactly that (it is the row's weight in the projection onto the
matrix's column space), so each KV head keeps its highest-leverage keys, without reading a query:

1. `X`: the head's pre-RoPE keys (RoPE undone with each slot's position), centred over the stored tokens.
2. A right Gaussian sketch `Phi` (`head_dim x sketch_dimension`, entries `N(0, 1 / sketch_dimension)`) gives
   `Y = X Phi`, and `l_i = y_i (Y^T Y + ridge I)^{-1} y_i^T`, solved through a Cholesky factor whose jitter grows
   as kvpress's does where float32 fails (`ridge`, then 10x, up to 5 tries).
3. The scores are z-normalised over the example's heads and tokens, so they also compare across heads (Ada-KV's
   head budgets: `adakv` with `base="leverage"`).

Nothing is protected; each head keeps its `budget` best keys. Defaults are kvpress 0.5.5's (`sketch_dimension=48`,
`ridge=1e-2`: its Cholesky jitter). Compactor (`compactor`) blends these scores with chunked attention.

Departures (no flag), as Compactor's: the sketch comes from `seed` and the layer index (kvpress draws it from
torch's global generator), and the z-score is per example (kvpress's spans the batch; neither changes a head's
ranking). kvpress scores one-shot prefill only; here a chunked prefill (`chunk_size=`) scores the keys the cache
holds after each chunk, as every key-only method does.
"""

from __future__ import annotations

import dataclasses

import jax

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.methods.base import Step
from kvjax.methods.common import cache_key_leverage, z_scores
from kvjax.methods.registry import register
from kvjax.methods.scorer import ScoringMethod
from kvjax.validation import check_int, check_number

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class LeverageScore(ScoringMethod):
    """Keep each head's keys of highest sketched leverage (pre-RoPE, centred, z-scored). kvpress's
    `LeverageScorePress` defaults."""

    name = "leverage"

    sketch_dimension: int = 48
    ridge: float = 1e-2
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "sketch_dimension", self.sketch_dimension, 1)
        check_int(self.name, "seed", self.seed, 0)
        check_number(self.name, "ridge", self.ridge, 0)

    def scores(self, cache: KVCache, q: Array, step: Step, protect: Array | None) -> Array:
        stored = kvc.stored_mask(cache)
        leverage = cache_key_leverage(cache, stored, step, self.seed, self.sketch_dimension, self.ridge)
        return z_scores(leverage, stored)
