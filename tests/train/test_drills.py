"""Retrieval drills: every trained answer is what the drill's own context says (a parser as the oracle)."""

import random
import re
from pathlib import Path

import numpy as np
import pytest

import kvjax
from kvjax.models.char_tokenizer import build_char_tokenizer
from kvjax.train.data import TaskMixture
from kvjax.train.drills import LookupDrill, NiahDrill, RecallDrill, VariableTrackingDrill

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


_LOOKUP_Q = re.compile(r"The variable assigned ((?:VAR )?[A-Z]{5}|\d{5}) is$")


@pytest.mark.parametrize("length", [512, 2048])
def test_lookup_drill_answers_the_name_left_of_the_queried_right_hand_side(length):
    tok = build_char_tokenizer()
    drill, forms, looked_up, statements = LookupDrill(tok), set(), 0, 0
    for seed in range(12):
        ids, spans = drill.example(random.Random(seed), length)
        assert len(ids) <= length and ids[-1] == tok.eos_token_id and spans[-1][1] == len(ids)
        text = tok.decode(ids, skip_special_tokens=True)
        context = re.split(r"\n(?:Question|The variable)", text)[0]
        assigned = _ASSIGN.findall(context)
        source = dict(assigned)  # variable -> value or variable
        assert len(source) == len(assigned) >= 2  # every name assigned once
        left_of = {rhs: name for name, rhs in assigned}  # the reverse lookup the answers need
        assert len(left_of) == len(assigned)
        for before, answer in _rounds(tok, ids, spans):
            last = before.split("\n")[-1]
            short = _LOOKUP_Q.search(last)
            if short:
                forms.add("short")
                assert answer == left_of[short.group(1).removeprefix("VAR ")]
                looked_up += 1
            else:
                forms.add("vt")
                value = _VT_Q.findall(last)[0]
                names = answer.split(", ")
                assert f"{len(names)} variables are assigned the value {value}, they are: " in last
                assert names[0] == left_of[value]
                assert all(left_of[a] == b for a, b in zip(names, names[1:], strict=False))
                assert names[-1] not in left_of  # the whole chain
                looked_up += len(names)
        statements += len(assigned)
    assert forms == {"short", "vt"}
    assert looked_up >= 0.6 * statements  # rounds that do not fit are dropped


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


@pytest.mark.parametrize("length", [512, 2048])
def test_recall_drill_asks_for_each_needle_once_in_three_forms(length):
    tok = build_char_tokenizer()
    drill, forms, recalled, total = RecallDrill(tok), set(), 0, 0
    for seed in range(10):
        ids, spans = drill.example(random.Random(seed), length)
        assert len(ids) <= length and ids[-1] == tok.eos_token_id and spans[-1][1] == len(ids)
        text = tok.decode(ids, skip_special_tokens=True)
        needles = _NEEDLE.findall(text.split("\n")[1])  # the context line
        values = dict(needles)
        assert len(values) == len(needles) >= 2  # one needle per key
        asked = []
        for before, answer in _rounds(tok, ids, spans):
            last = before.split("\n")[-1]
            key = re.search(r"for ([a-z]+-[a-z]+) (?:is:|mentioned)", last).group(1)
            forms.add(last.split(" for ")[0][:12])
            assert answer == values[key]
            asked.append(key)
        assert asked and len(set(asked)) == len(asked)  # never asked twice
        recalled, total = recalled + len(asked), total + len(values)
    assert forms == {"One of the s", "The special ", "What are all"}
    assert recalled >= (0.6 if length > 1000 else 0.3) * total  # rounds that do not fit are dropped


def test_item_start_weight_marks_each_items_first_token_and_what_follows_it():
    """Weighted targets: each value's first digit, the comma and space between values, and the end token."""
    tok = build_char_tokenizer()
    names = ("ruler/niah_multivalue", "drill/niah")
    mix = TaskMixture(tok, task_names=names, lengths=(1024,), copy_prob=0.3, item_start_weight=6.0)
    plain = TaskMixture(tok, task_names=names, lengths=(1024,), copy_prob=0.3)
    batch, reference = mix.batch(3, 8, 1024), plain.batch(3, 8, 1024)
    np.testing.assert_array_equal(batch.tokens, reference.tokens)
    np.testing.assert_array_equal(batch.loss_mask > 0, reference.loss_mask > 0)  # the same targets, reweighted
    weighted_rows = 0
    for i, mask in enumerate(batch.loss_mask):
        ids, spans = mix.example(3, i, 1024)
        for start, end in spans:
            answer = tok.decode(ids[start:end])
            got = "".join(tok.decode([ids[j + 1]]) for j in range(start - 1, end - 1) if mask[j] == 6.0)
            if not re.fullmatch(r" \d+(, \d+)*(</s>)?", answer):
                assert not got  # a copy warm-up: left at weight 1
                continue
            values = answer.removesuffix("</s>").strip().split(", ")
            want = ", ".join(v[0] for v in values) + ("</s>" if answer.endswith("</s>") else "")
            assert got == want
            weighted_rows += 1
    assert weighted_rows >= 4


def test_item_start_weight_marks_a_words_first_token_after_any_prefix():
    """With BPE, a name's first token carries its space (`" QWERT"` -> `" Q"`), so the first letter is
    weighted whether the prefix ends in a space (`they are: `) or not (`The variable assigned 12345 is`)."""
    from kvjax.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(Path(kvjax.__file__).parent / "assets" / "kvjax-tiny"))
    mix = TaskMixture(tok, task_names=("drill/lookup",), lengths=(512,), copy_prob=0.0, item_start_weight=5.0)
    batch, checked = mix.batch(0, 4, 512), 0
    for i, mask in enumerate(batch.loss_mask):
        ids, spans = mix.example(0, i, 512)
        for start, end in spans:
            names = tok.decode(ids[start:end], skip_special_tokens=True).strip().split(", ")
            got = [tok.decode([ids[j + 1]]) for j in range(start - 1, end - 1) if mask[j] == 5.0]
            firsts = [g.strip() for g in got if g.strip() not in ("", ",", "</s>")]  # one token per name
            assert len(firsts) == len(names) and all(n.startswith(f) for f, n in zip(firsts, names, strict=True))
            checked += 1
    assert checked >= 20
