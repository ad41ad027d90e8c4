"""kvjax's `merging` against kvpress's `MergingPress`, cache by cache: the same kept pairs, the same merged values and
the same generated tokens, over KNorm, SnapKV and ExpectedAttention.

    python benchmarks/kvpress_merging_check.py --kvpress_python=/work/venvs/kvpress/bin/python \
        --out=benchmarks/results/kvpress_merging_check.json

Run with kvjax's Python; kvpress runs in its own virtual environment (`--kvpress_python`). Per case and seed, the
kvpress side writes a random float32 Llama (2 layers, 4 heads, 2 KV heads, head size 16, vocabulary 1,000; weights
drawn with std 0.3 so that attention is not uniform) with `save_pretrained`, draws a prompt, prefills it under the
press and saves each layer's compressed keys and values, then generates greedily under the press. kvjax loads that
directory and generates as many tokens with `merging` (`return_cache=True`). Per layer and KV head, each kvpress key
is matched to kvjax's nearest prompt key (within 1e-3: the same pair kept) and the two values are compared (a head
that keeps other pairs is checked for a near tie: the same tokens, another copy of a repeated one). As a control,
the values kvjax's base alone keeps are compared the same way: they must differ where a merge happened, or the check
could not fail. Both sides rank ties to the lower position (kvpress's `topk` is made stable).
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

import numpy as np
from kvpress_check import KVPRESS_IMPORTS, RANDOM_LLAMA, kvpress_side, parser

#: name: (kvpress scorer, its arguments, MergingPress's gates, kvjax base, its arguments, ratio, prompt, new tokens)
CASES = {
    "knorm_0.5": ("KnormPress", {}, {}, "knorm", {}, 0.5, 64, 12),
    "knorm_0.75_fraction_0.75": ("KnormPress", {}, {"merge_fraction": 0.75}, "knorm", {}, 0.75, 64, 12),
    "snapkv_0.5_threshold_0.1": ("SnapKVPress", {"window_size": 8}, {"similarity_threshold": 0.1}, "snapkv",
                                 {"window_size": 8}, 0.5, 64, 12),
    "expected_attention_0.5_fraction_0.5": ("ExpectedAttentionPress", {"epsilon": 1e-2}, {"merge_fraction": 0.5},
                                            "expected_attention", {"epsilon": 1e-2}, 0.5, 80, 12),
}

#: Runs in kvpress's venv: argv = folder, scorer, its arguments, the gates (JSON), ratio, prompt tokens, new, seed.
KVPRESS_SIDE = KVPRESS_IMPORTS + """
folder, scorer, scorer_args, gates, ratio, prompt_len, new, seed = sys.argv[1:9]
""" + RANDOM_LLAMA + r"""
inner = getattr(kvpress, scorer)(compression_ratio=float(ratio), **json.loads(scorer_args))
press = kvpress.MergingPress(press=inner, **json.loads(gates))
with torch.no_grad(), press(model):
    cache = DynamicCache()
    model(prompt, past_key_values=cache)
arrays = {}
for i, layer in enumerate(cache.layers):
    arrays[f"k{i}"], arrays[f"v{i}"] = layer.keys[0].numpy(), layer.values[0].numpy()
np.savez(folder + "/kvpress_cache.npz", **arrays)
with torch.no_grad(), press(model):
    result = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=int(new), do_sample=False,
                            pad_token_id=0)
print(json.dumps({"prompt": prompt[0].tolist(), "tokens": result[0, int(prompt_len):].tolist()}))
"""


def compare(cache, theirs: dict, prompt: list[int], every) -> dict:
    """kvjax's prompt pairs against kvpress's compressed cache: kept keys matched, their values' largest gap (over the
    heads that keep the same pairs). A head that keeps other pairs is checked against `every` (the uncompressed
    cache's keys, one per prompt position): does it keep the same tokens, another copy of a repeated one?"""
    from kvjax import cache as kvc

    prompt_len = len(prompt)
    heads, same_keys, copies, worst_key, worst_value = 0, 0, 0, 0.0, 0.0
    for layer, part in enumerate(cache.layers):
        keys = np.asarray(kvc.keys(part, np.float32)[0], np.float64)
        values = np.asarray(kvc.values(part, np.float32)[0], np.float64)
        pos, length = np.asarray(part.pos[0]), np.asarray(part.length[0])
        for head in range(length.shape[0]):
            mine = [s for s in range(int(length[head])) if 0 <= pos[head, s] < prompt_len]
            their_k = theirs[f"k{layer}"][head].astype(np.float64)
            their_v = theirs[f"v{layer}"][head].astype(np.float64)
            gaps = np.linalg.norm(their_k[:, None] - keys[head, mine][None], axis=-1)
            nearest = gaps.argmin(axis=1)
            key_gap = float(gaps.min(axis=1).max())
            heads += 1
            worst_key = max(worst_key, key_gap)
            if len(mine) == len(their_k) and key_gap < 1e-3:
                same_keys += 1
                value_gap = np.abs(values[head, np.asarray(mine)[nearest]] - their_v).max()
                worst_value = max(worst_value, float(value_gap))
                continue
            all_keys = np.asarray(kvc.keys(every.layers[layer], np.float32)[0, head], np.float64)
            all_pos = np.asarray(every.layers[layer].pos[0, head])
            found = np.linalg.norm(their_k[:, None] - all_keys[None], axis=-1).argmin(axis=1)
            their_tokens = sorted(prompt[int(all_pos[i])] for i in found)
            copies += their_tokens == sorted(prompt[int(p)] for p in pos[head, mine])
    return {"heads": heads, "heads_same_keys": same_keys, "heads_differing_only_in_copies": copies,
            "largest_key_distance": worst_key, "largest_value_difference": worst_value}


def kvjax_side(folder: str, base: str, base_args: dict, gates: dict, ratio: float, ref: dict, new: int) -> dict:
    """kvjax's generation of the same prompt with `merging`, and with its base alone (the control)."""
    import kvjax

    model = kvjax.load_model(folder, dtype="float32")
    theirs = dict(np.load(f"{folder}/kvpress_cache.npz"))
    every = kvjax.generate(model, [ref["prompt"]], method="full", max_new_tokens=1, return_cache=True).cache
    merged = kvjax.generate(model, [ref["prompt"]], method="merging", max_new_tokens=new, return_cache=True,
                            method_args=dict(base=base, base_args=base_args, compression_ratio=ratio, **gates))
    alone = kvjax.generate(model, [ref["prompt"]], method=base, max_new_tokens=new, return_cache=True,
                           method_args=dict(compression_ratio=ratio, **base_args))
    return {"tokens_equal": [int(t) for t in merged.tokens[0]] == ref["tokens"],
            "merging": compare(merged.cache, theirs, ref["prompt"], every),
            "base_alone": compare(alone.cache, theirs, ref["prompt"], every)}


def main() -> int:
    args = parser(__doc__).parse_args()
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    results = {}
    for name, (scorer, scorer_args, gates, base, base_args, ratio, prompt_len, new) in CASES.items():
        rows = []
        for seed in range(args.seeds):
            with tempfile.TemporaryDirectory(prefix="kvjax-merging-check-") as folder:
                ref = kvpress_side(args.kvpress_python, KVPRESS_SIDE, folder, scorer, json.dumps(scorer_args),
                                   json.dumps(gates), str(ratio), str(prompt_len), str(new), str(seed))
                if ref is None:
                    return 1
                rows.append(kvjax_side(folder, base, base_args, gates, ratio, ref, new))
        results[name] = {"scorer": scorer, "scorer_args": scorer_args, "gates": gates, "method": "merging",
                         "base": base, "base_args": base_args, "compression_ratio": ratio, "prompt_tokens": prompt_len,
                         "new_tokens": new, "runs": rows}
        same = sum(r["tokens_equal"] for r in rows)
        keys = sum(r["merging"]["heads_same_keys"] for r in rows)
        heads = sum(r["merging"]["heads"] for r in rows)
        copies = sum(r["merging"]["heads_differing_only_in_copies"] for r in rows)
        value = max(r["merging"]["largest_value_difference"] for r in rows)
        control = min(r["base_alone"]["largest_value_difference"] for r in rows)
        print(f"{name}: tokens equal in {same} / {len(rows)}; the same kept pairs in {keys} / {heads} heads (of the "
              f"others, {copies} keep the same tokens, another copy of a repeated one); in those heads the largest "
              f"value difference is {value:.2e} (the base alone: at least {control:.2e})")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
