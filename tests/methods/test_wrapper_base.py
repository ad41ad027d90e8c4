"""The one wrapper base, the one state initialiser, the shared helpers (issue 59 item 2). Oracles: the wrapped method
itself (every need a wrapper forwards equals the base's), the source (which modules a method file imports) and the
registry. No compile."""

import ast
import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from kvzap_weights import FIXTURE as KVZAP
from learned_files import lukv_curve, qfilter_dir

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec, Method
from kvjax.methods.scorer import ScoringMethod
from kvjax.methods.wrapper import ScorerWrapper, Wrapper
from kvjax.validation import check_int

#: Every registered method built around a scoring method, with the arguments it needs besides its base.
WRAPPERS = {
    "adakv": {"budget": 12}, "criticaladakv": {"budget": 12}, "criticalkv": {"budget": 12},
    "chunkkv": {"budget": 12, "chunk_size": 3}, "key_rerotation": {"budget": 12},
    "entropy_gated_chunkkv": {"budget": 12, "chunk_size": 3, "low_entropy_chunk_length": 1},
    "per_layer": {"compression_ratios": [0.5, 0.8]}, "decoding": {"target_size": 12},
    "compression_ratio_decoding": {"target_compression_ratio": 0.7},
    "dms": {"threshold": 0.0, "sliding_window_size": 4},
    # a curve for SPEC's 2 layers x the 4 KV heads its cache check is called with (the base's refusal comes first)
    "lukv": {"compression_ratio": 0.5, "curve": lukv_curve(2, 4)},
    "chunk": {"compression_ratio": 0.5, "chunk_length": 8},
    "block": {"compression_ratio": 0.5, "block_size": 8},
    "cam": {"target_size": 12, "compression_interval": 4},
    "merging": {"budget": 12},
}
#: Bases a wrapper refuses, with the reason it names: a chunk scored alone, a block with the kept tokens, or CaM's
#: scoring of the cache while decoding has no prompt-wide statistics, attention sums or hidden states, and no blocks
#: read as the prompt is (keydiff's block_size).
SELF_CONTAINED = {"observed_attention": "reads attention_lse", "expected_attention": "keeps statistics",
                  "kvzap": "reads hidden", "keydiff": "compresses as the prompt is read"}
REFUSED = {"chunk": SELF_CONTAINED, "block": SELF_CONTAINED, "cam": SELF_CONTAINED}
#: Scoring bases with every kind of need: attention lse (observed_attention), hidden states and per-slot scores
#: and a model check (kvzap), a learned file checked against the cache (qfilter), running state (expected_attention),
#: a prefill chunk size (keydiff's block_size), none (snapkv, knorm).
BASES = {
    "snapkv": {"window_size": 4}, "knorm": {}, "keydiff": {"block_size": 8}, "observed_attention": {},
    "expected_attention": {}, "kvzap": {"weights": str(KVZAP)}, "qfilter": {"filters": qfilter_dir(2, 2, 16)},
}
SPEC = CacheSpec(batch=2, kv_heads=2, capacity=20, num_heads=8, head_dim=16, num_layers=2, dtype=jnp.bfloat16)
FLAGS = ("uses_score",)


def test_every_method_with_a_base_stands_on_the_one_wrapper_base():
    with_base = {n for n in methods.available()
                 if "base" in {f.name for f in dataclasses.fields(methods.method_class(n))}}
    assert with_base == set(WRAPPERS)
    for name in with_base:
        assert issubclass(methods.method_class(name), Wrapper), name
    # Ada-KV's per-head counts exceed a scorer's budget: it is a wrapper, not a scoring method (and so no base).
    assert not issubclass(methods.method_class("adakv"), ScoringMethod)
    assert issubclass(methods.method_class("chunkkv"), ScorerWrapper)
    with pytest.raises(ConfigError, match="base must name a scoring method"):
        methods.get("chunkkv", budget=12, base="adakv")


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("base", sorted(BASES))
def test_a_wrapper_gives_its_base_everything_the_base_needs(wrapper, base):
    if base in REFUSED.get(wrapper, {}):
        with pytest.raises(ConfigError, match=REFUSED[wrapper][base]):
            methods.get(wrapper, base=base, base_args=BASES[base], **WRAPPERS[wrapper])
        return
    method = methods.get(wrapper, base=base, base_args=BASES[base], **WRAPPERS[wrapper])
    inner = method.inner
    assert type(inner) is methods.method_class(base) and inner.hyperparameters().items() >= BASES[base].items()
    for flag in FLAGS:  # the wrapper may need more (criticalkv: W_o; dms: its scores), never less
        assert getattr(method, flag) >= getattr(inner, flag), flag
    assert method.layer_inputs >= inner.layer_inputs
    assert method.prefill_window() == inner.prefill_window()
    state = method.init_cache_state(SPEC)
    for key, leaves in inner.init_cache_state(SPEC).items():  # decoding adds its query ring
        assert key in state and jax.tree.map(jnp.shape, leaves) == jax.tree.map(jnp.shape, state[key]), key
    small = dataclasses.replace(SPEC, kv_heads=4)  # qfilter's filters are for 2 KV heads, kvzap's weights too
    for call in (lambda m: m.check_cache_spec(small), lambda m: m.init_cache_state(small)):
        try:
            call(inner)
        except ConfigError as e:
            with pytest.raises(ConfigError, match=re.escape(str(e))):
                call(method)
        else:
            call(method)


def test_one_state_initialiser():
    """`init_state` only calls `init_cache_state`; a method overriding `init_state` would be silently ignored by the
    runtime, so defining one is refused."""
    for name, args in [("lagkv", {"budget": 12, "sink_size": 2, "lag_size": 4}), ("sagekv", {"budget": 12}),
                       ("streaming_llm", {"budget": 10, "rerotate": True}), ("knorm", {"budget": 12})]:
        method = methods.get(name, **args)
        got, want = method.init_state(2, 2, 20), method.init_cache_state(SPEC)
        assert sorted(got) == sorted(want), name
        for key in want:
            assert (jnp.asarray(got[key]) == jnp.asarray(want[key])).all(), (name, key)
    assert not any("init_state" in vars(methods.method_class(n)) for n in methods.available())
    with pytest.raises(TypeError, match="init_cache_state"):
        @dataclasses.dataclass(frozen=True)
        class Old(Method):  # noqa: F841
            def init_state(self, batch, kv_heads, capacity):
                return {}


def test_one_integer_check():
    for bad in (0, -1, True, 2.0, "3", None):
        with pytest.raises(ConfigError, match=rf"^m: n must be an integer >= 1, got {bad!r}$"):
            check_int("m", "n", bad, 1)
    check_int("m", "n", None, 1, optional=True)
    check_int("m", "n", 1, 1)
    # The same message from every family that had its own copy.
    for name, args in [("lagkv", {"budget": 12, "lag_size": 0}), ("sagekv", {"budget": 12, "topk": -1}),
                       ("infllm", {"topk": 0}), ("actqkv", {"dcm_history": 0}), ("snapkv", {"budget": 12,
                                                                                           "window_size": 0})]:
        field = next(k for k in args if k != "budget")
        with pytest.raises(ConfigError, match=rf"^{name}: {field} must be an integer >= \d, got "):
            methods.get(name, **args)


def test_no_method_file_imports_another_methods_helpers():
    """A method file imports another method's file only to subclass its method (criticaladakv: AdaKV, pyramidkv:
    SnapKV, actqkv: QLLM); shared helpers live in kvjax/methods/common.py."""
    folder = pathlib.Path(methods.__file__).parent
    method_modules = {p.stem for p in folder.glob("*.py") if "@register" in p.read_text()}
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvjax.methods."):
                source = node.module.rsplit(".", 1)[1]
                if source in method_modules and source != path.stem:
                    module = __import__(node.module, fromlist=["_"])
                    for alias in node.names:
                        thing = getattr(module, alias.name)
                        assert isinstance(thing, type) and issubclass(thing, Method), (path.name, alias.name)
