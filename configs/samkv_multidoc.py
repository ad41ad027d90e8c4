"""SamKV Tables 1 and 3: multi-document QA (2WikiMQA, MuSiQue, HotpotQA) from per-document caches.

    python -m kvjax.eval --config=configs/samkv_multidoc.py:mistral-7b --model_dir=... --data_dir=/data/longbench

Every passage is prefilled alone and reused; strategies assemble them for the question. EPIC's k
is set so its recompute ratio is near Table 1's 14.1 % on ~1K-token passages.
"""

import ml_collections


def get_config(model: str = "mistral-7b") -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        model=model,  # Table 3: mistral-7b, llama-3.1-8b; ablations: qwen2.5-3b
        method="recompute,reuse,multi_infllm,cacheblend,epic,samkv",
        method_args={"epic": {"k": 32}},
        task="multidoc",
        context_length="32000",
        max_samples=200,
        dtype="bfloat16",
    ))
