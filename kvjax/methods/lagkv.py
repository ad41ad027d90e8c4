"""`lagkv`: LagKV, "Lag-Relative Information of the KV Cache" (Liang et al., 2025, arXiv 2504.04704).

Attention-free eviction. Per layer and KV head the cache is `[sink S][compressed][partitions of L]`;
partitions are anchored at absolute position `S` (partition `p` = positions `[S + pL, S + (p+1)L)`)
and each one is scored against the **next** one (its "lag" reference), Eqs. 7-11:

    mn, mx   = per-channel min / max of the reference partition's keys (values)   (Eqs. 7-8)
    Xbar     = (X - mn) / max(mx - mn, eps)                                         (Eq. 9)
    s_Z      = softmax over the L tokens of std_channels(Xbar)  (ddof=1)            (Eq. 10)
    score    = s_K + value_weight * s_V                                             (Eq. 11)

and keeps its best tokens; the sink, the already compressed part and the last full partition plus
the remainder (a sliding window of `L ... 2L-1` tokens) are never touched. Nothing is compressed
below `S + 2L` tokens. The kept length follows Eq. 12.

Two ways to set how much is kept:

* **Partition mode** (`retention=r`, the official `lag_kv.py`, paper Sec. 2 and the Table 3
  ablation; default `r = 0.5`): every partition keeps `m = floor(r L)` tokens. All three stages of
  the paper run: one-shot compression after prefill; **recursive** compression during decoding (a
  partition is compressed as soon as the next one is complete: every `L` tokens); and
  **chunk-by-chunk prefill** (`generate(..., chunk_size=c)`): each chunk attends the already
  compressed cache, then the complete partitions are compressed, so peak KV memory is
  `capacity + c` whatever the prompt length. Partitions are grid-aligned, so the kept set depends
  only on the K/V stream, not on the chunking; with `c` a divisor of both `S` and `L` (e.g.
  `c = gcd(S, L)`) compressions happen at exactly the paper's points (`S + 2L`, then every `L`).
* **Budget mode** (`budget=` / `compression_ratio=`, the paper's RULER protocol run in kvpress,
  Sec. 3.2, "r adapted by Eq. 13"): after prefill each example keeps exactly its budget: sink and
  window first, the rest spread evenly over the partitions by within-partition rank (+-1 token,
  earlier partitions first on ties, float32 ranks). Decoding then continues the recursion at the
  example's adapted rate `m_b` (`compress_decode=False` keeps kvpress's prefill-only behaviour).
  A global budget needs the whole prompt, so chunked prefill is partition mode only.

Decode ordering ("use_then_compress"): the reference attends a new token over the uncompressed
cache, then compresses. The decode hook runs *before* attention, so it compresses the partition
completed by the *previous* token (the new token lies in the window and does not change the
scores): the same caches are attended, for one extra slot.

**Capacity bound** (partition mode): with `N = prompt + max_new_tokens` tokens at most ever in the
cache and `J = max(0, floor((N - S) / L) - 1)` partitions ever compressed,

    capacity = min(N, S + m * J + 2L + 1)

(compressed prefix + a window of at most `2L` tokens + the token appended before the deferred
compression). With `compression_ratio=C` the same bound holds with `m * J` replaced by
`floor((1 - C) L J)`; with an absolute `budget=B` it is `max(B, S + 2L - 1) + max_new_tokens`
(capped by `N`), since an example whose prompt fits its budget keeps every decode token.

Variants (paper Sec. 4.4): `variant="local"` (LocalKV, Eqs. 14-15: min / max of the partition
itself) and `variant="l2"` (score = -||k||, Eq. 16; the official `l2_kv.py` defaults: values not
scored, layers 0 and 1 not compressed). A skipped layer keeps every token, so it is allocated at `N`; the others at
the bound above (`layer_capacities`).

Deviations from the reference code, all documented in the spec: statistics in float32 (reference:
cache dtype); `max - min` clamped at `minmax_eps` (reference: none, a constant reference channel
gives inf / NaN; `minmax_eps=0` restores it); kept tokens stored in position order (reference:
top-k order; attention is permutation invariant); ties go to the lower position.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Method, Step, last_position
from kvjax.methods.capabilities import QueryHeadMask
from kvjax.methods.common import descending_rank
from kvjax.methods.registry import register
from kvjax.ops.select import topk_keep
from kvjax.validation import check_choice, check_int, check_number

Array = jax.Array

VARIANTS = ("lag", "local", "l2")


def partition_scores(
    z: Array, *, variant: str = "lag", eps: float = 1e-6
) -> Array:
    """Per-token score of partitions `0..P-1` of `z` `[..., P + 1, L, H]` (one modality), float32.

    `variant="lag"`: Eqs. 7-10 with partition `p + 1` as reference; `"local"`: Eqs. 14-15 (the
    partition itself); `"l2"`: `-||z||` (Eq. 16, no softmax). Returns `[..., P, L]`.
    """
    z = z.astype(jnp.float32)
    x = z[..., :-1, :, :]
    if variant == "l2":
        return -jnp.sqrt(jnp.sum(x * x, axis=-1))
    ref = z[..., 1:, :, :] if variant == "lag" else x
    mn = jnp.min(ref, axis=-2, keepdims=True)
    den = jnp.max(ref, axis=-2, keepdims=True) - mn
    if eps > 0:
        den = jnp.maximum(den, eps)
    xbar = (x - mn) / den
    sd = jnp.std(xbar, axis=-1, ddof=1)
    return jax.nn.softmax(sd, axis=-1)


@register
@dataclasses.dataclass(frozen=True)
class LagKV(Method):
    """LagKV: `sink_size` 16, `lag_size` 128 (the paper's RULER setting; official code 1024),
    `retention` 0.5 (official default) unless `budget` / `compression_ratio` is given."""

    name = "lagkv"

    sink_size: int = 16
    lag_size: int = 128
    retention: float | None = None
    variant: str = "lag"
    value_weight: float | None = None
    skip_layers: tuple[int, ...] | None = None
    minmax_eps: float = 1e-6
    compress_decode: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "sink_size", self.sink_size, 0)
        check_int(self.name, "lag_size", self.lag_size, 1)
        check_choice(self.name, "variant", self.variant, VARIANTS)
        if self.retention is not None:
            if self.compresses:
                raise ConfigError(
                    "lagkv: give retention= (tokens kept per partition, the official code's ratio) or "
                    f"budget= / compression_ratio=, not both (got retention={self.retention!r})"
                )
            check_number("lagkv", "retention", self.retention, above=0, maximum=1)
            if self._partition_keep < 1:
                raise ConfigError(
                    f"lagkv: retention={self.retention} keeps floor(retention * lag_size) = 0 tokens per "
                    f"partition of lag_size={self.lag_size}; raise retention or lag_size"
                )
        elif not self.compresses:
            object.__setattr__(self, "retention", 0.5)
        if self.compression_ratio is not None and math.floor((1.0 - self.compression_ratio) * self.lag_size) < 1:
            raise ConfigError(
                f"lagkv: compression_ratio={self.compression_ratio} leaves less than one token per partition "
                f"of lag_size={self.lag_size} during decoding; lower it or raise lag_size"
            )
        check_number("lagkv", "value_weight", self.value_weight, 0, optional=True)
        if self.skip_layers is not None:
            if not isinstance(self.skip_layers, tuple | list) or any(
                not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.skip_layers
            ):
                raise ConfigError(
                    f"lagkv: skip_layers must be a tuple of layer indices >= 0, got {self.skip_layers!r}"
                )
            object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        check_number("lagkv", "minmax_eps", self.minmax_eps, 0)
        if not isinstance(self.compress_decode, bool):
            raise ConfigError(f"lagkv: compress_decode must be a bool, got {self.compress_decode!r}")

    # ---- resolved hyperparameters --------------------------------------------------------------
    @property
    def partition_mode(self) -> bool:
        """True when every partition keeps a fixed `m` (retention), False for a global budget."""
        return self.retention is not None

    @property
    def _partition_keep(self) -> int:
        return int(math.floor(self.retention * self.lag_size + 1e-9))

    @property
    def keep_per_partition(self) -> int | None:
        """`m = floor(r L)` in partition mode (None in budget mode, where it is adapted per example)."""
        return self._partition_keep if self.partition_mode else None

    @property
    def resolved_value_weight(self) -> float:
        if self.value_weight is not None:
            return float(self.value_weight)
        return 0.0 if self.variant == "l2" else 1.0

    @property
    def resolved_skip_layers(self) -> tuple[int, ...]:
        if self.skip_layers is not None:
            return self.skip_layers
        return (0, 1) if self.variant == "l2" else ()

    # ---- sizes -----------------------------------------------------------------------------------
    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Static slots of the largest layer: every token where a layer is skipped, else the compressed bound."""
        if self.resolved_skip_layers:
            return prompt_len + max_new_tokens
        return self._compressed_capacity(prompt_len, max_new_tokens)

    def layer_capacities(self, prompt_len: int, max_new_tokens: int, num_layers: int) -> tuple[int, ...] | None:
        """With `skip_layers` (the `l2` variant's layers 0 and 1) a skipped layer keeps every token and the others
        their compressed bound; None without."""
        skip = self.resolved_skip_layers
        if not skip:
            return None
        compressed = self._compressed_capacity(prompt_len, max_new_tokens)
        return tuple(prompt_len + max_new_tokens if layer in skip else compressed for layer in range(num_layers))

    def _compressed_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Static slots of a compressed layer; see the module docstring for the bound."""
        s, lag = self.sink_size, self.lag_size
        total = prompt_len + max_new_tokens
        parts = max(0, (total - s) // lag - 1) if total >= s else 0
        if self.partition_mode:
            bound = s + self._partition_keep * parts + 2 * lag + 1
        elif self.compression_ratio is not None:
            bound = s + int(math.floor((1.0 - self.compression_ratio) * lag * parts + 1e-9)) + 2 * lag + 1
        else:
            prefill = max(min(self.budget, prompt_len), min(prompt_len, s + 2 * lag - 1))
            bound = prefill + max_new_tokens
        return min(total, bound)

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Array]:
        # parts: partitions already compressed (the uncompressed region starts at S + parts * L);
        # keep: tokens kept per partition during decoding in budget mode.
        zeros = jnp.zeros((spec.batch, spec.kv_heads), jnp.int32)
        return {"parts": zeros, "keep": zeros + self.lag_size}

    @property
    def decode_appends_only(self) -> bool:
        """With `compress_decode=False` the decode hook only appends, so decode takes the model's
        in-place path (a subclass overriding `decode` keeps the general one)."""
        plain = type(self).decode is LagKV.decode and not isinstance(self, QueryHeadMask)
        return (not self.compress_decode and plain) or super().decode_appends_only

    # ---- hooks -----------------------------------------------------------------------------------
    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        if not self.partition_mode and not step.final_chunk:
            raise ConfigError(
                "lagkv: chunked prefill needs partition mode (retention=...): a global budget= / "
                "compression_ratio= is spread over the partitions of the whole prompt"
            )
        self._check_head_dim(cache)
        n_seen = last_position(cache) + 1
        max_parts = max(1, cache.capacity // self.lag_size)

        def compress(c: KVCache) -> KVCache:
            if self.partition_mode:
                return self._compress(c, n_seen, max_parts, step.capacity, keep=self._partition_keep)
            out = self._compress(c, n_seen, max_parts, step.capacity, budget=step.budget)
            return out.replace(state={**out.state, "keep": self._adapted_keep(out, n_seen, step.budget)})

        return self._unless_skipped(step, compress, lambda c: kvc.truncate(c, step.capacity), cache)

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        if not self.compress_decode:
            return cache
        # Tokens before the new one: their partitions are compressed now, before it attends.
        n_seen = last_position(cache)
        keep = self._partition_keep if self.partition_mode else cache.state["keep"]

        def compress(c: KVCache) -> KVCache:
            todo = self._pending(c, n_seen, 1)
            return jax.lax.cond(
                jnp.any(todo > 0),
                lambda x: self._compress(x, n_seen, 1, x.capacity, keep=keep),
                lambda x: x,
                c,
            )

        return self._unless_skipped(step, compress, lambda c: c, cache)

    # ---- internals -------------------------------------------------------------------------------
    def _check_head_dim(self, cache: KVCache) -> None:
        if self.variant != "l2" and cache.head_dim < 2:
            raise ConfigError(f"lagkv: the channel std (ddof=1) needs head_dim >= 2, got {cache.head_dim}")

    def _unless_skipped(
        self,
        step: Step,
        compress: Callable[[KVCache], KVCache],
        identity: Callable[[KVCache], KVCache],
        cache: KVCache,
    ) -> KVCache:
        skip = self.resolved_skip_layers
        if not skip:
            return compress(cache)
        skipped = jnp.any(step.layer == jnp.asarray(skip, jnp.int32))
        return jax.lax.cond(skipped, identity, compress, cache)

    def _pending(self, cache: KVCache, n_seen: Array, max_parts: int) -> Array:
        """`[B, K]` partitions that can be compressed now: complete ones with a complete successor."""
        s, lag = self.sink_size, self.lag_size
        complete = jnp.where(n_seen >= s, (n_seen - s) // lag, 0)
        return jnp.clip(complete - 1 - cache.state["parts"], 0, max_parts)

    def _compress(
        self,
        cache: KVCache,
        n_seen: Array,
        max_parts: int,
        capacity: int,
        *,
        keep: int | Array | None = None,
        budget: Array | None = None,
    ) -> KVCache:
        """One compression call (spec 3.3): scores the pending partitions of the uncompressed region
        (tokens at positions `< n_seen` only) and keeps `keep` per partition, or, with `budget`
        `[B]`, exactly `budget` tokens in all (sink and window first, then by within-partition rank).
        """
        s, lag = self.sink_size, self.lag_size
        parts = cache.state["parts"]
        todo = self._pending(cache, n_seen, max_parts)
        stored = kvc.stored_mask(cache)
        # Slots are sorted by position; the uncompressed region starts at slot `start`.
        start = jnp.sum(stored & (cache.pos < (s + parts * lag)[..., None]), axis=-1).astype(jnp.int32)
        width = (max_parts + 1) * lag
        idx = jnp.minimum(start[..., None] + jnp.arange(width, dtype=jnp.int32), cache.capacity - 1)

        def window(x: Array) -> Array:
            w = jnp.take_along_axis(x, idx[..., None], axis=2)
            return w.reshape(*w.shape[:2], max_parts + 1, lag, w.shape[-1])

        score = partition_scores(window(kvc.keys(cache)), variant=self.variant, eps=self.minmax_eps)
        weight = self.resolved_value_weight
        if weight:
            values = window(kvc.values(cache))
            score = score + weight * partition_scores(values, variant=self.variant, eps=self.minmax_eps)
        rank = descending_rank(score).reshape(*score.shape[:2], max_parts * lag)  # [B, K, P * L]

        # Map every slot to its place in the scored window.
        offset = jnp.arange(cache.capacity, dtype=jnp.int32) - start[..., None]
        scored = (offset >= 0) & (offset < todo[..., None] * lag) & stored
        slot_rank = jnp.take_along_axis(rank, jnp.clip(offset, 0, max_parts * lag - 1), axis=-1)
        new_state = {**cache.state, "parts": parts + todo}
        if budget is None:
            keep = jnp.asarray(keep, jnp.int32)
            keep = keep[..., None] if keep.ndim else keep
            out = kvc.keep_where(cache, ~scored | (slot_rank < keep), capacity)
            return out.replace(state=new_state)
        indices, counts = topk_keep(
            -slot_rank.astype(jnp.float32), stored, budget, capacity=capacity, protect=stored & ~scored,
            positions=cache.pos,
        )
        return kvc.compact(cache, indices, counts).replace(state=new_state)

    def _adapted_keep(self, cache: KVCache, n_seen: Array, budget: Array) -> Array:
        """`[B, K]` tokens per partition for decoding in budget mode: the rate Eq. 13 gave the prompt."""
        s, lag = self.sink_size, self.lag_size
        complete = jnp.where(n_seen >= s, (n_seen - s) // lag, 0)
        tail = n_seen - s - (complete - 1) * lag
        compressed = (complete >= 2) & (cache.length < n_seen)
        spread = (cache.length - jnp.minimum(n_seen, s) - tail) // jnp.maximum(complete - 1, 1)
        rate = (lag * budget[:, None]) // jnp.maximum(n_seen, 1)
        return jnp.clip(jnp.where(compressed, spread, rate), 1, lag).astype(jnp.int32)
