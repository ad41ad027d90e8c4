"""KV-cache compression methods: `available()`, `get(name, **hyperparameters)`.

Every method is a frozen dataclass with pure `prefill(cache, q, step)` and `decode(cache, q, step)`
hooks (see `kvjax.methods.base`), so it drops into any decoder with a fixed-shape cache.
"""

from kvjax.methods import (  # noqa: F401  (registration)
    actqkv,
    adakv,
    ahakv,
    block,
    cam,
    capkv,
    chunk,
    chunkkv,
    compactor,
    compression_ratio_decoding,
    criticalkv,
    cur,
    decoding,
    dms,
    duo_attention,
    entropy_gated_chunkkv,
    expected_attention,
    expected_attention_stats,
    fastkvzip,
    finch,
    full,
    h2o,
    infllm,
    key_rerotation,
    keydiff,
    knorm,
    kvcompose,
    kvgrad,
    kvzap,
    kvzip,
    lagkv,
    leverage,
    lm_infinite,
    lukv,
    merging,
    nacl,
    non_causal_attention,
    observed_attention,
    per_layer,
    pyramidkv,
    qfilter,
    qllm,
    quest,
    random,
    sagekv,
    simlayerkv,
    snapkv,
    streaming_llm,
    tova,
)
from kvjax.methods.base import Method, Step, per_example_budget
from kvjax.methods.registry import available, get, method_class, register

__all__ = ["Method", "Step", "available", "get", "method_class", "per_example_budget", "register"]
