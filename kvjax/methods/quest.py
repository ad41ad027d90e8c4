"""`quest`: Quest, "Query-Aware Sparsity for Efficient Long-Context LLM Inference" (Tang et al., ICML
2024).

The whole KV cache is kept (capacity = prompt + max_new); what changes is which tokens each decode
step attends. The cache is cut into pages of `page_size` (16) consecutive slots; each page keeps
the element-wise minimum and maximum of its keys. At every decode step, per KV head:

1. the query's upper bound on the page's attention logits, `sum_c max(q_c * min_c, q_c * max_c)`
   (per query head, reduced over the GQA group by the mean; `group_reduce="max"` as option);
2. the current page (holding the new token) plus the top `budget // page_size - 1` other pages
   (ties: lower page) are attended, through `cache.attend`; the rest is masked out;
3. the first `dense_layers` (2) layers attend everything (the paper skips them: low sparsity).

Page summaries live in `cache.state` (`page_min`, `page_max`, `[B, K, pages, head_dim]` in the
storage dtype; min / max of stored values is exact): built at prefill and updated in O(head_dim)
per step for the page the new token lands in (a page that starts with it is reset). Prefill itself
attends in full (Quest is decode-only); with `question_ids`, the question is prefilled as the end
of the prompt (`question_in_prompt`), as Quest sees it.

Budget: `budget=` is the token budget (attended tokens per head, whole pages; at least one page).
With `compression_ratio` it is each example's prompt budget. Whenever a head holds no more tokens
than the budget it attends all of them (the cache already fits). Deviation: Quest's accuracy
script scores every page alike with at least 3 pages; this follows its kernels, where the page
budget counts the always-attended last page.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import cache as kvc
from kvjax.cache import KVCache
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Method, Step
from kvjax.methods.capabilities import QuestionReader, Retrieval
from kvjax.methods.common import cache_limit
from kvjax.methods.registry import register
from kvjax.ops.blocks import page_scores
from kvjax.ops.select import keep_mask, topk_keep
from kvjax.validation import check_bool, check_choice, check_int

Array = jax.Array


def num_pages(capacity: int, page_size: int) -> int:
    return -(-capacity // page_size)


def page_bounds(k: Array, stored: Array, page_size: int) -> tuple[Array, Array]:
    """Per-page element-wise min / max of the stored keys `[B, K, C, H]` -> `[B, K, P, H]` (0 for empty
    pages), in the keys' dtype."""
    b, kv, c, h = k.shape
    p = num_pages(c, page_size)
    pad = p * page_size - c
    kk = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(b, kv, p, page_size, h)
    ok = jnp.pad(stored, ((0, 0), (0, 0), (0, pad))).reshape(b, kv, p, page_size, 1)
    inf = jnp.asarray(jnp.inf, k.dtype)
    lo = jnp.min(jnp.where(ok, kk, inf), axis=3)
    hi = jnp.max(jnp.where(ok, kk, -inf), axis=3)
    filled = jnp.any(ok, axis=3)
    return jnp.where(filled, lo, 0).astype(k.dtype), jnp.where(filled, hi, 0).astype(k.dtype)


def _set_row(buf: Array, index: Array, value: Array) -> Array:
    """`buf[b, k, index[b, k]] = value[b, k]` for `[B, K, P, H]` buffers."""
    return jax.vmap(jax.vmap(lambda row, i, v: row.at[i].set(v)))(buf, index, value)


@register
@dataclasses.dataclass(frozen=True)
class Quest(Method, Retrieval, QuestionReader):
    """Full cache, each decode step attends the top pages by min/max key bound; `page_size` 16,
    first `dense_layers` (2) dense; `budget` = tokens attended per step."""

    name = "quest"
    uses_attend = True

    page_size: int = 16
    dense_layers: int = 2
    always_last_page: bool = True
    group_reduce: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.compresses:
            raise ConfigError(f"{self.name}: needs budget= (tokens attended per step) or compression_ratio=")
        check_int(self.name, "page_size", self.page_size, 1)
        check_int(self.name, "dense_layers", self.dense_layers, 0)
        check_bool(self.name, "always_last_page", self.always_last_page)
        check_choice(self.name, "group_reduce", self.group_reduce, ("mean", "max"))
        if self.budget is not None and self.budget < self.page_size:
            raise ConfigError(
                f"{self.name}: budget={self.budget} is below one page (page_size={self.page_size}); "
                "the token budget is spent in whole pages"
            )

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens  # nothing is evicted

    def init_cache_state(self, spec: CacheSpec) -> dict[str, Array]:
        shape = (spec.batch, spec.kv_heads, num_pages(spec.capacity, self.page_size), spec.head_dim)
        return {"page_min": jnp.zeros(shape, spec.dtype), "page_max": jnp.zeros(shape, spec.dtype)}

    def prefill(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        cache = kvc.truncate(cache, step.capacity)
        lo, hi = page_bounds(kvc.keys(cache), kvc.stored_mask(cache), self.page_size)
        attend = None if cache.attend is None else jnp.ones_like(cache.attend)
        return cache.replace(attend=attend, state={**cache.state, "page_min": lo, "page_max": hi})

    @property
    def gathers_at_decode(self) -> bool:
        """Decode attends the chosen pages gathered into a compact list (`decode_slots`), as Quest's kernels
        do, instead of a mask over the whole cache; the dense layers keep the masked attention."""
        return True

    @property
    def decode_dense_layers(self) -> int:
        return self.dense_layers

    def decode_dense(self, cache: KVCache, q: Array, step: Step, take: Any) -> KVCache:
        """A dense layer (step 3): only the page summaries move; every slot is attended."""
        cache = self._update_page(cache, take)
        return cache.replace(attend=None if cache.attend is None else jnp.ones_like(cache.attend))

    def _page_width(self, capacity: int) -> int:
        """Static pages a step may attend: the budget's pages (the largest prompt budget with a ratio), plus
        one, which a head that fits its budget may need for a partly filled last page."""
        limit = self.budget if self.budget is not None else self.prompt_budget(capacity)
        return min(max(limit // self.page_size, 1) + 1, num_pages(capacity, self.page_size))

    def decode_slots(self, cache: KVCache, q: Array, step: Step, take: Any) -> tuple[KVCache, Array, Array]:
        """Steps 1-2 of `decode` (the dense layers do not come here): the chosen pages' slots, `[B, K, W]`.
        A head that fits its budget lists every filled page."""
        cache = self._update_page(cache, take)
        limit = cache_limit(self, step)[:, None]  # [B, 1]
        fits = cache.length <= limit
        live = (cache.length + self.page_size - 1) // self.page_size
        pages = jnp.where(fits, live, jnp.maximum(limit // self.page_size, 1))
        width = self._page_width(cache.capacity)
        idx, count = self._choose_pages(cache, q, pages, width)
        slots = (idx[..., None] * self.page_size + jnp.arange(self.page_size, dtype=jnp.int32)).reshape(
            *idx.shape[:2], width * self.page_size
        )
        chosen = jnp.repeat(jnp.arange(width, dtype=jnp.int32) < count[..., None], self.page_size, axis=-1)
        ok = chosen & (slots < cache.length[..., None])
        # `attend` as `decode` leaves it (the last step's mask, for inspection; this path does not read it)
        c, p = cache.capacity, cache.state["page_min"].shape[2]
        mask = jnp.repeat(keep_mask(idx, count, p), self.page_size, axis=-1)[..., :c]
        attend = None if cache.attend is None else jnp.where(fits[..., None], True, mask) | ~kvc.stored_mask(cache)
        return cache.replace(attend=attend), jnp.clip(slots, 0, c - 1), ok

    def _choose_pages(self, cache: KVCache, q: Array, pages: Array, width: int) -> tuple[Array, Array]:
        """Steps 1-2: the page bound per query head reduced over the group, then the current page and the
        best others, `pages` `[B, K]` in all -> (`[B, K, width]` page indices, `[B, K]` count)."""
        b, kv, _, h = cache.k.shape
        p = cache.state["page_min"].shape[2]
        live = (cache.length + self.page_size - 1) // self.page_size  # [B, K] pages holding a token
        bound = page_scores(q[:, 0].reshape(b, kv, -1, h), cache.state["page_min"], cache.state["page_max"],
                            num_pages=live, group_reduce=self.group_reduce)
        page = jnp.arange(p, dtype=jnp.int32)
        filled = page < live[..., None]  # [B, K, P]
        current = page == ((cache.length - 1) // self.page_size)[..., None]
        return topk_keep(
            bound, filled, pages, capacity=width, protect=current if self.always_last_page else None
        )

    def decode(self, cache: KVCache, q: Array, step: Step) -> KVCache:
        c = cache.capacity
        cache = self._update_page(cache)
        stored = kvc.stored_mask(cache)
        p = cache.state["page_min"].shape[2]
        # 1-2. the current page + the best others by the bound, within the token budget
        limit = cache_limit(self, step)[:, None]  # [B, 1]
        idx, count = self._choose_pages(cache, q, jnp.maximum(limit // self.page_size, 1), p)
        chosen = jnp.repeat(keep_mask(idx, count, p), self.page_size, axis=-1)[..., :c]
        # 3. dense layers, and heads that fit their budget, attend everything
        dense = (step.layer < self.dense_layers) | (cache.length <= limit)[..., None]
        return cache.replace(attend=jnp.where(dense, True, chosen) | ~stored)

    def _update_page(self, cache: KVCache, take: Any = None) -> KVCache:
        """Folds the newest slot's key into its page's min / max (resetting a page it starts). `take`: as
        in `decode_slots`."""
        slot = jnp.maximum(cache.length - 1, 0)  # [B, K]
        page = slot // self.page_size
        if take is None:
            k_new = kvc.take_slots(cache.k, slot)  # [B, K, H], read from the slot alone
        else:
            k_new = take(slot[..., None])[0][:, :, 0]
        lo, hi = cache.state["page_min"], cache.state["page_max"]
        first = (slot % self.page_size == 0)[..., None]
        old_lo = jnp.take_along_axis(lo, page[..., None, None], axis=2)[:, :, 0]
        old_hi = jnp.take_along_axis(hi, page[..., None, None], axis=2)[:, :, 0]
        new_lo = jnp.where(first, k_new, jnp.minimum(old_lo, k_new))
        new_hi = jnp.where(first, k_new, jnp.maximum(old_hi, k_new))
        state = {**cache.state, "page_min": _set_row(lo, page, new_lo), "page_max": _set_row(hi, page, new_hi)}
        return cache.replace(state=state)
