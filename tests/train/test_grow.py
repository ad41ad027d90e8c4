"""Growing a trained model into a larger architecture keeps its function exactly (kvjax.train.grow)."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.errors import ConfigError
from kvjax.models.model import DecoderLM
from kvjax.train.grow import grow, layer_order
from kvjax.train.loop import TrainConfig


def _model(**arch):
    cfg = TrainConfig(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, **arch)
    config = cfg.model_config(vocab_size=60, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    return DecoderLM.random(config, seed=1, dtype=jnp.float32, scale=0.3)


@pytest.mark.parametrize(
    "arch",
    [
        dict(num_layers=4),
        dict(num_layers=3, num_heads=8, num_kv_heads=4, head_dim=8),  # more KV groups
        dict(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8),  # bigger groups
        dict(num_layers=5, intermediate_size=80),
    ],
)
def test_grown_model_has_the_same_logits(arch):
    small = _model()
    cfg = TrainConfig(**{"hidden_size": 32, "intermediate_size": 48, "num_heads": 4, "num_kv_heads": 2, **arch})
    big_config = cfg.model_config(vocab_size=60, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    weights = grow(small.weights(), small.config, big_config, seed=5)
    big = DecoderLM(big_config, weights, dtype=jnp.float32)
    ids = np.random.default_rng(0).integers(0, 60, (2, 33))
    np.testing.assert_allclose(np.asarray(big(ids)[0]), np.asarray(small(ids)[0]), atol=2e-5)
    # The new layers are not dead: random input projections, outputs that start at zero.
    for i, source in enumerate(layer_order(2, big_config.num_layers)):
        if source is None:
            lw = weights["layers"][i]
            assert np.all(lw["o"] == 0) and np.all(lw["down"] == 0)
            assert np.std(lw["qkv"]) > 0 and np.std(lw["gate_up"]) > 0


def test_layer_order_spreads_new_layers_between_old_ones():
    assert layer_order(4, 4) == [0, 1, 2, 3]
    assert layer_order(4, 6) == [0, None, 1, 2, None, 3]
    for old, new in [(1, 3), (2, 7), (4, 5), (3, 9)]:
        order = layer_order(old, new)
        assert len(order) == new and [o for o in order if o is not None] == list(range(old))


def test_cannot_shrink_or_change_widths():
    small = _model()
    for arch, word in [(dict(num_layers=1), "shrink"), (dict(hidden_size=64), "hidden_size")]:
        cfg = TrainConfig(hidden_size=arch.get("hidden_size", 32), intermediate_size=48,
                          num_layers=arch.get("num_layers", 2), num_heads=4, num_kv_heads=2,
                          head_dim=8 if "hidden_size" in arch else 0)
        config = cfg.model_config(vocab_size=60, eos_token_id=2, bos_token_id=1, pad_token_id=0)
        with pytest.raises(ConfigError, match=word):
            grow(small.weights(), small.config, config)


def test_train_starts_from_init_from_grown(tmp_path):
    """`init_from` loads an exported model and grows it: before any step the run's model is that model."""
    from kvjax.models.char_tokenizer import build_char_tokenizer
    from kvjax.models.export import save_hf
    from kvjax.train.loop import train

    tok = build_char_tokenizer()
    cfg = TrainConfig(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
    source = DecoderLM.random(cfg.model_config(len(tok), tok.eos_token_id, tok.bos_token_id, tok.pad_token_id),
                              seed=2, dtype=jnp.float32, scale=0.3)
    save_hf(source.config, source.weights(), tmp_path / "source")
    grown_cfg = TrainConfig(workdir=str(tmp_path / "run"), hidden_size=32, intermediate_size=48, num_layers=3,
                            num_heads=4, num_kv_heads=2, init_from=str(tmp_path / "source"), steps=2,
                            lengths=(320,), tasks=("passkey",), curriculum_steps=0, tokens_per_batch=0,
                            batch_size=1, max_position_embeddings=1024, position_span=1024)
    model, losses = train(grown_cfg, tok, progress=False, stop_at=0)
    assert losses == [] and model.config.num_layers == 3
    ids = np.asarray([tok.encode("The pass key is 12345.")])
    np.testing.assert_allclose(np.asarray(model(ids)[0]), np.asarray(source(ids)[0]), atol=2e-5)
    _, losses = train(grown_cfg, tok, progress=False)  # and it trains from there
    assert len(losses) == 2 and np.all(np.isfinite(losses))
