"""KVzap-MLP: the two-layer surrogate `W2 gelu(W1 h + b1) + b2` per layer (exact erf GELU), trained by gradient
descent on the same (attention input, log KVzip+ score) pairs as KVzap-Linear (Jeblick and Jegou, 2026, arXiv
2601.07891; the recipe of kvpress's `kvzap/train.py`, reimplemented with optax).

Every layer's MLP is trained jointly: the loss is the mean squared error over every (pair, layer, KV head) target.
AdamW (betas 0.9 / 0.999, eps 1e-8, weight decay 0.01 on every parameter), learning rate 5e-3 annealed by a cosine
stepped once per epoch (epoch `e` of `E` uses `lr (1 + cos(pi e / E)) / 2`), the gradient clipped to global norm
1.0, batches of 512 pairs reshuffled every epoch, 15 epochs, hidden size 512, torch `nn.Linear`'s initialisation
(weights and biases uniform in `+-1/sqrt(fan_in)`). 5 % of the pairs (rounded up) are held out for validation.

The step is jitted once: every batch has the same shape; the last, partial batch of an epoch is padded and its
padding masked out of the loss, so its gradient is the smaller batch's mean exactly (as the official DataLoader,
which keeps a smaller last batch). Float32 throughout; the split, the initialisation and the shuffles come from one
NumPy generator seeded with the calibration seed, so the same arguments give the same bytes on one machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import save_file

from kvjax.errors import KvjaxError
from kvjax.methods.kvzap import WEIGHTS_FILE

#: The official training's defaults (kvpress `kvzap/train.py`).
HIDDEN_DIM = 512
EPOCHS = 15
LEARNING_RATE = 5e-3
BATCH_SIZE = 512
WEIGHT_DECAY = 0.01
CLIP_NORM = 1.0
VALIDATION_SHARE = 0.05

Params = dict[str, jax.Array]


def validation_split(n: int, rng: np.random.Generator, share: float = VALIDATION_SHARE) -> tuple[np.ndarray,
                                                                                                     np.ndarray]:
    """`(train, validation)` sorted pair indices: `ceil(share * n)` pairs drawn for validation."""
    held = math.ceil(share * n)
    if n < 2 or held >= n:
        raise KvjaxError(f"kvzap-mlp: {n} calibration pairs cannot be split into training and a {share:g} "
                         "validation share; give more --samples")
    order = rng.permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])


def init_params(rng: np.random.Generator, layers: int, dim: int, hidden: int, outputs: int) -> dict[str, np.ndarray]:
    """torch `nn.Linear`'s default initialisation per layer, stacked `[L, in, out]`: weights and biases uniform in
    `+-1/sqrt(fan_in)`; float32."""
    def uniform(fan_in: int, shape: tuple[int, ...]) -> np.ndarray:
        bound = 1.0 / math.sqrt(fan_in)
        return rng.uniform(-bound, bound, shape).astype(np.float32)

    return {"w1": uniform(dim, (layers, dim, hidden)), "b1": uniform(dim, (layers, hidden)),
            "w2": uniform(hidden, (layers, hidden, outputs)), "b2": uniform(hidden, (layers, outputs))}


def forward(params: Params, x: jax.Array) -> jax.Array:
    """`[n, L, K]` predictions of every layer's MLP for inputs `x` `[n, L, D]` (float32)."""
    h = jnp.einsum("nld,ldm->nlm", x, params["w1"]) + params["b1"]
    h = jax.nn.gelu(h, approximate=False)
    return jnp.einsum("nlm,lmk->nlk", h, params["w2"]) + params["b2"]


predict = jax.jit(forward)


def make_optimizer(steps_per_epoch: int, epochs: int, learning_rate: float = LEARNING_RATE,
                   weight_decay: float = WEIGHT_DECAY, clip_norm: float = CLIP_NORM) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW at a cosine learning rate that changes once per epoch."""
    def schedule(count: jax.Array) -> jax.Array:
        epoch = (count // steps_per_epoch).astype(jnp.float32)
        return learning_rate * (1 + jnp.cos(jnp.pi * epoch / epochs)) / 2

    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay))


def masked_loss(params: Params, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean squared error over the unmasked pairs' every layer and head (`mask` `[B]`, 1 = real pair)."""
    err = jnp.square(forward(params, x) - y) * mask[:, None, None]
    return jnp.sum(err) / (jnp.sum(mask) * y.shape[1] * y.shape[2])


def make_train_step(optimizer: optax.GradientTransformation):
    """The jitted step `(params, opt_state, x_all, y_all, rows [B], mask [B]) -> (params, opt_state, loss)`: the
    batch is gathered from the training pairs inside the program, so its shape is fixed."""
    @jax.jit
    def step(params: Params, opt_state, x_all: jax.Array, y_all: jax.Array, rows: jax.Array, mask: jax.Array):
        loss, grads = jax.value_and_grad(masked_loss)(params, x_all[rows], y_all[rows], mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def r2_per_head(y: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """`[L, K]` coefficient of determination of `pred` for `y` (`[n, L, K]`), float64; NaN where the targets do not
    vary (e.g. one validation pair)."""
    y, pred = np.asarray(y, np.float64), np.asarray(pred, np.float64)
    residual = np.square(y - pred).sum(0)
    total = np.square(y - y.mean(0)).sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(total > 0, 1 - residual / np.where(total > 0, total, 1), np.nan)


@dataclasses.dataclass(frozen=True)
class MLPFit:
    """The trained weights (stacked `[L, in, out]` float32 numpy), the split and what the validation pairs say."""

    params: dict[str, np.ndarray]
    train_rows: np.ndarray
    validation_rows: np.ndarray
    epoch_losses: list[float]
    validation_r2: np.ndarray  # [L, K]


def fit(x: np.ndarray, y: np.ndarray, seed: int, hidden_dim: int = HIDDEN_DIM, epochs: int = EPOCHS,
        learning_rate: float = LEARNING_RATE, batch_size: int = BATCH_SIZE) -> MLPFit:
    """Trains every layer's MLP jointly on `x` `[n, L, D]` -> `y` `[n, L, K]` (the official recipe)."""
    if hidden_dim <= 0 or epochs <= 0 or batch_size <= 0:
        raise KvjaxError(f"kvzap-mlp: hidden_dim={hidden_dim}, epochs={epochs}, batch_size={batch_size} must be > 0")
    n, layers, dim = x.shape
    rng = np.random.default_rng(seed)
    train_rows, validation_rows = validation_split(n, rng)
    params = {k: jnp.asarray(v) for k, v in init_params(rng, layers, dim, hidden_dim, y.shape[2]).items()}
    batch = min(batch_size, len(train_rows))
    steps = math.ceil(len(train_rows) / batch)
    optimizer = make_optimizer(steps, epochs, learning_rate)
    step = make_train_step(optimizer)
    opt_state = optimizer.init(params)
    x_train = jnp.asarray(x[train_rows], jnp.float32)
    y_train = jnp.asarray(y[train_rows], jnp.float32)
    mask = np.zeros(steps * batch, np.float32)
    mask[:len(train_rows)] = 1
    mask = mask.reshape(steps, batch)
    losses = []
    for _ in range(epochs):
        order = np.zeros(steps * batch, np.int32)
        order[:len(train_rows)] = rng.permutation(len(train_rows))
        order = order.reshape(steps, batch)
        epoch_loss = []
        for s in range(steps):
            params, opt_state, loss = step(params, opt_state, x_train, y_train, order[s], mask[s])
            epoch_loss.append(loss)
        weights = mask.sum(1)
        losses.append(float(np.dot(np.asarray(jax.device_get(epoch_loss), np.float64), weights) / weights.sum()))
    trained = {k: np.asarray(v) for k, v in params.items()}
    pred = np.asarray(predict(params, jnp.asarray(x[validation_rows], jnp.float32)))
    return MLPFit(trained, train_rows, validation_rows, losses, r2_per_head(y[validation_rows], pred))


def write_mlp(directory: pathlib.Path, params: dict[str, np.ndarray], provenance: dict) -> pathlib.Path:
    """The MLP surrogate in the published layout (`config.json`, `model.safetensors` with `layers.{l}.0.weight`
    `[M, D]`, `.0.bias` `[M]`, `.2.weight` `[K, M]`, `.2.bias` `[K]`, float32)."""
    directory.mkdir(parents=True, exist_ok=True)
    layers, dim, hidden = params["w1"].shape
    outputs = params["w2"].shape[-1]
    tensors = {}
    for i in range(layers):
        tensors[f"layers.{i}.0.weight"] = np.ascontiguousarray(params["w1"][i].T, np.float32)
        tensors[f"layers.{i}.0.bias"] = np.ascontiguousarray(params["b1"][i], np.float32)
        tensors[f"layers.{i}.2.weight"] = np.ascontiguousarray(params["w2"][i].T, np.float32)
        tensors[f"layers.{i}.2.bias"] = np.ascontiguousarray(params["b2"][i], np.float32)
    config = dict(model_type="kvzap", input_dim=int(dim), output_dim=int(outputs), n_modules=int(layers),
                  hidden_dim=int(hidden), architectures=["KVzapModel"], kvjax_calibration=provenance)
    (directory / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(tensors, str(directory / WEIGHTS_FILE))
    return directory


__all__ = ["BATCH_SIZE", "CLIP_NORM", "EPOCHS", "HIDDEN_DIM", "LEARNING_RATE", "VALIDATION_SHARE", "WEIGHT_DECAY",
           "MLPFit", "fit", "forward", "init_params", "make_optimizer", "make_train_step", "masked_loss", "predict",
           "r2_per_head", "validation_split", "write_mlp"]
