"""Gemma 3 270M at a long context on the CPU: a `full` generation, its peak memory and its cache by layer kind.

    python benchmarks/gemma3_long_context.py --context_length=16384 --out=benchmarks/results/gemma3_long_context.json

The real model (`gemma3-270m`, `make gemma3`; converted on first use) reads a needle-in-a-haystack prompt of
`--context_length` tokens (filler sentences, one "special magic number" at half depth, the question last; no chat
template: the file carries none) and generates `--max_new_tokens` tokens greedily with the full cache. Recorded: the
prefill and decode times (wall, compile included, and the process's CPU seconds), the peak resident memory of the
process (`ru_maxrss`: weights, cache, activations, compiled programs), and the cache's bytes by layer kind: Gemma's
five sliding-window layers per global one each hold a ring of the window (512 tokens) while a global layer holds the
whole sequence, so the rings are the saving the windows give before any compression method acts (a method compresses
the global layers only). `all_global` is what the same cache would take with every layer global.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import resource
import sys
import time

import numpy as np

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
NEEDLE = "The special magic number is 7382915. "
QUESTION = "\nWhat is the special magic number mentioned in the text above? The special magic number is"
ANSWER = "7382915"


def prompt_ids(tok, length: int) -> list[int]:
    """`length` tokens: BOS, filler with the needle at half depth, the question last."""
    question = tok(QUESTION, add_special_tokens=False).input_ids
    needle = tok(NEEDLE, add_special_tokens=False).input_ids
    filler = tok(FILLER, add_special_tokens=False).input_ids
    room = length - 1 - len(question) - len(needle)
    body = (filler * (room // len(filler) + 1))[:room]
    half = room // 2
    return [tok.bos_token_id, *body[:half], *needle, *body[half:], *question]


def cache_bytes(config, cache) -> dict[str, int]:
    rings = sum(layer.nbytes for layer, w in zip(cache.layers, config.layer_windows, strict=True) if w is not None)
    globals_ = [layer.nbytes for layer, w in zip(cache.layers, config.layer_windows, strict=True) if w is None]
    return {"ring_layers": rings, "global_layers": sum(globals_), "total": cache.nbytes,
            "all_global": max(globals_) * config.num_layers, "rings": len(config.layer_windows) - len(globals_),
            "globals": len(globals_)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context_length", type=int, default=16384)
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--out", default=None, help="write the record as JSON here")
    args = p.parse_args(argv)

    import jax

    import kvjax
    from kvjax.runtime.generate import decode, prefill

    t0, c0 = time.perf_counter(), time.process_time()
    tok = kvjax.load_tokenizer(args.model)
    model = kvjax.load_model(args.model)
    load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ids = prompt_ids(tok, args.context_length)
    assert len(ids) == args.context_length

    t0, c0 = time.perf_counter(), time.process_time()
    state = prefill(model, [ids], method="full", max_new_tokens=args.max_new_tokens)
    jax.block_until_ready(state.cache)
    prefill_s, prefill_cpu = time.perf_counter() - t0, time.process_time() - c0
    by_kind = cache_bytes(model.config, state.cache)
    t0, c0 = time.perf_counter(), time.process_time()
    tokens, counts, _ = decode(model, state, max_new_tokens=args.max_new_tokens)
    decode_s, decode_cpu = time.perf_counter() - t0, time.process_time() - c0
    text = tok.decode(np.asarray(tokens)[0][: int(np.asarray(counts)[0])], skip_special_tokens=True)
    record = {
        "model": args.model, "context_length": args.context_length, "max_new_tokens": args.max_new_tokens,
        "generated": text, "answer_found": ANSWER in text,
        "load_s": round(load_s, 1), "prefill_s_with_compile": round(prefill_s, 1),
        "decode_s_with_compile": round(decode_s, 1), "generated_tokens": int(np.asarray(counts)[0]),
        # CPU seconds of the process (all its threads): what the phases cost on a machine shared with other jobs
        "load_cpu_s": round(load_cpu, 1), "prefill_cpu_s": round(prefill_cpu, 1), "decode_cpu_s": round(decode_cpu, 1),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_load_bytes": rss_loaded, "cache_bytes": by_kind, "dtype": str(model.dtype),
        "machine": f"{platform.machine()}, {platform.processor() or ''} {__import__('os').cpu_count()} CPUs".strip(),
        "jax": jax.__version__, "backend": jax.default_backend(),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
