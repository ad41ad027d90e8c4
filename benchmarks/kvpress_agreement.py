"""Do kvjax and NVIDIA kvpress evict alike on a real model? Same prompts, same ids, answers compared.

    python benchmarks/kvpress_agreement.py --model=smollm2-135m --task=ruler/niah_single_1 \
        --context_length=2048 --samples=8 --out=benchmarks/results/kvpress_agreement.json

Builds `--samples` prompts of `--task` with kvjax's prompt encoder (the chat template where the tokenizer
has one; the question is fed after compression, kvpress's query-agnostic setting, or with `--query_aware`
compressed with the context, as in kvpress's query-aware runs), then generates
`--new_tokens` greedy tokens per prompt and method with kvjax and with kvpress (run by `--kvpress_python`, a
virtual environment with kvpress, torch and transformers < 5.3: see benchmarks/README.md) from the same
model directory. Prints, per method, the samples each library answers right (the task's own metric on the
text) and how many generations are token for token the same. Methods: kvpress's defaults, given to kvjax
by its own names. (kvpress 0.5.5's PyramidKVPress is left out: its layers of different lengths break the
attention mask of the question's multi-token forward in transformers 5.2. SimLayerKV's lazy layers are shorter
too: where the compressed cache's layers differ in length, the worker feeds the question one token at a time.)

`--measure=kept` compares what each library keeps instead: the context alone is prefilled with the method, and
per layer and KV head the kept positions of kvjax's cache are compared with kvpress's (kvpress's compressed keys
matched to the uncompressed forward's keys; for presses that mask instead of dropping, the complement of
`masked_key_indices`): mean Jaccard index per layer and head, and how many heads keep exactly the same set.
`--measure=both` does both.

The methods that read per-model learned files (`duo_attention_*`, `qfilter_*`, `fastkvzip_*`, `lukv_*`,
`expected_attention_stats_*`) get seeded files generated for the model's dimensions in the published layouts (a
DuoAttention pattern directory, a Q-Filters directory, Fast KVzip's gate tensors as safetensors, an LU-KV budget curve
`.npy`, an `ExpectedAttentionStats` directory); kvpress's loaders, which would fetch them from GitHub / the Hugging
Face hub by model name, are pointed at the same files (Fast KVzip: the worker builds kvpress's `FastKVzipGate`
modules and loads each with its layer's tensors, in place of the hub's pickled file; LU-KV: the press's
`_budget_curves` set to the array; Expected Attention's statistics: the press's `stats_folder`).
Compactor's (and LeverageScore's) random sketch is shared the same way: kvpress's leverage uses kvjax's draws
(`compactor_sketches`), unless `--own_sketches` (each library its own; the leverage then depends on the draws, even
for a square sketch).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import bench_util as bu

#: Placeholder for a method's learned file, replaced by the generated file's path (`learned_files`).
LEARNED = "<generated>"

# name: (kvpress press, its arguments, kvjax method, its arguments)
METHODS = {
    "full": (None, {}, "full", {}),
    "snapkv_0.25": ("SnapKVPress", dict(compression_ratio=0.25, window_size=64, kernel_size=5),
                    "snapkv", dict(compression_ratio=0.25, window_size=64, kernel_size=5)),
    "snapkv_0.5": ("SnapKVPress", dict(compression_ratio=0.5, window_size=64, kernel_size=5),
                   "snapkv", dict(compression_ratio=0.5, window_size=64, kernel_size=5)),
    # kvjax's SnapKV default window (32, the paper's) in place of kvpress's 64
    "snapkv_w32_0.25": ("SnapKVPress", dict(compression_ratio=0.25, window_size=32, kernel_size=5),
                        "snapkv", dict(compression_ratio=0.25, window_size=32, kernel_size=5)),
    "snapkv_w32_0.5": ("SnapKVPress", dict(compression_ratio=0.5, window_size=32, kernel_size=5),
                       "snapkv", dict(compression_ratio=0.5, window_size=32, kernel_size=5)),
    "knorm_0.25": ("KnormPress", dict(compression_ratio=0.25), "knorm", dict(compression_ratio=0.25)),
    "streaming_llm_0.25": ("StreamingLLMPress", dict(compression_ratio=0.25, n_sink=4),
                           "streaming_llm", dict(compression_ratio=0.25, sink_size=4)),
    "streaming_llm_0.75": ("StreamingLLMPress", dict(compression_ratio=0.75, n_sink=4),
                           "streaming_llm", dict(compression_ratio=0.75, sink_size=4)),
    "lagkv_0.5": ("LagKVPress", dict(compression_ratio=0.5, n_sink=4, lag_size=128),
                  "lagkv", dict(compression_ratio=0.5, sink_size=4, lag_size=128)),
    # issue 44's scorers and wrappers (kvpress 0.5.5 defaults; a nested press is [name, arguments])
    "expected_attention_0.25": ("ExpectedAttentionPress", dict(compression_ratio=0.25),
                                "expected_attention", dict(compression_ratio=0.25)),
    "expected_attention_0.5": ("ExpectedAttentionPress", dict(compression_ratio=0.5),
                               "expected_attention", dict(compression_ratio=0.5)),
    "expected_attention_0.75": ("ExpectedAttentionPress", dict(compression_ratio=0.75),
                                "expected_attention", dict(compression_ratio=0.75)),
    "keydiff_0.25": ("KeyDiffPress", dict(compression_ratio=0.25), "keydiff", dict(compression_ratio=0.25)),
    "keydiff_0.5": ("KeyDiffPress", dict(compression_ratio=0.5), "keydiff", dict(compression_ratio=0.5)),
    "keydiff_0.75": ("KeyDiffPress", dict(compression_ratio=0.75), "keydiff", dict(compression_ratio=0.75)),
    "observed_attention_0.5": ("ObservedAttentionPress", dict(compression_ratio=0.5),
                               "observed_attention", dict(compression_ratio=0.5)),
    "observed_attention_0.75": ("ObservedAttentionPress", dict(compression_ratio=0.75),
                                "observed_attention", dict(compression_ratio=0.75)),
    "criticalkv_ea_0.5": ("CriticalKVPress", dict(press=["ExpectedAttentionPress",
                                                         dict(compression_ratio=0.5, use_vnorm=False)]),
                          "criticalkv", dict(compression_ratio=0.5, base="expected_attention",
                                             base_args={"use_vnorm": False})),
    "criticalkv_ea_0.75": ("CriticalKVPress", dict(press=["ExpectedAttentionPress",
                                                          dict(compression_ratio=0.75, use_vnorm=False)]),
                           "criticalkv", dict(compression_ratio=0.75, base="expected_attention",
                                              base_args={"use_vnorm": False})),
    "criticalkv_snapkv_0.5": ("CriticalKVPress", dict(press=["SnapKVPress", dict(compression_ratio=0.5,
                                                                                   window_size=64, kernel_size=5)]),
                              "criticalkv", dict(compression_ratio=0.5, base="snapkv",
                                                 base_args={"window_size": 64, "kernel_size": 5})),
    "cur_0.5": ("CURPress", dict(compression_ratio=0.5), "cur", dict(compression_ratio=0.5)),
    "cur_0.75": ("CURPress", dict(compression_ratio=0.75), "cur", dict(compression_ratio=0.75)),
    # SimLayerKV: kvpress's defaults (threshold 1.0: never lazy), then thresholds that make some of SmolLM2's layers
    # lazy at 1K with a 256-token recent window (its laziness there runs from 0.25 to 0.97 across layers)
    "simlayerkv": ("SimLayerKVPress", {}, "simlayerkv", {}),
    **{f"simlayerkv_r256_{t}": ("SimLayerKVPress", dict(lazy_threshold=t, n_recent=256),
                                "simlayerkv", dict(lazy_threshold=t, n_recent=256)) for t in (0.6, 0.8)},
    # kvpress's threshold for Llama 3, its 1024-token recent window (trims only prompts over 1029 tokens)
    "simlayerkv_0.9": ("SimLayerKVPress", dict(lazy_threshold=0.9), "simlayerkv", dict(lazy_threshold=0.9)),
    "simlayerkv_last8_r256_0.8": ("SimLayerKVPress", dict(lazy_threshold=0.8, n_recent=256, n_last=8),
                                  "simlayerkv", dict(lazy_threshold=0.8, n_recent=256, n_last=8)),
    # CapKV (CapPress): kvpress's defaults (tau 5, 512 future positions, 4 sinks, epsilon 1e-6) on both sides
    **{f"capkv_{r}": ("CapPress", dict(compression_ratio=r), "capkv", dict(compression_ratio=r))
       for r in (0.25, 0.5, 0.75)},
    # Compactor: both libraries draw the same sketch (kvjax's, shipped to the worker: `compactor_sketches`), so the
    # leverage is deterministic; "kvpress" scores a partial last chunk as kvpress 0.5.5 runs it (padding keys at
    # logit 0), "fill" is kvjax's default (the authors' filled mass, padding keys masked)
    "compactor_0.5": ("CompactorPress", dict(compression_ratio=0.5),
                      "compactor", dict(compression_ratio=0.5, partial_chunk="kvpress")),
    "compactor_fill_0.5": ("CompactorPress", dict(compression_ratio=0.5),
                           "compactor", dict(compression_ratio=0.5)),
    "compactor_d64_0.5": ("CompactorPress", dict(compression_ratio=0.5, sketch_dimension=64),
                          "compactor", dict(compression_ratio=0.5, sketch_dimension=64, partial_chunk="kvpress")),
    "adakv_compactor_0.5": ("AdaKVPress", dict(press=["CompactorPress", dict(compression_ratio=0.5)]),
                            "adakv", dict(compression_ratio=0.5, base="compactor", max_head_share=8.0,
                                          base_args={"partial_chunk": "kvpress"})),
    "adakv_compactor_fill_0.5": ("AdaKVPress", dict(press=["CompactorPress", dict(compression_ratio=0.5)]),
                                 "adakv", dict(compression_ratio=0.5, base="compactor", max_head_share=8.0)),
    # LeverageScore, Compactor's leverage alone: the same shared sketch
    "leverage_0.5": ("LeverageScorePress", dict(compression_ratio=0.5), "leverage", dict(compression_ratio=0.5)),
    "leverage_0.75": ("LeverageScorePress", dict(compression_ratio=0.75), "leverage", dict(compression_ratio=0.75)),
    "adakv_leverage_0.5": ("AdaKVPress", dict(press=["LeverageScorePress", dict(compression_ratio=0.5)]),
                           "adakv", dict(compression_ratio=0.5, base="leverage", max_head_share=8.0)),
    # NonCausalAttention, Compactor's attention alone: kvpress's padding keys, the authors' fill, Ada-KV over it
    "non_causal_attention_0.5": ("NonCausalAttnPress", dict(compression_ratio=0.5), "non_causal_attention",
                                 dict(compression_ratio=0.5, partial_chunk="kvpress")),
    "non_causal_attention_fill_0.5": ("NonCausalAttnPress", dict(compression_ratio=0.5), "non_causal_attention",
                                      dict(compression_ratio=0.5)),
    "non_causal_attention_0.75": ("NonCausalAttnPress", dict(compression_ratio=0.75), "non_causal_attention",
                                  dict(compression_ratio=0.75, partial_chunk="kvpress")),
    "adakv_non_causal_attention_0.5": ("AdaKVPress", dict(press=["NonCausalAttnPress", dict(compression_ratio=0.5)]),
                                       "adakv", dict(compression_ratio=0.5, base="non_causal_attention",
                                                     max_head_share=8.0, base_args=dict(partial_chunk="kvpress"))),
    # ChunkPress: each chunk compressed alone (kvpress's SnapKV rotates a chunk's window queries with the RoPE of the
    # prompt's last positions; key-only scorers are unaffected)
    "chunk_knorm_0.5": ("ChunkPress", dict(press=["KnormPress", dict(compression_ratio=0.5)], chunk_length=512),
                        "chunk", dict(compression_ratio=0.5, chunk_length=512, base="knorm")),
    "chunk_keydiff_0.75": ("ChunkPress", dict(press=["KeyDiffPress", dict(compression_ratio=0.75)], chunk_length=512),
                           "chunk", dict(compression_ratio=0.75, chunk_length=512, base="keydiff")),
    "chunk_snapkv_0.5": ("ChunkPress", dict(press=["SnapKVPress", dict(compression_ratio=0.5, window_size=64)],
                                            chunk_length=1024),
                         "chunk", dict(compression_ratio=0.5, chunk_length=1024, base="snapkv",
                                       base_args=dict(window_size=64))),
    "chunk_snapkv_kvpress_0.5": ("ChunkPress", dict(press=["SnapKVPress", dict(compression_ratio=0.5, window_size=64)],
                                                    chunk_length=1024),
                                 "chunk", dict(compression_ratio=0.5, chunk_length=1024, base="snapkv",
                                               base_args=dict(window_size=64), query_rope="kvpress")),
    # one chunk (the whole prompt): the window's RoPE is then the same in both libraries
    "chunk_snapkv_one_0.5": ("ChunkPress", dict(press=["SnapKVPress", dict(compression_ratio=0.5, window_size=64)],
                                                chunk_length=2048),
                             "chunk", dict(compression_ratio=0.5, chunk_length=2048, base="snapkv",
                                           base_args=dict(window_size=64))),
    # BlockPress: the kept set re-chosen with each block of 128 (kvpress's default); SnapKV's window is the block's
    # last queries, which kvpress rotates with the RoPE of the prompt's last positions
    "block_knorm_0.5": ("BlockPress", dict(press=["KnormPress", dict(compression_ratio=0.5)], block_size=128),
                        "block", dict(compression_ratio=0.5, block_size=128, base="knorm")),
    "block_keydiff_0.75": ("BlockPress", dict(press=["KeyDiffPress", dict(compression_ratio=0.75)], block_size=128),
                           "block", dict(compression_ratio=0.75, block_size=128, base="keydiff")),
    **{f"block_snapkv{'_kvpress' if rope == 'kvpress' else ''}_0.5": (
        "BlockPress", dict(press=["SnapKVPress", dict(compression_ratio=0.5, window_size=64)], block_size=128),
        "block", dict(compression_ratio=0.5, block_size=128, base="snapkv", base_args=dict(window_size=64),
                      query_rope=rope)) for rope in ("own", "kvpress")},
    # one block of the whole rest of the prompt (SnapKV over the prompt at once); blocks of 512 and 160 (a last block
    # longer than the window: 128 leaves 43-45 tokens at 2K, where kvpress's window reads kept tokens' mixed rows)
    **{f"block{size}_snapkv_kvpress_0.5": (
        "BlockPress", dict(press=["SnapKVPress", dict(compression_ratio=0.5, window_size=64)], block_size=size),
        "block", dict(compression_ratio=0.5, block_size=size, base="snapkv", base_args=dict(window_size=64),
                      query_rope="kvpress")) for size in (2048, 512, 160)},
    # kept positions only: kvpress's layers of different lengths need flash attention for the question's forward
    "per_layer_keydiff": ("PerLayerCompressionPress", dict(press=["KeyDiffPress", {}],
                                                           compression_ratios=[0.25, 0.75] * 15),
                          "per_layer", dict(base="keydiff", compression_ratios=[0.25, 0.75] * 15)),
    "key_rerotation_knorm_0.5": ("KeyRerotationPress", dict(press=["KnormPress", dict(compression_ratio=0.5)]),
                                 "key_rerotation", dict(base="knorm", compression_ratio=0.5)),
    # kvjax caps a head at max_head_share x the budget (a static cache); 8 lifts the cap at these ratios, as kvpress
    "criticaladakv_ea_0.5": ("CriticalAdaKVPress", dict(press=["ExpectedAttentionPress",
                                                               dict(compression_ratio=0.5, use_vnorm=False)]),
                             "criticaladakv", dict(compression_ratio=0.5, base="expected_attention", max_head_share=8.0,
                                                   base_args={"use_vnorm": False})),
    # the leaderboard's AdaKV and CriticalAdaKV over SnapKV (kvpress's window 64 on both sides), at an 8-token
    # window, where Ada-KV's safeguard (kvjax: counted after the protected window; kvpress: with it) differs less,
    # and with kvpress's safeguard (`safeguard="kvpress"`)
    **{f"{name}_snapkv{tag}_0.5": (press, dict(press=["SnapKVPress", dict(compression_ratio=0.5, window_size=w,
                                                                            kernel_size=5)]),
                                   name, dict(compression_ratio=0.5, base="snapkv", max_head_share=8.0,
                                              base_args={"window_size": w, "kernel_size": 5}, **extra))
       for name, press in (("adakv", "AdaKVPress"), ("criticaladakv", "CriticalAdaKVPress"))
       for tag, w, extra in (("", 64, {}), ("_w8", 8, {}), ("_kvpress", 64, {"safeguard": "kvpress"}))},
    # issue 44 items 3 / 7b: KVzap's surrogate (generated weights, `--kvzap_weights`; KVZAP is replaced by that path)
    # alone and under DMS's threshold, and DMS over Knorm (kvpress scores Knorm as -||k||)
    "kvzap_0.5": ("KVzapPress", dict(compression_ratio=0.5, model_type="mlp"),
                  "kvzap", dict(compression_ratio=0.5, weights="KVZAP")),
    "dms_kvzap": ("DMSPress", dict(press=["KVzapPress", dict(model_type="mlp")], threshold=0.0,
                                   sliding_window_size=128),
                  "dms", dict(threshold=0.0, sliding_window_size=128, base="kvzap", base_args={"weights": "KVZAP"})),
    "dms_knorm": ("DMSPress", dict(press=["KnormPress", {}], threshold=-8.0, sliding_window_size=128),
                  "dms", dict(threshold=-8.0, sliding_window_size=128, base="knorm")),
    # per-model learned files: both libraries read the same generated files (LEARNED: written for the model by
    # `learned_files`; kvpress's loaders are pointed at them instead of GitHub / the Hugging Face hub)
    **{f"duo_attention_{r}": ("DuoAttentionPress", dict(head_compression_ratio=r),
                              "duo_attention", dict(head_compression_ratio=r, patterns=LEARNED))
       for r in (0.25, 0.5, 0.75)},
    **{f"qfilter_{r}": ("QFilterPress", dict(compression_ratio=r),
                        "qfilter", dict(compression_ratio=r, filters=LEARNED)) for r in (0.25, 0.5, 0.75)},
    # Fast KVzip: both libraries read the same generated gates (LEARNED; non-zero sink keys and biases); kvpress is
    # uncapped (share 8 lifts kvjax's cap at these ratios)
    **{f"fastkvzip_{r}": ("FastKVzipPress", dict(compression_ratio=r),
                          "fastkvzip", dict(compression_ratio=r, max_head_share=8.0, gates=LEARNED))
       for r in (0.5, 0.75)},
    "fastkvzip_layerwise_0.5": ("FastKVzipPress", dict(compression_ratio=0.5, layerwise=True),
                                "fastkvzip", dict(compression_ratio=0.5, layerwise=True, max_head_share=8.0,
                                                  gates=LEARNED)),
    # LU-KV over its default Expected Attention (epsilon 2e-2, sink 4, window 1): a generated budget curve, set as
    # the press's `_budget_curves` (kvpress would fetch the published curve by model name, Llama-3.1-8B's only)
    **{f"lukv_{r}": ("LUKVPress", dict(compression_ratio=r), "lukv", dict(compression_ratio=r, curve=LEARNED))
       for r in (0.25, 0.5, 0.75)},
    # Expected Attention with offline query statistics: both libraries read the same generated statistics (kvpress
    # from `stats_folder`, in place of the hub's `alessiodevoto/exp_att_stats_<model>_...`)
    **{f"expected_attention_stats_{r}": ("ExpectedAttentionStatsPress", dict(compression_ratio=r, stats_folder=LEARNED),
                                         "expected_attention_stats", dict(compression_ratio=r, stats=LEARNED))
       for r in (0.25, 0.5, 0.75)},
    # KVzip: kvjax gets the repeat prompt's ids from the tokenizer (`kvzip_prompt`); kvpress is uncapped (share 8)
    "kvzip_0.5": ("KVzipPress", dict(compression_ratio=0.5), "kvzip", dict(compression_ratio=0.5, max_head_share=8.0)),
    "kvzip_0.75": ("KVzipPress", dict(compression_ratio=0.75),
                   "kvzip", dict(compression_ratio=0.75, max_head_share=8.0)),
    "kvzip_chunk512_0.5": ("KVzipPress", dict(compression_ratio=0.5, chunk_size=512),
                           "kvzip", dict(compression_ratio=0.5, chunk_size=512, max_head_share=8.0)),
    # KVzip+ (kvpress's leaderboard entry `kvzip_plus`): the same press with its normalisation
    **{f"kvzip_plus_{r}": ("KVzipPress", dict(compression_ratio=r, kvzip_plus_normalization=True),
                           "kvzip", dict(compression_ratio=r, max_head_share=8.0, kvzip_plus_normalization=True))
       for r in (0.5, 0.75)},
    # KVgrad (KVgradPress): KVzip's replay in chunks of 512, differentiated
    **{f"kvgrad_{r}": ("KVgradPress", dict(compression_ratio=r),
                       "kvgrad", dict(compression_ratio=r, max_head_share=8.0)) for r in (0.5, 0.75)},
    # KVCompose (KVComposePress): the context replayed bare over its own cache, composite tokens per layer (default)
    # or per-head counts (structured=False); kvpress is uncapped (share 8)
    **{f"kvcompose_{r}": ("KVComposePress", dict(compression_ratio=r),
                          "kvcompose", dict(compression_ratio=r, max_head_share=8.0)) for r in (0.5, 0.75)},
    **{f"kvcompose_unstructured_{r}": ("KVComposePress", dict(compression_ratio=r, structured=False),
                                       "kvcompose", dict(compression_ratio=r, structured=False, max_head_share=8.0))
       for r in (0.5, 0.75)},
    # query-aware (run with --query_aware): Finch's window is each sample's question ("question": its token count;
    # kvpress finds it from a delimiter the worker inserts there); no re-rotation, so kept keys match by value
    "finch_0.5": ("FinchPress", dict(compression_ratio=0.5, rerotate_keys=False),
                  "finch", dict(compression_ratio=0.5, window_size="question", rerotate=False)),
    "finch_0.75": ("FinchPress", dict(compression_ratio=0.75, rerotate_keys=False),
                   "finch", dict(compression_ratio=0.75, window_size="question", rerotate=False)),
    "finch_chunked_0.5": ("FinchPress", dict(compression_ratio=0.5, chunk_length=512, rerotate_keys=False),
                          "finch", dict(compression_ratio=0.5, window_size="question", chunk_length=512,
                                        rerotate=False)),
    # kvpress's ChunkKV default chunk (20) over its SnapKV default (window 64)
    "chunkkv_0.5": ("ChunkKVPress", dict(press=["SnapKVPress", dict(compression_ratio=0.5, window_size=64,
                                                                     kernel_size=5)], chunk_length=20),
                    "chunkkv", dict(compression_ratio=0.5, chunk_size=20, base_args={"window_size": 64})),
    "chunkkv_0.75": ("ChunkKVPress", dict(press=["SnapKVPress", dict(compression_ratio=0.75, window_size=64,
                                                                      kernel_size=5)], chunk_length=20),
                     "chunkkv", dict(compression_ratio=0.75, chunk_size=20, base_args={"window_size": 64})),
    # EntropyGatedChunkKV at kvpress's defaults (chunks of 10, spiky ones cut to 4 tokens) over SnapKV (window 64);
    # kvjax's default lets the window's tokens compete in their chunks as kvpress's press does (a gated chunk can
    # drop some). Rows measured before that default (2026-12-05): `entropy_gated_chunkkv_{r}` then meant "kept"
    # (now `entropy_gated_chunkkv_kept_{r}`), `entropy_gated_chunkkv_kvpress_{r}` the mode now the default.
    **{f"entropy_gated_chunkkv{mode}_{r}": (
        "EntropyGatedChunkKVPress", dict(press=["SnapKVPress", dict(compression_ratio=r, window_size=64,
                                                                    kernel_size=5)],
                                         chunk_length=10, low_entropy_chunk_length=4),
        "entropy_gated_chunkkv", dict(compression_ratio=r, chunk_size=10, low_entropy_chunk_length=4,
                                      base_args={"window_size": 64}, **extra))
       for r in (0.5, 0.75) for mode, extra in (("", {}), ("_kept", {"protected_tokens": "kept"}))},
}
#: Presses that need a delimiter token before the question (the worker inserts one, then the press drops it).
DELIMITED = ("FinchPress",)

#: Presses that read the attention weights (kvpress needs transformers' eager attention for them).
EAGER = ("ObservedAttentionPress",)

#: Presses whose context manager replaces the decoder's forward (`model.model.forward`): the worker prefills through
#: `model.model`, as kvpress's pipeline does (KVComposePress switches to eager attention itself and replays the
#: context inside that forward).
INNER = ("KVComposePress",)

KVPRESS_SCRIPT = r"""
import json, sys, torch, kvpress
from transformers import AutoModelForCausalLM, DynamicCache
torch.set_num_threads(int(sys.argv[3]))
job = json.load(open(sys.argv[2]))
models = {}
if job.get("stable_topk"):  # ties in a stable order, the lower index first (kvjax's), in place of torch's own
    import collections
    TopK = collections.namedtuple("topk", "values indices")

    def stable_topk(x, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
        return TopK(values.narrow(dim, 0, k), indices.narrow(dim, 0, k))

    torch.topk = torch.Tensor.topk = stable_topk

def model_for(eager):
    impl = "eager" if eager else "sdpa"
    if impl not in models:
        models[impl] = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32,
                                                            attn_implementation=impl).eval()
    return models[impl]

def build(name, args):
    args = dict(args)
    if "press" in args:
        args["press"] = build(*args["press"])
    press = getattr(kvpress, name)(**args)
    if name == "FastKVzipPress":  # kvpress's own gate modules, each loaded with its layer's generated tensors
        from safetensors.torch import load_file
        from kvpress.presses.fastkvzip_press import FastKVzipGate
        tensors = load_file(job["learned"]["fastkvzip"] + "/model.safetensors")
        gates = []
        for i in range(len({k.split(".")[1] for k in tensors})):
            sd = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"layers.{i}.")}
            nhead, _, sink, dim = sd["k_base"].shape
            gate = FastKVzipGate(i, sd["q_proj.weight"].shape[1], nhead, sd["b"].shape[2], torch.float32, dim, sink)
            gate.load_state_dict(sd, strict=True)
            gates.append(gate.eval())
        press.gates = gates
    if name == "LUKVPress":  # the generated curve, in place of the download by model name
        import numpy as np
        press._budget_curves = np.load(job["learned"]["lukv"], allow_pickle=False)
    if name == "KVzapPress":  # the local generated checkpoint, under the name kvpress would fetch
        from kvpress.presses.kvzap_press import KVzapModel
        press.kvzap_model = KVzapModel.from_pretrained(job["kvzap_weights"])
        press.kvzap_model_name = f"nvidia/KVzap-{press.model_type}-{sys.argv[1].rstrip('/').split('/')[-1]}"
    return press

def eager(name, args):
    return name in job["eager"] or ("press" in args and eager(*args["press"]))

def prefill(model, press, ctx, window=0):
    cache = DynamicCache()
    if press is not None and type(press).__name__ in job["delimited"]:
        # an id the prompt does not hold marks where the question starts; the press removes it after embedding
        press.delimiter_token_id = model.config.vocab_size - 1
        assert press.delimiter_token_id not in ctx[0].tolist()
        split = ctx.shape[1] - window
        ctx = torch.cat([ctx[:, :split], torch.tensor([[press.delimiter_token_id]]), ctx[:, split:]], dim=1)
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
    if press is None:
        model(input_ids=ctx, past_key_values=cache, use_cache=True)
    elif type(press).__name__ in job["inner"]:  # the pipeline's own prefill call
        with press(model):
            model.model(input_ids=ctx, past_key_values=cache)
    else:
        with press(model):
            model(input_ids=ctx, past_key_values=cache, use_cache=True)
    return cache

def kept(model, cache, full, n):
    # per layer, per KV head: sorted positions of the pairs kvpress keeps
    out = []
    for i, layer in enumerate(model.model.layers):
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        keys, ref = cache.layers[i].keys[0].float(), full.layers[i].keys[0].float()
        heads = []
        for h in range(keys.shape[0]):
            if masked is not None:
                _, hi, si = masked
                gone = set(si[hi == h].tolist())
                heads.append([p for p in range(n) if p not in gone])
                continue
            a, b = keys[h], ref[h]
            d = (a * a).sum(-1)[:, None] + (b * b).sum(-1)[None] - 2 * a @ b.T
            heads.append(sorted(d.argmin(-1).tolist()))
        out.append(heads)
    return out

learned = job.get("learned", {})
if "duo_attention" in learned:  # kvpress's own parsing of the pattern, from the local directory
    import numpy as np
    from kvpress.presses.duo_attention_press import DuoAttentionPress

    def local_pattern(model, d=learned["duo_attention"]):
        config = json.load(open(d + "/config.json"))
        scores = np.clip(np.loadtxt(d + "/full_attention_heads.tsv", dtype=float, delimiter="\t"), 0, 1)
        return config["sink_size"], config["recent_size"], scores

    DuoAttentionPress.load_attention_pattern = staticmethod(local_pattern)
if "qfilter" in learned:  # QFilters.from_pretrained on the local directory (the hub layout)
    from kvpress.presses.qfilter_press import QFilterPress, QFilters
    QFilterPress.load_q_filters = staticmethod(lambda name, d=learned["qfilter"]: QFilters.from_pretrained(d).q_filters)

sketch = {"layer": None, "draws": None}  # kvjax's sketch draws for the running method and layer (`compactor_sketches`)
if job.get("sketches"):
    import numpy as np
    from kvpress.presses import leverage_press

    plain_score = kvpress.CompactorPress.score

    def score_layer(self, module, *args, **kwargs):
        sketch["layer"] = module.layer_idx
        return plain_score(self, module, *args, **kwargs)

    class SharedSketch:  # torch, except that the leverage's Gaussian draws are kvjax's
        def __getattr__(self, name):
            return getattr(torch, name)

        def randn(self, *shape, device=None, dtype=None):
            draws = torch.from_numpy(sketch["draws"][sketch["layer"]]).to(device=device, dtype=dtype)
            assert tuple(draws.shape) == tuple(shape[1:]), (draws.shape, shape)
            return draws.expand(*shape)

    plain_leverage = leverage_press.LeverageScorePress.score

    def leverage_layer(self, module, *args, **kwargs):
        sketch["layer"] = module.layer_idx
        return plain_leverage(self, module, *args, **kwargs)

    kvpress.CompactorPress.score = score_layer
    leverage_press.LeverageScorePress.score = leverage_layer
    leverage_press.torch = SharedSketch()

out = {}
for name, (press_name, press_args) in job["methods"].items():
    press = build(press_name, press_args) if press_name else None
    if name in job.get("sketches", {}):
        sketch["draws"] = np.load(job["sketches"][name])
    model = model_for(press_name is not None and eager(press_name, press_args))
    rows, kept_rows = [], []
    for s in job["samples"]:
        with torch.inference_mode():
            n = len(s["ctx"])
            ctx = torch.tensor([s["ctx"]])
            if job["kept"]:
                full = prefill(model, None, ctx)
                kept_rows.append(kept(model, prefill(model, press, ctx, s["window"]), full, n))
            if not job["generate"]:
                continue
            cache = prefill(model, press, ctx, s["window"])
            x = torch.tensor([s["q"]])  # the question, uncompressed, at its original positions
            pos = torch.arange(n, n + x.shape[1])[None]
            tokens = []
            if len({layer.keys.shape[2] for layer in cache.layers}) > 1:
                # layers of different lengths (SimLayerKV's lazy ones): transformers 5.2 sizes a multi-token
                # forward's mask by layer 0, so the question goes one token at a time (a one-token forward needs none)
                for i in range(x.shape[1] - 1):
                    model(input_ids=x[:, i:i + 1], position_ids=pos[:, i:i + 1], past_key_values=cache, use_cache=True)
                x, pos = x[:, -1:], pos[:, -1:]
            for _ in range(job["new_tokens"]):
                logits = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True).logits
                x = logits[:, -1:].argmax(-1)
                tokens.append(int(x))
                pos = pos[:, -1:] + 1
        rows.append(tokens)
    out[name] = dict(tokens=rows, kept=kept_rows)
    print(name, flush=True, file=sys.stderr)
print(json.dumps(out))
"""


KVZAP_WRITER = r"""
import sys, torch
from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
torch.manual_seed(int(sys.argv[5]))
config = KVzapConfig(input_dim=int(sys.argv[2]), output_dim=int(sys.argv[3]), n_modules=int(sys.argv[4]),
                     hidden_dim=int(sys.argv[6]))
KVzapModel(config).save_pretrained(sys.argv[1])
"""


def write_kvzap_weights(python: str, folder: str, config, hidden_dim: int = 64, seed: int = 0) -> None:
    """Random KVzap weights for the model, written by kvpress's own `KVzapModel.save_pretrained` (the published
    layout), so both libraries load the same file."""
    env = dict(os.environ, PYTHONPATH="")
    subprocess.run([python, "-c", KVZAP_WRITER, folder, str(config.hidden_size), str(config.num_kv_heads),
                    str(config.num_layers), str(seed), str(hidden_dim)], check=True, env=env, capture_output=True)


#: kvjax methods whose leverage draws Compactor's Gaussian sketch (the same defaults: seed 0, 48 columns).
SKETCHED = ("compactor", "leverage")


def with_weights(args, path: str):
    """`args` with every "KVZAP" placeholder (kvjax's arguments, nested dicts too) replaced by `path`."""
    if isinstance(args, dict):
        return {k: with_weights(v, path) for k, v in args.items()}
    return path if args == "KVZAP" else args


def compactor_args(method: str, method_args: dict) -> dict | None:
    """The hyperparameters of a kvjax method that sketches keys as Compactor (`compactor` or `leverage`, itself or
    `adakv`'s base), or None for another."""
    if method in SKETCHED:
        return method_args
    if method_args.get("base") in SKETCHED:
        return method_args.get("base_args", {})
    return None


def compactor_sketches(names: list[str], config, out: pathlib.Path) -> dict[str, str]:
    """Per Compactor method, an `.npy` of kvjax's sketch draws `[L, K, head_dim, sketch_dimension]`
    (`kvjax.methods.common.gaussian_sketch`, the method's `seed`), which the kvpress worker's leverage uses in
    place of torch's global generator: both libraries then sketch the keys alike."""
    import numpy as np

    from kvjax.methods.common import gaussian_sketch
    from kvjax.methods.compactor import Compactor

    paths = {}
    for name in names:
        args = compactor_args(METHODS[name][2], METHODS[name][3])
        if args is None:
            continue
        seed, dim = args.get("seed", Compactor.seed), args.get("sketch_dimension", Compactor.sketch_dimension)
        draws = np.stack([np.asarray(gaussian_sketch(seed, layer, config.num_kv_heads, config.head_dim, dim))
                          for layer in range(config.num_layers)])
        paths[name] = str(out / f"sketch_{name}.npy")
        np.save(paths[name], draws)
    return paths


def learned_files(model_dir: str, out: pathlib.Path) -> dict[str, str]:
    """Generated files in the published layouts for the model's dimensions (seeded): a DuoAttention pattern (distinct
    head scores, the official runs' sink 128 / recent 256), Q-Filters (unit-variance normal), Fast KVzip's gates
    (`fastkvzip.seeded_gates`, one per layer, the model's query groups per KV head as the published gates have), an
    LU-KV budget curve (`[99, layers, kv_heads]` prune ratios: row `t` keeps `(1 - (t + 1) / 100) * w` of each head,
    distinct weights `w` of mean 1 in [0.3, 1.7], clipped to [0, 1]) and Expected Attention's query statistics (per
    layer and query head a unit-normal mean and the covariance `A A^T / head_dim`, `A` unit-normal)."""
    import numpy as np

    from kvjax.methods.duo_attention import write_attention_pattern
    from kvjax.methods.expected_attention_stats import write_statistics
    from kvjax.methods.fastkvzip import seeded_gates, write_gates
    from kvjax.methods.lukv import CURVE_ROWS, write_budget_curve
    from kvjax.methods.qfilter import write_qfilters

    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rng = np.random.default_rng(0)
    scores = rng.permutation(layers * kv_heads).reshape(layers, kv_heads) / (layers * kv_heads)
    duo = write_attention_pattern(out / "duo_pattern", scores, sink_size=128, recent_size=256, model_name=model_dir)
    filters = rng.normal(size=(layers, kv_heads, head_dim)).astype(np.float32)
    gates = seeded_gates(layers, config["hidden_size"], kv_heads, config["num_attention_heads"] // kv_heads)
    weights = 0.3 + 1.4 * (rng.permutation(layers * kv_heads).reshape(layers, kv_heads) + 0.5) / (layers * kv_heads)
    keep = (1.0 - (np.arange(CURVE_ROWS) + 1.0) / 100.0)[:, None, None] * weights[None]
    curve = write_budget_curve(out / "lukv_curve.npy", 1.0 - np.clip(keep, 0.0, 1.0))
    heads = config["num_attention_heads"]
    mean = rng.normal(size=(layers, heads, head_dim)).astype(np.float32)
    root = rng.normal(size=(layers, heads, head_dim, head_dim))
    stats = write_statistics(out / "ea_stats", mean, np.einsum("lnij,lnkj->lnik", root, root) / head_dim,
                             model_name=model_dir, dataset_name="generated")
    return {"duo_attention": str(duo), "qfilter": str(write_qfilters(out / "qfilters", filters)),
            "fastkvzip": str(write_gates(out / "fastkvzip_gates", gates)), "lukv": str(curve),
            "expected_attention_stats": str(stats)}


def with_files(method: str, method_args: dict, files: dict[str, str]) -> dict:
    """`method_args` with LEARNED replaced by the generated file of `method`."""
    return {k: files[method] if v == LEARNED else v for k, v in method_args.items()}


def for_sample(method_args: dict, window: int) -> dict:
    """The method's arguments for one sample: `window_size="question"` becomes the sample's question length."""
    return {k: (window if v == "question" else v) for k, v in method_args.items()}


def kvjax_kept(model, ctx: list[int], method: str, method_args: dict) -> list:
    """`[L][K]` sorted prompt positions kvjax keeps after prefilling `ctx` with the method."""
    import kvjax

    out = kvjax.generate(model, [ctx], method=method, method_args=method_args or None, max_new_tokens=1,
                         stop_at_eos=False, return_cache=True)
    return [[[p for p in head if p < len(ctx)] for head in layer[0]] for layer in kvjax.cache.positions_kept(out.cache)]


def jaccard(ours: list, theirs: list) -> dict:
    """Per layer mean Jaccard index over samples and heads; the overall mean; heads with identical sets."""
    per_layer, same, heads = [], 0, 0
    for layer in range(len(ours[0])):
        values = []
        for mine, other in zip(ours, theirs, strict=True):
            for a, b in zip(mine[layer], other[layer], strict=True):
                a, b = set(a), set(b)
                values.append(len(a & b) / max(len(a | b), 1))
                same += a == b
                heads += 1
        per_layer.append(sum(values) / len(values))
    return dict(mean=sum(per_layer) / len(per_layer), min_layer=min(per_layer), identical_heads=same, heads=heads,
                per_layer=[round(v, 4) for v in per_layer])


def trimmed_layers(kept: list, encoded: list) -> int:
    """How many (sample, layer) pairs keep fewer than the whole context in some KV head (SimLayerKV's lazy layers)."""
    return sum(any(len(head) < len(ctx) for head in layer) for sample, (ctx, _) in zip(kept, encoded, strict=True)
               for layer in sample)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="kvjax preset or model directory")
    p.add_argument("--task", default="ruler/niah_single_1")
    p.add_argument("--context_length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--query_aware", action="store_true",
                   help="the question is part of the compressed prompt (kvpress's query-aware setting)")
    p.add_argument("--new_tokens", type=int, default=24)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--kvpress_python", default="/work/venvs/kvpress/bin/python")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the kvpress process")
    p.add_argument("--measure", default="generate", choices=("generate", "kept", "both"),
                   help="greedy generations, kept positions per layer and head, or both")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--own_sketches", action="store_true",
                   help="Compactor: each library draws its own random sketch (default: kvpress uses kvjax's draws)")
    p.add_argument("--stable_topk", action="store_true",
                   help="kvpress's torch.topk made stable (ties to the lower index, as kvjax): a diagnostic for "
                        "presses whose result depends on the order torch gives tied scores")
    p.add_argument("--kvzap_weights", default=None,
                   help="local KVzap checkpoint for the kvzap methods (written with random weights by kvpress's "
                        "KVzapModel when the directory does not exist)")
    p.add_argument("--ea_stats", default=None,
                   help="Expected Attention's query statistics for the expected_attention_stats methods (a directory "
                        "from python -m kvjax.calibrate --method=expected_attention_stats; default: generated ones)")
    args = p.parse_args(argv)
    generate, measure_kept = args.measure in ("generate", "both"), args.measure in ("kept", "both")
    names = [m for m in args.methods.split(",") if m]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        p.error(f"unknown --methods {unknown}; choose from {list(METHODS)}")

    import jax

    import kvjax
    from kvjax.eval.runner import PromptEncoder
    from kvjax.models.presets import resolve_model_dir
    from kvjax.models.tokenizer import load_tokenizer
    from kvjax.tasks import get

    model_dir = str(resolve_model_dir(args.model))
    needs_kvzap = any("KVZAP" in json.dumps(METHODS[m][3]) for m in names)
    if needs_kvzap and not args.kvzap_weights:
        p.error("the kvzap methods need --kvzap_weights=DIR (a local KVzap checkpoint; generated when absent)")
    if needs_kvzap and not pathlib.Path(args.kvzap_weights, "config.json").is_file():
        from kvjax.models.config import ModelConfig

        write_kvzap_weights(args.kvpress_python, args.kvzap_weights, ModelConfig.from_dir(model_dir))
    tokenizer = load_tokenizer(args.model)
    encoder = PromptEncoder(tokenizer, "auto")
    task = get(args.task, tokenizer=tokenizer)
    samples = task.samples(count_tokens=encoder.count_tokens, context_length=args.context_length,
                           num_samples=args.samples, seed=0)
    encoded = [encoder.encode(task, s, query_aware=args.query_aware) for s in samples]
    # the question's tokens at the end of each query-aware context (the context without it is a prefix of it)
    windows = [len(c) - len(encoder.encode(task, s, query_aware=False)[0]) if args.query_aware else 0
               for (c, _), s in zip(encoded, samples, strict=True)]
    asks = [m for m in names if "question" in METHODS[m][3].values()]
    if asks and not args.query_aware:
        p.error(f"{asks} read the question inside the prompt: add --query_aware")

    tmp = tempfile.TemporaryDirectory()  # the job and the generated files, removed when the run ends
    files = learned_files(model_dir, pathlib.Path(tmp.name))
    if args.ea_stats:
        files["expected_attention_stats"] = str(pathlib.Path(args.ea_stats).resolve())
    if args.own_sketches:
        sketches = {}
    else:
        from kvjax.models.config import ModelConfig

        sketches = compactor_sketches(names, ModelConfig.from_dir(model_dir), pathlib.Path(tmp.name))
    job = pathlib.Path(tmp.name) / "job.json"
    job.write_text(json.dumps(dict(
        samples=[dict(ctx=c, q=q, window=w) for (c, q), w in zip(encoded, windows, strict=True)],
        new_tokens=args.new_tokens, eager=EAGER,
        methods={m: (METHODS[m][0], with_files(METHODS[m][2], METHODS[m][1], files)) for m in names},
        delimited=DELIMITED, inner=INNER, kept=measure_kept, generate=generate, learned=files,
        kvzap_weights=args.kvzap_weights, sketches=sketches, stable_topk=args.stable_topk,
    )))
    env = dict(os.environ, PYTHONPATH="")
    proc = subprocess.run([args.kvpress_python, "-c", KVPRESS_SCRIPT, model_dir, str(job), str(args.threads)],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"kvpress worker failed:\n{proc.stderr[-3000:]}")
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])

    model = kvjax.load_model(args.model)
    rows = []
    for name in names:
        # the previous row's compiled programs go: a method with a program per layer size (`lukv`, `per_layer`) holds
        # enough of them to exhaust the process's memory maps (vm.max_map_count) after a few rows
        jax.clear_caches()
        _, _, method, method_args = METHODS[name]
        method_args = with_weights(method_args, args.kvzap_weights)
        method_args = with_files(method, method_args, files)
        if method in ("kvzip", "kvgrad"):  # the repeat prompt and the chat template's ids, as KVzipPress builds them
            from kvjax.methods.kvzip import prompt_ids

            method_args = {**prompt_ids(tokenizer), **method_args}
        row = dict(method=name, samples=len(samples))
        if measure_kept:
            ours_kept = [kvjax_kept(model, ctx, method, for_sample(method_args, w))
                         for (ctx, _), w in zip(encoded, windows, strict=True)]
            row["kept"] = jaccard(ours_kept, theirs[name]["kept"])
            row["kept"]["trimmed_layers"] = dict(kvjax=trimmed_layers(ours_kept, encoded),
                                                 kvpress=trimmed_layers(theirs[name]["kept"], encoded),
                                                 of=len(encoded) * len(ours_kept[0]))
            print(f"{name:>24}: kept positions, mean Jaccard {row['kept']['mean']:.4f} (lowest layer "
                  f"{row['kept']['min_layer']:.4f}), identical heads {row['kept']['identical_heads']}/"
                  f"{row['kept']['heads']}, layers trimmed kvjax {row['kept']['trimmed_layers']['kvjax']} / kvpress "
                  f"{row['kept']['trimmed_layers']['kvpress']} of {row['kept']['trimmed_layers']['of']}", flush=True)
        if not generate:
            rows.append(row)
            continue
        ours = []
        for (ctx, q), w in zip(encoded, windows, strict=True):
            out = kvjax.generate(model, [ctx], question_ids=[q], method=method,
                                 method_args=for_sample(method_args, w) or None,
                                 max_new_tokens=args.new_tokens, stop_at_eos=False)
            ours.append([int(t) for t in out.tokens[0][: args.new_tokens]])

        def right(tokens: list[list[int]]) -> int:
            texts = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
            return sum(int(task.score(text, s)[s.metric] >= 1.0) for text, s in zip(texts, samples, strict=True))

        tokens = theirs[name]["tokens"]
        row.update(kvjax_right=right(ours), kvpress_right=right(tokens),
                   same_tokens=sum(a == b for a, b in zip(ours, tokens, strict=True)),
                   kvjax_tokens=ours, kvpress_tokens=tokens)
        rows.append(row)
        print(f"{name:>24}: kvjax {row['kvjax_right']}/{len(samples)} right, kvpress {row['kvpress_right']}/"
              f"{len(samples)}, identical generations {row['same_tokens']}/{len(samples)}", flush=True)
    version = bu.kvpress_version(args.kvpress_python)
    result = dict(benchmark="kvpress_agreement", machine=bu.machine(), model=args.model, task=args.task,
                  context_length=args.context_length, query_aware=args.query_aware, new_tokens=args.new_tokens,
                  measure=args.measure, kvpress=version, shared_sketches=not args.own_sketches,
                  stable_topk=args.stable_topk, rows=rows)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
