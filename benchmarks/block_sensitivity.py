"""How much of `block`'s kept set moves with float rounding alone? kvjax against itself, nothing else changed.

    python benchmarks/block_sensitivity.py --model=smollm2-135m --context_length=2048 --samples=8 \
        --perturb=ulp --ulp_bits=23,17,13 --out=benchmarks/results/block_sensitivity_2k_s8.json

Each method runs on the same prompts (the RULER niah_single_1 contexts that `benchmarks/kvpress_agreement.py`
compresses) as is, then perturbed at the level of float rounding, a row each: `--perturb=block_k`, `window_scores`'
key blocks of 64 instead of 1024 (`kvjax.tuning.override(window_block_k=64)`: only the order in which each
softmax's terms are summed); `--perturb=ulp`, every prefill query the method reads times `1 + 2^-bits u`, `u`
uniform in [-1, 1) (seeded), for each of `--ulp_bits` (23: one float32 ulp; 13: about 1e-4, float32's error in a RoPE
angle near 2,000 radians). Two libraries that each compute the model's forward round queries and keys differently by
about such amounts. The kept positions are compared as the agreement script compares kvjax's and kvpress's (mean
Jaccard per layer and head, identical heads): what agreement float rounding alone leaves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import bench_util as bu
from kvpress_agreement import jaccard, kvjax_kept

#: name: (method, hyperparameters)
METHODS = {
    **{f"block{size}_snapkv_0.5": ("block", dict(compression_ratio=0.5, block_size=size, base="snapkv",
                                                 base_args=dict(window_size=64), query_rope="kvpress"))
       for size in (2048, 512, 160, 128)},
    "block128_knorm_0.5": ("block", dict(compression_ratio=0.5, block_size=128, base="knorm")),
    "snapkv_0.5": ("snapkv", dict(compression_ratio=0.5, window_size=64)),
}


def perturbed(method, bits: int = 23):
    """`method` (an instance) whose prefill reads each query component times `1 + 2^-bits u` (`bits` 23: up to one
    float32 ulp)."""
    import jax
    import jax.numpy as jnp

    base = type(method)

    @dataclasses.dataclass(frozen=True)
    class Perturbed(base):
        def prefill(self, cache, q, step):
            u = jax.random.uniform(jax.random.key(0), q.shape, jnp.float32, -1.0, 1.0)
            return base.prefill(self, cache, (q.astype(jnp.float32) * (1.0 + 2.0**-bits * u)).astype(q.dtype), step)

    Perturbed.__name__ = Perturbed.__qualname__ = f"Perturbed{base.__name__}"
    return Perturbed(**{f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="ruler/niah_single_1")
    p.add_argument("--context_length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--perturb", default="block_k", choices=("block_k", "ulp"))
    p.add_argument("--ulp_bits", default="23",
                   help="--perturb=ulp: comma-separated relative sizes 2^-bits (23: one ulp), a row each")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    names = [m for m in args.methods.split(",") if m]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        p.error(f"unknown --methods {unknown}; choose from {list(METHODS)}")

    import jax

    import kvjax
    from kvjax import methods, tuning
    from kvjax.eval.runner import PromptEncoder
    from kvjax.models.tokenizer import load_tokenizer
    from kvjax.tasks import get

    tokenizer = load_tokenizer(args.model)
    encoder = PromptEncoder(tokenizer, "auto")
    task = get(args.task, tokenizer=tokenizer)
    samples = task.samples(count_tokens=encoder.count_tokens, context_length=args.context_length,
                           num_samples=args.samples, seed=0)
    contexts = [encoder.encode(task, s, query_aware=False)[0] for s in samples]
    model = kvjax.load_model(args.model)
    rows = []
    for name in names:
        method, method_args = METHODS[name]
        jax.clear_caches()  # each pass traces its programs under its own tuning
        plain = [kvjax_kept(model, ctx, method, method_args) for ctx in contexts]
        runs = [int(b) for b in args.ulp_bits.split(",")] if args.perturb == "ulp" else [None]
        for bits in runs:
            jax.clear_caches()
            if bits is not None:
                moved = perturbed(methods.get(method, **method_args), bits)
                other = [kvjax_kept(model, ctx, moved, {}) for ctx in contexts]
            else:
                with tuning.override(window_block_k=64):
                    other = [kvjax_kept(model, ctx, method, method_args) for ctx in contexts]
            row = dict(method=name, ulp_bits=bits, kept=jaccard(plain, other))
            rows.append(row)
            what = f"2^-{bits}" if bits is not None else "block_k 64"
            print(f"{name:>22} ({what}): mean Jaccard {row['kept']['mean']:.4f} (lowest layer "
                  f"{row['kept']['min_layer']:.4f}), identical heads {row['kept']['identical_heads']}/"
                  f"{row['kept']['heads']}", flush=True)
    result = dict(benchmark="block_sensitivity", machine=bu.machine(), model=args.model, task=args.task,
                  context_length=args.context_length, samples=args.samples, perturb=args.perturb, rows=rows)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
