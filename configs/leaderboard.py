"""`make leaderboard`: kvpress's leaderboard protocol on the models that run on a CPU, and on Qwen3-8B (kvpress's
own leaderboard model) for a user with its weights and an accelerator.

    python configs/leaderboard.py kvjax-tiny            # every run of the panel, one per line
    python configs/leaderboard.py kvjax-tiny --available [--calibration_dir=DIR]   # without those lacking a file
    python -m kvjax.eval --config=configs/leaderboard.py:smollm2-135m
    python -m kvjax.eval --config=configs/leaderboard.py:smollm2-135m/query_aware
    python -m kvjax.eval --config=configs/leaderboard.py:smollm2-135m/kvzap_linear,calibration_dir=DIR  # each threshold
    python -m kvjax.eval --config=configs/leaderboard.py:qwen3-8b --model_dir=/models   # /models/qwen3-8b or Qwen3-8B
    python -m kvjax.eval.leaderboard results/leaderboard

kvpress (evaluation/leaderboard.sh, 0.5.5) runs the 13 RULER tasks at a fixed length (here 10 synthetic ones:
qa_1 / qa_2 need SQuAD / HotpotQA files, add them with --task=ruler --data_dir=DIR; cwe's few-shot prompt
alone is ~2.3K tokens, more than 1K or 2K hold), the full cache once and every press at compression ratios
0.25 / 0.5 / 0.75 / 0.875, here also 0.9375 and 0.96875 (16:1 and 32:1, proposed in kvpress#286 because the
methods converge at 8:1). Lengths: SmolLM2-135M (8K context) at 2K and 4K, kvjax-tiny (trained at 1K to 4K on
these tasks) at 1K. 20 samples per cell; the chat template is used where the tokenizer has one (SmolLM2), with
the answer prefix opening the assistant turn.

The argument is ``<model>`` or ``<model>/<mode>``; every mode writes to ``results/leaderboard/<model>``, so one
render shows them together. The modes (``runs()``; ``python configs/leaderboard.py <model>`` lists a model's):

* ``""``: the query-agnostic loop (the question is fed after compression): kvpress's presses random, knorm,
  snapkv, streaming_llm, tova, observed_attention, pyramidkv, lagkv, keydiff, cur, kvzip at their defaults, plus
  compactor, criticalkv / criticaladakv (over SnapKV), expected_attention (the press alone) and kvjax's own
  methods (adakv = AdaKV-SnapKV, nacl, sagekv, ahakv, h2o, lm_infinite, quest). kvjax's `lagkv` here keeps its
  own defaults (sink 16, lag 128, the LagKV paper's RULER setting); its `snapkv`, `pyramidkv` and `adakv` read
  a 32-token window (kvpress's SnapKVPress: 64), as the archived SmolLM2 panels did.
* ``adakv_compactor``: kvpress's ``adakv_compactor``, `adakv` over `compactor`.
* ``adakv_expected_attention``: kvpress's leaderboard ``expected_attention`` entry, which is
  ``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``: `adakv` over `expected_attention` with epsilon 0.01.
* ``lagkv_kvpress`` / ``lagkv_official``: LagKV with kvpress's LagKVPress defaults (sink 4, lag 128; the
  leaderboard's row) and with the official code's (sink 16, lag 1024); each row names its sink and lag.
* ``kvzip_plus``: kvpress's ``kvzip_plus``, `kvzip` with KVzip+'s normalisation (``kvzip_plus_normalization``).
* ``kvgrad``: kvpress 0.5.5's KVgradPress (KVzip's replay, differentiated), at its defaults.
* ``query_aware``: kvpress's second loop, the question compressed with the context: snapkv, adakv (AdaKV-SnapKV),
  finch (the prompt's last 32 tokens read as the question, its default `window_size`) and chunkkv (chunks of 20,
  kvpress's ``chunkkv`` entry; a ``--method`` subset without chunkkv also needs ``--method_args=``, as the
  chunk size is scoped to chunkkv).
* ``qfilter``, ``duo_attention``, ``kvzap_linear[=<threshold>]`` and ``kvzap_mlp[=<threshold>]``: the presses that
  read per-model learned files from a calibration directory (default: ``kvjax/assets/calibration/<model>``, else
  ``results/calibration/<model>`` where only that exists; written by ``python -m kvjax.calibrate --out=DIR``; a
  missing file: one-line error naming it): Q-Filters at the ratios;
  DuoAttention at head ratios 0.25-0.875 (kvpress's ``--head_compression_ratio`` sweep; `compression_ratio` is
  the head ratio for it); KVzap (linear or MLP surrogate) under DMS at every threshold of the sweep in one run (one
  cell each, one shared prefill; kvpress: -3, -4, -5, -6 for Qwen3-8B; a calibrated model's own quantiles,
  ``thresholds()``), or at the one given after ``=``, its kept share measured, not set. ``kvzap``: both surrogates
  in one run.

The calibration directory is given in the config argument (``<model>/<mode>,calibration_dir=DIR``), as the eval
CLI has no flag of its own for it. Expected there, each in its published layout: ``<model>_qfilt/``
(model.safetensors + config.json), ``kvzap-linear/`` and ``kvzap-mlp/`` (config.json + model.safetensors) and
``duo_attention/`` (full_attention_heads.tsv + config.json).

Qwen3-8B mirrors kvpress's evaluation/leaderboard.sh: RULER at 4096 tokens, the same ratios and loops, 500 samples
per task as kvpress's RULER-4K set holds, the chat template with thinking off (kvpress passes
``enable_thinking=False``; so does kvjax's prompt encoder), bfloat16 on the accelerator (the CLI's ``auto``).
Lower ``--max_samples`` for a quicker pass.
"""

import json
import os
import sys

import ml_collections

LENGTHS = {"kvjax-tiny": "1024", "smollm2-135m": "2048,4096", "qwen3-8b": "4096"}
# SmolLM2: two batches of 10 per cell (batch 8 decodes 1.26x faster per sample than 4 on the 2-core VM;
# the recording of a batch of 10 is ~2.5 GB at 2K, ~5 GB at 4K). Qwen3-8B: 8 prompts of 4K per batch (its
# shared-prefill recording is ~9 GB in bfloat16: 36 layers x 4096 tokens x (32 + 2 x 8) heads x 128 x 2 bytes
# x 8 prompts).
BATCH = {"kvjax-tiny": 8, "smollm2-135m": 10, "qwen3-8b": 8}
SAMPLES = {"kvjax-tiny": 20, "smollm2-135m": 20, "qwen3-8b": 500}
RATIOS = "0.25,0.5,0.75,0.875,0.9375,0.96875"
# The query-agnostic loop: the methods of the first leaderboard (kept as they were, so archived cells stay
# valid), then the presses added with kvpress 0.5.5's leaderboard.
OLDER_METHODS = (
    "full,streaming_llm,snapkv,pyramidkv,adakv,knorm,random,nacl,lagkv,sagekv,ahakv,h2o,tova,lm_infinite,quest"
)
NEW_METHODS = "expected_attention,observed_attention,keydiff,cur,compactor,kvzip,criticalkv,criticaladakv"
METHODS = f"{OLDER_METHODS},{NEW_METHODS}"
QUERY_AWARE_METHODS = "snapkv,adakv,finch,chunkkv"  # adakv = AdaKV-SnapKV (its default base)
# Modes running one method with settings of its own (the CLI holds one setting per method name and sweep).
SINGLE = {
    "adakv_compactor": ("adakv", "adakv.base=compactor"),
    "adakv_expected_attention": ("adakv", "adakv.base=expected_attention,adakv.base_args={'epsilon':0.01}"),
    "lagkv_kvpress": ("lagkv", "lagkv.sink_size=4,lagkv.lag_size=128"),
    "lagkv_official": ("lagkv", "lagkv.sink_size=16,lagkv.lag_size=1024"),
    "kvzip_plus": ("kvzip", "kvzip.kvzip_plus_normalization=True"),
    "kvgrad": ("kvgrad", ""),
}
# KVzap thresholds (log-scores): kvpress's for Qwen3-8B. A model calibrated by `python -m kvjax.calibrate` takes
# its own instead: the quantiles of its log KVzip+ targets at 25 / 50 / 75 / 87.5% pruned, which its kvzap-linear
# config.json records (kvjax-tiny: -6.95 .. -4.55, SmolLM2-135M: -5.84 .. -1.93; kvpress's -3 .. -6 would prune
# nearly nothing of kvjax-tiny's cache).
KVPRESS_THRESHOLDS = (-3, -4, -5, -6)
LEARNED = ("qfilter", "duo_attention")
# RULER's synthetic tasks but cwe, whose few-shot example alone is ~2.3K tokens (it does not fit 1K or 2K).
TASKS = "ruler/niah_single_1,ruler/niah_single_2,ruler/niah_single_3,ruler/niah_multikey_1,ruler/niah_multikey_2," \
    "ruler/niah_multikey_3,ruler/niah_multivalue,ruler/niah_multiquery,ruler/vt,ruler/fwe"
CALIBRATION_DIR = "kvjax/assets/calibration/{model}"  # where `make calibrate` writes (committed for kvjax-tiny)
#: Where the learned files are looked for without a calibration_dir, the first directory that exists: the committed
#: one, then the gitignored one `make calibrate-smollm2` writes.
CALIBRATION_DIRS = (CALIBRATION_DIR, "results/calibration/{model}")
# The learned files under the calibration directory: method -> (method argument, path).
# Each in its published layout, named as `python -m kvjax.calibrate --out=DIR` writes them: Q-Filters'
# `<model>_qfilt/`, KVzap's linear / MLP surrogate (config.json + model.safetensors), DuoAttention's pattern
# directory (full_attention_heads.tsv + config.json).
LEARNED_FILES = {"qfilter": ("filters", "{model}_qfilt"), "kvzap_linear": ("weights", "kvzap-linear"),
                 "kvzap_mlp": ("weights", "kvzap-mlp"), "duo_attention": ("patterns", "duo_attention")}
KVZAP = ("kvzap_linear", "kvzap_mlp")  # kvpress's kvzap_linear / kvzap_mlp: DMSPress(KVzapPress(model_type=...))


def thresholds(model: str, calibration_dir: str | None = None) -> tuple[float, ...]:
    """The KVzap thresholds of `model`'s sweep: its calibration's target quantiles where its kvzap-linear
    config.json records them, else kvpress's."""
    path = os.path.join(_calibration_root(model, calibration_dir), LEARNED_FILES["kvzap_linear"][1], "config.json")
    try:
        with open(path) as f:
            quantiles = json.load(f)["kvjax_calibration"]["target_quantiles"]
    except (OSError, KeyError, ValueError):
        return KVPRESS_THRESHOLDS
    return tuple(round(float(quantiles[q]), 2) for q in sorted(quantiles, key=float))


def runs(model: str, calibration_dir: str | None = None) -> list[str]:
    """Every config argument of one model's panel, in the order `make leaderboard` runs them (the learned-file
    modes last)."""
    _check_model(model)
    out = [model, f"{model}/query_aware", *(f"{model}/{m}" for m in SINGLE), *(f"{model}/{m}" for m in LEARNED)]
    return out + [f"{model}/{kind}" for kind in KVZAP]  # each sweeps every threshold in one run


def _check_model(model: str) -> None:
    if model not in LENGTHS:
        raise ValueError(f"unknown leaderboard model {model!r}; one of {', '.join(LENGTHS)}")


def _calibration_root(model: str, calibration_dir: str | None) -> str:
    if calibration_dir:
        return calibration_dir
    roots = [d.format(model=model) for d in CALIBRATION_DIRS]
    return next((r for r in roots if os.path.isdir(r)), roots[0])


def _learned_file(method: str, model: str, calibration_dir: str | None) -> str:
    """The path of `method`'s learned file for `model`; a missing one is a one-line error."""
    root = _calibration_root(model, calibration_dir)
    path = os.path.join(root, LEARNED_FILES[method][1].format(model=model))
    if not os.path.exists(path):
        raise ValueError(f"{method} needs {path} (learned for {model}); write it with `python -m kvjax.calibrate "
                         f"--method={method.split('_')[0] if method in KVZAP else method} --model={model} "
                         f"--out={root}` or give ,calibration_dir=DIR")
    return path


def parse_arg(arg: str) -> tuple[str, str, dict[str, str]]:
    """``<model>[/<mode>][,key=value...]`` -> (model, mode, options)."""
    head, *opts = arg.split(",")
    model, _, mode = head.partition("/")
    options = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or key != "calibration_dir":
            raise ValueError(f"unknown leaderboard option {opt!r}; calibration_dir=DIR")
        options[key] = value
    return model, mode, options


def get_config(arg: str = "smollm2-135m") -> ml_collections.ConfigDict:
    model, mode, options = parse_arg(arg)
    _check_model(model)
    method, method_args, ratios = METHODS, "", RATIOS
    calibration_dir = options.get("calibration_dir")
    if mode == "query_aware":
        method = QUERY_AWARE_METHODS
        method_args = "chunkkv.chunk_size=20"  # kvpress's chunkkv entry: ChunkKVPress(SnapKVPress(), chunk_length=20)
    elif mode in SINGLE:
        method, method_args = SINGLE[mode]
    elif mode in LEARNED:
        method = mode
        key, _ = LEARNED_FILES[mode]
        method_args = f"{mode}.{key}={_learned_file(mode, model, calibration_dir)}"
        if mode == "duo_attention":
            ratios = "0.25,0.5,0.75,0.875"  # head ratios, as kvpress's --head_compression_ratio sweep
    elif mode.partition("=")[0] in (*KVZAP, "kvzap"):
        kind, given, threshold = mode.partition("=")
        if given:
            try:
                float(threshold)
            except ValueError:
                raise ValueError(f"{kind} threshold {threshold!r} is not a number") from None
        method, ratios = "dms", None  # DMS keeps what scores above the threshold: no nominal ratio
        # Several thresholds / surrogates are `|` alternatives: one cell each, sharing the run's prefill.
        swept = threshold if given else "|".join(str(t) for t in thresholds(model, calibration_dir))
        base_args = "|".join(f"{{'weights':'{_learned_file(k, model, calibration_dir)}','model_type':'"
                             f"{k.split('_')[1]}'}}" for k in (KVZAP if kind == "kvzap" else (kind,)))
        method_args = f"dms.base=kvzap,dms.threshold={swept},dms.base_args={base_args}"
    elif mode:
        modes = ["query_aware", *SINGLE, *LEARNED, *(f"{k}[=<threshold>]" for k in (*KVZAP, "kvzap"))]
        raise ValueError(f"unknown leaderboard mode {mode!r}; '' or one of {', '.join(modes)}")
    return ml_collections.ConfigDict(dict(
        model=model,
        method=method,
        method_args=method_args,
        compression_ratio=ratios,
        query_aware=mode == "query_aware",
        task=TASKS,
        context_length=LENGTHS[model],
        max_samples=SAMPLES[model],
        batch_size=BATCH[model],
        chat_template="auto",
        output_dir=f"results/leaderboard/{model}",
    ))


def available_runs(model: str, calibration_dir: str | None = None) -> list[str]:
    """`runs(model)` without the learned-file runs whose file is missing (each named on stderr)."""
    out = []
    for arg in runs(model, calibration_dir):
        learned = arg.partition("/")[2].partition("=")[0] in (*LEARNED, *KVZAP)
        if learned and calibration_dir:
            arg += f",calibration_dir={calibration_dir}"
        try:
            get_config(arg)
        except ValueError as e:
            print(f"skipped {arg.split(',')[0]}: {e}", file=sys.stderr)
            continue
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    """Prints a model's runs, one config argument per line (`make leaderboard` loops over them)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python configs/leaderboard.py", description="List a model's leaderboard "
                                     "runs, one --config argument (after configs/leaderboard.py:) per line.")
    parser.add_argument("model", choices=sorted(LENGTHS))
    parser.add_argument("--available", action="store_true",
                        help="leave out the learned-file runs whose file is missing (each named on stderr)")
    parser.add_argument("--calibration_dir", default=None, help="the learned files' directory (default: the first "
                        f"of {', '.join(CALIBRATION_DIRS)} that exists)")
    args = parser.parse_args(argv)
    listed = (available_runs if args.available else runs)(args.model, args.calibration_dir)
    print("\n".join(listed))


if __name__ == "__main__":
    main()
