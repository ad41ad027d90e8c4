"""KVzap-MLP training (kvjax.calibrate.kvzap_mlp) against a NumPy float64 reference of the official recipe (one
clipped AdamW step; a whole short training with the DataLoader's smaller last batch), an invariant (on targets a
linear map cannot explain, the MLP's validation R^2 beats the ridge fit's), and the round trip through the `kvzap`
method's loader and the leaderboard's listing."""

from __future__ import annotations

import json
import math
import pathlib
import runpy

import jax.numpy as jnp
import numpy as np
import pytest
from reference_calibration import adamw_step, mlp_forward, mlp_grads
from tiny import random_prompts, tiny_model

import kvjax
from kvjax import methods
from kvjax.calibrate import kvzap, kvzap_mlp
from kvjax.calibrate.__main__ import main
from kvjax.methods.kvzap import surrogate_scores

LAYOUT = ([1], [5, 6, 7])
ROOT = pathlib.Path(__file__).resolve().parents[2]
ASSETS = pathlib.Path(kvjax.__file__).parent / "assets" / "calibration" / "kvjax-tiny"


def _problem(seed: int, n: int, layers: int = 2, dim: int = 8, hidden: int = 16, outputs: int = 3, offset: float = 0,
             scale: float = 1.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, layers, dim)).astype(np.float32)
    y = (offset + scale * rng.normal(size=(n, layers, outputs))).astype(np.float32)
    params = kvzap_mlp.init_params(rng, layers, dim, hidden, outputs)
    return x, y, params


@pytest.mark.parametrize("offset, scale", [(5.0, 1.0), (0.0, 0.1)])
def test_one_step_matches_reference(offset, scale):
    """Three steps of the first epoch (the last batch padded and masked) and one of the second (half the lr)."""
    x, y, params = _problem(0, 10, offset=offset, scale=scale)
    pre, out = mlp_forward(params, x)
    got = np.asarray(kvzap_mlp.predict({k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x)))
    np.testing.assert_allclose(got, out, rtol=1e-5, atol=1e-5)
    optimizer = kvzap_mlp.make_optimizer(steps_per_epoch=3, epochs=2, learning_rate=5e-3)
    step = kvzap_mlp.make_train_step(optimizer)
    state = optimizer.init({k: jnp.asarray(v) for k, v in params.items()})
    mine = {k: jnp.asarray(v) for k, v in params.items()}
    ref, ref_state = dict(params), {}
    batches = [([3, 1, 4, 0], 4), ([9, 2, 6, 5], 4), ([8, 7, 0, 0], 2), ([0, 5, 2, 7], 4)]
    norms = []
    for i, (rows, real) in enumerate(batches):
        mask = np.array([1.0] * real + [0.0] * (4 - real), np.float32)
        mine, state, loss = step(mine, state, jnp.asarray(x), jnp.asarray(y), jnp.asarray(rows, jnp.int32),
                                 jnp.asarray(mask))
        ref_loss, grads = mlp_grads(ref, x[rows[:real]], y[rows[:real]])
        lr = 5e-3 * (1 + math.cos(math.pi * (i // 3) / 2)) / 2
        ref, ref_state, norm = adamw_step(ref, grads, ref_state, lr)
        norms.append(norm)
        np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
        for k in ref:
            np.testing.assert_allclose(np.asarray(mine[k]), ref[k], rtol=1e-4, atol=1e-6, err_msg=f"step {i} {k}")
    # the offset targets have every gradient clipped, the small centred ones none
    assert (min(norms) > 1.0) if offset else (max(norms) < 1.0), norms


def test_fit_matches_reference_training():
    """`fit` = the recipe run in float64 with the DataLoader's smaller last batch: seeded split (5 %, rounded up),
    torch's initialisation, a reshuffle per epoch, the lr of each epoch."""
    x, y, _ = _problem(1, 45, dim=6, hidden=10, outputs=2, offset=2.0)
    trained = kvzap_mlp.fit(x, y, seed=11, hidden_dim=10, epochs=3, batch_size=16)
    rng = np.random.default_rng(11)
    order = rng.permutation(45)
    held, train = np.sort(order[:3]), np.sort(order[3:])
    np.testing.assert_array_equal(trained.validation_rows, held)
    np.testing.assert_array_equal(trained.train_rows, train)
    bound_in, bound_hidden = 1 / math.sqrt(6), 1 / math.sqrt(10)
    params = {"w1": rng.uniform(-bound_in, bound_in, (2, 6, 10)), "b1": rng.uniform(-bound_in, bound_in, (2, 10)),
              "w2": rng.uniform(-bound_hidden, bound_hidden, (2, 10, 2)),
              "b2": rng.uniform(-bound_hidden, bound_hidden, (2, 2))}
    params = {k: v.astype(np.float32) for k, v in params.items()}
    state, losses = {}, []
    for epoch in range(3):
        perm = rng.permutation(42)
        lr = 5e-3 * (1 + math.cos(math.pi * epoch / 3)) / 2
        epoch_loss = 0.0
        for start in range(0, 42, 16):  # batches of 16, 16, 10
            rows = train[perm[start:start + 16]]
            loss, grads = mlp_grads(params, x[rows], y[rows])
            params, state, _ = adamw_step(params, grads, state, lr)
            epoch_loss += loss * len(rows) / 42
        losses.append(epoch_loss)
    for k in params:
        np.testing.assert_allclose(trained.params[k], params[k], rtol=1e-4, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(trained.epoch_losses, losses, rtol=1e-5)
    pred = mlp_forward(params, x[held])[1]
    want = 1 - ((y[held] - pred) ** 2).sum(0) / ((y[held] - y[held].mean(0)) ** 2).sum(0)
    np.testing.assert_allclose(trained.validation_r2, want, rtol=1e-4, atol=1e-5)


def test_mlp_beats_ridge_on_a_nonlinear_teacher():
    """Targets `c + sum_j |u_j . x|` (a GELU teacher with paired +-u hidden units) have no linear part a ridge fit
    could use; the MLP trained by the official recipe explains them out of sample."""
    rng = np.random.default_rng(2)
    n, layers, dim, outputs = 4000, 2, 16, 2
    x = rng.normal(size=(n, layers, dim)).astype(np.float32)
    u = rng.normal(size=(layers, dim, 4)) / math.sqrt(dim)
    proj = np.abs(np.einsum("nld,ldj->nlj", x, u))  # [n, L, 4]
    mix = rng.uniform(0.5, 1.5, size=(layers, 4, outputs))
    y = (-5 + np.einsum("nlj,ljk->nlk", proj, mix) + 0.05 * rng.normal(size=(n, layers, outputs))).astype(np.float32)
    trained = kvzap_mlp.fit(x, y, seed=3)
    sums = kvzap.NormalEquations(layers, dim, outputs)
    for layer in range(layers):
        sums.add(layer, x[trained.train_rows, layer], y[trained.train_rows, layer])
    w, b = sums.solve()
    held = trained.validation_rows
    ridge = kvzap_mlp.r2_per_head(y[held], np.einsum("nld,ldk->nlk", x[held].astype(np.float64), w) + b)
    assert np.all(ridge < 0.1), ridge
    assert np.all(trained.validation_r2 > 0.8), trained.validation_r2
    assert trained.epoch_losses[-1] < trained.epoch_losses[0] / 10


def test_written_mlp_round_trips_through_kvzap(tmp_path):
    """The directory `calibrate` writes loads as the `kvzap` method's MLP, holds the weights `fit` trains on the
    collected pairs, and scores the calibration inputs as the trained function does."""
    model = tiny_model(num_layers=2)
    prompts = random_prompts(8, (40, 40))
    linear, mlp = kvzap.calibrate(model, prompts, LAYOUT, tmp_path, seed=4, tokens_per_sample=30, hidden_dim=32,
                                  log=lambda *_: None)
    assert (linear.name, mlp.name) == ("kvzap-linear", "kvzap-mlp")
    sums = kvzap.collect(model, prompts, LAYOUT, seed=4, tokens_per_sample=30)
    x, y = sums.pairs()
    assert x.shape == (60, 2, 64) and y.shape == (60, 2, 2)
    trained = kvzap_mlp.fit(x, y, seed=4, hidden_dim=32)
    method = methods.get("kvzap", weights=str(mlp), model_type="mlp", compression_ratio=0.5)
    loaded = method.surrogate
    assert (loaded.model_type, loaded.w1.shape, loaded.w2.shape) == ("mlp", (2, 64, 32), (2, 32, 2))
    for key in ("w1", "b1", "w2", "b2"):
        np.testing.assert_array_equal(getattr(loaded, key), trained.params[key], err_msg=key)
    weights = {k: jnp.asarray(getattr(loaded, k)) for k in ("w1", "b1", "w2", "b2")}
    want = np.asarray(kvzap_mlp.predict({k: jnp.asarray(v) for k, v in trained.params.items()}, jnp.asarray(x)))
    for layer in range(2):
        got = np.asarray(surrogate_scores(weights, jnp.asarray(layer), jnp.asarray(x[None, :, layer])))[0]
        np.testing.assert_allclose(got, want[:, layer], rtol=1e-5, atol=1e-5)
    meta = json.loads((mlp / "config.json").read_text())["kvjax_calibration"]
    linear_meta = json.loads((linear / "config.json").read_text())["kvjax_calibration"]
    assert meta["target_quantiles"] == linear_meta["target_quantiles"] and meta["pairs"] == 60
    assert (meta["train_pairs"], meta["validation_pairs"], meta["epochs"]) == (57, 3, 15)
    held = trained.validation_rows
    np.testing.assert_allclose(meta["validation_r2_per_layer"], np.round(
        kvzap_mlp.r2_per_head(y[held], want[held]).mean(1), 4), atol=2e-4)


def test_committed_kvjax_tiny_mlp_is_listed_by_the_leaderboard():
    """kvjax-tiny's committed `kvzap-mlp` fits the model, and `configs/leaderboard.py --available` keeps its runs."""
    from kvjax.models.model import load_model

    config = load_model("kvjax-tiny").config
    methods.get("dms", threshold=-5.0, base_args={"weights": str(ASSETS / "kvzap-mlp"),
                                                  "model_type": "mlp"}).check_model(config)
    meta = json.loads((ASSETS / "kvzap-mlp" / "config.json").read_text())["kvjax_calibration"]
    assert meta["pairs"] == 16 * 500 and meta["seed"] == 1234 and meta["epochs"] == kvzap_mlp.EPOCHS
    leaderboard = runpy.run_path(str(ROOT / "configs" / "leaderboard.py"))
    listed = leaderboard["available_runs"]("kvjax-tiny", str(ASSETS))
    assert [a.split(",")[0] for a in listed if "/kvzap_mlp" in a] == ["kvjax-tiny/kvzap_mlp"]  # every threshold
    swept = leaderboard["get_config"](f"kvjax-tiny/kvzap_mlp,calibration_dir={ASSETS}").method_args
    assert f"dms.threshold={'|'.join(map(str, leaderboard['thresholds']('kvjax-tiny', str(ASSETS))))}," in swept
    assert len(leaderboard["thresholds"]("kvjax-tiny", str(ASSETS))) == 4


@pytest.mark.parametrize("flag", ["--kvzap_hidden_dim=0", "--kvzap_epochs=-1"])
def test_cli_rejects_bad_mlp_flags(flag, tmp_path, capsys):
    assert main(["--method=kvzap", "--model=kvjax-tiny", f"--out={tmp_path}", flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag.split("=")[0] + " must be > 0" in err, err
