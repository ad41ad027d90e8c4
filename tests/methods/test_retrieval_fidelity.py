"""Issue 23 items 1-3: InfLLM's positional scheme past the model window, Q-LLM's question vector chosen
inside the prompt, ActQKV's dynamic cut-off at the paper's settings. Every oracle here is float64 NumPy
written from the papers (InfLLM Sec. 3.1 / ActQKV Eq. 11-12 / Q-LLM's question tokens), not from kvjax."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvc
from kvjax.methods.actqkv import ActQKV
from kvjax.methods.base import CacheSpec, Step

# ---------------------------------------------------------------------------------------------------
# Item 3: ActQKV's dynamic cut-off (Eq. 11-12)
# ---------------------------------------------------------------------------------------------------


def _np_rope(x: np.ndarray, pos: float, inv_freq: np.ndarray) -> np.ndarray:
    ang = pos * inv_freq.astype(np.float64)
    ang = np.concatenate([ang, ang])
    half = x.shape[-1] // 2
    return x * np.cos(ang) + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * np.sin(ang)


def _eq11(scores: np.ndarray) -> float:
    """Eq. 11 normalised by log n: the entropy of softmax(scores)."""
    p = np.exp(scores - scores.max())
    p /= p.sum()
    return float(-(p * np.log(p)).sum() / math.log(len(scores)))


def _eq12(thetas: list[float], topk: int, n: int, cap: int) -> list[int]:
    """Eq. 12 with the history mean of every later layer equal to its entropy (steady state):
    B^l = round(Theta_l / (Theta_l + sum_{j>l} Theta_j) * B_kv), B_kv starting at L * topk; no floor,
    at most `cap` and `n` blocks."""
    remaining, out = len(thetas) * topk, []
    for layer, theta in enumerate(thetas):
        share = theta / (theta + sum(thetas[layer + 1 :]))
        b = min(int(np.floor(share * remaining + 0.5)), cap, n)
        out.append(b)
        remaining -= b
    return out


@functools.cache
def _hook(method):
    return jax.jit(method.decode)


def _dcm_budgets(method: ActQKV, spreads: list[float]) -> tuple[list[int], list[int]]:
    """Runs `method.decode` layer after layer (as the layer scan does) on blocks whose cosine scores
    against the decode query are +-spread (half each): a larger spread gives a lower entropy.
    Returns (kvjax's per-layer budgets, the NumPy Eq. 12 budgets)."""
    num_layers, k = len(spreads), method.retrieved_blocks
    n_blocks = 3 * k
    p = method.n_init + method.n_local + method.block_size * n_blocks  # n_blocks due, none forms now
    cap = p + 1
    heads, hd = 2, 4
    spec = CacheSpec(batch=1, kv_heads=1, capacity=cap, num_heads=heads, head_dim=hd, num_layers=num_layers,
                     dtype=jnp.float32)
    rng = np.random.default_rng(0)
    inv_freq = 1.0 / 100.0 ** (np.arange(hd // 2) / (hd // 2))
    q = rng.standard_normal((heads, hd))
    probe = _np_rope(q, method.retrieval_position - p, inv_freq).reshape(-1)  # the global query
    unit = probe / np.linalg.norm(probe)
    ortho = rng.standard_normal(probe.shape)
    ortho -= (ortho @ unit) * unit
    ortho /= np.linalg.norm(ortho)
    state = method.init_cache_state(spec)
    nb_max = state["rep"].shape[1]
    kk = rng.standard_normal((1, p + 1, 1, hd)).astype(np.float32)
    base = kvc.append(kvc.init(1, 1, cap, hd, jnp.float32, attend=True), kk, kk, jnp.arange(p + 1)[None])
    reps, thetas = [], []
    for spread in spreads:
        cos = np.where(np.arange(n_blocks) % 2 == 0, 1.0, -1.0) * spread  # cosine of each block with the probe
        rep = np.zeros((1, nb_max, heads * hd), np.float32)
        rep[0, :n_blocks] = cos[:, None] * unit + np.sqrt(1 - cos**2)[:, None] * ortho
        reps.append(rep)
        thetas.append(_eq11(cos))
    hist = np.zeros((1, num_layers, method.dcm_history), np.float32)
    hist[0, :, :5] = np.array(thetas)[:, None]  # steady state: the history mean is each layer's entropy
    shared = {**state["shared"], "ent_hist": jnp.asarray(hist), "ent_count": jnp.full((1, num_layers), 5, jnp.int32)}
    got = []
    for layer in range(num_layers):
        st = {**state, "rep": jnp.asarray(reps[layer]), "nb": jnp.asarray([n_blocks], jnp.int32), "shared": shared}
        step = Step(positions=jnp.asarray([[p]], jnp.int32), budget=jnp.asarray([0], jnp.int32),
                    layer=jnp.int32(layer), inv_freq=jnp.asarray(inv_freq, jnp.float32), capacity=cap,
                    num_layers=num_layers)
        qq = _np_rope(q, p, inv_freq)[None, None].astype(np.float32)  # post-RoPE query at p
        out = _hook(method)(base.replace(state=st), jnp.asarray(qq), step)
        shared = out.state["shared"]
        got.append(int(np.asarray(out.state["n_retrieved"])[0]))
    return got, _eq12(thetas, k, n_blocks, method.block_cap)


@pytest.mark.parametrize("preset", [None, "llama-3-8b"])
def test_dcm_cuts_below_topk_and_stays_within_the_layer_budget(preset):
    """Eq. 12 at the defaults (topk 23) and the Llama-3-8B preset (topk 46): a peaked layer gets fewer
    than topk blocks, and the layers never sum past L * topk."""
    method = ActQKV() if preset is None else ActQKV.preset(preset)
    k = method.retrieved_blocks
    spreads = [0.0, 1.0, 0.3, 0.0, 0.9, 0.5, 0.0, 0.1]
    got, want = _dcm_budgets(method, spreads)
    assert got == want
    assert sum(got) <= len(spreads) * k
    assert min(got) < k  # the cut-off cuts
