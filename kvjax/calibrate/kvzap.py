"""KVzap-Linear fitted to KVzip+ scores (Jeblick and Jegou, 2026, arXiv 2601.07891; the recipe of kvpress's
`kvzap/train.py` and `kvzap/data.py`, reimplemented).

Targets (KVzip+): each calibration context `c` is run once, as one plain causal forward, inside the repeat prompt
`opening + c + "\\n\\nRepeat the previous context exactly." + end of user turn / assistant opening + c` (the chat
template's when the tokenizer has one, else bare with a newline). For a context pair `i` and query head `n`, with
`a_nji` the softmax attention (over every earlier token of the extended prompt) of the repeated copy's token `j`:

    s_i(n) = max_j a_nji * ||W_O,n v_i|| / ||h_j||

where `h_j` is `j`'s attention input (after the layer's norm) and `W_O,n v_i` what pair `i`'s value writes into
the residual stream through head `n`'s slice of the output projection: KVzip's score (the largest attention the
repeat gives the pair) weighted by the pair's output norm and normalised by the reading token's hidden norm, the
"+" of KVzip+. A KV head's target is the max over its GQA group, and the regression target is its log (computed
as log-softmax plus log norms, so no probability underflows to log 0).

Fit (KVzap-Linear): per layer, a linear map from the attention input `h_i` `[D]` to the `K` log scores, ridge
least squares with an unpenalised intercept and `alpha=1.0` (scikit-learn `Ridge()`'s default, what the official
training calls), solved in closed form in float64 from the accumulated normal equations. As the official data
collection, `tokens_per_sample` (500) context positions are drawn per prompt (seeded).

KVzap-MLP (`kvjax.calibrate.kvzap_mlp`): the two-layer surrogate trained by AdamW on the same pairs, every layer
jointly, as the official training does (5 % of the pairs held out). `calibrate` writes both, `kvzap-linear` and
`kvzap-mlp`; the MLP's `config.json` records its validation R^2 per layer next to a ridge fit's on the same split.

A model with sliding-window layers (Gemma 3) gets one surrogate per global layer, in order (`n_modules` is their
count, `model_layers` in `config.json` names them): the methods act on those layers only, and KVzap indexes its
surrogates as they do (`ModelConfig.method_layer`).
"""

from __future__ import annotations

import functools
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from kvjax.calibrate import kvzap_mlp
from kvjax.calibrate.activations import LayerActivations, run_layers
from kvjax.chat import has_chat_template, user_turn
from kvjax.methods.kvzap import WEIGHTS_FILE
from kvjax.methods.kvzip import REPEAT_TEXT

#: Context positions drawn per prompt (the official `--n_tokens`) and the ridge penalty (scikit-learn's default).
TOKENS_PER_SAMPLE = 500
RIDGE_ALPHA = 1.0


def repeat_layout(tokenizer: Any, chat_template: bool = True) -> tuple[list[int], list[int]]:
    """`(opening, middle)` token ids: the extended prompt is `opening + context + middle + context`. `opening`:
    the chat template's tokens before a user message (else the tokenizer's own special tokens, e.g. BOS);
    `middle`: the repeat instruction, the end of the user turn and the assistant opening (else a newline)."""
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    if chat_template and has_chat_template(tokenizer):
        opening, suffix = user_turn(tokenizer)
        return encode(opening), encode(REPEAT_TEXT) + encode(suffix)
    return list(tokenizer.encode("", add_special_tokens=True)), encode(REPEAT_TEXT) + encode("\n")


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def kvzip_plus_log_scores(q: jax.Array, k: jax.Array, v: jax.Array, hidden: jax.Array, o: jax.Array,
                          context_start: int, repeat_start: int, length: int) -> jax.Array:
    """`[length, K]` float32 log KVzip+ scores of the context `[context_start, +length)` read by its copy at
    `[repeat_start, +length)`; `q` `[T, N, H]` post-RoPE (scaled), `k` / `v` `[T, K, H]`, `hidden` `[T, D]`,
    `o` `[N, H, D]`."""
    t, n, h = q.shape
    kv = k.shape[1]
    group = n // kv
    heads = jnp.arange(n) // group
    rows = q[repeat_start:repeat_start + length].astype(jnp.float32)  # [R, N, H]
    keys = k.astype(jnp.float32)[:, heads]  # [T, N, H]
    logits = jnp.einsum("rnh,tnh->nrt", rows, keys) / np.sqrt(h)
    causal = jnp.arange(t)[None, :] <= (repeat_start + jnp.arange(length))[:, None]  # [R, T]
    logits = jnp.where(causal[None], logits, -jnp.inf)
    log_attn = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    log_attn = log_attn[:, :, context_start:context_start + length]  # [N, R, C]
    h_norm = jnp.linalg.norm(hidden[repeat_start:repeat_start + length].astype(jnp.float32), axis=-1)  # [R]
    values = v[context_start:context_start + length].astype(jnp.float32)[:, heads]  # [C, N, H]
    out_norm = jnp.linalg.norm(jnp.einsum("cnh,nhd->ncd", values, o.astype(jnp.float32)), axis=-1)  # [N, C]
    per_head = jnp.max(log_attn - jnp.log(h_norm)[None, :, None], axis=1) + jnp.log(out_norm)  # [N, C]
    return jnp.max(per_head.reshape(kv, group, length), axis=1).T


class NormalEquations:
    """Per layer, the running sums a ridge fit with intercept needs: n, sum x, sum y, X^T X, X^T Y (float64), and
the pairs themselves (float32; the MLP trains on them)."""

    def __init__(self, layers: int, dim: int, outputs: int):
        self.n = np.zeros(layers)
        self.sx = np.zeros((layers, dim))
        self.sy = np.zeros((layers, outputs))
        self.xx = np.zeros((layers, dim, dim))
        self.xy = np.zeros((layers, dim, outputs))
        self.yy = np.zeros((layers, outputs))
        self.targets: list[list[np.ndarray]] = [[] for _ in range(layers)]
        self.inputs: list[list[np.ndarray]] = [[] for _ in range(layers)]

    def add(self, layer: int, x: np.ndarray, y: np.ndarray) -> None:
        x, y = x.astype(np.float64), y.astype(np.float64)
        self.n[layer] += len(x)
        self.sx[layer] += x.sum(0)
        self.sy[layer] += y.sum(0)
        self.xx[layer] += x.T @ x
        self.xy[layer] += x.T @ y
        self.yy[layer] += (y * y).sum(0)
        self.targets[layer].append(y.astype(np.float32))
        self.inputs[layer].append(x.astype(np.float32))

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """`(x [n, L, D], y [n, L, K])` float32: every pair added, row `i` the same token in every layer."""
        x = np.stack([np.concatenate(chunks) for chunks in self.inputs], axis=1)
        return x, np.stack([np.concatenate(chunks) for chunks in self.targets], axis=1)

    def solve(self, alpha: float = RIDGE_ALPHA) -> tuple[np.ndarray, np.ndarray]:
        """`(W [L, D, K], b [L, K])` minimising `||y - x W - b||^2 + alpha ||W||^2` per layer."""
        mx, my = self.sx / self.n[:, None], self.sy / self.n[:, None]
        cxx = self.xx - self.n[:, None, None] * mx[:, :, None] * mx[:, None, :]
        cxy = self.xy - self.n[:, None, None] * mx[:, :, None] * my[:, None, :]
        eye = np.eye(cxx.shape[-1])[None]
        w = np.linalg.solve(cxx + alpha * eye, cxy)
        return w, my - np.einsum("ld,ldk->lk", mx, w)

    def r2(self, w: np.ndarray) -> np.ndarray:
        """`[L, K]` coefficient of determination of the fit `w` (with its intercept) on the pairs summed."""
        mx, my = self.sx / self.n[:, None], self.sy / self.n[:, None]
        cxx = self.xx - self.n[:, None, None] * mx[:, :, None] * mx[:, None, :]
        cxy = self.xy - self.n[:, None, None] * mx[:, :, None] * my[:, None, :]
        total = self.yy - self.n[:, None] * my * my
        explained = 2 * np.einsum("ldk,ldk->lk", w, cxy) - np.einsum("ldk,lde,lek->lk", w, cxx, w)
        return explained / total

    def quantiles(self, levels: tuple[float, ...] = (0.25, 0.5, 0.75, 0.875)) -> dict[str, float]:
        """Quantiles of the log targets over every layer, head and pair: the DMS thresholds that would prune these
        shares of the calibration pairs if the surrogate predicted them exactly."""
        every = np.concatenate([np.concatenate(t).ravel() for t in self.targets])
        return {f"{q:g}": round(float(np.quantile(every, q)), 4) for q in levels}


def write_linear(directory: pathlib.Path, w: np.ndarray, b: np.ndarray, provenance: dict) -> pathlib.Path:
    """The linear surrogate in the published layout (`config.json`, `model.safetensors` with `layers.{l}.weight`
    `[K, D]` and `.bias` `[K]`, float32)."""
    directory.mkdir(parents=True, exist_ok=True)
    layers, dim, outputs = w.shape
    tensors = {}
    for i in range(layers):
        tensors[f"layers.{i}.weight"] = np.ascontiguousarray(w[i].T, np.float32)
        tensors[f"layers.{i}.bias"] = np.ascontiguousarray(b[i], np.float32)
    config = dict(model_type="kvzap", input_dim=int(dim), output_dim=int(outputs), n_modules=int(layers),
                  hidden_dim=None, architectures=["KVzapModel"], kvjax_calibration=provenance)
    (directory / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(tensors, str(directory / WEIGHTS_FILE))
    return directory


def collect(model: Any, contexts: list[list[int]], layout: tuple[list[int], list[int]], seed: int,
            tokens_per_sample: int = TOKENS_PER_SAMPLE, visit: Any = None,
            progress: Callable[[], None] | None = None) -> NormalEquations:
    """Runs every context in its repeat prompt and accumulates (attention input, log KVzip+ score) pairs at
    `tokens_per_sample` drawn context positions. `visit(activations, positions, log_scores)`: also called per
    layer (tests)."""
    config = model.config
    sums = NormalEquations(config.method_layers, config.hidden_size, config.num_kv_heads)
    rng = np.random.default_rng(seed)
    opening, middle = layout
    for context in contexts:
        c0, length = len(opening), len(context)
        r0 = c0 + length + len(middle)
        picked = np.sort(rng.permutation(length)[:tokens_per_sample])

        def add(a: LayerActivations, c0: int = c0, r0: int = r0, length: int = length,
                picked: np.ndarray = picked) -> None:
            if config.layer_window(a.layer) is not None:  # a sliding-window layer: no method acts on it
                return
            scores = np.asarray(kvzip_plus_log_scores(a.q, a.k, a.v, a.hidden, a.o, c0, r0, length))
            sums.add(config.method_layer(a.layer), a.hidden[c0 + picked], scores[picked])
            if visit is not None:
                visit(a, c0 + picked, scores[picked])

        run_layers(model, opening + context + middle + context, add)
        if progress is not None:
            progress()
    return sums


def calibrate(model: Any, contexts: list[list[int]], layout: tuple[list[int], list[int]], out: pathlib.Path, *,
              seed: int, tokens_per_sample: int = TOKENS_PER_SAMPLE, alpha: float = RIDGE_ALPHA,
              hidden_dim: int = kvzap_mlp.HIDDEN_DIM, epochs: int = kvzap_mlp.EPOCHS,
              log: Any = print, progress: Callable[[], None] | None = None) -> list[pathlib.Path]:
    """Writes the linear surrogate to `out/kvzap-linear` and the MLP to `out/kvzap-mlp`; returns both directories.
    `progress()`: after each context's forward."""
    start = time.perf_counter()
    sums = collect(model, contexts, layout, seed, tokens_per_sample, progress=progress)
    w, b = sums.solve(alpha)
    r2 = sums.r2(w)
    quantiles = sums.quantiles()
    layers = list(model.config.global_layers)
    provenance = dict(recipe=f"KVzap-Linear: ridge (alpha={alpha:g}, intercept) on log KVzip+ scores",
                      model_layers=layers, samples=len(contexts), tokens_per_sample=tokens_per_sample,
                      pairs=int(sums.n[0]), seed=seed,
                      target_quantiles=quantiles, r2_per_layer=[round(float(v), 4) for v in r2.mean(1)])
    linear = write_linear(out / "kvzap-linear", w, b, provenance)
    log(f"kvzap: linear surrogate of {w.shape[0]} layers ({w.shape[1]} -> {w.shape[2]}) from {int(sums.n[0])} pairs "
        f"({len(contexts)} prompts, mean R^2 {r2.mean():.3f}) in {time.perf_counter() - start:.1f} s -> {linear}")
    mlp = calibrate_mlp(sums, out / "kvzap-mlp", seed=seed, alpha=alpha, hidden_dim=hidden_dim, epochs=epochs,
                        provenance=dict(model_layers=layers, samples=len(contexts),
                                        tokens_per_sample=tokens_per_sample), log=log)
    return [linear, mlp]


def calibrate_mlp(sums: NormalEquations, directory: pathlib.Path, *, seed: int, alpha: float = RIDGE_ALPHA,
                  hidden_dim: int = kvzap_mlp.HIDDEN_DIM, epochs: int = kvzap_mlp.EPOCHS,
                  provenance: dict | None = None, log: Any = print) -> pathlib.Path:
    """Trains the MLP surrogate on the pairs `sums` kept and writes it to `directory`. The validation pairs are
    also scored by a ridge fit (`alpha`) on the same training split, so the two surrogates compare out of sample."""
    start = time.perf_counter()
    x, y = sums.pairs()
    trained = kvzap_mlp.fit(x, y, seed, hidden_dim=hidden_dim, epochs=epochs)
    rows, held = trained.train_rows, trained.validation_rows
    split = NormalEquations(x.shape[1], x.shape[2], y.shape[2])
    for layer in range(x.shape[1]):
        split.add(layer, x[rows, layer], y[rows, layer])
    w, b = split.solve(alpha)
    ridge_pred = np.einsum("nld,ldk->nlk", x[held].astype(np.float64), w) + b
    ridge_r2 = kvzap_mlp.r2_per_head(y[held], ridge_pred)
    mlp_r2 = trained.validation_r2

    def per_layer(r2: np.ndarray) -> list[float | None]:  # null where undefined (too few validation pairs)
        return [round(float(v), 4) if np.isfinite(v) else None for v in r2.mean(1)]

    meta = dict(recipe=f"KVzap-MLP: W2 gelu(W1 h + b1) + b2 per layer (hidden {hidden_dim}), every layer jointly, "
                f"MSE on log KVzip+ scores; AdamW (lr {kvzap_mlp.LEARNING_RATE:g}, weight decay "
                f"{kvzap_mlp.WEIGHT_DECAY:g}), cosine per epoch, clip {kvzap_mlp.CLIP_NORM:g}, batch "
                f"{kvzap_mlp.BATCH_SIZE}", **(provenance or {}), pairs=int(len(x)), train_pairs=int(len(rows)),
                validation_pairs=int(len(held)), seed=seed, epochs=epochs,
                train_loss_per_epoch=[round(v, 4) for v in trained.epoch_losses],
                target_quantiles=sums.quantiles(), validation_r2_per_layer=per_layer(mlp_r2),
                ridge_validation_r2_per_layer=per_layer(ridge_r2))
    directory = kvzap_mlp.write_mlp(directory, trained.params, meta)
    log(f"kvzap: MLP surrogate of {x.shape[1]} layers ({x.shape[2]} -> {hidden_dim} -> {y.shape[2]}) trained on "
        f"{len(rows)} pairs for {epochs} epochs (validation R^2 {mlp_r2.mean():.3f} on {len(held)} pairs, ridge on "
        f"the same split {ridge_r2.mean():.3f}) in {time.perf_counter() - start:.1f} s -> {directory}")
    return directory


__all__ = ["RIDGE_ALPHA", "TOKENS_PER_SAMPLE", "NormalEquations", "calibrate", "calibrate_mlp", "collect",
           "kvzip_plus_log_scores", "repeat_layout", "write_linear"]
