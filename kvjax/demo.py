"""`python -m kvjax.demo`: a short generation demo with compressed caches on a random tiny model.

Prints, per method and budget, the cache memory, decode throughput and the share of generated tokens
equal to the full cache's. The weights are random, so that share is not accuracy: a random model's
greedy path changes with any perturbation. The evaluation CLI (`python -m kvjax.eval`) measures task
accuracy on a trained model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvjax import methods
from kvjax.cli.refuse import ArgumentParser
from kvjax.models.config import ModelConfig, RopeConfig
from kvjax.models.model import DecoderLM
from kvjax.runtime.generate import generate


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the demo; `--help` describes it and runs nothing (it takes no other argument)."""
    ArgumentParser(prog="python -m kvjax.demo", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                   epilog=__doc__.split("\n\n", 1)[1]).parse_args(argv)
    config = ModelConfig(
        model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=4,
        num_heads=8, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0),
        max_position_embeddings=8192, eos_token_ids=(),
    )
    model = DecoderLM.random(config, seed=0, scale=0.3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (1000, 700)]
    new = 32
    shown = ("streaming_llm", "snapkv", "h2o", "lagkv", "sagekv", "ahakv")
    runs = [("full", {})] + [(name, {"budget": b}) for name in shown if name in methods.available() for b in (64, 256)]
    runs.append(("actqkv", {}))  # retrieval: its budget is tokens attended per step; defaults keep 64 + 512 + blocks
    print(f"{'method':<16}{'budget':>8}{'cache KiB':>12}{'tok/s':>10}{'same as full':>14}")
    reference = None
    for name, args in runs:
        try:
            generate(model, prompts, method=name, method_args=args, max_new_tokens=new)  # compile
        except Exception as e:  # a method that needs hyperparameters this demo does not set
            print(f"{name:<16}{args.get('budget', '-'):>8}  skipped: {e}")
            continue
        start = time.perf_counter()
        out = generate(model, prompts, method=name, method_args=args, max_new_tokens=new, return_cache=True)
        seconds = time.perf_counter() - start
        if reference is None:
            reference = out.tokens
        agree = float(np.mean(out.tokens == reference))
        kib = out.cache.nbytes / 1024
        print(f"{name:<16}{args.get('budget', '-'):>8}{kib:>12.1f}{out.tokens.size / seconds:>10.1f}{agree:>14.1%}")


if __name__ == "__main__":
    main()
