"""kvpress's BlockPress over SnapKV in float64, against the reading of it that kvjax's `block` implements.

    /path/to/kvpress-venv/bin/python benchmarks/kvpress_block_check.py \
        --out=benchmarks/results/kvpress_block_check.json

Runs in the kvpress virtual environment (torch, transformers, kvpress; no kvjax, no jax). A random one-layer Llama
attention (float64) gives hidden states, keys and values of a 90-token prompt; kvpress's `BlockPress(SnapKVPress)`
compresses them at several block sizes, with torch's `topk` as it is and made stable (ties to the lower index, as
kvjax ranks them). The same selection is computed in NumPy from the definition `tests/methods/test_block.py` checks
kvjax's `block` against (the block's last queries, rotated with the RoPE of the prompt's last positions, vote over
the kept tokens and the block; the latest `window` protected; the votes pooled in the kept-then-block order; the
best `n_kept`, ties to the earlier member). Per block size: the Jaccard index of each KV head's kept positions.
In float64 the only difference left is the order torch's `topk` gives tied scores (SnapKV's window, all scored
the same); with a stable `topk` every head is expected to keep the same set.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import pathlib

import numpy as np
import torch

N, WINDOW, KERNEL, RATIO = 90, 4, 5, 0.5
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
TopK = collections.namedtuple("TopK", "values indices")


def stable_topk(x, k, dim=-1, largest=True, sorted=True):
    """`torch.topk` with ties in index order."""
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return TopK(values.narrow(dim, 0, k), indices.narrow(dim, 0, k))


def layer(seed: int):
    """A float64 Llama attention and its prompt: the module, hidden states, RoPE tables, pre-RoPE queries, keys,
    values."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, rotate_half

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, intermediate_size=HIDDEN, num_hidden_layers=1, max_position_embeddings=512)
    attention = LlamaAttention(config, layer_idx=0).double()
    hidden = torch.randn(1, N, HIDDEN, dtype=torch.float64)
    cos, sin = (x.double() for x in LlamaRotaryEmbedding(config)(hidden, torch.arange(N)[None]))

    def heads(proj, count):
        return proj(hidden).view(1, N, count, HEAD_DIM).transpose(1, 2)

    keys = heads(attention.k_proj, KV_HEADS)
    keys = keys * cos[:, None] + rotate_half(keys) * sin[:, None]
    return attention, hidden, (cos, sin), heads(attention.q_proj, HEADS), keys, heads(attention.v_proj, KV_HEADS)


def kvpress_kept(attention, hidden, rope, keys, values, block: int) -> list[list[int]]:
    from kvpress import BlockPress, SnapKVPress

    press = BlockPress(SnapKVPress(compression_ratio=RATIO, window_size=WINDOW, kernel_size=KERNEL), block_size=block)
    kept, _ = press.compress(attention, hidden, keys, values, None, {"position_embeddings": rope})
    return [sorted(int(torch.argmin(((keys[0, h] - row) ** 2).sum(-1))) for row in kept[0, h]) for h in range(KV_HEADS)]


def reference_kept(queries, keys, rope, block: int) -> list[list[int]]:
    """The definition, in NumPy float64."""
    cos, sin = (x[0].numpy() for x in rope)
    q, k = queries[0].numpy(), keys[0].numpy()
    half, group = HEAD_DIM // 2, HEADS // KV_HEADS
    n_kept = int(N * (1 - RATIO))

    def rotated(x, position):
        return x * cos[position] + np.concatenate([-x[half:], x[:half]]) * sin[position]

    def pool(x):
        padded = np.concatenate([np.zeros(KERNEL // 2), x, np.zeros(KERNEL // 2)])
        return np.array([padded[j:j + KERNEL].sum() / KERNEL for j in range(len(x))])

    out = []
    for kh in range(KV_HEADS):
        chosen = list(range(n_kept))
        for start in range(n_kept, N, block):
            end = min(start + block, N)
            members = chosen + list(range(start, end))
            votes = np.zeros(len(members))
            for i, p in enumerate(range(end - WINDOW, end)):
                for head in range(kh * group, (kh + 1) * group):
                    query = rotated(q[head, p], N - WINDOW + i)
                    seen = [j for j, m in enumerate(members) if m <= p]
                    logits = np.array([k[kh, members[j]] @ query for j in seen]) / math.sqrt(HEAD_DIM)
                    probs = np.exp(logits - logits.max())
                    votes[seen] += probs / probs.sum() / WINDOW / group
            protected = set(sorted(members)[-WINDOW:])
            pooled = pool(np.array([0.0 if m in protected else x for m, x in zip(members, votes, strict=True)]))
            rank = [math.inf if m in protected else x for m, x in zip(members, pooled, strict=True)]
            order = sorted(range(len(members)), key=lambda j: (-rank[j], j))
            chosen = [members[j] for j in order[:n_kept]]
        out.append(sorted(chosen))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="45,20,8,6",
                   help="block sizes (45: one block after the first 45 kept tokens; 6: a last block of 3 tokens, "
                        "shorter than the window, where kvpress's window reads kept tokens' mixed hidden states)")
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    real_topk, real_method = torch.topk, torch.Tensor.topk
    rows = []
    for block in (int(b) for b in args.blocks.split(",")):
        for mode in ("torch", "stable"):
            values = []
            for seed in range(args.seeds):
                attention, hidden, rope, queries, keys, values_ = layer(seed)
                if mode == "stable":
                    torch.topk = torch.Tensor.topk = stable_topk
                try:
                    theirs = kvpress_kept(attention, hidden, rope, keys, values_, block)
                finally:
                    torch.topk, torch.Tensor.topk = real_topk, real_method
                ours = reference_kept(queries, keys, rope, block)
                values += [len(set(a) & set(b)) / len(set(a) | set(b)) for a, b in zip(ours, theirs, strict=True)]
            row = dict(block=block, topk=mode, mean_jaccard=float(np.mean(values)),
                       identical_heads=int(sum(v == 1.0 for v in values)), heads=len(values))
            rows.append(row)
            print(f"block {block:>3}, {mode:>6} topk: mean Jaccard {row['mean_jaccard']:.4f}, identical heads "
                  f"{row['identical_heads']}/{row['heads']}", flush=True)
    from importlib.metadata import version

    result = dict(benchmark="kvpress_block_check", kvpress=version("kvpress"), torch=version("torch"),
                  transformers=version("transformers"), prompt=N, window=WINDOW, kernel=KERNEL, ratio=RATIO,
                  rows=rows)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
