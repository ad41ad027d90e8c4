"""Retrieval drills: every trained answer is what the drill's own context says (a parser as the oracle)."""

import random
import re

import pytest

from kvjax.models.char_tokenizer import build_char_tokenizer
from kvjax.train.data import TaskMixture
from kvjax.train.drills import NiahDrill, VariableTrackingDrill

_NEEDLE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")
_NIAH_Q = re.compile(r"What are all the special magic numbers for (.+?) mentioned in the provided text\?")
_ASSIGN = re.compile(r"VAR ([A-Z]{5}) = (?:VAR )?([A-Z]{5}|\d{5})\.")
_VT_Q = re.compile(r"Find all variables that are assigned the value (\d{5}) in the text above")


def _rounds(tok, ids, spans):
    """(text before the answer, answer) per span, `</s>` removed."""
    return [(tok.decode(ids[:a], skip_special_tokens=True), tok.decode(ids[a:b], skip_special_tokens=True).strip())
            for a, b in spans]


@pytest.mark.parametrize("length", [1024, 4096])
def test_niah_drill_answers_are_the_queried_keys_values(length):
    tok = build_char_tokenizer()
    drill, multi_value, multi_query = NiahDrill(tok), 0, 0
    for seed in range(12):
        ids, spans = drill.example(random.Random(seed), length)
        assert len(ids) <= length and len(ids) >= 0.9 * length and ids[-1] == tok.eos_token_id
        assert spans[-1][1] == len(ids) and all(b > a for a, b in spans)
        context = tok.decode(ids, skip_special_tokens=True).split("\nWhat are all")[0]
        values: dict[str, list[str]] = {}
        for key, value in _NEEDLE.findall(context):
            values.setdefault(key, []).append(value)
        asked = set()
        for before, answer in _rounds(tok, ids, spans):
            keys = re.split(r", and |, ", _NIAH_Q.findall(before)[-1])
            assert not asked & set(keys)  # never asked twice: an earlier answer is no shortcut
            asked |= set(keys)
            got = answer.split(", ")
            assert got == [v for k in keys for v in got if v in values[k]]  # grouped by key, in query order
            assert sorted(got) == sorted(v for k in keys for v in values[k])
            multi_value += any(len(values[k]) > 1 for k in keys)
            multi_query += len(keys) > 1
        assert asked and asked <= set(values)  # rounds that do not fit are dropped
    assert multi_value and multi_query


@pytest.mark.parametrize("length", [1024, 2048])
def test_vt_drill_answers_walk_the_chains(length):
    tok = build_char_tokenizer()
    drill = VariableTrackingDrill(tok)
    for seed in range(12):
        ids, spans = drill.example(random.Random(seed), length)
        assert len(ids) <= length and ids[-1] == tok.eos_token_id
        text = tok.decode(ids, skip_special_tokens=True)
        source = dict(_ASSIGN.findall(text.split("\nQuestion:")[0]))  # variable -> value or variable
        for before, answer in _rounds(tok, ids, spans):
            value = _VT_Q.findall(before)[-1]
            names = answer.split(", ")
            assert f"{len(names)} variables are assigned the value {value}" in before
            assert source[names[0]] == value
            assert all(source[b] == a for a, b in zip(names, names[1:], strict=False))
            assert not [v for v, s in source.items() if s == names[-1]]  # the whole chain


def test_drills_in_the_mixture_train_every_answer():
    tok = build_char_tokenizer()
    mix = TaskMixture(tok, task_names=("drill/niah", "drill/vt"), lengths=(1024,))
    batch = mix.batch(0, 4, 1024)
    for tokens, mask in zip(batch.tokens, batch.loss_mask, strict=True):
        ids = [int(t) for t in tokens if t]
        trained = tok.decode([ids[i + 1] for i in range(len(ids) - 1) if mask[i]])
        assert trained.count("</s>") == 1 and len(re.findall(r"\d{7}|[A-Z]{5}", trained)) >= 1
        assert "What" not in trained and "Question" not in trained
    with pytest.raises(Exception, match="drill/nope"):
        TaskMixture(tok, task_names=("drill/nope",), lengths=(1024,))
