"""The leaderboard's decode: each cell replayed from one shared recording, then decoded; ms / step vs `full`.

    cd benchmarks && python decode_replay.py --cells=full,snapkv:0.25,h2o:0.25,tova:0.25

A batch of random prompts is recorded once (`shared_prefill.record`, as `kvjax.eval`'s sweeps do); each
cell (`method`, `method:ratio` or `method:budget`) is replayed into its own cache and decodes
`--new_tokens` greedy tokens without stopping at EOS, `--repeats` times; the median wall time per step
after the first (compiling) call is reported beside `full`'s, which runs first in the same process.
"""

import argparse
import statistics
import time

import jax
import numpy as np

import kvjax
from kvjax import methods
from kvjax.runtime import shared_prefill


def method_of(cell: str) -> methods.Method:
    name, _, amount = cell.partition(":")
    if not amount:
        return methods.get(name)
    return methods.get(name, **({"compression_ratio": float(amount)} if "." in amount else {"budget": int(amount)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="A preset or model directory (kvjax.load_model).")
    p.add_argument("--context", type=int, default=2000, help="Prompt tokens (random ids).")
    p.add_argument("--batch", type=int, default=10, help="Prompts decoded together (the leaderboard's batch).")
    p.add_argument("--new_tokens", type=int, default=33, help="Tokens per timed decode.")
    p.add_argument("--repeats", type=int, default=3, help="Timed decodes per cell after the compiling one.")
    p.add_argument("--cells", default="full,snapkv:0.25,h2o:0.25,tova:0.25", help="Comma list of cells.")
    args = p.parse_args()
    cells = args.cells.split(",")
    if cells[0] != "full":
        cells = ["full", *[c for c in cells if c != "full"]]
    model = kvjax.load_model(args.model)
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, min(40000, model.config.vocab_size), (args.batch, args.context)).tolist()
    rec = shared_prefill.record(model, prompts, attention_lse=True)
    steps = args.new_tokens - 1  # the first token comes from the prefill's logits
    full_ms = None
    for cell in cells:
        method = method_of(cell)
        times = []
        for _ in range(args.repeats + 1):
            state = shared_prefill.prefill_from(model, rec, method, max_new_tokens=args.new_tokens)
            state.logits.block_until_ready()
            start = time.perf_counter()
            _, _, cache = kvjax.decode(model, state, max_new_tokens=args.new_tokens, stop_at_eos=False)
            jax.block_until_ready(cache)
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times[1:]) / steps
        full_ms = ms if full_ms is None else full_ms
        print(f"{cell:16s} slots {cache.capacity:5d}  {ms:7.1f} ms/step  {full_ms / ms:5.2f}x full", flush=True)


if __name__ == "__main__":
    main()
