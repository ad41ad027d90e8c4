"""Decode throughput at the largest batch that fits: aggregate tokens/s, bytes moved, peak memory.

    python benchmarks/throughput.py --out=/tmp/throughput.json                        # accelerator: 8B shape
    python benchmarks/throughput.py --contexts=32768 --methods=full,snapkv --budgets=1024 --out=...
    python benchmarks/throughput.py --batches=16 --contexts=8192 --methods=full --out=...   # a fixed batch
    python benchmarks/throughput.py --smoke --out=/tmp/throughput.json                  # CPU, seconds
    python benchmarks/throughput.py --plan="1x32768p:full,snapkv@1024;16x8192:full;maxx32768:full,snapkv@1024" \
        --out=...     # groups of BATCHxCONTEXT (max: the largest batch that fits; p: also time a prefill)

For each context, method and budget: the batch is the largest whose cache fits in `--memory_fraction` of the
device's memory beside the weights and the decode step's activations (or each of `--batches`); one that runs out
of memory all the same is retried a tenth smaller (`smaller_batch`; the row keeps `out_of_memory_at`). The decode
then runs on a cache holding what a prefill of `context` tokens per example leaves (random keys and values in
the real shapes, valid slots and dtypes: `min(budget, context)` slots for a compressing method, every token for
`full`), so the batch's prefill (which at 32K x hundreds of examples would take minutes) is not paid; a real
prefill is timed at batch 1 for each row (`prefill_s`). Reported per row: batch, decode step time, aggregate
tokens/s (batch / step), bytes per step (weights + the allocated cache: K / V and the slots' positions,
`step_bytes`) and their rate against the device's measured copy bandwidth, the allocated cache bytes and the peak
device memory (`row_peak`: the row's own where it raised the process's, which the device never resets). Rows are
rewritten to the JSON after each measurement, so a run cut short keeps what it measured (`--time_budget_s` stops
new planned rows).
With `--tunings` / `--kv_dtypes` each planned row runs under every variant before the next row starts, so the time
budget keeps whole A/B pairs.

Methods: those whose decode appends in place or evicts in place (`full`, `snapkv`, `streaming_llm`, `knorm`,
`pyramidkv`, `adakv`, ...): their per-step cost is the cache they hold, which the synthetic fill reproduces.
`--hf` adds transformers' `generate` (sdpa, PyTorch) at batch 1 and the first `--batches` entry on the same
device and shape as the reference (run it in a process of its own: PyTorch and JAX would share the memory).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import importlib  # noqa: E402

import bench_util as bu  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvjax import methods as kvm  # noqa: E402
from kvjax import tuning  # noqa: E402
from kvjax.cache import ModelCache  # noqa: E402
from kvjax.methods import capabilities as caps  # noqa: E402
from kvjax.methods.base import per_example_budget  # noqa: E402
from kvjax.quant import storage as qs  # noqa: E402

gen = importlib.import_module("kvjax.runtime.generate")  # the module (`kvjax.runtime.generate` is the function)


def device_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def row_peak(before: int | None, after: int | None) -> dict[str, int | None]:
    """A row's peak device memory from the process's high-water mark before and after it (the device keeps one for
    the process, never reset): `peak_bytes`, the row's own where it raised the mark, else None (its peak was at
    most an earlier row's, which the mark shows); `process_peak_bytes`, the mark after the row."""
    own = after if after is not None and (before is None or after > before) else None
    return dict(peak_bytes=own, process_peak_bytes=after)


def copy_bandwidth(mib: int, repeats: int = 5) -> float:
    """The device's copy bandwidth in bytes/s: 2 x bytes / time of a jitted elementwise pass."""
    x = jnp.ones((mib << 18,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    bu.block(f(x))
    return 2 * x.nbytes / bu.median(bu.time_call(lambda: f(x), repeats))


def weights_bytes(model: Any) -> int:
    """Bytes of weights a decode step reads (the embedding table only for its one row, unless tied)."""
    weights = model.weights()
    total = sum(w.nbytes for w in jax.tree.leaves(weights))
    if not model.config.tie_word_embeddings:
        total -= weights["embed"].nbytes - weights["embed"].shape[1] * weights["embed"].dtype.itemsize
    return total


def step_bytes(model: Any, cache: ModelCache) -> int:
    """Bytes a decode step reads: the weights (`weights_bytes`) and every array of the cache's layers: keys and
    values (or their codes, scales, zero points and KIVI's ring), the slots' positions, which the XLA path's mask
    and the fused kernel's blocks read beside them (1.5% of an int8 cache's bytes, 5% of KIVI-2's), the lengths."""
    return weights_bytes(model) + sum(layer.nbytes for layer in cache.layers)


def cache_bytes(method: Any, config: Any, batch: int, capacity: int, dtype: Any, kv_dtype: str | None = None) -> int:
    """Allocated bytes of the method's cache (`jax.eval_shape`: nothing allocated)."""
    shapes = jax.eval_shape(lambda: gen.init_cache(method, config, batch, capacity, dtype, kv_dtype))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


@functools.cache
def _layer_filler(kept: int, context: int, head_dim: int, dtype: Any, quant: Any) -> Any:
    """`synthetic_state`'s jitted fill of one layer, made once per (kept, context, head_dim, dtype, storage): a
    function defined inside `synthetic_state` was a new one at every call and compiled again for every state."""

    @functools.partial(jax.jit, donate_argnums=0)  # each layer replaced in place: never two caches at once
    def fill(layer: Any, key_k: Any, key_v: Any) -> Any:
        slots = jnp.arange(layer.capacity)
        valid = slots < kept
        # A compressing method keeps sparse positions; the step's cost only depends on how many.
        pos = jnp.where(valid, jnp.where(slots < 16, slots, context - kept + slots), -1).astype(jnp.int32)
        length = jnp.full(layer.length.shape, kept, jnp.int32)
        shape = layer.pos.shape + (head_dim,)

        def noise(key: Any, shape: tuple[int, ...]) -> Any:  # drawn in the model dtype: no float32 copy of the layer
            return jnp.where(valid[:, None], jax.random.normal(key, shape, dtype), 0).astype(dtype)

        if quant is None:
            k, v = noise(key_k, shape), noise(key_v, shape)
        else:  # quantized one example at a time, drawn inside the loop: nothing of a whole layer's size but its store
            def one(xs: Any) -> Any:
                key, n = xs
                return qs.quantize(quant, role, noise(key, shape[1:])[None], n[None], dtype)

            k = v = None
            for role, key in (("k", key_k), ("v", key_v)):
                store = jax.lax.map(one, (jax.random.split(key, layer.pos.shape[0]), length))
                store = jax.tree.map(lambda a: a[:, 0], store)
                k, v = (store, v) if role == "k" else (k, store)
        return layer.replace(k=k, v=v, pos=jnp.broadcast_to(pos, layer.pos.shape), length=length)

    return fill


def synthetic_state(model: Any, method: Any, batch: int, context: int, new: int, seed: int = 0,
                    kv_dtype: str | None = None) -> Any:
    """What `gen.prefill` leaves for `[batch, context]` prompts: the method's cache at its capacity, the first
    `min(budget, context)` slots of every head valid (positions kept in order), random K / V; with `kv_dtype`
    (`kvjax.quant`: int8, int4, kivi2, ...) stored in that format, quantized from the random values as a prefill
    quantizes its layer (`kvjax.quant.storage.quantize`; KIVI's newest tokens in its full-precision ring)."""
    bucket = gen.bucket_length(context)
    quant = gen.resolve_kv_dtype(kv_dtype, model.config.head_dim)
    capacity = gen.cache_capacity(method, bucket, new, quantized=quant is not None)
    cache = gen.init_cache(method, model.config, batch, capacity, model.dtype, quant)
    lengths = np.full((batch,), context, np.int64)
    budget = per_example_budget(method, lengths)
    kept = int(budget[0])
    keys = jax.random.split(jax.random.key(seed), 2 * cache.num_layers + 1)

    fill = _layer_filler(kept, context, model.config.head_dim, jnp.dtype(model.dtype), quant)
    layers, shared = list(cache.layers), cache.shared
    del cache
    for i, layer in enumerate(layers):
        layers[i] = fill(layer, keys[2 * i], keys[2 * i + 1])
    cache = ModelCache(tuple(layers), shared)
    logits = jax.random.normal(keys[-1], (batch, model.config.vocab_size), jnp.float32)
    return gen.PrefillState(cache=cache, logits=logits, prompt_lengths=lengths, budget=jnp.asarray(budget),
                            method=method)


def largest_batch(model: Any, method: Any, context: int, new: int, fraction: float, cap: int,
                  kv_dtype: str | None = None) -> int:
    """The largest batch whose cache, beside the weights and the step's activations, fits in `fraction` of the
    device memory (at most `cap`)."""
    limit = device_bytes()
    if limit is None:
        return 1
    config = model.config
    capacity = gen.cache_capacity(method, gen.bucket_length(context), new, quantized=kv_dtype is not None)
    per_example = cache_bytes(method, config, 1, capacity, model.dtype, kv_dtype)
    # Per example: float32 logits (sampled twice over) and the layer activations of one token.
    per_example += 3 * config.vocab_size * 4 + 8 * (config.hidden_size + config.intermediate_size) * 4
    free = fraction * limit - sum(w.nbytes for w in jax.tree.leaves(model.weights())) - (1 << 30)
    return int(max(1, min(cap, free // per_example)))


def smaller_batch(batch: int) -> int:
    """The batch to try after `batch` ran out of memory: a tenth fewer rows (at least one). `largest_batch` sizes
    the cache from the memory it needs, so what it leaves out (the step's temporaries) is a small share; halving
    (as before) could report half the batch that fits, and KIVI-2's bar is a ratio of two such batches."""
    return max(1, batch - max(1, batch // 10))


def decode_row(model: Any, name: str, budget: int | None, context: int, batch: int, args: argparse.Namespace,
               bandwidth: float | None, prefill: bool, kv_dtype: str | None = None) -> dict[str, Any]:
    new = args.new_tokens
    method = kvm.get(name, **({} if name == "full" else bu.method_args(name, budget, context)))
    if not (method.decode_appends_only or caps.evicts_in_place(method)):
        raise ValueError(f"{name}: its decode state is not reproduced by a synthetic prefill (see the docstring)")
    before = peak_bytes()
    state = synthetic_state(model, method, batch, context, new, kv_dtype=kv_dtype)
    bu.block(state.cache)
    start = time.perf_counter()
    bu.block(gen.decode(model, state, max_new_tokens=new, stop_at_eos=False)[2])  # compile + one run
    first = time.perf_counter() - start
    # A second call, untimed in the step, its time and XLA compiles kept in the row: a recompile shows there (run 14,
    # H200: jax 0.11 compiled the loop again on its second call, fixed in `kvjax.ops._impl`), and the repeats
    # measure the steady state after it.
    times, compiles = [], []
    for _ in range(1 + args.repeats):
        state = synthetic_state(model, method, batch, context, new, kv_dtype=kv_dtype)
        bu.block(state.cache)
        with bu.CompileLog() as log:
            times += bu.time_call(lambda s=state: gen.decode(model, s, max_new_tokens=new, stop_at_eos=False)[2], 1)
        compiles.append(log)
    second, times = times[0], times[1:]
    step = bu.median(times) / (new - 1)
    moved = step_bytes(model, state.cache)
    row = dict(method=name, budget=None if name == "full" else budget, context=context, batch=batch,
               new_tokens=new, decode_first_s=first, decode_second_s=second,
               second_call_compiles=compiles[0].count, second_call_compile_s=compiles[0].seconds,
               repeat_compiles=sum(log.count for log in compiles[1:]), step_ms=step * 1e3,
               repeat_ms=[t * 1e3 / (new - 1) for t in times], tokens_per_s=batch / step,
               bytes_per_step=moved, tb_per_s=moved / step / 1e12, cache_bytes=state.cache.nbytes,
               cache_capacity=state.cache.capacity, **row_peak(before, peak_bytes()))
    if bandwidth:
        row["fraction_of_copy_bandwidth"] = moved / step / bandwidth
    if prefill:
        ids = np.random.default_rng(context).integers(0, model.config.vocab_size, (1, context))
        bu.block(gen.prefill(model, ids, method=method, max_new_tokens=new, kv_dtype=kv_dtype).cache)  # compile
        row["prefill_s"] = bu.median(bu.time_call(
            lambda: gen.prefill(model, ids, method=method, max_new_tokens=new, kv_dtype=kv_dtype).cache, 1))
    return row


def hf_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """transformers' `generate` (sdpa, DynamicCache) on the same shape with random bf16 weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = bu.model_config(args.model)
    hf = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                     intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                     num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                     head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                     rms_norm_eps=config.rms_norm_eps, attn_implementation="sdpa")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(hf).to(torch.bfloat16 if device == "cuda" else torch.float32).eval()
    rows = []
    for context in bu.csv_ints(args.contexts):
        for batch in sorted({1, *(bu.csv_ints(args.batches) if args.batches else [])}):
            ids = torch.randint(0, config.vocab_size, (batch, context), device=device)
            mask = torch.ones_like(ids)
            kw = dict(attention_mask=mask, pad_token_id=0, do_sample=False)
            with torch.no_grad():
                model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                model(ids[:, :context])
                if device == "cuda":
                    torch.cuda.synchronize()
                prefill = time.perf_counter() - start
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **kw)
                if device == "cuda":
                    torch.cuda.synchronize()
                total = time.perf_counter() - start
            step = (total - prefill) / (args.new_tokens - 1)
            rows.append(dict(method="transformers.generate", context=context, batch=batch, prefill_s=prefill,
                             step_ms=step * 1e3, tokens_per_s=batch / step))
            print(f"hf T={context} B={batch}: prefill {prefill:.2f} s, {batch / step:.1f} tok/s", flush=True)
    return rows


def plan(args: argparse.Namespace) -> list[tuple[int | None, int, bool, str, int | None]]:
    """(batch or None for the largest that fits, context, time a prefill, method, budget) per row."""
    rows = []
    if args.plan:
        for group in args.plan.split(";"):
            shape, _, names = group.strip().partition(":")
            prefill = shape.endswith("p")
            batch, _, context = shape.rstrip("p").rpartition("x")
            for item in bu.csv_strs(names):
                name, _, budget = item.partition("@")
                rows.append((None if batch == "max" else int(batch), int(context), prefill, name,
                             int(budget) if budget else None))
        return rows
    for context in bu.csv_ints(args.contexts):
        for name in bu.csv_strs(args.methods):
            for budget in ([None] if name == "full" else bu.csv_ints(args.budgets)):
                for batch in (bu.csv_ints(args.batches) if args.batches else [None]):
                    rows.append((batch, context, args.prefill, name, budget))
    return rows


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny model, short contexts, seconds.")
    p.add_argument("--model", default=None, help="Preset shape (llama-3.1-8b; smoke: tiny).")
    p.add_argument("--dtype", default=None, help="bfloat16 (accelerator) / float32 (CPU).")
    p.add_argument("--contexts", default=None, help="Comma list (8192,32768; smoke 64).")
    p.add_argument("--methods", default="full,snapkv,streaming_llm", help="Comma list (in-place decode methods).")
    p.add_argument("--budgets", default=None, help="Comma list of budgets of the compressing methods (1024,4096).")
    p.add_argument("--batches", default=None, help="Fixed batches instead of the largest that fits.")
    p.add_argument("--max_batch", type=int, default=1024)
    p.add_argument("--memory_fraction", type=float, default=0.9)
    p.add_argument("--new_tokens", type=int, default=None, help="Tokens per timed decode (32; smoke 4).")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prefill", action="store_true", help="Also time a real batch-1 prefill of each row.")
    p.add_argument("--plan", default=None, help="Row groups `BATCHxCONTEXT[p]:method[@budget],...;...` (BATCH may "
                   "be max; p: also time a batch-1 prefill); replaces --contexts / --methods / --budgets / --batches.")
    p.add_argument("--tuning", default="", help="kvjax.tuning fields for the whole run, e.g. "
                   "decode_dots_in_cache_dtype=true (comma list of name=value).")
    p.add_argument("--tunings", default=None, help="A/B in one process: `;`-separated --tuning values, each planned "
                   "row run under each in turn on the same weights (an empty value: the defaults); rows name theirs.")
    p.add_argument("--kv_dtypes", default="model", help="Comma list of cache storages (`kv_dtype=`: model, int8, "
                   "fp8, int4, kivi2, kivi4, ...; `:` options as in kvjax.quant), each planned row run under each; "
                   "rows name theirs.")
    p.add_argument("--hf", action="store_true", help="Only transformers' generate (its own process).")
    p.add_argument("--copy_mib", type=int, default=None)
    p.add_argument("--time_budget_s", type=float, default=1e9)
    args = p.parse_args(argv)
    args.quick = args.smoke  # bench_util.write's name for a smoke run
    args.model = args.model or ("tiny" if args.smoke else "llama-3.1-8b")
    args.dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    args.contexts = args.contexts or ("64" if args.smoke else "8192,32768")
    args.budgets = args.budgets or ("16" if args.smoke else "1024,4096")
    args.new_tokens = args.new_tokens or (4 if args.smoke else 32)
    config = bu.model_config(args.model)
    if args.hf:
        rows = hf_rows(args)
        bu.write(args.out, "throughput_hf", args, config, args.dtype, rows)
        return
    variants = args.tunings.split(";") if args.tunings is not None else [args.tuning]
    for text in variants:  # every variant checked (unknown fields, bad values) before the first compiles
        with tuning.override(**parse_tuning(text)):
            pass
    args.kv_dtypes = [None if d == "model" else d for d in bu.csv_strs(args.kv_dtypes)]
    for kv_dtype in args.kv_dtypes:
        gen.resolve_kv_dtype(kv_dtype, config.head_dim)  # a bad storage named before anything compiles
    run(args, config, [text.strip() for text in variants])


def parse_tuning(text: str) -> dict[str, Any]:
    """`name=value,...` -> overrides (true / false, ints, `auto_pallas=op+op` a set of op names and
    `auto_fused_quantized=int8+int4` one of storages, else strings)."""
    out: dict[str, Any] = {}
    for item in bu.csv_strs(text):
        name, _, value = item.partition("=")
        name, low = name.strip(), value.strip().lower()
        if name == "auto_pallas" or (name == "auto_fused_quantized" and low not in ("true", "false")):
            out[name] = frozenset(op for op in value.strip().split("+") if op)
            continue
        out[name] = (low == "true") if low in ("true", "false") else int(low) if low.isdigit() else value.strip()
    return out


def read_bandwidth(mib: int, passes: int = 20) -> float:
    """The device's read bandwidth in bytes/s: `passes` reductions of one buffer inside one jitted loop (each pass
    adds the loop's carry, so none is hoisted), which keeps the host's dispatch out of a sub-millisecond pass."""
    x = jnp.ones((mib << 18,), jnp.float32)

    @jax.jit
    def f(a: Any) -> Any:
        return jax.lax.fori_loop(0, passes, lambda i, c: c + jnp.sum(a + c), jnp.float32(0))

    bu.block(f(x))
    return passes * x.nbytes / bu.median(bu.time_call(lambda: f(x), 3))


def run(args: argparse.Namespace, config: Any, variants: list[str]) -> None:
    """The plan's rows in order, each under every tuning variant and storage in turn: an A/B cut short by the time
    budget keeps whole pairs (old and new of one shape), not every row of the first variant alone."""
    deadline = time.monotonic() + args.time_budget_s
    bandwidth = None if args.smoke else copy_bandwidth(args.copy_mib or 1024)
    read = None if args.smoke else read_bandwidth(args.copy_mib or 4096)
    if read:
        print(f"copy {bandwidth / 1e12:.2f} TB/s, read {read / 1e12:.2f} TB/s", flush=True)
    model = bu.random_model(config, args.dtype)
    rows: list[dict[str, Any]] = []
    for batch, context, prefill, name, budget in plan(args):
        if budget is not None and budget >= context:  # nothing to compress
            continue
        late = time.monotonic() > deadline  # checked per planned row: a row started runs under every variant
        for text in variants:
            for kv_dtype in args.kv_dtypes:
                if late:
                    rows.append(dict(method=name, budget=budget, context=context, batch=batch,
                                     kv_dtype=kv_dtype or "model", tuning=text, skipped="time budget"))
                    continue
                with tuning.override(**parse_tuning(text)):
                    run_row(args, model, rows, bandwidth, read, text, kv_dtype, batch, context, prefill, name, budget)
    bu.write(args.out, "throughput", args, config, args.dtype, rows, copy_bandwidth=bandwidth,
             read_bandwidth=read, device_bytes=device_bytes())


def run_row(args: argparse.Namespace, model: Any, rows: list[dict[str, Any]], bandwidth: float | None,
            read: float | None, variant: str, kv_dtype: str | None, batch: int | None, context: int, prefill: bool,
            name: str, budget: int | None) -> None:
    """One planned row under the tuning in force (`variant`, its text) and `kv_dtype`, appended to `rows` and
    written with them."""
    storage = kv_dtype or "model"
    auto = batch is None
    if auto:
        method = kvm.get(name, **({} if name == "full" else bu.method_args(name, budget, context)))
        batch = largest_batch(model, method, context, args.new_tokens, args.memory_fraction, args.max_batch,
                              kv_dtype)
    row, failed = None, None
    while row is None:
        try:
            row = decode_row(model, name, budget, context, batch, args, bandwidth, prefill, kv_dtype)
        except Exception as e:  # out of memory at a batch of our choosing: a little smaller, and try again
            if "RESOURCE_EXHAUSTED" in str(e) and batch > 1 and auto:
                failed, batch = batch, smaller_batch(batch)
                continue
            row = dict(method=name, budget=budget, context=context, batch=batch,
                       error=f"{type(e).__name__}: {str(e)[-800:]}")
    if failed is not None:
        row["out_of_memory_at"] = failed  # the largest batch lies between the row's and this
    # Against `full` at the same context, tuning, storage and way of choosing the batch (fixed, or the largest).
    full = next((r for r in rows if r["method"] == "full" and r["context"] == context and "tokens_per_s" in r
                 and r.get("tuning") == variant and r.get("auto_batch") == auto
                 and r.get("kv_dtype") == storage and (auto or r["batch"] == row["batch"])), None)
    row["auto_batch"] = auto
    row["tuning"] = variant
    row["kv_dtype"] = storage
    if read and "bytes_per_step" in row:
        row["fraction_of_read_bandwidth"] = row["bytes_per_step"] / (row["step_ms"] / 1e3) / read
    if full and "tokens_per_s" in row:
        row["throughput_vs_full"] = row["tokens_per_s"] / full["tokens_per_s"]
    rows.append(row)
    bu.write(args.out, "throughput", args, model.config, args.dtype, rows, copy_bandwidth=bandwidth,
             read_bandwidth=read, device_bytes=device_bytes())
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
