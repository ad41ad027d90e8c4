"""Using kvjax's cache and methods inside your own Flax NNX decoder.

This tiny decoder is not kvjax's: its own layers, its own parameter names, one `KVCache` per layer in
a Python list. kvjax supplies the fixed-shape cache (`kvjax.cache`), attention over it
(`kvjax.ops.attention`) and any compression method (`kvjax.methods.get(...)`): the method's two hooks
are the only lines that know about compression.

    python examples/own_flax_model.py --method=streaming_llm --budget=16
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import cache as kvc
from kvjax import methods
from kvjax.methods.base import Method, Step, per_example_budget
from kvjax.ops.attention import decode_attention, prefill_attention
from kvjax.rope import apply_rope


class Block(nnx.Module):
    """Pre-norm attention + MLP block with grouped-query attention and RoPE."""

    def __init__(self, dim: int, heads: int, kv_heads: int, *, rngs: nnx.Rngs):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nnx.RMSNorm(dim, rngs=rngs), nnx.RMSNorm(dim, rngs=rngs)
        self.wq = nnx.Linear(dim, heads * self.head_dim, use_bias=False, rngs=rngs)
        self.wkv = nnx.Linear(dim, 2 * kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(heads * self.head_dim, dim, use_bias=False, rngs=rngs)
        self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, positions, cache: kvc.KVCache, method: Method, step: Step, decoding: bool):
        b, t, _ = x.shape
        h = self.norm1(x)
        inv_freq = step.inv_freq
        q = apply_rope(self.wq(h).reshape(b, t, self.heads, self.head_dim), positions, inv_freq)
        k, v = jnp.split(self.wkv(h).reshape(b, t, 2 * self.kv_heads, self.head_dim), 2, axis=2)
        k = apply_rope(k, positions, inv_freq)
        if decoding:  # append, let the method evict / mask, then attend
            cache = method.decode(kvc.append(cache, k, v, positions), q, step)
            out = decode_attention(q[:, 0], positions[:, 0], cache.k, cache.v, cache.pos, kvc.valid_mask(cache))
            out = out[:, None]
        else:  # append the chunk into extra room, attend, then compress to capacity
            work = kvc.append(kvc.extend(cache, t), k, v, positions)
            out = prefill_attention(q, positions, work.k, work.v, work.pos, kvc.valid_mask(work))
            cache = method.prefill(work, q, step)
        x = x + self.wo(out.reshape(b, t, -1))
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x)))), cache


class TinyDecoder(nnx.Module):
    def __init__(self, vocab: int = 64, dim: int = 64, depth: int = 2, heads: int = 4, kv_heads: int = 2, *, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, kv_heads, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)
        self.inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, dim // heads, 2) / (dim // heads)))

    def __call__(self, tokens, positions, caches, method, budget, decoding):
        x = self.embed(tokens)
        new_caches = []
        for i, (block, cache) in enumerate(zip(self.blocks, caches, strict=True)):
            step = Step(positions=positions, budget=budget, layer=jnp.int32(i), inv_freq=self.inv_freq,
                        capacity=cache.capacity, num_layers=len(self.blocks))
            x, cache = block(x, positions, cache, method, step, decoding)
            new_caches.append(cache)
        return self.head(x), new_caches


@functools.partial(nnx.jit, static_argnums=(4, 5))
def run(model, tokens, positions, caches, method, decoding, budget):
    return model(tokens, positions, caches, method, budget, decoding)


def generate(model: TinyDecoder, prompt: list[int], method: Method, max_new_tokens: int):
    """Greedy decoding; returns the new tokens and the per-layer caches."""
    block = model.blocks[0]
    capacity = method.capacity(len(prompt), max_new_tokens)
    caches = [kvc.init(1, block.kv_heads, capacity, block.head_dim, jnp.float32) for _ in model.blocks]
    caches = [c.replace(state=method.init_state(1, block.kv_heads, capacity)) for c in caches]
    budget = jnp.asarray(per_example_budget(method, np.array([len(prompt)])))
    tokens = jnp.asarray([prompt], jnp.int32)
    logits, caches = run(model, tokens, jnp.arange(len(prompt))[None], caches, method, False, budget)
    out = [int(jnp.argmax(logits[0, -1]))]
    for i in range(max_new_tokens - 1):
        pos = jnp.asarray([[len(prompt) + i]], jnp.int32)
        logits, caches = run(model, jnp.asarray([[out[-1]]]), pos, caches, method, True, budget)
        out.append(int(jnp.argmax(logits[0, -1])))
    return out, caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="streaming_llm", help=f"one of {methods.available()}")
    parser.add_argument("--budget", type=int, default=16)
    args = parser.parse_args()
    model = TinyDecoder(rngs=nnx.Rngs(0))
    method = methods.get(args.method) if args.method == "full" else methods.get(args.method, budget=args.budget)
    prompt = list(np.random.default_rng(0).integers(0, 64, size=40))
    tokens, caches = generate(model, prompt, method, max_new_tokens=8)
    kept = [int(p) for p in np.asarray(caches[0].pos[0, 0]) if p >= 0]
    print(f"{args.method}: tokens {tokens}")
    print(f"layer 0 head 0 keeps positions {sorted(kept)}; cache bytes {sum(c.nbytes for c in caches)}")


if __name__ == "__main__":
    main()
