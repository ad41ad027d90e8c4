"""The generic wrappers: `per_layer` (a compression ratio per layer, each layer allocated at its own size) and
`key_rerotation` (kept keys moved to contiguous positions). Oracles: the base method run at the layer's budget,
a NumPy float64 RoPE rotation of each kept key, and the cache's real sizes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, generate_and_check, kept, run_prefill
from reference_scorers import rope_matrix

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.per_layer import kept_of

RATIOS = (0.2, 0.7)
INV_FREQ = (1.0 / 100.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)


def test_per_layer_keeps_each_layers_ratio_by_the_base_scores():
    batch = Batch()
    method = methods.get("per_layer", base="keydiff", compression_ratios=list(RATIOS))
    for layer, ratio in enumerate(RATIOS):
        out, _, _ = run_prefill(method, batch, layer=layer, num_layers=2)
        for b, n in enumerate(batch.lengths[:2]):
            want = kept_of(int(n), ratio)
            assert want == max(1, int(np.floor(np.float32(n) * (np.float32(1) - np.float32(ratio)))))
            base, _, _ = run_prefill(methods.get("keydiff", budget=want), batch)
            for k in range(batch.kv):
                assert kept(out, b, k) == kept(base, b, k), (layer, b, k)


def test_per_layer_allocates_each_layer_at_its_size():
    from tiny import tiny_model

    import kvjax

    method = methods.get("per_layer", base="knorm", compression_ratios=[0.25, 0.75])
    lengths, new = (40, 23, 31), 5
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in lengths]
    model = tiny_model(dtype=jnp.bfloat16, num_heads=8, num_kv_heads=2, num_layers=2)
    result = kvjax.generate(model, prompts, method=method, max_new_tokens=new, return_cache=True)
    layers = result.cache.layers
    assert [layer.capacity for layer in layers] == [kept_of(64, 0.25) + new, kept_of(64, 0.75) + new]
    assert layers[1].nbytes < layers[0].nbytes / 2
    for layer, ratio in zip(layers, (0.25, 0.75), strict=True):
        for b, n in enumerate(lengths):
            for k in range(2):
                held = kept(layer, b, k)
                assert sum(p < n for p in held) == kept_of(n, ratio)
                assert [p for p in held if p >= n] == list(range(n, n + new - 1))


@pytest.mark.parametrize("args,match", [(dict(compression_ratios=[]), "compression_ratios"),
                                        (dict(compression_ratios=[0.5], budget=4), "not budget"),
                                        (dict(compression_ratios=[1.0]), "compression_ratios")])
def test_per_layer_bad_hyperparameters(args, match):
    with pytest.raises(ConfigError, match=match):
        methods.get("per_layer", base="knorm", **args)
    method = methods.get("per_layer", base="knorm", compression_ratios=[0.5, 0.5, 0.5])
    with pytest.raises(ConfigError, match="3 entries but the model has 2 layers"):
        method.layer_capacities(40, 4, 2)


def test_key_rerotation_packs_the_kept_keys_before_the_next_position():
    batch = Batch()
    method = methods.get("key_rerotation", base="knorm", budget=9)
    capacity = method.capacity(batch.t, 3)
    step = dataclasses.replace(batch.step(method, capacity), inv_freq=jnp.asarray(INV_FREQ))
    out = jax.jit(method.prefill)(batch.cache(capacity), batch.qj(), step)
    base, _, _ = run_prefill(methods.get("knorm", budget=9), batch)
    for b, n in enumerate(batch.lengths):
        for k in range(batch.kv):
            held = kept(out, b, k)
            assert held == kept(base, b, k)
            for rank, p in enumerate(held):
                target = int(n) - len(held) + rank
                want = rope_matrix(target - p, INV_FREQ.astype(np.float64)) @ batch.k[b, p, k].astype(np.float64)
                got = np.asarray(out.k[b, k, rank], np.float64)
                np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())  # bf16 storage


def test_key_rerotation_end_to_end():
    generate_and_check(methods.get("key_rerotation", base="snapkv", budget=9, base_args={"window_size": 4}),
                       prompt_kept=lambda layer, b: 9)
