"""Compact decode of the retrieval methods: each step attends only the gathered sinks, retrieved blocks and
recent tokens, instead of a mask over the whole cache.

Oracle: the general decode path (`append`, `method.decode` writing `cache.attend`, a masked attention over
every slot, `observe`), which a subclass with `gathers_at_decode` off forces. Both paths
must generate the same tokens and end with the same cache: positions, lengths, the retrieval mask and the
chosen blocks exactly; keys, values, local scores and representatives within float rounding (the softmax
sums the same terms in another order). A second oracle: the compact path never reads more than its static
width of keys per step.
"""

import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import assert_caches_close, random_prompts, tiny_model

import kvjax
from kvjax import cache as kvc
from kvjax import methods
from kvjax.methods import capabilities as caps
from kvjax.methods.base import Method
from kvjax.runtime import forward

# Small geometry: 2 sinks, blocks of 4, a local window of 8, so blocks form and are retrieved while decoding.
SMALL = dict(n_init=2, n_local=8, block_size=4, window=8, repr_topk=2)
CASES = [
    ("infllm", dict(topk=2, **SMALL)),
    ("infllm", dict(topk=2, position_scheme="exact", **SMALL)),
    ("qllm", dict(topk=2, **SMALL)),
    ("actqkv", dict(topk=2, **SMALL)),
    # Quest: pages of 4, 12 tokens (3 pages) per step; layer 0 dense (the masked branch), layer 1 compact.
    ("quest", dict(budget=12, page_size=4, dense_layers=1)),
    ("quest", dict(compression_ratio=0.7, page_size=4, dense_layers=0, group_reduce="max")),
]


def general_path(method: Method) -> Method:
    """The same method with the compact decode off: the masked attention over the whole cache."""
    cls = type(method)
    forced = type(f"{cls.__name__}MaskedDecode", (cls,), {"gathers_at_decode": False})
    return forced(**{f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init})






def test_retrieval_methods_take_the_compact_path():
    for name, args in CASES:
        method = methods.get(name, **args)
        assert caps.gathers(method), name
        assert not caps.gathers(general_path(method))
    for name in ("full", "snapkv", "h2o"):
        assert not caps.gathers(methods.get(name, **({} if name == "full" else {"budget": 64}))), name


@pytest.mark.parametrize("name,args", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_compact_decode_equals_the_masked_decode(name, args):
    model = tiny_model()
    prompts = random_prompts(3, (37, 22, 41))  # ragged; blocks are formed at prefill and during decode
    question = random_prompts(4, (3, 2, 4)) if name in ("qllm", "actqkv") else None
    method = methods.get(name, **args)
    kw = dict(max_new_tokens=12, return_cache=True, question_ids=question)
    fast = kvjax.generate(model, prompts, method=method, **kw)
    slow = kvjax.generate(model, prompts, method=general_path(method), **kw)
    np.testing.assert_array_equal(fast.tokens, slow.tokens)
    np.testing.assert_array_equal(fast.num_tokens, slow.num_tokens)
    assert_caches_close(fast.cache, slow.cache, tol=2e-5)
    if name == "quest":  # selective: the last step's compact layers attended fewer tokens than they hold
        last = fast.cache.layers[-1]
        attend, stored = np.asarray(last.attend), np.asarray(kvc.stored_mask(last))
        assert ((attend & stored).sum(-1) < stored.sum(-1)).any()
        return
    # Retrieval really was selective at the end: some formed block of some layer is not attended.
    state = fast.cache.stacked().state
    selected = np.asarray(state["selected"])
    formed = np.arange(selected.shape[-1]) < np.asarray(state["nb"])[..., None]
    assert (formed & ~selected).any() and selected.any()


def test_one_step_logits_and_cache_match():
    model = tiny_model()
    method = methods.get("infllm", topk=2, **SMALL)
    state = kvjax.prefill(model, random_prompts(5, (40, 29)), method=method, max_new_tokens=6)
    step = jax.jit(forward.decode_step, static_argnums=(0, 3))
    args = (model.weights(), model.rope())
    tokens, positions = jnp.asarray([3, 7], jnp.int32), jnp.asarray(state.prompt_lengths)
    fast_logits, fast_cache = step(model.config, *args, method, state.cache, tokens, positions, state.budget)
    slow_logits, slow_cache = step(
        model.config, *args, general_path(method), state.cache, tokens, positions, state.budget
    )
    np.testing.assert_allclose(np.asarray(fast_logits), np.asarray(slow_logits), rtol=1e-5, atol=1e-5)
    assert_caches_close(fast_cache, slow_cache, tol=2e-5)


def test_compact_width_does_not_grow_with_the_context():
    """The attention of a decode step reads `n_init + topk * block_size + n_local + block_size` keys per
    KV head, whatever the cache holds (seen in the traced program's attention shapes)."""
    model = tiny_model()
    method = methods.get("infllm", topk=2, **SMALL)
    width = 2 + 2 * 4 + 8 + 4
    for length in (40, 200):
        state = kvjax.prefill(model, random_prompts(6, (length,)), method=method, max_new_tokens=2)
        jaxpr = jax.make_jaxpr(forward.decode_step, static_argnums=(0, 3))(
            model.config, model.weights(), model.rope(), method, state.cache, jnp.asarray([1], jnp.int32),
            jnp.asarray(state.prompt_lengths), state.budget,
        )
        shapes = [e.outvars[0].aval.shape for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
        # [B, K, G, keys] attention logits, or [B, K, keys, G] (`tuning.decode_keys_as_rows`); the probabilities
        # times values give [B, K, G, head_dim]
        group = model.config.num_heads // model.config.num_kv_heads
        scores = [s for s in shapes if len(s) == 4 and s[:2] == (1, 2) and s[-1] != model.config.head_dim]
        keys = {s[-2] if s[-1] == group else s[-1] for s in scores}
        assert scores and keys == {width}, (length, shapes)
        assert not [s for s in shapes if state.cache.capacity in s], (length, shapes)  # no dot over every slot


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)
