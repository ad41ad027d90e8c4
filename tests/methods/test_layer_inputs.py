"""Layer inputs (issue 59 item 3): one declaration per method (`Method.layer_inputs`), from which the step API's
checks, kvjax's runtime, the shared-prefill recording and the wrappers all derive; the per-input flags before it still
honoured with a DeprecationWarning.

Oracles: the flags of the code before (`FLAGS_BEFORE`, frozen from main at fb57575: the registered methods that set
`uses_attention_lse` / `uses_out_proj` / `uses_hidden_states`), the `Step` fields, and the step API's own contract (a
missing input is refused before anything runs). Small arrays, no compiled program."""

import dataclasses
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from kvzap_weights import FIXTURE as KVZAP

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.base import LAYER_INPUTS, CacheSpec, Method, Step
from kvjax.methods.h2o import H2O
from kvjax.runtime import forward, shared_prefill
from kvjax.runtime import step as step_api

#: What each registered method declared with the flags before `layer_inputs` (every other method: none), and the
#: declarations of methods added since (KVgrad: W_o).
FLAGS_BEFORE = {
    "h2o": {"attention_lse"}, "observed_attention": {"attention_lse"}, "kvzap": {"hidden"},
    "criticalkv": {"out_proj"}, "criticaladakv": {"out_proj"}, "kvgrad": {"out_proj"}, "fastkvzip": {"hidden"},
}
OLD_FLAGS = {"uses_attention_lse": "attention_lse", "uses_out_proj": "out_proj", "uses_hidden_states": "hidden"}
B, T, N, K, H, D = 2, 4, 4, 2, 8, 64  # D: the width KVzap's generated weights take


def test_the_declarations_are_the_flags_before():
    for name in methods.available():  # a wrapper's class: its own (its instance adds its base's, below)
        assert methods.method_class(name).layer_inputs == frozenset(FLAGS_BEFORE.get(name, ())), name


def test_every_layer_input_is_a_step_field_the_runtime_computes():
    fields = {f.name for f in dataclasses.fields(Step)}
    assert set(LAYER_INPUTS) <= fields and set(LAYER_INPUTS) == {"attention_lse", "out_proj", "hidden"}
    # Those the model passes each have one line in kvjax's block; the step's attention computes the others (lse).
    assert set(forward.BLOCK_INPUTS) == {n for n, kind in LAYER_INPUTS.items() if not kind.from_attention}
    assert {n for n, kind in LAYER_INPUTS.items() if kind.from_attention} == {"attention_lse"}


def test_a_wrapper_reads_its_own_inputs_and_its_bases():
    crit = methods.get("criticalkv", budget=12, base="kvzap", base_args={"weights": str(KVZAP)})
    assert crit.layer_inputs == {"out_proj", "hidden"} and type(crit).layer_inputs == {"out_proj"}
    dms = methods.get("dms", threshold=0.0, base_args={"weights": str(KVZAP)})
    assert dms.layer_inputs == {"hidden"} and type(dms).layer_inputs == frozenset()
    assert methods.get("adakv", budget=12, base="observed_attention").layer_inputs == {"attention_lse"}
    again = dataclasses.replace(crit, base="knorm", base_args={})  # derived again for the new base
    assert again.layer_inputs == {"out_proj"}


def test_a_bad_declaration_fails_when_the_class_is_defined():
    with pytest.raises(TypeError, match=r"unknown layer input\(s\) \['hiden'\].*'hidden'"):
        @dataclasses.dataclass(frozen=True)
        class Typo(Method):
            layer_inputs = frozenset({"hiden"})
    with pytest.raises(TypeError, match="must be a set of input names"):
        @dataclasses.dataclass(frozen=True)
        class NotASet(Method):
            layer_inputs = "hidden"


def test_the_flags_before_still_declare_and_read_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="declare layer_inputs"):
        @dataclasses.dataclass(frozen=True)
        class Reads(Method):
            uses_hidden_states = True
            uses_out_proj = False
    assert Reads.layer_inputs == {"hidden"}

    with pytest.warns(DeprecationWarning, match="declare layer_inputs"):
        @dataclasses.dataclass(frozen=True)
        class TwoPass(H2O):  # False removes what the parent reads
            uses_attention_lse = False
    assert TwoPass.layer_inputs == frozenset() and H2O.layer_inputs == {"attention_lse"}

    class Mixin:  # a flag set on a mixin, as OutputAware did before
        uses_out_proj = True

    with pytest.warns(DeprecationWarning, match="Mixin.uses_out_proj"):
        @dataclasses.dataclass(frozen=True)
        class Mixed(Mixin, Method):
            pass
    assert Mixed.layer_inputs == {"out_proj"}

    with warnings.catch_warnings():
        warnings.simplefilter("error")

        @dataclasses.dataclass(frozen=True)
        class Child(Reads):  # a subclass of a mapped class inherits the declaration, without a new warning
            pass
    assert Child.layer_inputs == {"hidden"}

    crit = methods.get("criticalkv", budget=12, base="kvzap", base_args={"weights": str(KVZAP)})
    for flag, name in OLD_FLAGS.items():
        for method in (crit, Reads(), TwoPass(budget=4), H2O(budget=4)):
            with pytest.warns(DeprecationWarning, match=f"read '{name}' in method.layer_inputs"):
                assert getattr(method, flag) == (name in method.layer_inputs)
        with pytest.warns(DeprecationWarning):
            assert getattr(H2O, flag) == (name in H2O.layer_inputs)  # read on the class too


def _layer(method, capacity=12):
    spec = CacheSpec(batch=B, kv_heads=K, capacity=capacity, num_heads=N, head_dim=H, num_layers=2, dtype=jnp.float32)
    return step_api.init_cache(method, spec).layer(0)


def _args(t):
    q, kv = jnp.zeros((B, t, N, H)), jnp.zeros((B, t, K, H))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
    return q, kv, kv, positions, jnp.full((B,), 8, jnp.int32)


def test_the_step_api_names_what_is_missing_or_wrong_before_running():
    kvzap = methods.get("kvzap", budget=8, weights=str(KVZAP))
    crit = methods.get("criticalkv", budget=8, base="knorm")
    common = dict(layer=0, inv_freq=jnp.ones(H // 2), num_layers=2)
    w_o = jnp.zeros((N, H, D))
    with pytest.raises(ConfigError, match=r"kvzap: reads the layer's hidden states .*; pass hidden="):
        step_api.decode_layer(kvzap, _layer(kvzap), *_args(1), **common)
    with pytest.raises(ConfigError, match="criticalkv: reads the layer's output projection"):
        step_api.prefill_layer(crit, _layer(crit), *_args(T), **common, hidden=jnp.zeros((B, T, D)))
    with pytest.raises(ConfigError, match=r"hidden= has shape \(2, 3, 64\).*\(2, 4\)"):
        step_api.prefill_layer(kvzap, _layer(kvzap), *_args(T), **common, hidden=jnp.zeros((B, 3, D)))
    with pytest.raises(TypeError, match="unknown layer input hiden="):
        step_api.prefill_layer(kvzap, _layer(kvzap), *_args(T), **common, hiden=jnp.zeros((B, T, D)))
    with pytest.raises(ConfigError, match="attention_lse= is computed by the step's own attention"):
        step_api.prefill_layer(crit, _layer(crit), *_args(T), **common, out_proj=w_o,
                               attention_lse=jnp.zeros((B, K, N // K, T)))
    # W_o is a prefill input: a decode step of CriticalKV runs without it, and with it (an input nobody reads) alike.
    layer = _layer(crit)
    plain = step_api.decode_layer(crit, layer, *_args(1), **common)
    given = step_api.decode_layer(crit, layer, *_args(1), **common, out_proj=w_o)
    np.testing.assert_array_equal(np.asarray(plain[1].pos), np.asarray(given[1].pos))


def test_kvjax_block_computes_only_what_the_method_reads():
    from tiny import tiny_model

    model = tiny_model(num_layers=2)
    config, lw = model.config, model.weights()["layers"][0]
    x = jnp.ones((B, T, config.hidden_size), model.dtype)
    kvzap = methods.get("kvzap", budget=8, weights=str(KVZAP))
    crit = methods.get("criticalkv", budget=8, base="knorm")
    h2o = methods.get("h2o", budget=8)
    assert forward.block_inputs(config, methods.get("snapkv", budget=40).layer_inputs, lw, x) == {}
    assert forward.block_inputs(config, h2o.layer_inputs, lw, x) == {}  # the step's attention computes it
    assert set(forward.block_inputs(config, crit.layer_inputs, lw, x)) == {"out_proj"}
    assert forward.block_inputs(config, crit.layer_inputs, lw, x, decode=True) == {}  # at prefill only
    hidden = forward.block_inputs(config, kvzap.layer_inputs, lw, x, decode=True)["hidden"]
    assert hidden.shape == x.shape
    both = crit.layer_inputs | kvzap.layer_inputs
    assert set(forward.block_inputs(config, both, lw, None)) == {"out_proj"}  # without x: the weights' alone
    # What a recording must keep for these methods: the inputs of the tokens only.
    assert shared_prefill.recorded_inputs([crit, h2o, kvzap]) == {"attention_lse", "hidden"}
    assert shared_prefill.recorded_inputs([crit, methods.get("snapkv", budget=40)]) == frozenset()
