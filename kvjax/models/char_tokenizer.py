"""A character-level tokenizer built offline with the `tokenizers` library, saved in HF format.

Used by tests (a complete tiny model directory needs a tokenizer) and by the embedded tiny model.
The saved directory loads with `transformers.AutoTokenizer.from_pretrained` (no remote code).
"""

from __future__ import annotations

import os
import string

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
DEFAULT_CHARS = string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", "")


def build_char_tokenizer(chars: str = DEFAULT_CHARS):
    """A `PreTrainedTokenizerFast`: ids 0-3 are <pad>, <s>, </s>, <unk>, then one id per character."""
    from tokenizers import Tokenizer, decoders, models, processors

    from kvjax._transformers import import_transformers

    alphabet = list(dict.fromkeys(chars))
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *alphabet])}
    # BPE without merges and without a pre-tokenizer splits text into single characters.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return import_transformers().PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def save_char_tokenizer(directory: str | os.PathLike, chars: str = DEFAULT_CHARS) -> int:
    """Saves the tokenizer files into `directory`; returns the vocabulary size."""
    tok = build_char_tokenizer(chars)
    tok.save_pretrained(str(directory))
    return len(tok)
