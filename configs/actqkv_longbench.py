"""ActQKV Tables 1-2: LongBench (15 English datasets) and InfiniteBench, about 2K KV per step.

    python -m kvjax.eval --config=configs/actqkv_longbench.py --model_dir=... --data_dir=/data

The retrieval methods attend 64 sinks + 512 local + retrieved blocks; their defaults reproduce the
official configuration (docs/retrieval.md), InfLLM's positions included (far keys at one fixed
distance), so they take prompts past the model's context. The other methods, `full` first, attend
at exact positions and need the prompts to fit: the paper's Llama-3-8B-Instruct (8K) would refuse
them at 32K, so this config uses Llama-3.1-8B-Instruct (128K).
"""

import ml_collections

_TASKS = ",".join(f"longbench/{t}" for t in (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
    "multi_news", "trec", "triviaqa", "samsum", "passage_retrieval_en", "lcc", "repobench-p",
)) + ",infinitebench"


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        model="llama-3.1-8b",
        method="full,streaming_llm,lm_infinite,infllm,qllm,actqkv",
        method_args={"streaming_llm": {"budget": 2048}, "lm_infinite": {"budget": 2048}},
        task=_TASKS,
        context_length="32000",
        max_samples=0,
        dtype="bfloat16",
    ))
