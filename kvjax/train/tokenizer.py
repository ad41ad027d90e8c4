"""A small BPE tokenizer trained offline on generated task text, saved in Hugging Face format.

Digits are always single tokens (passkeys and values are copied digit by digit, at any length) and
the byte-level alphabet makes every string encodable and decoding exact. Character-level tokens
would make RULER's templates alone about 1K tokens long; BPE words keep the context for the haystack.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from kvjax.models.char_tokenizer import SPECIAL_TOKENS
from kvjax.train.data import HELD_OUT_SEEDS

_CAPITAL_RUN = re.compile("\u0120?[A-Z]{2,}")  # U+0120 is the byte-level space


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048):
    """A `PreTrainedTokenizerFast` (ids 0-3: <pad>, <s>, </s>, <unk>) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from kvjax._transformers import import_transformers

    PreTrainedTokenizerFast = import_transformers().PreTrainedTokenizerFast  # noqa: N806

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
    core = Tokenizer.from_str(json.dumps(drop_capital_merges(json.loads(core.to_str()))))
    bos = core.token_to_id("<s>")
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def drop_capital_merges(spec: dict, keep: Iterable[str] = ("VAR",)) -> dict:
    """A `tokenizer.json` spec without the BPE merges that join capital letters, except those that build
    the words in `keep`.

    Variable names (`VAR QWERT = 12345.`) are random capitals; a merge learnt from the names in the
    tokenizer's corpus turns just those names into single tokens, which a model trained on other names
    (spelt letter by letter) has never seen. Token ids are unchanged (the merged tokens stay in the
    vocabulary, unused), so a trained model keeps working with the result.
    """
    spec = json.loads(json.dumps(spec))
    merges = spec["model"]["merges"]
    pairs = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    built_from = {a + b: (a, b) for a, b in pairs}
    needed, todo = set(), [w for word in keep for w in (word, "\u0120" + word)]
    while todo:
        token = todo.pop()
        if token in built_from and token not in needed:
            needed.add(token)
            todo += built_from[token]
    spec["model"]["merges"] = [
        m for m, (a, b) in zip(merges, pairs, strict=True) if a + b in needed or not _CAPITAL_RUN.fullmatch(a + b)
    ]
    return spec


def task_corpus(
    task_names: Iterable[str], *, samples_per_task: int = 8, length_chars: int = 6000, seed: int = HELD_OUT_SEEDS
) -> list[str]:
    """Generated prompts and answers of the given tasks, for tokenizer training (no download).

    Seeds below `HELD_OUT_SEEDS` are the evaluation's: a tokenizer trained on them would learn the
    held-out samples' variable names as whole tokens. Drills (`drill/...`) share the tasks' wording and
    are skipped.
    """
    from kvjax import tasks
    from kvjax.tasks.base import full_prompt

    if seed < HELD_OUT_SEEDS:
        raise ValueError(f"task_corpus seed {seed} is held out for evaluation; use >= {HELD_OUT_SEEDS}")
    texts = []
    for name in task_names:
        if name.startswith("drill/"):
            continue
        task = tasks.get(name)
        samples = task.samples(
            count_tokens=len, context_length=length_chars, num_samples=samples_per_task, seed=seed, data_dir=None
        )
        texts += [full_prompt(s) + " " + ", ".join(s.answers) for s in samples]
    return texts
