"""Using kvjax's cache and methods inside your own Flax NNX decoder.

This decoder is not kvjax's: its own modules and parameter names. kvjax supplies the per-layer cache
(`kvjax.cache.ModelCache`, one buffer per layer) and the per-layer step API (`kvjax.runtime.step`): each layer
computes its post-RoPE q / k / v and calls `prefill_layer` (a prompt chunk) or `decode_layer` (one token),
which append to the layer's cache, run the method's hooks (eviction, retrieval, observers, per-head masks:
every registered method) and attend. The same two calls are what kvjax's own model makes. A method that scores by
having the model read the prompt again (KVzip, `ContextReplay`) also needs `replay_layer` for its replay rows.

    python examples/own_flax_model.py --method=streaming_llm --budget=16
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import methods
from kvjax.cache import ModelCache
from kvjax.methods import capabilities as caps
from kvjax.methods.base import CacheSpec, Method, per_example_budget
from kvjax.rope import apply_rope
from kvjax.runtime import step


class Block(nnx.Module):
    """Pre-norm grouped-query attention with RoPE, then a SwiGLU MLP (a Llama-style layer)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, *, rngs: nnx.Rngs):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nnx.RMSNorm(dim, epsilon=1e-5, rngs=rngs), nnx.RMSNorm(dim, epsilon=1e-5, rngs=rngs)
        init = nnx.initializers.normal(0.3)
        linear = functools.partial(nnx.Linear, use_bias=False, kernel_init=init, rngs=rngs)
        self.wq, self.wk, self.wv = linear(dim, dim), linear(dim, kv_heads * self.head_dim), linear(
            dim, kv_heads * self.head_dim)
        self.wo = linear(dim, dim)
        self.gate, self.up, self.down = linear(dim, hidden), linear(dim, hidden), linear(hidden, dim)

    def __call__(self, x, positions, cache, method: Method, budget, layer: int, num_layers: int, inv_freq,
                 decoding: bool, span=None):
        b, t, _ = x.shape
        h = self.norm1(x)
        q = apply_rope(self.wq(h).reshape(b, t, self.heads, self.head_dim), positions, inv_freq)
        k = apply_rope(self.wk(h).reshape(b, t, self.kv_heads, self.head_dim), positions, inv_freq)
        v = self.wv(h).reshape(b, t, self.kv_heads, self.head_dim)
        # The only compression-aware lines: kvjax appends to this layer's cache, runs the method, attends. The
        # output projection (as [heads, head_dim, dim]) is there for methods that weigh values by it (CriticalKV),
        # the normed hidden states `h` for methods that score from them (KVzap).
        if span is not None:  # a replay row of a ContextReplay method (KVzip): scored, not stored
            out, cache = step.replay_layer(method, cache, q, k, v, positions, span, layer=layer, inv_freq=inv_freq,
                                           num_layers=num_layers)
        elif decoding:
            out, cache = step.decode_layer(method, cache, q, k, v, positions, budget, layer=layer, inv_freq=inv_freq,
                                           num_layers=num_layers, hidden=h)
        else:
            w_o = self.wo.kernel[...].reshape(self.heads, self.head_dim, -1)
            out, cache = step.prefill_layer(method, cache, q, k, v, positions, budget, layer=layer,
                                            inv_freq=inv_freq, num_layers=num_layers, out_proj=w_o, hidden=h)
        x = x + self.wo(out.reshape(b, t, -1))
        h = self.norm2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h)), cache


class TinyDecoder(nnx.Module):
    def __init__(self, vocab: int = 64, dim: int = 64, depth: int = 2, heads: int = 4, kv_heads: int = 2,
                 hidden: int = 96, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, kv_heads, hidden, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.RMSNorm(dim, epsilon=1e-5, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, kernel_init=nnx.initializers.normal(0.3), rngs=rngs)
        head_dim = dim // heads
        self.inv_freq = nnx.Variable(1.0 / (10000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)))

    def __call__(self, tokens, positions, cache: ModelCache, method: Method, budget, decoding: bool, span=None):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x, layer_cache = block(x, positions, cache.layer(i), method, budget, i, len(self.blocks),
                                   self.inv_freq[...], decoding, span)
            cache = cache.with_layer(i, layer_cache)
        return self.head(self.norm(x)), cache


@functools.partial(nnx.jit, static_argnums=(4, 5), donate_argnums=3)
def run(model, tokens, positions, cache, method, decoding, budget, span=None):
    return model(tokens, positions, cache, method, budget, decoding, span)


@functools.partial(jax.jit, static_argnums=(0, 2))
def compress_replayed(method: Method, cache: ModelCache, capacity: int, budget) -> ModelCache:
    return cache.replace(layers=method.replay_compress(cache.layers, budget, capacity))


def generate(model: TinyDecoder, prompt: list[int], method: Method, max_new_tokens: int):
    """Greedy decoding of one prompt; returns the new tokens and the final cache. The prompt is prefilled in
    the method's own window when it has one (`prefill_window`), else in one chunk."""
    block = model.blocks[0]
    capacity = method.capacity(len(prompt), max_new_tokens)
    replays, compress = caps.replays_context(method), method
    if replays:  # KVzip: the prompt is held whole, read again, then compressed
        capacity, compress = len(prompt), methods.get("full")
    spec = CacheSpec(batch=1, kv_heads=block.kv_heads, capacity=capacity, num_heads=block.heads,
                     head_dim=block.head_dim, num_layers=len(model.blocks), dtype=jnp.float32,
                     layer_capacities=None if replays else method.layer_capacities(len(prompt), max_new_tokens,
                                                                                   len(model.blocks)))
    cache = step.init_cache(method, spec)
    budget = jnp.asarray(per_example_budget(method, np.array([len(prompt)])))
    chunk = method.prefill_window() or len(prompt)
    for start in range(0, len(prompt), chunk):
        piece = prompt[start : start + chunk]
        positions = jnp.arange(start, start + chunk, dtype=jnp.int32)[None]
        tokens = jnp.asarray([piece + [0] * (chunk - len(piece))], jnp.int32)
        positions = jnp.where(positions < len(prompt), positions, -1)  # padding of a last, short chunk
        logits, cache = run(model, tokens, positions, cache, compress, False, budget)
    out = [int(jnp.argmax(logits[0, (len(prompt) - 1) % chunk]))]
    if replays:
        for rows, row_lengths, spans in method.replay_rows(np.asarray([prompt]), np.asarray([len(prompt)])):
            steps = np.arange(rows.shape[1])[None]
            positions = jnp.asarray(np.where(steps < row_lengths[:, None], len(prompt) + steps, -1), jnp.int32)
            _, cache = run(model, jnp.asarray(rows), positions, cache, method, False, budget, jnp.asarray(spans))
        cache = compress_replayed(method, cache, method.capacity(len(prompt), max_new_tokens), budget)
    for i in range(max_new_tokens - 1):
        pos = jnp.asarray([[len(prompt) + i]], jnp.int32)
        logits, cache = run(model, jnp.asarray([[out[-1]]]), pos, cache, method, True, budget)
        out.append(int(jnp.argmax(logits[0, -1])))
    return out, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="streaming_llm", help=f"one of {methods.available()}")
    parser.add_argument("--budget", type=int, default=16)
    args = parser.parse_args()
    model = TinyDecoder(rngs=nnx.Rngs(0))
    needs_budget = args.method not in ("full", "infllm", "qllm", "actqkv")
    method = methods.get(args.method, budget=args.budget) if needs_budget else methods.get(args.method)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 64, size=40)]
    tokens, cache = generate(model, prompt, method, max_new_tokens=8)
    kept = [int(p) for p in np.asarray(cache.layers[0].pos[0, 0]) if p >= 0]
    print(f"{args.method}: tokens {tokens}")
    print(f"layer 0 head 0 keeps positions {sorted(kept)}; cache bytes {cache.nbytes}")


if __name__ == "__main__":
    main()
