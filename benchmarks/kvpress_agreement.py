"""Do kvjax and NVIDIA kvpress evict alike on a real model? Same prompts, same ids, answers compared.

    python benchmarks/kvpress_agreement.py --model=smollm2-135m --task=ruler/niah_single_1 \
        --context_length=2048 --samples=8 --out=benchmarks/results/kvpress_agreement.json

Builds `--samples` prompts of `--task` with kvjax's prompt encoder (the chat template where the tokenizer
has one; the question is fed after compression, kvpress's query-agnostic setting, or with `--query_aware`
compressed with the context, as in kvpress's query-aware runs), then generates
`--new_tokens` greedy tokens per prompt and method with kvjax and with kvpress (run by `--kvpress_python`, a
virtual environment with kvpress, torch and transformers < 5.3: see benchmarks/README.md) from the same
model directory. Prints, per method, the samples each library answers right (the task's own metric on the
text) and how many generations are token for token the same. Methods: kvpress's defaults, given to kvjax
by its own names. (kvpress 0.5.5's PyramidKVPress is left out: its layers of different lengths break the
attention mask of the question's multi-token forward in transformers 5.2.)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import bench_util as bu

# name: (kvpress press, its arguments, kvjax method, its arguments)
METHODS = {
    "full": (None, {}, "full", {}),
    "snapkv_0.25": ("SnapKVPress", dict(compression_ratio=0.25, window_size=64, kernel_size=5),
                    "snapkv", dict(compression_ratio=0.25, window_size=64, kernel_size=5)),
    "snapkv_0.5": ("SnapKVPress", dict(compression_ratio=0.5, window_size=64, kernel_size=5),
                   "snapkv", dict(compression_ratio=0.5, window_size=64, kernel_size=5)),
    # kvjax's SnapKV default window (32, the paper's) in place of kvpress's 64
    "snapkv_w32_0.25": ("SnapKVPress", dict(compression_ratio=0.25, window_size=32, kernel_size=5),
                        "snapkv", dict(compression_ratio=0.25, window_size=32, kernel_size=5)),
    "snapkv_w32_0.5": ("SnapKVPress", dict(compression_ratio=0.5, window_size=32, kernel_size=5),
                       "snapkv", dict(compression_ratio=0.5, window_size=32, kernel_size=5)),
    "knorm_0.25": ("KnormPress", dict(compression_ratio=0.25), "knorm", dict(compression_ratio=0.25)),
    "streaming_llm_0.25": ("StreamingLLMPress", dict(compression_ratio=0.25, n_sink=4),
                           "streaming_llm", dict(compression_ratio=0.25, sink_size=4)),
    "streaming_llm_0.75": ("StreamingLLMPress", dict(compression_ratio=0.75, n_sink=4),
                           "streaming_llm", dict(compression_ratio=0.75, sink_size=4)),
    "lagkv_0.5": ("LagKVPress", dict(compression_ratio=0.5, n_sink=4, lag_size=128),
                  "lagkv", dict(compression_ratio=0.5, sink_size=4, lag_size=128)),
}

KVPRESS_SCRIPT = r"""
import json, sys, torch, kvpress
from transformers import AutoModelForCausalLM, DynamicCache
torch.set_num_threads(int(sys.argv[3]))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation="sdpa").eval()
job = json.load(open(sys.argv[2]))
out = {}
for name, (press_name, press_args) in job["methods"].items():
    press = getattr(kvpress, press_name)(**press_args) if press_name else None
    rows = []
    for s in job["samples"]:
        with torch.inference_mode():
            cache, n = DynamicCache(), len(s["ctx"])
            ctx = torch.tensor([s["ctx"]])
            if press is None:
                model(input_ids=ctx, past_key_values=cache, use_cache=True)
            else:
                with press(model):
                    model(input_ids=ctx, past_key_values=cache, use_cache=True)
            x = torch.tensor([s["q"]])  # the question, uncompressed, at its original positions
            pos = torch.arange(n, n + x.shape[1])[None]
            tokens = []
            for _ in range(job["new_tokens"]):
                logits = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True).logits
                x = logits[:, -1:].argmax(-1)
                tokens.append(int(x))
                pos = pos[:, -1:] + 1
        rows.append(tokens)
    out[name] = rows
    print(name, flush=True, file=sys.stderr)
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="kvjax preset or model directory")
    p.add_argument("--task", default="ruler/niah_single_1")
    p.add_argument("--context_length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--query_aware", action="store_true",
                   help="the question is part of the compressed prompt (kvpress's query-aware setting)")
    p.add_argument("--new_tokens", type=int, default=24)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--kvpress_python", default="/work/venvs/kvpress/bin/python")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the kvpress process")
    p.add_argument("--out", default=None, help="JSON results file")
    args = p.parse_args(argv)
    names = [m for m in args.methods.split(",") if m]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        p.error(f"unknown --methods {unknown}; choose from {list(METHODS)}")

    import kvjax
    from kvjax.eval.runner import PromptEncoder
    from kvjax.eval.tasks import get
    from kvjax.models.presets import resolve_model_dir
    from kvjax.models.tokenizer import load_tokenizer

    model_dir = str(resolve_model_dir(args.model))
    tokenizer = load_tokenizer(args.model)
    encoder = PromptEncoder(tokenizer, "auto")
    task = get(args.task, tokenizer=tokenizer)
    samples = task.samples(count_tokens=encoder.count_tokens, context_length=args.context_length,
                           num_samples=args.samples, seed=0)
    encoded = [encoder.encode(task, s, query_aware=args.query_aware) for s in samples]

    with tempfile.TemporaryDirectory() as tmp:
        job = pathlib.Path(tmp) / "job.json"
        job.write_text(json.dumps(dict(
            samples=[dict(ctx=c, q=q) for c, q in encoded], new_tokens=args.new_tokens,
            methods={m: METHODS[m][:2] for m in names},
        )))
        env = dict(os.environ, PYTHONPATH="")
        proc = subprocess.run([args.kvpress_python, "-c", KVPRESS_SCRIPT, model_dir, str(job), str(args.threads)],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            sys.exit(f"kvpress worker failed:\n{proc.stderr[-3000:]}")
        theirs = json.loads(proc.stdout.strip().splitlines()[-1])

    model = kvjax.load_model(args.model)
    rows = []
    for name in names:
        _, _, method, method_args = METHODS[name]
        ours = []
        for ctx, q in encoded:
            out = kvjax.generate(model, [ctx], question_ids=[q], method=method, method_args=method_args or None,
                                 max_new_tokens=args.new_tokens, stop_at_eos=False)
            ours.append([int(t) for t in out.tokens[0][: args.new_tokens]])

        def right(tokens: list[list[int]]) -> int:
            texts = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
            return sum(int(task.score(text, s)[s.metric] >= 1.0) for text, s in zip(texts, samples, strict=True))

        row = dict(method=name, kvjax_right=right(ours), kvpress_right=right(theirs[name]),
                   same_tokens=sum(a == b for a, b in zip(ours, theirs[name], strict=True)), samples=len(samples),
                   kvjax_tokens=ours, kvpress_tokens=theirs[name])
        rows.append(row)
        print(f"{name:>20}: kvjax {row['kvjax_right']}/{len(samples)} right, kvpress {row['kvpress_right']}/"
              f"{len(samples)}, identical generations {row['same_tokens']}/{len(samples)}", flush=True)
    version = bu.kvpress_version(args.kvpress_python)
    result = dict(benchmark="kvpress_agreement", machine=bu.machine(), model=args.model, task=args.task,
                  context_length=args.context_length, query_aware=args.query_aware, new_tokens=args.new_tokens,
                  kvpress=version, rows=rows)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
