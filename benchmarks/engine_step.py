"""One decode step of the engine against one of `kvjax.generate`'s, on the same rows, greedy and sampled.

    python benchmarks/engine_step.py --out=/tmp/engine_step.json                # CPU: SmolLM2-135M's shape
    python benchmarks/engine_step.py --quick --out=/tmp/engine_step_smoke.json  # tiny model, seconds

`--rows` prompts of `--prompt` random tokens are prefilled once per path, then decoded `--new` tokens: by
`kvjax.decode` (one batch, no EOS) and by the engine (`--rows` slots, every request admitted in the first iteration,
`--steps` tokens per decode call). Reported per sampler setting (greedy; temperature 1 at `top_p` 1; temperature 1
at `top_p` 0.9): each path's decode seconds per step (median of `--repeats` runs after a warm-up run that compiles)
and the engine / generate ratio. A step is one token for every row; the engine's include its per-call bookkeeping.
"""

from __future__ import annotations

import sys
import time

import bench_util as bu
import jax
import numpy as np

import kvjax
from kvjax.engine import Engine, Request

SETTINGS = {"greedy": {}, "sampled": {"temperature": 1.0}, "nucleus": {"temperature": 1.0, "top_p": 0.9}}


def generate_step_s(model, prompts: list[list[int]], new: int, settings: dict) -> float:
    state = kvjax.prefill(model, prompts, method="full", max_new_tokens=new)
    jax.block_until_ready(state.logits)
    start = time.perf_counter()
    jax.block_until_ready(kvjax.decode(model, state, max_new_tokens=new, stop_at_eos=False, **settings))
    return (time.perf_counter() - start) / new


def engine_step_s(model, prompts: list[list[int]], new: int, steps: int, settings: dict) -> float:
    engine = Engine(model, method="full", max_prompt_tokens=max(map(len, prompts)), max_new_tokens=new,
                    slots=len(prompts), steps=steps, prefill_tokens=sys.maxsize, eos_token_id=(),
                    sampling=bool(settings))
    last: list = [None]
    requests = [Request(id=i, tokens=tuple(p), max_new_tokens=new, seed=i, **settings) for i, p in enumerate(prompts)]
    done = list(engine.run(requests, progress=lambda p: last.__setitem__(0, p)))
    assert sum(len(c.tokens) for c in done) == new * len(prompts)
    return last[0].decode_s / new


def run(argv: list[str]) -> dict:
    p = bu.parser(__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=None, help="Rows = slots (default 16; --quick 4).")
    p.add_argument("--prompt", type=int, default=None, help="Prompt tokens (default 1,000; --quick 40).")
    p.add_argument("--new", type=int, default=None, help="Tokens decoded (default 64; --quick 8).")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--settings", default=",".join(SETTINGS))
    args = p.parse_args(argv)
    if args.model is None and not args.quick:
        args.model = "smollm2-135m"
    name, dtype, repeats = bu.resolve_common(args)
    config = bu.model_config(name)
    model = bu.random_model(config, dtype)
    rows, prompt = args.rows or (4 if args.quick else 16), args.prompt or (40 if args.quick else 1000)
    new = args.new or (8 if args.quick else 64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, prompt).tolist() for _ in range(rows)]
    out = []
    for setting in bu.csv_strs(args.settings):
        settings = SETTINGS[setting]
        times = {"generate": [], "engine": []}
        for i in range(repeats + 1):  # the first run compiles
            g, e = generate_step_s(model, prompts, new, settings), engine_step_s(model, prompts, new, args.steps,
                                                                                  settings)
            if i:
                times["generate"].append(g)
                times["engine"].append(e)
        row = dict(setting=setting, **settings, rows=rows, prompt=prompt, new=new,
                   generate_step_s=bu.median(times["generate"]), engine_step_s=bu.median(times["engine"]))
        row["engine_over_generate"] = row["engine_step_s"] / row["generate_step_s"]
        out.append(row)
        print(row, flush=True)
    return bu.write(args.out, "engine_step", args, config, dtype, out, steps=args.steps, repeats=repeats)


if __name__ == "__main__":
    run(sys.argv[1:])
