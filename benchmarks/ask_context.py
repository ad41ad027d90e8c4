"""Compress a context once and ask it many questions, against `generate` of the context with each question.

    python benchmarks/ask_context.py --out=benchmarks/results/ask_context_smollm2.json
    python benchmarks/ask_context.py --quick --out=/tmp/ask_context.json

The model's shape is SmolLM2-135M's (`--quick`: the tiny shape) with random weights, unless `--model` names another.
One random context of `--context` tokens and `--questions` questions of 8-24 tokens, answers of `--new` tokens (EOS
off). For each method, warm (every program compiled by an untimed first round): the seconds of `generate` once per
question (each prefills and compresses the context again), of `compress_context` once, of `ask` with every question
in one batch, and of `save_context` / `load_context` through a file; the answers against `generate`'s, question by
question; the file's bytes against the compressed cache's and the `full` cache's of the same context and sizes.

Then the engine's prompt store (`Engine(prompt_store=DIR)`, `kvjax.run --prompt_store`): two contexts of that
length, a job of `--questions` requests alternating between them (so the held prompt pass never serves the next),
and a second job with other questions about them. Seconds of the second job without a store and with a store the
first job filled, the prompt passes each computed and read, and whether both give the same answers.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import bench_util as bu
import numpy as np

import kvjax
from kvjax.engine import Engine, Request
from kvjax.runtime.compile_cache import enable_compilation_cache


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _ready(context):
    """`context` once its arrays are computed (the prefill's programs run asynchronously)."""
    bu.block((context.cache, context.last_hidden))
    return context


def _round(model, name: str, args: dict, context: list[int], questions: list[list[int]], new: int,
           folder: str) -> dict:
    sizes = dict(max_new_tokens=new, max_question_tokens=max(len(q) for q in questions))
    generated, generate_s = _timed(lambda: [
        kvjax.generate(model, [context], method=name, method_args=args, question_ids=[q], max_new_tokens=new,
                       stop_at_eos=False).tokens for q in questions])
    compressed, compress_s = _timed(lambda: _ready(kvjax.compress_context(model, context, method=name,
                                                                           method_args=args, **sizes)))
    asked, ask_s = _timed(lambda: kvjax.ask(model, compressed, questions, stop_at_eos=False).tokens)
    path = os.path.join(folder, f"{name}.safetensors")
    _, save_s = _timed(lambda: kvjax.save_context(compressed, path, overwrite=True))
    loaded, load_s = _timed(lambda: kvjax.load_context(path, model))
    from_file = kvjax.ask(model, loaded, questions, stop_at_eos=False).tokens
    return dict(method=name, method_args=args, generate_s=generate_s, compress_s=compress_s, ask_s=ask_s,
                save_s=save_s, load_s=load_s, speedup=generate_s / (compress_s + ask_s),
                same_answers=int(sum(np.array_equal(a, g[0]) for a, g in zip(asked, generated, strict=True))),
                same_from_file=bool(np.array_equal(from_file, asked)), file_bytes=os.path.getsize(path),
                cache_bytes=compressed.nbytes)


def _job(contexts: list[list[int]], questions: list[list[int]], new: int, tag: str) -> list[Request]:
    return [Request(id=f"{tag}{i}", tokens=tuple(contexts[i % 2]), question=tuple(q), max_new_tokens=new)
            for i, q in enumerate(questions)]


def _engine_job(model, name: str, args: dict, requests: list[Request], new: int, store: str | None) -> tuple:
    """(seconds, {id: tokens}, prompt passes read, computed) of one job on a fresh engine."""
    engine = Engine(model, method=name, method_args=args, max_prompt_tokens=max(len(r.tokens) for r in requests),
                    max_question_tokens=24, max_new_tokens=new, slots=4, prompt_store=store)
    start = time.perf_counter()
    answers = {c.id: c.tokens for c in engine.run(requests)}
    took = time.perf_counter() - start
    return took, answers, *((engine.store.read, engine.store.written) if store else (0, 0))


def _store_round(model, name: str, args: dict, contexts, first, second, new: int, folder: str) -> dict:
    store = os.path.join(folder, f"store-{name}")
    _engine_job(model, name, args, _job(contexts, first, new, "w"), new, None)  # compiles every program
    plain_s, plain, _, _ = _engine_job(model, name, args, _job(contexts, second, new, "b"), new, None)
    fill_s, _, _, written = _engine_job(model, name, args, _job(contexts, first, new, "a"), new, store)
    stored_s, stored, read, computed = _engine_job(model, name, args, _job(contexts, second, new, "b"), new, store)
    return dict(method=name, method_args=args, second_job_s=plain_s, first_job_with_store_s=fill_s,
                second_job_with_store_s=stored_s, store_speedup=plain_s / stored_s, passes_written=written,
                passes_read=read, passes_computed=computed, same_answers=stored == plain)


def run(argv: list[str] | None = None) -> dict:
    enable_compilation_cache("off")
    p = bu.parser(__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=None, help="Context tokens (default 2000; quick 100).")
    p.add_argument("--questions", type=int, default=None, help="Questions asked (default 8; quick 3).")
    p.add_argument("--new", type=int, default=None, help="Answer tokens (default 32; quick 4).")
    p.add_argument("--methods", default="snapkv,kvzip", help="Query-agnostic methods at compression ratio 0.75.")
    p.add_argument("--parts", default="ask,store",
                   help="ask: compress_context / ask; store: the engine's prompt store.")
    args = p.parse_args(argv)
    args.model = args.model or (None if args.quick else "smollm2-135m")
    model_name, dtype, _ = bu.resolve_common(args)
    config = bu.tiny_config() if model_name == "tiny" else bu.model_config(model_name)
    model = bu.random_model(config, dtype)
    context_len = args.context or (100 if args.quick else 2000)
    count, new = args.questions or (3 if args.quick else 8), args.new or (4 if args.quick else 32)
    rng = np.random.default_rng(0)
    context = rng.integers(3, config.vocab_size, context_len).tolist()
    questions = [rng.integers(3, config.vocab_size, int(n)).tolist() for n in rng.integers(8, 25, count)]
    full = kvjax.compress_context(model, context, method="full", max_new_tokens=new,
                                  max_question_tokens=max(len(q) for q in questions)).nbytes
    parts = bu.csv_strs(args.parts)
    rows, store_rows = [], []
    with tempfile.TemporaryDirectory() as folder:
        for name in bu.csv_strs(args.methods) if "ask" in parts else []:
            method_args = {"compression_ratio": 0.75}
            _round(model, name, method_args, context, questions, new, folder)  # compiles every program
            row = _round(model, name, method_args, context, questions, new, folder)
            row.update(full_cache_bytes=full, file_vs_full=row["file_bytes"] / full)
            rows.append(row)
            print(f"{name:8s} generate x{count} {row['generate_s']:6.2f} s  compress {row['compress_s']:5.2f} s + ask "
                  f"{row['ask_s']:5.2f} s  ({row['speedup']:.2f}x)  same answers {row['same_answers']}/{count}  "
                  f"file {row['file_bytes'] / 1e6:.2f} MB ({row['file_vs_full']:.3f} of full's {full / 1e6:.2f} MB)  "
                  f"save {row['save_s']:.2f} s  load {row['load_s']:.2f} s", flush=True)
        contexts = [context, rng.integers(3, config.vocab_size, context_len).tolist()]
        second = [rng.integers(3, config.vocab_size, int(n)).tolist() for n in rng.integers(8, 25, count)]
        for name in bu.csv_strs(args.methods) if "store" in parts else []:
            row = _store_round(model, name, {"compression_ratio": 0.75}, contexts, questions, second, new, folder)
            store_rows.append(row)
            print(f"{name:8s} engine, second job of {count}: no store {row['second_job_s']:6.2f} s, store "
                  f"{row['second_job_with_store_s']:6.2f} s ({row['store_speedup']:.2f}x; {row['passes_read']} "
                  f"passes read, {row['passes_computed']} computed; the first job wrote {row['passes_written']})  "
                  f"same answers {row['same_answers']}", flush=True)
    return bu.write(args.out, "ask_context", args, config, dtype, rows, store_rows=store_rows, context=context_len,
                    questions=count, max_new_tokens=new)


if __name__ == "__main__":
    run(sys.argv[1:])
