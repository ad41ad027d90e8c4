"""Every registered method on an int8 cache keeps the tokens it keeps on the model-dtype cache.

The trained kvjax-tiny model's own queries / keys / values (one forward over prompt + continuation, recorded per
layer) go through the per-layer step API twice per method and layer, with and without `kv_dtype="int8"`: the
prefill, then decode steps. Same inputs in both runs, so only the cache's storage differs; the kept positions of
every layer and KV head must agree (Jaccard >= 0.98: at most one swap in the ~128 tokens a head keeps).

A one-chunk prefill scores in full precision by design (the chunk attends and is scored before it is stored), so
methods whose decode only appends are prefilled in two chunks (the second is scored against the stored, quantized
first one); the others decode-time scoring, eviction and retrieval read the quantized cache."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from golden_cases import FEW, every_method
from learned_files import duo_pattern, ea_stats_dir, fastkvzip_gates, kvzap_dir, lukv_curve, qfilter_dir

import kvjax
from kvjax import cache as kvc
from kvjax import methods
from kvjax.methods.base import CacheSpec, per_example_budget
from kvjax.quant import KVQuant
from kvjax.runtime import shared_prefill, step

PROMPTS = (232, 190)  # ragged batch
NEW = 6
LAYERS = (1, 4)
CHUNK = 128
RETRIEVAL = dict(n_init=4, n_local=64, block_size=16, window=64, repr_topk=4)
ARGS = {  # every method at a 128-token budget (or its retrieval shape)
    "full": {}, "snapkv": {"budget": 128, "window_size": 16},
    "adakv": {"budget": 128, "base_args": {"window_size": 16}},
    "pyramidkv": {"budget": 200, "window_size": 16},  # >= 128 in the deeper layer
    "knorm": {"budget": 128}, "random": {"budget": 128},
    "streaming_llm": {"budget": 128}, "lm_infinite": {"budget": 128, "n_global": 8}, "h2o": {"budget": 128},
    "tova": {"budget": 128}, "nacl": {"budget": 128, "window_size": 16}, "sagekv": {"budget": 128},
    "sagekv_union": {"budget": 128}, "ahakv": {"budget": 128},
    "lagkv": {"budget": 128, "sink_size": 4, "lag_size": 32},
    "quest": {"budget": 128, "page_size": 16, "dense_layers": 2}, "infllm": {"topk": 2, **RETRIEVAL},
    "qllm": {"topk": 2, **RETRIEVAL}, "actqkv": {"topk": 2, **RETRIEVAL},
    "expected_attention": {"budget": 128}, "keydiff": {"budget": 128}, "observed_attention": {"budget": 128},
    "criticalkv": {"budget": 128, "base_args": {"window_size": 16}},
    "criticaladakv": {"budget": 128, "base_args": {"window_size": 16}}, "cur": {"budget": 128},
    "leverage": {"budget": 128},
    "simlayerkv": {"lazy_threshold": 0.5, "n_recent": 64},
    "capkv": {"budget": 128},
    "compactor": {"budget": 128, "chunk_size": 64},
    "non_causal_attention": {"budget": 128, "chunk_size": 64},
    "chunk": {"compression_ratio": 0.5, "chunk_length": 128, "base": "keydiff"},
    "block": {"budget": 128, "block_size": 64, "base": "keydiff"},
    "per_layer": {"compression_ratios": [0.5] * 6, "base": "keydiff"},  # kvjax-tiny's six layers, one size
    "key_rerotation": {"budget": 128, "base": "knorm"},
    "merging": {"budget": 128, "merge_fraction": 0.75},
    "kvzap": {"budget": 128, "weights": "KVZAP"},
    "dms": {"threshold": 0.0, "sliding_window_size": 16, "decoding": True, "base_args": {"weights": "KVZAP"}},
    "decoding": {"budget": 128, "base": "knorm", "compression_interval": 2, "target_size": 120},
    "compression_ratio_decoding": {"budget": 128, "base": "knorm", "compression_interval": 2,
                                   "target_compression_ratio": 0.5},
    "cam": {"budget": 128, "base": "knorm", "compression_interval": 2, "target_size": 120, "merge_budget": 8},
    # generated files for kvjax-tiny (6 layers, 2 KV heads, head_dim 32)
    "duo_attention": {"patterns": duo_pattern(6, 2, sink_size=4, recent_size=64), "head_compression_ratio": 0.5},
    "qfilter": {"budget": 128, "filters": qfilter_dir(6, 2, 32)},
    "fastkvzip": {"budget": 128, "gates": fastkvzip_gates(6, 128, 2)},  # the step API's per-layer selection
    "lukv": {"compression_ratio": 0.5, "curve": lukv_curve(6, 2)},
    "expected_attention_stats": {"budget": 128, "stats": ea_stats_dir(6, 4, 32)},
    "kvzip": {"budget": 128},  # the step API's own-queries scoring (the replay needs kv_dtype=None)
    "kvgrad": {"budget": 128},  # the same, each pair weighed by ||v W_O||
    "kvcompose": {"budget": 128},  # the step API's self-read scoring (the replay needs kv_dtype=None)
    "finch": {"budget": 128, "window_size": 16}, "chunkkv": {"budget": 128, "base_args": {"window_size": 16}},
    "entropy_gated_chunkkv": {"budget": 128, "base_args": {"window_size": 16}},
}
#: Generated KVzap weights for kvjax-tiny (6 layers, hidden size 128, 2 KV heads), fed hidden states made from the
#: recorded queries (the recording keeps no hidden states; the two runs see the same ones).
KVZAP_DIR = kvzap_dir(layers=6, hidden_size=128, kv_heads=2, hidden_dim=8)  # written once per process tree


def _with_weights(args):
    if isinstance(args, dict):
        return {k: _with_weights(v) for k, v in args.items()}
    return KVZAP_DIR if args == "KVZAP" else args


def _hidden(q):
    """`[B, T, 128]` stand-in hidden states: the queries' rows, flattened and repeated."""
    flat = q.reshape(q.shape[0], q.shape[1], -1)
    return jax.numpy.tile(flat, (1, 1, -(-128 // flat.shape[-1])))[..., :128]


#: Methods whose decode only appends: their kept set is decided at prefill, so it runs in chunks.
CHUNKED = {"full", "snapkv", "pyramidkv", "adakv", "knorm", "nacl", "random", "simlayerkv", "merging"}


def test_every_registered_method_has_arguments_here():
    assert sorted(ARGS) == sorted(methods.available())


@functools.lru_cache(maxsize=1)
def _recording():
    model = kvjax.load_model("kvjax-tiny")
    rng = np.random.default_rng(46)
    rows = [rng.integers(3, model.config.vocab_size, size=n + NEW).tolist() for n in PROMPTS]
    rec = shared_prefill.record(model, rows)  # the full-cache forward: every position's q / k / v per layer
    return model, rec


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _run(method, num_layers, chunk, cache, qkv, positions, decode_qkv, decode_pos, budget, layer, inv_freq,
         out_proj):
    q, k, v = qkv
    for start in range(0, q.shape[1], chunk):
        part = slice(start, start + chunk)
        _, cache = step.prefill_layer(method, cache, q[:, part], k[:, part], v[:, part], positions[:, part], budget,
                                      layer=layer, inv_freq=inv_freq, num_layers=num_layers,
                                      final_chunk=start + chunk >= q.shape[1], out_proj=out_proj,
                                      hidden=_hidden(q[:, part]))

    def one(cache, xs):
        qi, ki, vi, pi = xs
        _, cache = step.decode_layer(method, cache, qi, ki, vi, pi, budget, layer=layer, inv_freq=inv_freq,
                                     num_layers=num_layers, hidden=_hidden(qi))
        return cache, None

    cache, _ = jax.lax.scan(one, cache, (*decode_qkv, decode_pos))
    return cache.pos


def _kept(model, rec, method, quant, layer: int) -> list:
    prompts = np.asarray(PROMPTS)
    bucket = 256
    config = model.config
    spec = CacheSpec(batch=len(PROMPTS), kv_heads=config.num_kv_heads, capacity=method.capacity(bucket, NEW),
                     num_heads=config.num_heads, head_dim=config.head_dim, num_layers=config.num_layers,
                     dtype=model.dtype, quant=quant)
    cache = step.init_cache(method, spec).layer(layer)
    q, k, v = rec.qkv[layer]
    positions = np.where(np.arange(bucket)[None] < prompts[:, None], np.arange(bucket)[None], -1).astype(np.int32)
    prompt_qkv = tuple(x[:, :bucket] for x in (q, k, v))
    at = prompts[:, None] + np.arange(NEW)[None]  # [B, NEW] each example's next positions
    rows = np.arange(len(PROMPTS))[:, None]
    decode_qkv = tuple(np.swapaxes(np.asarray(x)[rows, at][:, :, None], 0, 1) for x in (q, k, v))  # [NEW, B, 1, ...]
    decode_pos = np.swapaxes(at[:, :, None], 0, 1).astype(np.int32)
    budget = per_example_budget(method, prompts)
    chunk = CHUNK if method.name in CHUNKED else (method.prefill_window() or bucket)
    pos = _run(method, config.num_layers, chunk, cache, prompt_qkv, positions, decode_qkv, decode_pos, budget,
               np.int32(layer), model.rope()[0], model.weights()["layers"][layer]["o"])
    return kvc.positions_kept(kvc.KVCache(k=None, v=None, pos=pos, length=None))


@pytest.mark.parametrize("name", every_method(ARGS, FEW))
def test_int8_cache_keeps_what_the_model_dtype_cache_keeps(name):
    model, rec = _recording()
    method = methods.get(name, **_with_weights(ARGS[name]))
    for layer in LAYERS:
        plain = _kept(model, rec, method, None, layer)
        int8 = _kept(model, rec, method, KVQuant("int8"), layer)
        for b, (row_a, row_b) in enumerate(zip(plain, int8, strict=True)):
            for h, (a, c) in enumerate(zip(row_a, row_b, strict=True)):
                a, c = set(a), set(c)
                jaccard = len(a & c) / len(a | c)
                assert jaccard >= 0.98, (name, layer, b, h, jaccard, sorted(a ^ c))
