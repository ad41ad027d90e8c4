"""A tiny random Llama as an F32 GGUF (numpy and the `gguf` package's writer only; no torch), for the model-cache
and model-package tests."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np


def bpe_tokenizer(w: Any, tokens: list[str]) -> None:
    """The default tokenizer metadata: byte-level BPE (``gpt2``) with one merge, BOS 1 and EOS 2."""
    import gguf

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<") else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_tiny_gguf(path: pathlib.Path, ffn: int = 32,
                    tokenizer: Callable[[Any, list[str]], None] | None = bpe_tokenizer) -> pathlib.Path:
    """A 1-layer random Llama as an F32 GGUF with a 31-token vocabulary. ``ffn``: the MLP width (16384 makes a 3 MB
    model.safetensors, beside tokenizer files of a few KB); ``tokenizer(writer, tokens)`` writes the tokenizer
    metadata (None: none at all)."""
    import gguf

    rng = np.random.default_rng(0)
    dim, heads, kv, hd = 16, 2, 1, 8
    tokens = ["<unk>", "<s>", "</s>", *(chr(c) for c in range(ord("a"), ord("z") + 1)), "Ġ", "ab"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    if tokenizer is not None:
        tokenizer(w, tokens)
    shapes = {"token_embd.weight": (len(tokens), dim), "output_norm.weight": (dim,), "blk.0.attn_norm.weight": (dim,),
              "blk.0.attn_q.weight": (heads * hd, dim), "blk.0.attn_k.weight": (kv * hd, dim),
              "blk.0.attn_v.weight": (kv * hd, dim), "blk.0.attn_output.weight": (dim, heads * hd),
              "blk.0.ffn_norm.weight": (dim,), "blk.0.ffn_gate.weight": (ffn, dim), "blk.0.ffn_up.weight": (ffn, dim),
              "blk.0.ffn_down.weight": (dim, ffn)}
    for name, shape in shapes.items():
        w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
