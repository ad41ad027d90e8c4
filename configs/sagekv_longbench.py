"""SAGE-KV: LongBench at budget 8192 (Table 1), or the budget sweep of Fig. 2 on Quest's 8 tasks.

    python -m kvjax.eval --config=configs/sagekv_longbench.py --model_dir=... --data_dir=/data/longbench
    python -m kvjax.eval --config=configs/sagekv_longbench.py:sweep --model_dir=... --data_dir=/data/longbench

The question is part of the compressed prompt (query-aware selection, as the paper).
"""

import ml_collections

_QUEST_TASKS = ",".join(f"longbench/{t}" for t in (
    "gov_report", "multifieldqa_en", "narrativeqa", "passage_retrieval_en", "qasper", "repobench-p", "hotpotqa",
    "triviaqa",
))


def get_config(mode: str = "table") -> ml_collections.ConfigDict:
    sweep = mode == "sweep"
    return ml_collections.ConfigDict(dict(
        model="llama-3.1-8b",
        method="full,streaming_llm,quest,infllm,sagekv" if not sweep else "streaming_llm,quest,sagekv",
        budget="512,1024,2048,4096,8192" if sweep else "8192",
        task=_QUEST_TASKS if sweep else "longbench",
        context_length="32000",
        max_samples=0,
        query_aware=True,
        dtype="bfloat16",
    ))
