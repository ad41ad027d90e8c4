"""The synthetic multi-document task (multidoc/synthetic): documents, facts and distractors, lengths, scores; and
the mapping of --compression_ratio onto SamKV's sparsity knob. The CLI side: tests/eval/test_rag_cli.py."""

from __future__ import annotations

import os
import pathlib
import re

import pytest

from kvjax.errors import ConfigError
from kvjax.eval import tasks
from kvjax.eval.rag_amounts import strategy_args
from kvjax.eval.tasks.multidoc_synthetic import default_num_documents

ROOT = pathlib.Path(__file__).resolve().parents[2]
NEEDLE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")


def _count(text: str) -> int:
    return len(text.split())  # a whitespace tokenizer: lengths are checked against the same counter


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


@pytest.mark.parametrize("name,docs,facts", [
    ("multidoc/synthetic", None, 2), ("multidoc/synthetic_1fact", None, 1), ("multidoc/synthetic_7docs", 7, 2),
    ("multidoc/synthetic_3docs_1fact", 3, 1),
])
def test_documents_facts_and_distractors(name, docs, facts):
    length = 3000
    samples = tasks.get(name).samples(count_tokens=_count, context_length=length, num_samples=3, seed=0)
    assert len({s.id for s in samples}) == 3
    for s in samples:
        assert s.documents and "".join(s.documents) == s.context
        assert len(s.documents) == (docs or default_num_documents(length)) == s.metadata["num_documents"]
        found = [NEEDLE.findall(d) for d in s.documents]
        assert all(len(f) == 1 for f in found)  # one fact per document: the others are distractors
        keys = [f[0][0] for f in found]
        values = [f[0][1] for f in found]
        assert len(set(keys)) == len(keys) and len(set(values)) == len(values)
        assert len(s.answers) == facts
        holders = [values.index(a) + 1 for a in s.answers]  # documents holding the asked facts, in question order
        assert holders == s.metadata["answer_documents"] and len(set(holders)) == facts
        for d in holders:  # the question names exactly the keys of the answer documents
            assert keys[d - 1] in s.question
        assert sum(k in s.question for k in keys) == facts
        total = _count(s.prefix + s.context + s.question + s.answer_prefix)
        assert total == s.metadata["num_tokens"] <= length - s.max_new_tokens
        # Documents grow together: each holds the same number of filler sentences (one "." each) and its fact.
        assert [d.count(".") for d in s.documents] == [s.metadata["filler_units"] + 1] * len(s.documents)
    again = tasks.get(name).samples(count_tokens=_count, context_length=length, num_samples=3, seed=0)
    assert [s.context for s in again] == [s.context for s in samples]
    other = tasks.get(name).samples(count_tokens=_count, context_length=length, num_samples=3, seed=1)
    assert [s.answers for s in other] != [s.answers for s in samples]


def test_scores():
    task = tasks.get("multidoc/synthetic")
    (s,) = task.samples(count_tokens=_count, context_length=2000, num_samples=1, seed=0)
    a, b = s.answers
    assert task.score(f" {a} {b}", s) == {"string_match_all": 1.0, "qa_f1_score": 1.0}
    # LongBench's F1 counts the extra word: precision 2/3, recall 1.
    assert task.score(f" {a}, and {b}.", s) == {"string_match_all": 1.0, "qa_f1_score": pytest.approx(0.8)}
    assert task.score(f" {a}.", s)["string_match_all"] == 0.5
    assert task.score(" 42.", s) == {"string_match_all": 0.0, "qa_f1_score": 0.0}


def test_bad_names_and_lengths():
    with pytest.raises(ConfigError, match="facts must be 1 or 2"):
        tasks.get("multidoc/synthetic_3fact")
    with pytest.raises(ConfigError, match="number of documents"):
        tasks.get("multidoc/synthetic_1docs")
    with pytest.raises(Exception, match="needs 821 tokens without any filler, more than the 268 available"):
        tasks.get("multidoc/synthetic_64docs").samples(count_tokens=_count, context_length=300, num_samples=1, seed=0)


def test_compression_ratio_maps_onto_samkvs_knob_and_is_refused_elsewhere():
    assert strategy_args("samkv", {"update": "overwrite"}, None, 0.75) == {
        "update": "overwrite", "p_override": 0.25, "cross_doc_filter": False}
    assert strategy_args("samkv", {}, None, None) == {}
    with pytest.raises(ConfigError, match="--budget=64 has no meaning for samkv.*--compression_ratio"):
        strategy_args("samkv", {}, 64, None)
    with pytest.raises(ConfigError, match="p_override"):
        strategy_args("samkv", {"p_override": 0.3}, None, 0.5)
    for name, hint in (("cacheblend", "recompute_ratio"), ("epic", "epic.k"), ("reuse", "no knob"),
                       ("recompute", "no knob"), ("multi_infllm", "topk")):
        with pytest.raises(ConfigError, match=hint):
            strategy_args(name, {}, None, 0.5)
