"""LagKV Table 3: LongBench categories + the 64-digit passkey, lag size L in {1024, 512, 128}, 2x-8x.

    python -m kvjax.eval --config=configs/lagkv_ablation.py:1024 --model_dir=... --data_dir=/data/longbench

The ratios 2x, 4x, 6x, 8x are compression ratios 1/2, 3/4, 5/6, 7/8; the sink is 16 tokens.
"""

import ml_collections


def get_config(lag_size: str = "1024") -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        model="llama-3.1-8b",
        method="full,lagkv",
        compression_ratio="0.5,0.75,0.8333,0.875",
        method_args={"lagkv": {"lag_size": int(lag_size), "sink_size": 16}},
        task="longbench,passkey_64",
        context_length="32000",
        max_samples=0,  # every LongBench row
        dtype="bfloat16",
    ))
