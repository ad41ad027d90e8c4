"""A finished sample stops changing its cache: in a batch, a row that hit EOS keeps exactly the cache it had at its
last token, so what it keeps does not depend on when the batch's longest answer ends (issue 60 item 2).

Oracle: the same row decoded in a batch of copies of itself (same program, same shapes, every row finishing at the
same step, so nothing decodes past its end). For every registered method that evicts while decoding, a batch of
eight prompts that finish at different steps must give each row the tokens, token count, kept positions and cache
contents (positions and lengths everywhere; keys, values and scores on the slots it holds; method state) of its
copies. Preconditions checked: rows do finish at different steps, before the limit.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from golden_cases import LAYERS, METHODS, kept
from tiny import random_prompts, tiny_gemma3, tiny_model

import kvjax
from kvjax import cache as kvc
from kvjax import methods
from kvjax.methods import capabilities as caps

EOS = 33  # an id the tiny random model emits at various steps for these prompts
PROMPTS = random_prompts(21, (35, 41, 47, 52, 58, 60, 63, 64))  # one bucket: the copies run the batch's programs
NEW = 16


def evicts_while_decoding(name: str) -> bool:
    method = methods.get(name, **METHODS[name])
    return not method.decode_appends_only and not caps.gathers(method)


DECODE_EVICTING = sorted(n for n in METHODS if evicts_while_decoding(n))


def test_the_decode_evicting_methods_are_the_known_ones():
    """A method added later is covered by the parametrization below; this pins what it covers today."""
    assert DECODE_EVICTING == ["ahakv", "cam", "compression_ratio_decoding", "decoding", "dms", "duo_attention", "h2o",
                               "lagkv", "lm_infinite", "sagekv", "sagekv_union", "streaming_llm", "tova"]


def _row(cache, i: int):
    """Row `i` of every layer: positions and lengths, K / V / scores / masks on its stored slots, its method state."""
    out = []
    for layer in cache.layers:
        stored = np.asarray(kvc.stored_mask(layer))[i]
        k, v = (np.asarray(x)[i] for x in (kvc.keys(layer), kvc.values(layer)))
        fields = {"pos": np.asarray(layer.pos)[i], "length": np.asarray(layer.length)[i],
                  "k": np.where(stored[..., None], k, 0), "v": np.where(stored[..., None], v, 0)}
        if layer.score is not None:
            fields["score"] = np.where(stored, np.asarray(layer.score)[i], 0)
        if layer.attend is not None:
            fields["attend"] = np.asarray(layer.attend)[i] & stored
        for path, leaf in jax.tree_util.tree_leaves_with_path(layer.state):
            leaf = np.asarray(leaf)
            fields[f"state{jax.tree_util.keystr(path)}"] = leaf[i] if leaf.ndim and leaf.shape[0] == 8 else leaf
        out.append(fields)
    if cache.shared is not None:
        out.append({jax.tree_util.keystr(p): np.asarray(x)[i] for p, x in jax.tree_util.tree_leaves_with_path(
            cache.shared) if np.ndim(x) and np.shape(x)[0] == 8})
    return out


def _check(name: str, *, kv_dtype=None, model=None):
    model = model or tiny_model(num_layers=LAYERS.get(name, 2), eos_token_ids=(EOS,))
    method = methods.get(name, **METHODS[name])

    def run(prompts):
        return kvjax.generate(model, prompts, method=method, max_new_tokens=NEW, return_cache=True, kv_dtype=kv_dtype)

    batch = run(PROMPTS)
    counts = batch.num_tokens.tolist()
    assert len(set(counts)) > 1 and min(counts) < NEW, f"{name}: rows must finish at different steps ({counts})"
    kept_batch = kept(batch.cache)
    for i, prompt in enumerate(PROMPTS):
        alone = run([prompt] * len(PROMPTS))
        assert alone.tokens[0].tolist() == batch.tokens[i].tolist(), (name, i)
        assert int(alone.num_tokens[0]) == counts[i], (name, i)
        assert [layer[0] for layer in kept(alone.cache)] == [layer[i] for layer in kept_batch], (name, i)
        for got, want in zip(_row(batch.cache, i), _row(alone.cache, 0), strict=True):
            assert got.keys() == want.keys()
            for field in got:
                np.testing.assert_array_equal(got[field], want[field], err_msg=f"{name} row {i} {field}")


@pytest.mark.parametrize("name", DECODE_EVICTING)
def test_a_finished_row_keeps_the_cache_it_had_at_its_end(name):
    _check(name)


@pytest.mark.parametrize("name,kv_dtype", [("tova", "int8"), ("streaming_llm", "kivi4"), ("h2o", "kivi4")])
def test_quantized_rows_freeze_too(name, kv_dtype):
    _check(name, kv_dtype=kv_dtype)


def test_a_sliding_window_ring_freezes_too():
    """Gemma-3-like: sliding layers (rings) and a global layer the method manages."""
    _check("tova", model=tiny_gemma3(num_layers=3, window=16, eos_token_ids=(39,)))  # 39: emitted at various steps
