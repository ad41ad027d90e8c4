"""A small BPE tokenizer trained offline on generated task text, saved in Hugging Face format.

Digits are always single tokens (passkeys and values are copied digit by digit, at any length) and
the byte-level alphabet makes every string encodable and decoding exact. Character-level tokens
would make RULER's templates alone about 1K tokens long; BPE words keep the context for the haystack.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvjax.models.char_tokenizer import SPECIAL_TOKENS


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048):
    """A `PreTrainedTokenizerFast` (ids 0-3: <pad>, <s>, </s>, <unk>) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    bos = core.token_to_id("<s>")
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def task_corpus(
    task_names: Iterable[str], *, samples_per_task: int = 8, length_chars: int = 6000, seed: int = 0
) -> list[str]:
    """Generated prompts and answers of the given tasks, for tokenizer training (no download)."""
    from kvjax.eval import tasks
    from kvjax.eval.tasks.base import full_prompt

    texts = []
    for name in task_names:
        task = tasks.get(name)
        samples = task.samples(
            count_tokens=len, context_length=length_chars, num_samples=samples_per_task, seed=seed, data_dir=None
        )
        texts += [full_prompt(s) + " " + ", ".join(s.answers) for s in samples]
    return texts
