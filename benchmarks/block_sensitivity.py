"""How much of `block`'s kept set moves with float rounding alone? kvjax against itself, nothing else changed.

    python benchmarks/block_sensitivity.py --model=smollm2-135m --context_length=2048 --samples=8 \
        --out=benchmarks/results/block_sensitivity_2k_s8.json

Each method is run twice on the same prompts (the RULER niah_single_1 contexts that
`benchmarks/kvpress_agreement.py` compresses): once as is, once with `window_scores`' key blocks of 64 instead of
1024 (`kvjax.tuning.override(window_block_k=64)`), which changes only the order in which each softmax's terms are
summed. The kept positions of the two runs are compared as the agreement script compares kvjax's and kvpress's
(mean Jaccard per layer and head, identical heads): what agreement float rounding alone leaves.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="ruler/niah_single_1")
    p.add_argument("--context_length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    names = [m for m in args.methods.split(",") if m]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        p.error(f"unknown --methods {unknown}; choose from {list(METHODS)}")

    import jax

    import kvjax
    from kvjax import tuning
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
        jax.clear_caches()
        with tuning.override(window_block_k=64):
            regrouped = [kvjax_kept(model, ctx, method, method_args) for ctx in contexts]
        row = dict(method=name, kept=jaccard(plain, regrouped))
        rows.append(row)
        print(f"{name:>22}: mean Jaccard {row['kept']['mean']:.4f} (lowest layer {row['kept']['min_layer']:.4f}), "
              f"identical heads {row['kept']['identical_heads']}/{row['kept']['heads']}", flush=True)
    result = dict(benchmark="block_sensitivity", machine=bu.machine(), model=args.model, task=args.task,
                  context_length=args.context_length, samples=args.samples, rows=rows)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
