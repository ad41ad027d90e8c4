"""`make leaderboard`: kvpress's leaderboard protocol on the models that run on a CPU, and on Qwen3-8B (kvpress's
own leaderboard model) for a user with its weights and an accelerator.

    python -m kvjax.eval --config=configs/leaderboard.py:smollm2-135m
    python -m kvjax.eval --config=configs/leaderboard.py:smollm2-135m/query_aware
    python -m kvjax.eval --config=configs/leaderboard.py:qwen3-8b --model_dir=/models   # /models/qwen3-8b or Qwen3-8B
    python -m kvjax.eval.leaderboard results/leaderboard

kvpress (evaluation/leaderboard.sh) runs the 13 RULER tasks at a fixed length (here 10 synthetic ones:
qa_1 / qa_2 need SQuAD / HotpotQA files, add them with --task=ruler --data_dir=DIR; cwe's few-shot prompt
alone is ~2.3K tokens, more than 1K or 2K hold), the full cache once and
every press at compression ratios 0.25 / 0.5 / 0.75 / 0.875, query-agnostic (the question is fed after
compression), then a second, query-aware loop for the presses that read the question (SnapKV,
AdaKV-SnapKV, which is kvjax's `adakv` at its default base, Finch and ChunkKV; Finch reads the prompt's last 32
tokens as the question, its default `window_size`). Lengths: SmolLM2-135M (8K context) at 2K and 4K,
kvjax-tiny (trained at 1K to 4K on these tasks) at 1K. Every one-shot and decode-time method runs;
the retrieval methods (InfLLM, Q-LLM, ActQKV) and the multi-context strategies are not KV eviction at a
ratio and are left out, as kvpress has no counterpart. 20 samples per cell; the chat template is used
where the tokenizer has one (SmolLM2), with the answer prefix opening the assistant turn.

Qwen3-8B mirrors kvpress's evaluation/leaderboard.sh: RULER at 4096 tokens, the same ratios and loops, 500 samples
per task as kvpress's RULER-4K set holds, the chat template with thinking off (kvpress passes
``enable_thinking=False``; so does kvjax's prompt encoder), bfloat16 on the accelerator (the CLI's ``auto``).
Lower ``--max_samples`` for a quicker pass.

The argument is ``<model>`` or ``<model>/query_aware``; results go to ``results/leaderboard/<model>``.
"""

import ml_collections

LENGTHS = {"kvjax-tiny": "1024", "smollm2-135m": "2048,4096", "qwen3-8b": "4096"}
# SmolLM2: two batches of 10 per cell (batch 8 decodes 1.26x faster per sample than 4 on the 2-core VM;
# the recording of a batch of 10 is ~2.5 GB at 2K, ~5 GB at 4K). Qwen3-8B: 8 prompts of 4K per batch (its
# shared-prefill recording is ~9 GB in bfloat16: 36 layers x 4096 tokens x (32 + 2 x 8) heads x 128 x 2 bytes
# x 8 prompts).
BATCH = {"kvjax-tiny": 8, "smollm2-135m": 10, "qwen3-8b": 8}
SAMPLES = {"kvjax-tiny": 20, "smollm2-135m": 20, "qwen3-8b": 500}
RATIOS = "0.25,0.5,0.75,0.875"
METHODS = (
    "full,streaming_llm,snapkv,pyramidkv,adakv,knorm,random,nacl,lagkv,sagekv,ahakv,h2o,tova,lm_infinite,quest"
)
QUERY_AWARE_METHODS = "snapkv,adakv,finch,chunkkv"  # adakv = AdaKV-SnapKV (its default base)
# RULER's synthetic tasks but cwe, whose few-shot example alone is ~2.3K tokens (it does not fit 1K or 2K).
TASKS = "ruler/niah_single_1,ruler/niah_single_2,ruler/niah_single_3,ruler/niah_multikey_1,ruler/niah_multikey_2," \
    "ruler/niah_multikey_3,ruler/niah_multivalue,ruler/niah_multiquery,ruler/vt,ruler/fwe"


def get_config(arg: str = "smollm2-135m") -> ml_collections.ConfigDict:
    model, _, mode = arg.partition("/")
    if model not in LENGTHS:
        raise ValueError(f"unknown leaderboard model {model!r}; one of {', '.join(LENGTHS)}")
    if mode not in ("", "query_aware"):
        raise ValueError(f"unknown leaderboard mode {mode!r}; '' or 'query_aware'")
    return ml_collections.ConfigDict(dict(
        model=model,
        method=QUERY_AWARE_METHODS if mode else METHODS,
        compression_ratio=RATIOS,
        query_aware=bool(mode),
        task=TASKS,
        context_length=LENGTHS[model],
        max_samples=SAMPLES[model],
        batch_size=BATCH[model],
        chat_template="auto",
        output_dir=f"results/leaderboard/{model}",
    ))
