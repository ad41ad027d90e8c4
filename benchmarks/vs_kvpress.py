"""kvjax against NVIDIA kvpress on the same CPU or GPU, model directory, token ids and methods.

    python benchmarks/vs_kvpress.py --kvpress_python=/work/venvs/kvpress/bin/python \
        --out=benchmarks/results/vs_kvpress.json
    python benchmarks/vs_kvpress.py --quick --kvpress_python=... --out=/tmp/vs_kvpress.json   # smoke run
    python benchmarks/vs_kvpress.py --device=gpu --shape=llama-3.2-1b --dtype=bfloat16 \
        --kvpress_python=python3 --kvpress_path=/tmp/kvpress_site --out=...                  # on a GPU

kvpress pins its own torch / transformers, so it runs in its own virtual environment (see benchmarks/README.md)
and is never a kvjax dependency. This script (run with kvjax's Python) starts one worker process per library,
each pinned to one thread (XLA's single-threaded Eigen / `torch.set_num_threads(1)`), and sends them the same
requests in turn, alternating the libraries call by call: prefill the prompt with the method, then 32 greedy
tokens. Each worker reports the process CPU time of the call (`time.process_time`, so another process's load
does not count) and the tokens. Per (context, method): `first_s` is the worker's first call (kvjax: trace +
compile, or a load from the persistent compilation cache), `steady_s` the median of `--repeats` later calls.
kvjax's first call is measured twice, in a process with an empty compilation cache (`cold`) and in a fresh
process reading the cache the cold one wrote (`warm`). Generated tokens are compared per cell.

The model is `--model_dir` (a Hugging Face Llama directory, e.g. SmolLM2-135M-Instruct) or, by default, a
random Llama of `--shape` written with `save_pretrained` (`--quick`: a 2-layer one).

`--device=gpu` runs both workers on the GPU with their default threading and times wall clock instead of
process CPU time (both sides wait for their results: kvjax reads its tokens back, kvpress reads each greedy token
with `int()`); prefill and decode are timed apart. JAX gets `XLA_PYTHON_CLIENT_PREALLOCATE=false` so both
libraries share the device.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import bench_util as bu
import numpy as np
import report

# Matched hyperparameters: kvpress's defaults, given to kvjax by its own names.
METHODS = {
    "full": (None, {}, {}),
    "snapkv_0.5": ("SnapKVPress", dict(compression_ratio=0.5, window_size=64, kernel_size=5),
                   dict(compression_ratio=0.5, window_size=64, kernel_size=5)),
    "snapkv_0.75": ("SnapKVPress", dict(compression_ratio=0.75, window_size=64, kernel_size=5),
                    dict(compression_ratio=0.75, window_size=64, kernel_size=5)),
    "streaming_llm_0.75": ("StreamingLLMPress", dict(compression_ratio=0.75, n_sink=4),
                           dict(compression_ratio=0.75, sink_size=4)),
    "knorm_0.5": ("KnormPress", dict(compression_ratio=0.5), dict(compression_ratio=0.5)),
    "lagkv_0.5": ("LagKVPress", dict(compression_ratio=0.5, n_sink=4, lag_size=128),
                  dict(compression_ratio=0.5, sink_size=4, lag_size=128)),
}
KVJAX_NAME = {"full": "full", "snapkv": "snapkv", "streaming": "streaming_llm", "knorm": "knorm", "lagkv": "lagkv"}
SHAPES = {  # random Llamas of these models' shapes (their configs' numbers)
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3.2-1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True),
}

KVJAX_WORKER = r"""
import json, sys, time
import jax
import kvjax
from kvjax.runtime.generate import decode, prefill
model = kvjax.load_model(sys.argv[1], dtype=sys.argv[2])
import contextlib
from kvjax import tuning
knobs = contextlib.ExitStack()  # the tuning override stays entered for the worker's life
if sys.argv[3] == "causal":  # one-shot prefills through one causal fused attention call per layer
    knobs.enter_context(tuning.override(auto_causal_prefix=True))
if sys.argv[3] == "masked":  # one-shot prefills through the per-block masked path
    knobs.enter_context(tuning.override(auto_causal_prefix=False))
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    args = dict(req["kvjax_args"]) or None
    t0, w0 = time.process_time(), time.perf_counter()
    # kvjax.generate is exactly these two calls; they are timed apart here.
    state = prefill(model, [req["ids"]], method=req["kvjax_method"], method_args=args, max_new_tokens=req["new"])
    jax.block_until_ready(state.logits)
    w1 = time.perf_counter()
    tokens, _, _ = decode(model, state, max_new_tokens=req["new"], stop_at_eos=False)
    tokens = [int(t) for t in tokens[0]]
    w2 = time.perf_counter()
    print(json.dumps(dict(cpu_s=time.process_time() - t0, wall_s=w2 - w0, prefill_wall_s=w1 - w0,
                          decode_wall_s=w2 - w1, tokens=tokens)), flush=True)
"""

KVPRESS_WORKER = r"""
import contextlib, json, sys, time
import torch
device = sys.argv[3]
if device == "cpu":
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
import kvpress
from transformers import AutoModelForCausalLM, DynamicCache
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2]),
                                             attn_implementation="sdpa").to(device).eval()
print(json.dumps({"ready": True}), flush=True)

@torch.inference_mode()
def run(ids, press, new):
    x = torch.tensor([ids], device=device)
    cache = DynamicCache()
    with press(model) if press is not None else contextlib.nullcontext():
        out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1)
    tokens = [int(tok)]  # int() waits for the device
    w1 = time.perf_counter()
    for i in range(new - 1):  # positions go on from the prompt, whatever the cache kept
        pos = torch.tensor([[len(ids) + i]], device=device)
        out = model(input_ids=tok[:, None], position_ids=pos, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1)
        tokens.append(int(tok))
    return tokens, w1

for line in sys.stdin:
    req = json.loads(line)
    press = None if req["press"] is None else getattr(kvpress, req["press"])(**req["press_args"])
    t0, w0 = time.process_time(), time.perf_counter()
    tokens, w1 = run(req["ids"], press, req["new"])
    w2 = time.perf_counter()
    print(json.dumps(dict(cpu_s=time.process_time() - t0, wall_s=w2 - w0, prefill_wall_s=w1 - w0,
                          decode_wall_s=w2 - w1, tokens=tokens)), flush=True)
"""


class Worker:
    """A library's long-lived process answering one JSON request per line."""

    def __init__(self, python: str, code: str, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen([python, "-c", code, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited with {self.proc.wait()}")
            if line.startswith("{"):
                return json.loads(line)

    def call(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def make_model_dir(path: pathlib.Path, shape: str, quick: bool, dtype: str, device: str) -> None:
    """A random Llama of `shape` (2 layers with --quick), saved as safetensors in `dtype`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(SHAPES[shape], **(dict(num_hidden_layers=2) if quick else {}))
    torch.manual_seed(0)
    with torch.device("cuda" if device == "gpu" else "cpu"):  # on the GPU the random init takes seconds
        model = LlamaForCausalLM(LlamaConfig(**config)).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)


def _env(device: str, cache_dir: str | None, extra_path: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    repo = str(pathlib.Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([p for p in (extra_path, repo, env.get("PYTHONPATH", "")) if p])
    if device == "cpu":  # one thread each
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                            "intra_op_parallelism_threads=1").strip()
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    else:  # the two libraries share the device
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["KVJAX_COMPILATION_CACHE_DIR"] = cache_dir or "off"
    return env


def _request(name: str, ids: list[int], new: int) -> dict:
    press, press_args, kvjax_args = METHODS[name]
    return dict(ids=ids, new=new, press=press, press_args=press_args, kvjax_args=kvjax_args,
                kvjax_method=KVJAX_NAME[name.split("_")[0]])


def _row(c: int, name: str, first_j: dict, first_k: dict, steady_j: list[dict], steady_k: list[dict],
         clock: str) -> dict:
    """One (context, method) cell: medians of the steady calls, first calls, and the tokens compared."""
    med = lambda rs, key: float(np.median([r[key] for r in rs]))  # noqa: E731
    row = dict(context=c, method=name, kvjax_first_cold_s=first_j[clock], kvpress_first_s=first_k[clock],
               kvjax_steady_s=med(steady_j, clock), kvpress_steady_s=med(steady_k, clock),
               same_tokens=steady_j[0]["tokens"] == steady_k[0]["tokens"],
               kvjax_tokens=steady_j[0]["tokens"], kvpress_tokens=steady_k[0]["tokens"])
    if clock == "wall_s":  # on a device, where the two halves are worth seeing apart
        for lib, rs in (("kvjax", steady_j), ("kvpress", steady_k)):
            row[f"{lib}_prefill_s"], row[f"{lib}_decode_s"] = med(rs, "prefill_wall_s"), med(rs, "decode_wall_s")
    row["steady_ratio"] = row["kvjax_steady_s"] / row["kvpress_steady_s"]
    return row


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file, rewritten after every cell.")
    p.add_argument("--kvpress_python", default="/work/venvs/kvpress/bin/python")
    p.add_argument("--kvpress_path", default=None,
                   help="Extra PYTHONPATH of the kvpress worker only (kvpress + its transformers as wheels).")
    p.add_argument("--model_dir", default=None, help="HF Llama directory (default: a random Llama of --shape).")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="Shape of the random model.")
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                   help="cpu: one thread each, process CPU time; gpu: both on the GPU, wall clock.")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="Weights and cache.")
    p.add_argument("--contexts", default="1024,4096,8192")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="Steady-state calls per library and cell (median).")
    p.add_argument("--causal_prefill", action="store_true",
                   help="kvjax's one-shot prefill through one causal fused attention call per layer "
                        "(`kvjax.tuning` field `auto_causal_prefix`; cuDNN on GPU, its default there).")
    p.add_argument("--masked_prefill", action="store_true",
                   help="kvjax's one-shot prefill through the per-block masked path (`auto` without the causal "
                        "call), for an A/B against the default.")
    p.add_argument("--time_budget_s", type=float, default=None, help="Start no new cell after this many seconds.")
    p.add_argument("--quick", action="store_true", help="2-layer model, 256 tokens, 4 new tokens, 1 repeat.")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    names = args.methods.split(",")
    bad = [n for n in names if n not in METHODS]
    if bad:
        p.error(f"unknown --methods {bad}; choose from {sorted(METHODS)}")
    if args.quick:
        args.contexts, args.new_tokens, args.repeats = "256", 4, 1
    if args.device == "gpu":  # before this process's own jax starts (bench_util.machine)
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    start = time.perf_counter()
    clock = "cpu_s" if args.device == "cpu" else "wall_s"
    contexts = [int(c) for c in args.contexts.split(",")]
    work = pathlib.Path(tempfile.mkdtemp(prefix="vs_kvpress_"))
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = str(work / "model")
        make_model_dir(pathlib.Path(model_dir), args.shape, args.quick, args.dtype, args.device)
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    vocab, window = config["vocab_size"], config.get("max_position_embeddings")
    rng = np.random.default_rng(args.seed)
    # A context as long as the model's window leaves room for the new tokens (SmolLM2 at 8K: 8160 + 32).
    fit = {c: c if window is None else min(c, window - args.new_tokens) for c in contexts}
    prompts = {c: rng.integers(0, vocab, size=fit[c]).tolist() for c in contexts}
    cache_dir = str(work / "jax_cache")
    name = args.model_dir or f"random Llama, {args.shape} shape" + (" (2 layers)" if args.quick else "")
    model = dict(name=name, num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
                 num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
                 head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                 dtype=args.dtype)
    torch_device = "cuda" if args.device == "gpu" else "cpu"
    if args.causal_prefill and args.masked_prefill:
        p.error("--causal_prefill and --masked_prefill exclude each other")
    prefill_mode = "causal" if args.causal_prefill else "masked" if args.masked_prefill else "auto"
    result = dict(benchmark="vs_kvpress", machine=bu.machine(), model=model,
                  kvpress=bu.kvpress_version(args.kvpress_python, args.kvpress_path),
                  time=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), new_tokens=args.new_tokens,
                  repeats=args.repeats, kvjax_prefill=prefill_mode, threads=1 if args.device == "cpu" else "default",
                  clock="process CPU time" if args.device == "cpu" else "wall clock", rows=[])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    rows = result["rows"]
    # Cold pass: kvjax with an empty compilation cache, kvpress fresh; first calls, then steady state.
    jx = Worker(sys.executable, KVJAX_WORKER, [model_dir, args.dtype, prefill_mode], _env(args.device, cache_dir))
    kp = Worker(args.kvpress_python, KVPRESS_WORKER, [model_dir, args.dtype, torch_device],
                _env(args.device, None, args.kvpress_path))
    for c in contexts:
        for name in names:
            if args.time_budget_s is not None and time.perf_counter() - start > args.time_budget_s:
                print(f"time budget spent: {c} {name} and later cells not run", flush=True)
                break
            req = _request(name, prompts[c], args.new_tokens)
            first_j, first_k = jx.call(req), kp.call(req)
            steady_j, steady_k = [], []
            for _ in range(args.repeats):  # alternating, call by call
                steady_j.append(jx.call(req))
                steady_k.append(kp.call(req))
            row = _row(c, name, first_j, first_k, steady_j, steady_k, clock)
            rows.append(row)
            save()
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("tokens")}), flush=True)
    jx.close()
    kp.close()
    # Warm pass: a fresh kvjax process reading the cache the cold pass wrote (a user's next session).
    jx = Worker(sys.executable, KVJAX_WORKER, [model_dir, args.dtype, prefill_mode], _env(args.device, cache_dir))
    for row in rows:
        first = jx.call(_request(row["method"], prompts[row["context"]], args.new_tokens))
        row["kvjax_first_warm_s"] = first[clock]
        row["first_warm_ratio"] = first[clock] / row["kvpress_first_s"]
        save()
    jx.close()
    print(report.vs_kvpress(result))
    return result


if __name__ == "__main__":
    run()
