"""`make eval`: every main method at a few budgets on the embedded kvjax-tiny model, in minutes on a CPU.

    python -m kvjax.eval --config=configs/tiny_sweep.py

Context 1024 tokens, budgets of 64 and 256 kept tokens (6% and 25% of the prompt). The full cache
sets the ceiling; where a method falls below it, compression cost accuracy. Passkey and niah_single_2
hold one needle; niah_multiquery asks for four, so a method must keep four scattered needles.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        model="kvjax-tiny",
        method="full,streaming_llm,snapkv,h2o,tova,knorm,lagkv,sagekv,ahakv",
        budget="64,256",
        task="passkey,ruler/niah_single_2,ruler/niah_multiquery",
        context_length="1024",
        max_samples=8,
        batch_size=8,
        output_dir="results/tiny_sweep",
    ))
