"""What the checks against kvpress on random Llamas share (`kvpress_decoding_check.py`, `kvpress_merging_check.py`):
the kvpress side's imports, random model and prompt, the command line, and the call into kvpress's environment."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

#: The kvpress side's imports (it runs in kvpress's virtual environment, `python -c`).
KVPRESS_IMPORTS = r"""
import collections, json, sys
import numpy as np
import torch
import kvpress
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
"""

#: After the side has read `folder`, `prompt_len` and `seed` from its argv: a random float32 Llama (2 layers, 4 heads,
#: 2 KV heads, head size 16, vocabulary 1,000, no end of sequence; weights drawn with std 0.3 so that attention is not
#: uniform) saved in `folder` with `save_pretrained` (`model`), a `prompt` `[1, prompt_len]`, and torch's `topk` made
#: stable (ties to the lower index, as kvjax ranks them).
RANDOM_LLAMA = r"""
torch.manual_seed(int(seed))
config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                     tie_word_embeddings=False, eos_token_id=None)  # no end of sequence: every run is `new` long
model = LlamaForCausalLM(config).float().eval()
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.3)
model.save_pretrained(folder)
prompt = torch.randint(3, 1000, (1, int(prompt_len)), generator=torch.Generator().manual_seed(int(seed) + 1))
TopK = collections.namedtuple("TopK", "values indices")

def stable_topk(self, k, dim=-1, largest=True, sorted=True):
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return TopK(values.narrow(dim, 0, k), indices.narrow(dim, 0, k))

torch.Tensor.topk = stable_topk
"""


def parser(doc: str) -> argparse.ArgumentParser:
    """The checks' command line: `--kvpress_python`, `--out`, `--seeds`."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--kvpress_python", default="/work/venvs/kvpress/bin/python",
                   help="the Python of a virtual environment with torch, transformers and kvpress")
    p.add_argument("--out", help="write the results here as JSON (default: print only)")
    p.add_argument("--seeds", type=int, default=3, help="random models and prompts per case")
    return p


def kvpress_side(python: str, script: str, *argv: str) -> dict | None:
    """Runs `script` in kvpress's Python with `argv`: the JSON its last line prints, or None (its error printed)."""
    proc = subprocess.run([python, "-c", script, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


__all__ = ["KVPRESS_IMPORTS", "RANDOM_LLAMA", "kvpress_side", "parser"]
