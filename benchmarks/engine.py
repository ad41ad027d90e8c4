"""Continuous batching (`kvjax.engine`) against static batching on two seeded workloads (issue 56).

    python benchmarks/engine.py --out=/tmp/engine_cpu.json                       # CPU: SmolLM2-135M's shape
    python benchmarks/engine.py --gpu --out=$OUT/engine_gpu.json                 # GPU: Llama-3.1-8B's shape, bf16
    python benchmarks/engine.py --smoke --out=/tmp/engine_smoke.json             # tiny model, seconds

Workloads (seeded; prompts of random ids, no EOS: every request generates exactly its answer length):
* `long_generations`: short prompts, answers of widely varying length (log-uniform: many short, a long tail), run
  with the full cache and with compression during decode (the `decoding` wrapper over SnapKV: the prompt compressed
  to `--budget`, then back to it every `--interval` generated tokens). CPU: 64 requests, prompts 128-512, answers
  16-2,048. GPU: answers 16-16,384; also with int8 storage.
* `long_prompts`: long prompts, short answers (uniform). CPU: 64 requests, prompts 512-4,096, answers 8-64. GPU:
  prompts 4,096-32,768, answers 16-512.
* `rollouts`: an RL rollout's shape, several sampled answers (temperature 1) to each prompt. CPU: 8 prompts of
  512-1,024 tokens, 8 samples each, answers 32-64 (one length per prompt). GPU: 32 prompts of 4,096-16,384, 8
  samples, answers 256-2,048. Paths: the engine with `samples=8` (one prefill per prompt, its cache copied into 8
  slots); `separate`: the engine with each sample its own request (8 prefills per prompt; the same draws, so the
  same tokens, which the run checks); static batching of the prompts' copies.
* `shared_contexts`: several questions about each context (a document QA job), a context's questions listed
  together, the question fed after the compressed context. CPU: 8 contexts of 1,024-2,048 tokens, 4 questions of
  16-48 tokens each, answers 8-32. GPU: 16 contexts of 16,384-32,768, 8 questions of 32-128, answers 32-256. Paths:
  the engine (a context's questions share its prompt pass); `unshared`: the engine with `share_prompts=False`
  (the same tokens, which the run checks); static batching (every request its own context pass).

Both paths run in this process on the same requests with the same slot count: the engine (`--slots` slots, `--steps`
tokens per decode call, every free slot filled before each call; path `bounded`: at most the longest bucket's
prompt tokens prefilled per call, the engine's default before), and static batching: `kvjax.generate` in batches of
`--slots` requests sorted by prompt length, each batch generating its longest answer (the tokens past a request's own
length are not counted). Reported per (workload, method, path): generated tokens/s (the requests' own answer tokens over
the wall time), requests/s, the prefill and decode shares of the time, the seconds spent compiling (traced, lowered
and compiled programs, from JAX's compile log) and the same rates without them, the cache bytes the path allocates
and the process's peak memory (host RSS on CPU, device peak on GPU); then the engine / static ratio of each.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import resource
import sys
import time
from typing import Any

import bench_util as bu
import jax
import numpy as np

import kvjax
from kvjax import methods as kvm
from kvjax.engine import Engine, Request


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    requests: int
    prompts: tuple[int, int]
    answers: tuple[int, int]
    answer_law: str  # "log_uniform" (skewed) or "uniform"
    samples: int = 1  # sampled answers per prompt (temperature 1); 1: one greedy answer
    questions: int = 1  # requests per context, each with its own question (`requests` contexts x `questions`)
    question_tokens: tuple[int, int] = (0, 0)

    def draw(self, vocab: int, seed: int) -> list[Request]:
        rng = np.random.default_rng(seed)
        if self.questions > 1:
            return self._questions(rng, vocab)
        prompts = rng.integers(self.prompts[0], self.prompts[1] + 1, self.requests)
        lo, hi = self.answers
        if self.answer_law == "log_uniform":
            answers = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), self.requests)).astype(int).clip(lo, hi)
        else:
            answers = rng.integers(lo, hi + 1, self.requests)
        sampling = dict(samples=self.samples, temperature=1.0) if self.samples > 1 else {}
        return [Request(id=i, tokens=tuple(rng.integers(0, vocab, int(p)).tolist()), max_new_tokens=int(a), seed=i,
                        **sampling) for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]


    def _questions(self, rng: np.random.Generator, vocab: int) -> list[Request]:
        out = []
        for c in range(self.requests):
            context = tuple(rng.integers(0, vocab, int(rng.integers(self.prompts[0], self.prompts[1] + 1))).tolist())
            for q in range(self.questions):
                question = rng.integers(0, vocab, int(rng.integers(*self.question_tokens) + 1)).tolist()
                out.append(Request(id=(c, q), tokens=context, question=tuple(question),
                                   max_new_tokens=int(rng.integers(self.answers[0], self.answers[1] + 1))))
        return out


def separate(requests: list[Request]) -> list[Request]:
    """Each sample of each request as a request of its own (its own prefill), drawing what it draws there."""
    return [dataclasses.replace(r, id=(r.id, s), samples=(s,)) for r in requests for s in r.sample_indices]


WORKLOADS = {
    "cpu": {"long_generations": Workload("long_generations", 64, (128, 512), (16, 2048), "log_uniform"),
            "long_prompts": Workload("long_prompts", 64, (512, 4096), (8, 64), "uniform"),
            "rollouts": Workload("rollouts", 8, (512, 1024), (32, 64), "uniform", samples=8),
            "shared_contexts": Workload("shared_contexts", 8, (1024, 2048), (8, 32), "uniform", questions=4,
                                        question_tokens=(16, 48))},
    "gpu": {"long_generations": Workload("long_generations", 256, (512, 2048), (16, 16384), "log_uniform"),
            "long_prompts": Workload("long_prompts", 256, (4096, 32768), (16, 512), "uniform"),
            "rollouts": Workload("rollouts", 32, (4096, 16384), (256, 2048), "uniform", samples=8),
            "shared_contexts": Workload("shared_contexts", 16, (16384, 32768), (32, 256), "uniform", questions=8,
                                        question_tokens=(32, 128))},
    "smoke": {"long_generations": Workload("long_generations", 8, (16, 48), (2, 40), "log_uniform"),
              "long_prompts": Workload("long_prompts", 6, (64, 200), (2, 6), "uniform"),
              "rollouts": Workload("rollouts", 3, (40, 100), (3, 8), "uniform", samples=3),
              "shared_contexts": Workload("shared_contexts", 2, (64, 120), (2, 5), "uniform", questions=3,
                                          question_tokens=(4, 8))},
}


class CompileClock(logging.Handler):
    """Sums the seconds JAX logs for tracing, lowering and compiling programs (under `jax.log_compiles`)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0
        self.programs = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Finished ") and message.endswith(" sec"):
            self.seconds += float(message.split()[-2])
            self.programs += message.startswith("Finished XLA compilation")


@contextlib.contextmanager
def compile_clock():
    clock = CompileClock()
    logger = logging.getLogger("jax")
    logger.addHandler(clock)
    try:
        with jax.log_compiles(True):
            yield clock
    finally:
        logger.removeHandler(clock)


def peak_memory() -> int:
    """The device's peak bytes where it reports them, else this process's peak resident set (bytes)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def method_of(name: str, budget: int, interval: int) -> Any:
    if name == "full":
        return kvm.get("full")
    if name == "decoding":
        return kvm.get("decoding", base="snapkv", base_args={"window_size": min(32, budget // 4)}, budget=budget,
                       target_size=budget, compression_interval=interval, query_buffer_size=min(64, interval))
    return kvm.get(name, **bu.method_args(name, budget, 0))


def _row(path: str, tokens: int, requests: int, wall: float, prefill: float, clock: CompileClock, cache: int,
         peak: int) -> dict:
    steady = max(wall - clock.seconds, 1e-9)
    return dict(path=path, requests=requests, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                requests_per_s=requests / wall, prefill_share=prefill / wall, decode_share=1.0 - prefill / wall,
                compile_s=clock.seconds, programs=clock.programs, steady_tokens_per_s=tokens / steady,
                steady_requests_per_s=requests / steady, cache_bytes=cache, peak_bytes=peak)


def run_engine(model: Any, method: Any, kv_dtype: str | None, requests: list[Request], slots: int,
               steps: int, path: str = "engine", answers: dict | None = None) -> dict:
    """The engine's row; `answers` (if given) collects each answer's tokens by (id, sample). Path `bounded`: the
    engine with `prefill_tokens` at the slots' longest bucket (its default until every free slot was filled)."""
    settings = dict(method=method, max_prompt_tokens=max(len(r.tokens) for r in requests),
                    max_question_tokens=max(len(r.question) for r in requests),
                    max_new_tokens=max(r.max_new_tokens for r in requests), slots=slots, steps=steps,
                    kv_dtype=kv_dtype, sampling=any(r.temperature > 0 for r in requests),
                    share_prompts=path != "unshared")
    bound = Engine(model, **settings).layout.bucket if path == "bounded" else None
    with compile_clock() as clock:
        start = time.perf_counter()
        engine = Engine(model, prefill_tokens=bound, **settings)
        calls: list[Any] = []
        done = list(engine.run(requests, progress=calls.append))
        wall = time.perf_counter() - start
    tokens = sum(len(c.tokens) for c in done)
    assert tokens == sum(r.max_new_tokens * r.sample_count for r in requests)
    if answers is not None:
        for c in done:
            answers[c.id if path == "separate" else (c.id, c.sample or 0)] = c.tokens  # separate's: (id, sample)
    row = _row(path, tokens, len(done), wall, calls[-1].prefill_s, clock,
               engine.layout.slot_bytes() * engine.slots, peak_memory())
    # Of the row-steps the decode calls ran (every slot, `steps` each), those that produced a request's token.
    row.update(decode_calls=len(calls), useful_row_steps=tokens / (len(calls) * slots * steps))
    return row


def run_static(model: Any, method: Any, kv_dtype: str | None, requests: list[Request], batch: int) -> dict:
    """Static batches of `batch` rows sorted by prompt length; a request of n samples is n rows (copies of its
    prompt, sampled at its temperature)."""
    ordered = sorted(separate(requests), key=lambda r: len(r.tokens))
    temperature = max(r.temperature for r in requests)
    prefill_s, cache = 0.0, 0
    with compile_clock() as clock:
        start = time.perf_counter()
        for i in range(0, len(ordered), batch):
            group = ordered[i : i + batch]
            new = max(r.max_new_tokens for r in group)
            t0 = time.perf_counter()
            questions = [list(r.question) for r in group] if any(r.question for r in group) else None
            state = kvjax.prefill(model, [list(r.tokens) for r in group], method=method, max_new_tokens=new,
                                  kv_dtype=kv_dtype, question_ids=questions)
            jax.block_until_ready(state.logits)
            prefill_s += time.perf_counter() - t0
            cache = max(cache, state.cache.nbytes)
            out, count, final = kvjax.decode(model, state, max_new_tokens=new, stop_at_eos=False,
                                             temperature=temperature, seed=i)
            jax.block_until_ready(final)
            del state, final
        wall = time.perf_counter() - start
    tokens = sum(r.max_new_tokens for r in ordered)  # a row's own answer; the rest of its batch's is waste
    return _row("static", tokens, len(ordered), wall, prefill_s, clock, cache, peak_memory())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", "--quick", dest="smoke", action="store_true",
                   help="Tiny model, tiny workloads (checks the plumbing).")
    p.add_argument("--gpu", action="store_true", help="Llama-3.1-8B's shape in bfloat16, the GPU workloads.")
    p.add_argument("--model", default=None, help="Shape preset (default: smollm2-135m; --gpu: llama-3.1-8b).")
    p.add_argument("--workloads", default="long_generations,long_prompts")
    p.add_argument("--methods", default=None, help="Default: full,decoding (--gpu: full,decoding,decoding:int8).")
    p.add_argument("--slots", type=int, default=None, help="Slots = static batch size (default 16; --gpu: 64).")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--budget", type=int, default=None, help="decoding's budget (default 256; --gpu: 1024).")
    p.add_argument("--interval", type=int, default=None, help="decoding's compression interval (default 64).")
    p.add_argument("--requests", type=int, default=None, help="Requests per workload (default: the workload's).")
    p.add_argument("--answers", default=None,
                   help="LO,HI: the answer lengths' range instead of the workload's (same law; a shorter run).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paths", default=None, help="engine, bounded, static, separate, unshared (default: "
                   "engine,static; for rollouts engine,separate,static; for shared_contexts engine,unshared,static).")
    p.add_argument("--time_budget_s", type=float, default=None,
                   help="Start no new (workload, method, path) row past this many seconds (rows written as they end).")
    args = p.parse_args(argv)
    scale = "smoke" if args.smoke else ("gpu" if args.gpu else "cpu")
    model_name = args.model or {"smoke": "tiny", "gpu": "llama-3.1-8b", "cpu": "smollm2-135m"}[scale]
    dtype = "bfloat16" if args.gpu else "float32"
    args.model, args.quick = model_name, args.smoke  # what bench_util.write records
    config = bu.model_config(model_name)
    model = bu.random_model(config, dtype)
    slots = args.slots or {"smoke": 4, "gpu": 64, "cpu": 16}[scale]
    budget = args.budget or {"smoke": 16, "gpu": 1024, "cpu": 256}[scale]
    interval = args.interval or {"smoke": 8, "gpu": 256, "cpu": 64}[scale]
    names = bu.csv_strs(args.methods or ("full,decoding,decoding:int8" if args.gpu else "full,decoding"))
    rows = []
    started = time.perf_counter()
    for workload_name in bu.csv_strs(args.workloads):
        workload = WORKLOADS[scale][workload_name]
        if args.requests:
            workload = dataclasses.replace(workload, requests=args.requests)
        if args.answers:
            lo, hi = (int(v) for v in bu.csv_strs(args.answers))
            workload = dataclasses.replace(workload, answers=(lo, hi))
        requests = workload.draw(config.vocab_size, args.seed)
        for spec in names:
            name, _, kv_dtype = spec.partition(":")
            method = method_of(name, budget, interval)
            answers: dict = {}
            paths = args.paths or ("engine,separate,static" if workload.samples > 1 else
                                   "engine,unshared,static" if workload.questions > 1 else "engine,static")
            for path in bu.csv_strs(paths):
                if args.time_budget_s is not None and time.perf_counter() - started > args.time_budget_s:
                    print(f"time budget spent: {workload_name} {spec} {path} not run", flush=True)
                    continue
                if path == "static":
                    row = run_static(model, method, kv_dtype or None, requests, slots)
                else:
                    shared = dict(answers) if answers else None
                    answers.clear()
                    row = run_engine(model, method, kv_dtype or None, separate(requests) if path == "separate"
                                     else requests, slots, args.steps, path, answers)
                    if shared is not None:  # the same tokens whatever the schedule, or one prefill per sample
                        row["same_tokens"] = shared == answers
                row.update(workload=workload_name, method=spec, slots=slots,
                           workload_spec=dataclasses.asdict(workload))
                rows.append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                       if k != "workload_spec"}, flush=True)
                bu.write(args.out, "engine", args, config, dtype, rows, ratios=_ratios(rows), cpus=os.cpu_count(),
                         affinity=len(os.sched_getaffinity(0)), load=os.getloadavg(), budget=budget,
                         interval=interval, steps=args.steps)
    result = bu.write(args.out, "engine", args, config, dtype, rows, ratios=_ratios(rows), cpus=os.cpu_count(),
                      affinity=len(os.sched_getaffinity(0)), load=os.getloadavg(), budget=budget, interval=interval,
                      steps=args.steps)
    for r in result["ratios"]:
        print(r, flush=True)
    return result


def _ratios(rows: list[dict]) -> list[dict]:
    """Engine / static (and engine / separate, engine / bounded where run) per (workload, method), on wall time and
    without compile time."""
    out = []
    for row in rows:
        if row["path"] != "engine":
            continue
        for other in ("static", "separate", "bounded", "unshared"):
            rivals = [r for r in rows if r["path"] == other and (r["workload"], r["method"]) ==
                      (row["workload"], row["method"])]
            if rivals:
                s = rivals[0]
                out.append(dict(workload=row["workload"], method=row["method"], against=other,
                                tokens_per_s=row["tokens_per_s"] / s["tokens_per_s"],
                                steady_tokens_per_s=row["steady_tokens_per_s"] / s["steady_tokens_per_s"]))
    return out


def run(argv: list[str]) -> dict:
    """The smoke-test entry point (tests/test_benchmarks_smoke.py)."""
    return main(argv)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
