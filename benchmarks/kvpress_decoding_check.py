"""kvjax's decode-time compression against kvpress's, generation by generation: `decoding` against `DecodingPress`
and `compression_ratio_decoding` against `CompressionRatioDecodingPress`, both over KNorm.

    python benchmarks/kvpress_decoding_check.py --kvpress_python=/work/venvs/kvpress/bin/python \
        --out=benchmarks/results/kvpress_decoding_check.json

Run with kvjax's Python; kvpress runs in its own virtual environment (`--kvpress_python`). Per case, the kvpress side
writes a random float32 Llama (2 layers, 4 heads, 2 KV heads, vocabulary 1,000; weights drawn with std 0.3 so that
attention is not uniform) with `save_pretrained`, draws a prompt, generates greedily under the press with
`model.generate`, and saves its final cache's keys and, at every forward, layer 0's cache length before the press
acts. kvjax loads that directory, generates as many tokens with the matching method, and compares: the tokens, and
each layer's and KV head's kept keys (each kvpress key found among kvjax's within 1e-3; both caches hold every
token but the last generated one). The cases cover the interval's cadence, the float64 rounding of the ratio's target
(`1 - 0.8` is 0.19999999999999996: a prompt of 40 tokens at an interval of 5 compresses at 45, 50, ... tokens seen,
where `int(seen * 0.19999999999999996)` is one less than `seen / 5`), and the compression after every token while
the target is one pair (a 12-token prompt at ratio 0.95; `target_size=1`).
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

import numpy as np
from kvpress_check import KVPRESS_IMPORTS, RANDOM_LLAMA, kvpress_side, parser

#: name: (kvpress press, its arguments, kvjax method, its arguments, prompt tokens, new tokens)
CASES = {
    "decoding_12_every_5": ("DecodingPress", {"target_size": 12, "compression_interval": 5},
                            "decoding", {"target_size": 12, "compression_interval": 5}, 37, 23),
    "decoding_1_every_4": ("DecodingPress", {"target_size": 1, "compression_interval": 4},
                           "decoding", {"target_size": 1, "compression_interval": 4}, 20, 9),
    "ratio_0.8_every_5": ("CompressionRatioDecodingPress", {"target_compression_ratio": 0.8, "compression_interval": 5},
                          "compression_ratio_decoding", {"target_compression_ratio": 0.8, "compression_interval": 5},
                          40, 23),
    "ratio_0.5_every_3": ("CompressionRatioDecodingPress", {"target_compression_ratio": 0.5, "compression_interval": 3},
                          "compression_ratio_decoding", {"target_compression_ratio": 0.5, "compression_interval": 3},
                          64, 20),
    "ratio_0.95_every_8": ("CompressionRatioDecodingPress",
                           {"target_compression_ratio": 0.95, "compression_interval": 8},
                           "compression_ratio_decoding", {"target_compression_ratio": 0.95, "compression_interval": 8},
                           12, 14),
}

#: Runs in kvpress's venv: argv = folder, press, its arguments (JSON), prompt tokens, new tokens, seed.
KVPRESS_SIDE = KVPRESS_IMPORTS + """
folder, press_name, press_args, prompt_len, new, seed = sys.argv[1:7]
""" + RANDOM_LLAMA + r"""
press = getattr(kvpress, press_name)(base_press=kvpress.KnormPress(), **json.loads(press_args))
lengths, attended = [], {}

def record(module, args, kwargs, output):  # registered before the press's hook: the cache the token attended
    keys = kwargs["past_key_values"].layers[module.layer_idx].keys[0]
    attended[module.layer_idx] = keys.clone().numpy()
    if module.layer_idx == 0:
        lengths.append(int(keys.shape[1]))

hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in model.model.layers]
with torch.no_grad(), press(model):
    result = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=int(new), do_sample=False,
                            pad_token_id=0, return_dict_in_generate=True)
for hook in hooks:
    hook.remove()
np.savez(folder + "/kvpress_keys.npz", *[attended[i] for i in range(config.num_hidden_layers)])
print(json.dumps({"prompt": prompt[0].tolist(), "tokens": result.sequences[0, int(prompt_len):].tolist(),
                  "lengths": lengths}))
"""


def kvjax_side(folder: str, method: str, args: dict, ref: dict, new: int) -> dict:
    """kvjax's generation of the same prompt and its comparison with kvpress's."""
    import kvjax
    from kvjax import cache as kvc

    model = kvjax.load_model(folder, dtype="float32")
    out = kvjax.generate(model, [ref["prompt"]], method=method, method_args=args, max_new_tokens=new,
                         return_cache=True)
    tokens = [int(t) for t in out.tokens[0]]
    sequence = ref["prompt"] + ref["tokens"]
    # layer 0's key of every position: a function of the token and its position alone
    every = kvjax.generate(model, [sequence[:-1]], method="full", max_new_tokens=1, return_cache=True).cache.layers[0]
    every_keys, every_pos = np.asarray(kvc.keys(every)[0], np.float64), np.asarray(every.pos[0])
    theirs = np.load(f"{folder}/kvpress_keys.npz")
    heads, identical, copies, worst = 0, 0, 0, 0.0
    for layer, cache in enumerate(out.cache.layers):
        length, pos = np.asarray(cache.length[0]), np.asarray(cache.pos[0])
        keys = np.asarray(kvc.keys(cache)[0], np.float64)
        for head in range(length.shape[0]):
            mine, their = keys[head, :length[head]], theirs[f"arr_{layer}"][head].astype(np.float64)
            nearest = np.linalg.norm(their[:, None] - mine[None], axis=-1).min(axis=1)  # each kvpress key's
            same = len(mine) == len(their) and bool((nearest < 1e-3).all())
            heads, identical, worst = heads + 1, identical + same, max(worst, float(nearest.max()))
            if layer == 0 and not same:  # the same tokens kept, another copy of a repeated one?
                found = np.linalg.norm(their[:, None] - every_keys[head][None], axis=-1).argmin(axis=1)
                kept_theirs = sorted(sequence[int(every_pos[head, i])] for i in found)
                copies += kept_theirs == sorted(sequence[int(p)] for p in pos[head, :length[head]])
    return {"tokens_equal": tokens == ref["tokens"], "heads_identical": identical, "heads": heads,
            "layer0_heads_differing_only_in_copies": copies, "largest_key_distance": worst,
            "kvpress_lengths": ref["lengths"]}


def main() -> int:
    args = parser(__doc__).parse_args()
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    results = {}
    for name, (press, press_args, method, method_args, prompt_len, new) in CASES.items():
        rows = []
        for seed in range(args.seeds):
            with tempfile.TemporaryDirectory(prefix="kvjax-decoding-check-") as folder:
                ref = kvpress_side(args.kvpress_python, KVPRESS_SIDE, folder, press, json.dumps(press_args),
                                   str(prompt_len), str(new), str(seed))
                if ref is None:
                    return 1
                rows.append(kvjax_side(folder, method, method_args, ref, new))
        results[name] = {"press": press, "press_args": press_args, "method": method, "method_args": method_args,
                         "prompt_tokens": prompt_len, "new_tokens": new, "runs": rows}
        same = sum(r["tokens_equal"] for r in rows)
        identical, heads = sum(r["heads_identical"] for r in rows), sum(r["heads"] for r in rows)
        copies = sum(r["layer0_heads_differing_only_in_copies"] for r in rows)
        print(f"{name}: tokens equal in {same} / {len(rows)}; kept keys identical in {identical} / {heads} heads "
              f"(of the others, {copies} layer-0 heads keep the same tokens, another copy of a repeated one); "
              f"kvpress's layer-0 lengths (seed 0): {rows[0]['kvpress_lengths']}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
