"""Using kvjax's cache and methods inside your own Flax NNX decoder.

This decoder is not kvjax's: its own modules and parameter names. kvjax supplies the per-layer cache
(`kvjax.cache.ModelCache`, one buffer per layer) and the per-layer step API (`kvjax.runtime.step`): each layer
computes its post-RoPE q / k / v and calls `prefill_layer` (a prompt chunk) or `decode_layer` (one token),
which append to the layer's cache, run the method's hooks (eviction, retrieval, observers, per-head masks:
every registered method) and attend. The same two calls are what kvjax's own model makes. A method that scores by
having the model read the prompt again (KVzip, `ContextReplay`) also needs `replay_layer` for its replay rows (Fast
KVzip has none: its `prompt_scorer` scores the prompt as it is read, then every layer is compressed at once), and one
that differentiates that reading (KVgrad, `replay_objective`) a gradient of the decoder's own forward
(`replay_gradients`: the block adds a zero to its attention output so that the gradient can be taken there).

    python examples/own_flax_model.py --method=streaming_llm --budget=16
    python examples/own_flax_model.py --method=snapkv --method_args=window_size=4
    python examples/own_flax_model.py --method=per_layer --method_args="compression_ratios=[0.25,0.9],base=knorm"

Every registered method runs from its command line: with the example's arguments for a 40-token prompt
(`EXAMPLE_ARGS`; a budget of 16 where the method takes one), `--method_args` over them. The methods that read a file
learned for the model (`LEARNED_FILES`: KVzap, Q-Filters, DuoAttention, DMS with its KVzap scorer, Fast KVzip's gates,
LU-KV's budget curve, Expected Attention's query statistics) need it named in `--method_args`, made for this decoder's
shapes (2 layers, 4 query heads on 2 KV heads of 16, hidden size 64).
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import methods
from kvjax.cache import ModelCache
from kvjax.errors import KvjaxError
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
                 decoding: bool, span=None, replay_gradient=None, delta=None):
        b, t, _ = x.shape
        h = self.norm1(x)
        q = apply_rope(self.wq(h).reshape(b, t, self.heads, self.head_dim), positions, inv_freq)
        k = apply_rope(self.wk(h).reshape(b, t, self.kv_heads, self.head_dim), positions, inv_freq)
        v = self.wv(h).reshape(b, t, self.kv_heads, self.head_dim)
        # The only compression-aware lines: kvjax appends to this layer's cache, runs the method, attends. The
        # output projection (as [heads, head_dim, dim]) is there for methods that weigh values by it (CriticalKV),
        # the normed hidden states `h` for methods that score from them (KVzap).
        w_o = self.wo.kernel[...].reshape(self.heads, self.head_dim, -1)
        if span is not None:  # a replay row of a ContextReplay method (KVzip): scored, not stored
            out, cache = step.replay_layer(method, cache, q, k, v, positions, span, layer=layer, inv_freq=inv_freq,
                                           num_layers=num_layers, replay_gradient=replay_gradient, out_proj=w_o,
                                           hidden=h)
        elif decoding:
            out, cache = step.decode_layer(method, cache, q, k, v, positions, budget, layer=layer, inv_freq=inv_freq,
                                           num_layers=num_layers, hidden=h)
        else:
            out, cache = step.prefill_layer(method, cache, q, k, v, positions, budget, layer=layer,
                                            inv_freq=inv_freq, num_layers=num_layers, out_proj=w_o, hidden=h)
        attended = self.wo(out.reshape(b, t, -1))
        x = x + (attended if delta is None else attended + delta)  # delta: KVgrad's point of differentiation
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

    def __call__(self, tokens, positions, cache: ModelCache, method: Method, budget, decoding: bool, span=None,
                 replay_gradients=None):
        x, cache = self.last_hidden(tokens, positions, cache, method, budget, decoding, span, replay_gradients)
        return self.head(self.norm(x)), cache

    def last_hidden(self, tokens, positions, cache: ModelCache, method: Method, budget, decoding: bool, span=None,
                    replay_gradients=None, deltas=None):
        """The last block's output (before the final norm) and the cache; `replay_gradients` / `deltas`: per layer."""
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x, layer_cache = block(x, positions, cache.layer(i), method, budget, i, len(self.blocks),
                                   self.inv_freq[...], decoding, span, None if replay_gradients is None else
                                   replay_gradients[i], None if deltas is None else deltas[i])
            cache = cache.with_layer(i, layer_cache)
        return x, cache


@functools.partial(nnx.jit, static_argnums=(4, 5), donate_argnums=3)
def run(model, tokens, positions, cache, method, decoding, budget, span=None, replay_gradients=None):
    return model(tokens, positions, cache, method, budget, decoding, span, replay_gradients)


@functools.partial(nnx.jit, static_argnums=(4,))
def replay_gradients(model, tokens, positions, cache, method, span):
    """KVgrad's replay objective (`ContextReplay.replay_objective`): per layer, each replay row's norm of the gradient
    of the last block's sum of squares over the real rows with respect to the layer's attention output."""
    real = positions >= 0

    def objective(deltas):
        unscored = [jnp.zeros(positions.shape, jnp.float32)] * len(model.blocks)  # this pass's scores are dropped
        x, _ = model.last_hidden(tokens, positions, cache, method, None, False, span, unscored, deltas)
        return jnp.sum(jnp.where(real[..., None], x * x, 0.0))

    x = model.embed(tokens)
    grads = jax.grad(objective)([jnp.zeros_like(x) for _ in model.blocks])
    return [jnp.where(real, jnp.linalg.norm(g, axis=-1), 0.0) for g in grads]


@functools.partial(jax.jit, static_argnums=(0, 2))
def compress_replayed(method: Method, cache: ModelCache, capacity: int, budget) -> ModelCache:
    return cache.replace(layers=method.replay_compress(cache.layers, budget, capacity))


def generate(model: TinyDecoder, prompt: list[int], method: Method, max_new_tokens: int):
    """Greedy decoding of one prompt; returns the new tokens and the final cache. The prompt is prefilled in
    the method's own window when it has one (`prefill_window`), else in one chunk."""
    block = model.blocks[0]
    capacity = method.capacity(len(prompt), max_new_tokens)
    replays, compress = caps.replays_context(method), method
    if replays:  # KVzip: the prompt is held whole, read again, then compressed (Fast KVzip: scored as it is read)
        capacity, compress = len(prompt), method.prompt_scorer() or methods.get("full")
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
            rows, spans = jnp.asarray(rows), jnp.asarray(spans)
            gradients = replay_gradients(model, rows, positions, cache, method, spans) \
                if caps.differentiates_replay(method) else None
            _, cache = run(model, rows, positions, cache, method, False, budget, spans, gradients)
        cache = compress_replayed(method, cache, method.capacity(len(prompt), max_new_tokens), budget)
    for i in range(max_new_tokens - 1):
        pos = jnp.asarray([[len(prompt) + i]], jnp.int32)
        logits, cache = run(model, jnp.asarray([[out[-1]]]), pos, cache, method, True, budget)
        out.append(int(jnp.argmax(logits[0, -1])))
    return out, cache


#: What a method needs beyond its defaults to compress this example's 40-token prompt: the defaults are sized for
#: prompts of thousands of tokens (SnapKV's 32-token observation window alone fills a budget of 16).
EXAMPLE_ARGS: dict[str, dict[str, Any]] = {
    "snapkv": {"window_size": 8}, "pyramidkv": {"window_size": 8}, "finch": {"window_size": 8},
    "nacl": {"window_size": 8}, "lm_infinite": {"n_global": 4}, "lagkv": {"sink_size": 4, "lag_size": 8},
    # wrappers of SnapKV
    **{name: {"base_args": {"window_size": 8}} for name in ("adakv", "chunkkv", "criticalkv", "criticaladakv",
                                                            "key_rerotation", "entropy_gated_chunkkv")},
    "per_layer": {"compression_ratios": [0.5, 0.75]},  # one ratio per layer: they are its budget
    "chunk": {"compression_ratio": 0.6, "chunk_length": 16, "base_args": {"window_size": 8}},  # a ratio, no budget
    "block": {"block_size": 8, "base_args": {"window_size": 8}},  # blocks of 8 after the kept 16
    "cam": {"target_size": 12, "compression_interval": 2},  # merges while it decodes, from the 2nd token
    "simlayerkv": {"lazy_threshold": 0.3, "n_recent": 16},  # kvpress's threshold 1.0 never trims a layer
}
#: Methods that keep by their own arguments, not a token budget (no --budget by default).
NO_BUDGET = ("full", "infllm", "qllm", "actqkv", "per_layer", "duo_attention", "dms", "simlayerkv", "chunk")
#: Methods that read a file learned for the model: the argument naming it (give it with --method_args).
LEARNED_FILES = {"kvzap": "weights=DIR", "qfilter": "filters=DIR", "duo_attention": "patterns=DIR",
                 "dms": "threshold=T,base_args={'weights': DIR}", "fastkvzip": "gates=DIR",
                 "lukv": "curve=FILE,compression_ratio=R", "expected_attention_stats": "stats=DIR"}
DEFAULT_BUDGET = 16


def parse_method_args(text: str | None) -> dict[str, Any]:
    """`key=value,key=value`, values read as Python literals (`8`, `0.5`, `[0.5, 0.75]`, `{'window_size': 4}`; other
    text stays a string); commas inside brackets or quotes belong to their value."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text or ""):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{" or ch in ")]}":
            depth += 1 if ch in "([{" else -1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append((text or "")[start:])
    out: dict[str, Any] = {}
    for item in (x.strip() for x in items if x.strip()):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise KvjaxError(f"--method_args item {item!r} is not key=value")
        if key in out:
            raise KvjaxError(f"--method_args gives {key!r} twice")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def build_method(name: str, budget: int | None = None, method_args: dict[str, Any] | None = None) -> Method:
    """The method `main` runs: `EXAMPLE_ARGS[name]`, `method_args` over them, and `budget` (default: 16 for a method
    that takes a token budget and is given neither a budget nor a compression ratio)."""
    args = {**EXAMPLE_ARGS.get(name, {}), **(method_args or {})}
    if budget is not None:
        args["budget"] = budget
    elif name not in NO_BUDGET and "budget" not in args and "compression_ratio" not in args:
        args["budget"] = DEFAULT_BUDGET
    if name in LEARNED_FILES and not (method_args or {}):
        raise KvjaxError(f"{name} reads a file learned for the model: give it with --method_args={LEARNED_FILES[name]} "
                         "(made for this decoder: 2 layers, 2 KV heads of 16, hidden size 64)")
    return methods.get(name, **args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runnable = [m for m in methods.available() if m not in LEARNED_FILES]
    learned = ", ".join(f"{m} ({arg})" for m, arg in LEARNED_FILES.items())
    parser.add_argument("--method", default="streaming_llm", choices=methods.available(), metavar="METHOD",
                        help=f"one of {', '.join(runnable)}; with --method_args naming a learned file: {learned}")
    parser.add_argument("--budget", type=int, default=None,
                        help=f"tokens kept (default {DEFAULT_BUDGET}, for the methods that take a budget; not "
                        f"{', '.join(NO_BUDGET)}, which keep by their own arguments)")
    parser.add_argument("--method_args", default=None,
                        help="the method's arguments, key=value,... over the example's (e.g. window_size=4 or "
                        "\"compression_ratios=[0.25,0.9]\")")
    return parser


PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 64, size=40)]
NEW_TOKENS = 8


def run_from_args(argv: list[str] | None = None) -> tuple[Method, list[int], ModelCache]:
    """What `main` runs for a command line: (the method, the generated tokens, the final cache); KvjaxError on a bad
    value."""
    args = _parser().parse_args(argv)
    method = build_method(args.method, args.budget, parse_method_args(args.method_args))
    tokens, cache = generate(TinyDecoder(rngs=nnx.Rngs(0)), PROMPT, method, max_new_tokens=NEW_TOKENS)
    return method, tokens, cache


def main(argv: list[str] | None = None) -> int:
    try:
        method, tokens, cache = run_from_args(argv)
    except KvjaxError as e:  # a bad value: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    kept = [int(p) for p in np.asarray(cache.layers[0].pos[0, 0]) if p >= 0]
    print(f"{method.name}: tokens {tokens}")
    print(f"layer 0 head 0 keeps positions {sorted(kept)}; cache bytes {cache.nbytes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
