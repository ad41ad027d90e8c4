"""AhaKV Table 1: LongBench at a 1000-token budget (720 for Llama-2) with a recent window of 32.

    python -m kvjax.eval --config=configs/ahakv_longbench.py:llama-3-8b --model_dir=... --data_dir=/data/longbench

Prompts are middle-truncated to the model's context minus generation room (about 7.5K for 8K
models, 3.5K for Llama-2). English LongBench only (the Chinese datasets need jieba).
"""

import ml_collections

_BUDGET = {"llama-2-7b": 720}
_CONTEXT = {"llama-2-7b": 3500, "qwen2.5-7b": 31500}


def get_config(model: str = "llama-3-8b") -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        model=model,
        method="full,streaming_llm,h2o,snapkv,nacl,tova,ahakv",
        budget=str(_BUDGET.get(model, 1000)),
        method_args={"ahakv": {"recent_size": 32}, "snapkv": {"window_size": 32}, "h2o": {"window_size": 32}},
        task="longbench",
        context_length=str(_CONTEXT.get(model, 7500)),
        max_samples=0,
        query_aware=True,
        dtype="bfloat16",
    ))
