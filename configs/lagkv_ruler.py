"""LagKV Tables 1-2: RULER at 16K, compression ratios 0.25-0.875, vs SnapKV and StreamingLLM.

    python -m kvjax.eval --config=configs/lagkv_ruler.py --model_dir=/models/Llama-3.1-8B-Instruct
    python -m kvjax.eval --config=configs/lagkv_ruler.py:qwen2.5-7b --model_dir=/models/Qwen2.5-7B-Instruct

RULER's qa_1 / qa_2 read a local SQuAD / HotpotQA file from --data_dir. The context is compressed
without the question (kvpress's protocol, which the paper follows).
"""

import ml_collections


def get_config(model: str = "llama-3.1-8b") -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        model=model,  # Table 1: llama-3.1-8b; Table 2: qwen2.5-7b
        method="full,snapkv,streaming_llm,lagkv",
        compression_ratio="0.25,0.5,0.75,0.875",
        method_args={"lagkv": {"lag_size": 128, "sink_size": 16}},
        task="ruler",
        context_length="16384",
        max_samples=100,
        dtype="bfloat16",
    ))
