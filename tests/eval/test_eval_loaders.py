"""File-based tasks read their fixtures in the published formats; bad input gives clear errors."""

import json
import logging
import os
import re

import pytest

from kvjax.errors import KvjaxError
from kvjax.eval import tasks
from kvjax.eval.tasks.base import DataError, LengthError, full_prompt, read_jsonl
from kvjax.eval.tasks.longbench import score_longbench

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "eval")
LB = os.path.join(FIXTURES, "longbench")
IB = os.path.join(FIXTURES, "infinitebench")
RULER = os.path.join(FIXTURES, "ruler")
LB_FIXTURES = sorted(f[: -len(".jsonl")] for f in os.listdir(LB) if f.endswith(".jsonl"))


def words(text: str) -> int:
    return len(text.split())


def load(name, data_dir, context_length=4096, **options):
    return tasks.get(name, **options).samples(
        count_tokens=words, context_length=context_length, num_samples=0, seed=0, data_dir=data_dir
    )


@pytest.mark.parametrize("dataset", LB_FIXTURES)
def test_longbench_fixture_loads_and_scores_its_answer(dataset):
    name = f"longbench/{dataset}"
    task = tasks.get(name)
    samples = load(name, LB)
    assert samples
    for s in samples:
        assert s.id.startswith(dataset.removesuffix("_e"))
        assert s.max_new_tokens > 0 and s.answers
        assert "{context}" not in full_prompt(s) and "{input}" not in full_prompt(s)
        # ROUGE's F carries LongBench's 1e-8 smoothing, hence approx.
        assert task.score(s.answers[0], s)[s.metric] == pytest.approx(1.0)


def test_longbench_prompt_metric_and_chat_flag():
    s = load("longbench/trec", LB)[0]
    assert s.prefix.startswith("Please determine the type of the question below.")
    assert s.question == "\n" + "Question: What city hosted the 1900 Olympics?\nType:"
    assert not s.chat_template and s.max_new_tokens == 64 and s.metric == "classification_score"
    # First-line rule for TREC.
    assert score_longbench("trec", "\nCity\nCountry", s) == 1.0
    assert score_longbench("trec", "City Country", s) == 0.5
    q = load("longbench/qasper", LB)[0]
    assert q.chat_template and q.metric == "qa_f1_score" and q.max_new_tokens == 128
    assert tasks.get("longbench/qasper").score("PTB", q)["qa_f1_score"] == 1.0


def test_longbench_middle_truncation():
    full = load("longbench/qasper", LB, context_length=10_000)[0]
    cut = load("longbench/qasper", LB, context_length=300)[0]
    assert not full.metadata["truncated"] and cut.metadata["truncated"]
    assert words(full_prompt(cut)) <= 300 - cut.max_new_tokens
    assert cut.context.split()[:3] == full.context.split()[:3]
    assert cut.context.split()[-3:] == full.context.split()[-3:]
    assert cut.question == full.question


def test_longbench_e_buckets():
    task = tasks.get("longbench/qasper_e")
    samples = load("longbench/qasper_e", LB)
    assert [s.metadata["bucket"] for s in samples] == ["0-4k", "4-8k", "8k+"]
    records = [
        {"metric": s.metric, "scores": task.score(p, s), "metadata": s.metadata}
        for s, p in zip(samples, ["Penn Treebank", "six", "SGD"], strict=True)
    ]
    agg = task.aggregate(records)
    assert agg["length_buckets"] == {"0-4k": 100.0, "4-8k": 100.0, "8k+": 0.0}
    assert agg["score"] == pytest.approx(200 / 3)


@pytest.mark.parametrize("length", ["4k", [1200], True])
def test_longbench_e_length_that_is_no_number_is_one_line(tmp_path, length):
    """LongBench-E buckets rows by their 'length': one that is no number is refused naming the file and row (a
    string raised a ValueError traceback; True was bucketed as a length of 1)."""
    row = {"input": "q", "context": "c", "answers": ["a"], "_id": "e1", "length": length, "all_classes": None}
    (tmp_path / "qasper_e.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"qasper_e\.jsonl: row e1 has a 'length' of .*, not a number"):
        load("longbench/qasper_e", str(tmp_path))
    (tmp_path / "qasper_e.jsonl").write_text(json.dumps({**row, "length": 5000}) + "\n")
    assert load("longbench/qasper_e", str(tmp_path))[0].metadata["bucket"] == "4-8k"


def test_chinese_and_unknown_tasks_are_clear_errors():
    with pytest.raises(KvjaxError, match="jieba"):
        tasks.get("longbench/dureader")
    with pytest.raises(KvjaxError, match="did you mean ruler/niah_single_1"):
        tasks.get("ruler/niah_single1")
    with pytest.raises(KvjaxError, match="unknown option"):
        tasks.get("passkey", bogus=1)
    assert tasks.expand("ruler_synthetic,passkey,passkey")[-1] == "passkey"
    assert len(tasks.expand("ruler")) == 13
    with pytest.raises(KvjaxError):
        tasks.expand("passkey,nope")


def test_missing_data_dir_and_file():
    with pytest.raises(DataError, match="--data_dir"):
        load("longbench/qasper", None)
    with pytest.raises(DataError, match="not a directory"):
        load("longbench/qasper", os.path.join(LB, "missing"))
    with pytest.raises(DataError, match="narrativeqa.jsonl"):
        load("longbench/narrativeqa", LB)
    with pytest.raises(DataError, match="squad.json"):
        load("ruler/qa_1", LB)


def _write_bad(tmp_path):
    good = {
        "input": "q",
        "context": "c",
        "answers": ["a"],
        "_id": "x1",
        "length": 1,
        "all_classes": None,
        "dataset": "qasper",
        "language": "en",
    }
    path = tmp_path / "qasper.jsonl"
    path.write_text(
        json.dumps(good)
        + "\n"
        + '{"input": "broken\n'
        + json.dumps({**good, "_id": "x3"})
        + "\n"
        + json.dumps({"input": "no context"})
        + "\n"
    )
    return str(path)


def test_malformed_jsonl_names_file_and_line(tmp_path, caplog):
    path = _write_bad(tmp_path)
    with pytest.raises(DataError, match=r"qasper\.jsonl:2: invalid JSON"):
        read_jsonl(path)
    with pytest.raises(DataError, match=r"qasper\.jsonl:2"):
        load("longbench/qasper", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        samples = load("longbench/qasper", str(tmp_path), skip_malformed=True)
    assert [s.id for s in samples] == ["x1", "x3"]
    assert "qasper.jsonl:2" in caplog.text and "qasper.jsonl:4: missing field(s)" in caplog.text


@pytest.mark.parametrize(("name", "file", "key"), [
    ("longbench/qasper", "qasper.jsonl", "_id"), ("multidoc/hotpotqa", "hotpotqa.jsonl", "_id"),
    ("infinitebench/passkey", "passkey.jsonl", "id"),
])
def test_a_repeated_sample_id_is_refused_naming_both_lines(tmp_path, caplog, name, file, key):
    """Results and resume are keyed by sample id: a second row of one id was run but never counted (the first record
    of an id is the one read back), so the score silently covered fewer samples than the file has."""
    row = {"input": "q", "context": "Passage 1:\nc", "answers": ["a"], "answer": ["1"], "length": 1}
    ids = ["r1", "r2", "r1"] if key == "_id" else [0, 1, "0"]  # "0" and 0 are one sample id
    (tmp_path / file).write_text("".join(json.dumps({**row, key: i}) + "\n" for i in ids))
    with pytest.raises(DataError, match=rf"{re.escape(file)}:3: {key} '{ids[0]}' repeats line 1's"):
        load(name, str(tmp_path))
    with caplog.at_level(logging.WARNING):
        samples = load(name, str(tmp_path), skip_malformed=True)
    assert [s.id for s in samples] == [str(i) for i in ids[:2]] and f"{file}:3" in caplog.text


@pytest.mark.parametrize("name", tasks.GROUPS["infinitebench"])
def test_infinitebench_fixture(name):
    task = tasks.get(name)
    samples = load(name, IB)
    assert samples
    for s in samples:
        # Multiple choice is scored on the letter ("B." for code_debug, whose rules need the dot).
        short = name.split("/")[1]
        perfect = {"code_debug": f"{s.answers[-1]}.", "longbook_choice_eng": s.answers[-1]}
        assert task.score(perfect.get(short, s.answers[0]), s)["accuracy"] == 1.0
        assert task.score("zzz", s)["accuracy"] == 0.0


@pytest.mark.parametrize(("name", "answer", "message"), [
    ("passkey", [], r"answer \[\] holds no answer"),
    ("passkey", [""], r"answer \[''\] holds no answer"),
    ("kv_retrieval", None, r"answer None holds no answer"),
    ("math_find", ["the largest"], r"math_find's answer \['the largest'\] is not a number"),
    ("math_find", [True], r"answer \[True\] holds no answer"),
])
def test_infinitebench_answer_without_a_value_is_refused_where_it_is_read(tmp_path, name, answer, message):
    """An answer the official rules cannot compare is one DataError naming the file and id when the file is read: []
    raised an IndexError and math_find's 'the largest' a ValueError when the first prediction was scored, after the
    model ran; [""] scored every reply without digits as a correct passkey."""
    row = {"id": 7, "context": "x y", "input": "The largest number of the list?", "answer": answer, "options": []}
    (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=rf"{name}\.jsonl \(id 7\): {message}"):
        load(f"infinitebench/{name}", str(tmp_path))
    (tmp_path / f"{name}.jsonl").write_text(json.dumps({**row, "answer": ["12"]}) + "\n")
    task = tasks.get(f"infinitebench/{name}")
    sample = load(f"infinitebench/{name}", str(tmp_path))[0]
    assert task.score("12", sample)["accuracy"] == 1.0 and task.score("none", sample)["accuracy"] == 0.0


def test_infinitebench_official_rules():
    def score(name, pred):
        task = tasks.get(f"infinitebench/{name}")
        return task.score(pred, load(f"infinitebench/{name}", IB)[0])["accuracy"]

    assert score("passkey", "The pass key is 71432.") == 1.0
    assert score("passkey", "714320") == 0.0
    assert score("kv_retrieval", 'The value is "0a9b-value".') == 1.0
    assert score("math_find", "17") == 1.0 and score("math_find", "17.5") == 0.0
    assert score("code_debug", "B. beta") == 1.0
    assert score("code_debug", "The answer is: beta") == 1.0
    assert score("code_debug", "The answer is: A") == 0.0
    assert score("code_debug", "beta") == 0.0  # no letter, no answer prefix
    assert score("longbook_choice_eng", "B") == 1.0
    assert score("longbook_choice_eng", "A") == 0.0
    assert score("longbook_choice_eng", "I think the answer is: B") == 1.0
    assert score("longbook_choice_eng", "I think the answer is: C") == 0.0
    assert score("longbook_choice_eng", "Clearly B") == 0.0  # first character decides
    assert score("longbook_choice_eng", "my guess: B") == 1.0  # first standalone letter
    math = load("infinitebench/math_find", IB)
    assert math[0].prefix.startswith("What is the largest number in the following list?")
    cd = load("infinitebench/code_debug", IB)[0]
    assert "B. beta" in cd.question and cd.answers == ("beta", "B")


@pytest.mark.parametrize("name", tasks.GROUPS["multidoc"])
def test_multidoc_splits_passages(name):
    samples = load(name, LB)
    task = tasks.get(name)
    for s in samples:
        assert len(s.documents) >= 2
        assert "".join(s.documents) == s.context
        assert all(d.startswith("Passage ") for d in s.documents)
        assert s.prefix.endswith("The following are given passages.\n")
        assert task.score(s.answers[0], s)["qa_f1_score"] == 1.0


def test_multidoc_drops_middle_passages_to_fit():
    full = load("multidoc/musique", LB)[0]
    cut = load("multidoc/musique", LB, context_length=full.metadata["num_tokens"] + 32 - 3)[0]
    assert cut.metadata["dropped_documents"] == 1
    assert cut.documents[0] == full.documents[0] and cut.documents[-1] == full.documents[-1]


@pytest.mark.parametrize(("name", "length"), [("ruler/qa_1", 512), ("ruler/qa_2", 900)])
def test_ruler_qa_from_local_files(name, length):
    task = tasks.get(name)
    samples = task.samples(count_tokens=words, context_length=length, num_samples=3, seed=0, data_dir=RULER)
    for s in samples:
        target = length - s.max_new_tokens
        assert 0.98 * target <= s.metadata["num_tokens"] <= target
        assert any(a.lower() in s.context.lower() for a in s.answers)
        assert s.context.startswith("Document 1:\n") and s.metric == "string_match_part"
        assert task.score(f"It is {s.answers[-1]}.", s)["string_match_part"] == 1.0
    # SQuAD's unanswerable question is never asked.
    assert all(s.metadata["query"] != "Who destroyed the harbour?" for s in samples)


_PARA = {"context": "The harbour town. " * 40}


@pytest.mark.parametrize(("articles", "message"), [
    (["oops"], r"article 0: expected an object, got str"),
    ([{"paragraphs": ["oops"]}], r"article 0, paragraph 0 has no 'context' text"),
    ([{"paragraphs": [{**_PARA, "qas": [{"answers": [{"text": "x"}]}]}]}],
     r"article 0, paragraph 0, question 0 has no 'question' text"),
    ([{"paragraphs": [{**_PARA, "qas": [{"question": "q", "answers": ["x"]}]}]}],
     r"article 0, paragraph 0, question 0: each answer must be an object with a 'text' string"),
    ([{"paragraphs": [_PARA]}, {"paragraphs": [{**_PARA, "qas": [{"question": "q", "answers": None}]}]}],
     r"article 1, paragraph 0, question 0: 'answers' must be a list, got NoneType"),
])
def test_a_malformed_squad_file_is_one_line_naming_the_item(tmp_path, articles, message):
    """ruler/qa_1's SQuAD reader names the file and the item it cannot read (it raised KeyError / AttributeError /
    TypeError tracebacks), as the HotpotQA reader of qa_2 does."""
    (tmp_path / "squad.json").write_text(json.dumps({"data": articles}))
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "squad.json")) + ": " + message):
        tasks.get("ruler/qa_1").samples(count_tokens=words, context_length=512, num_samples=1, seed=0,
                                        data_dir=str(tmp_path))


@pytest.mark.parametrize("name", ["longbench/hotpotqa", "multidoc/hotpotqa"])
def test_a_lone_surrogate_is_one_line_naming_file_line_and_field(tmp_path, name, caplog):
    """`"\\ud800"` is valid JSON but no text (a tokenizer raised a TypeError on it): the row is refused where it is
    read, or skipped with --skip_malformed; a proper surrogate pair (an emoji) is text and loads."""
    row = {"input": "Which city?", "context": "Passage 1:\nParis is a city.", "answers": ["Paris"], "_id": "ok",
           "length": 4, "all_classes": None}
    lines = [json.dumps(row), json.dumps({**row, "_id": "emoji", "input": "Which city? \U0001f600"}),
             json.dumps({**row, "_id": "bad", "context": "Passage 1:\nParis \ud800 is a city."})]
    assert "\\ud800" in lines[2] and "\\ud83d\\ude00" in lines[1]  # how the JSON files spell them
    (tmp_path / "hotpotqa.jsonl").write_text("\n".join(lines) + "\n")
    message = r"hotpotqa\.jsonl:3: field 'context' holds a lone surrogate \\ud800 at character 18"
    with pytest.raises(DataError, match=message):
        load(name, str(tmp_path))
    with caplog.at_level(logging.WARNING):
        samples = load(name, str(tmp_path), skip_malformed=True)
    assert [s.id for s in samples] == ["ok", "emoji"] and "hotpotqa.jsonl:3" in caplog.text


NO_ROOM = [
    "ruler/cwe", "passkey", "multidoc/synthetic", "longbench/qasper", "infinitebench/passkey", "multidoc/musique",
]


@pytest.mark.parametrize("name", NO_ROOM)
def test_a_context_with_no_room_for_the_prompt_is_one_error_before_any_file(name):
    """Every task that fits a prompt into `context_length - max_new_tokens` refuses a context that leaves none with
    the same message, and a file-based one says so before it looks for its file (`data_dir=None` here)."""
    task = tasks.get(name)
    new = task.max_new_tokens
    message = rf"^{re.escape(name)}: context_length {new} leaves no room for the prompt after {new} generated tokens$"
    with pytest.raises(LengthError, match=message):
        task.samples(count_tokens=words, context_length=new, num_samples=1, seed=0, data_dir=None)


@pytest.mark.parametrize("name", ["longbench/qasper", "infinitebench/passkey", "multidoc/musique"])
def test_max_prompt_tokens_sets_the_budget_and_refuses_a_negative_one(name):
    short = tasks.get(name, max_prompt_tokens=40)
    assert short.prompt_budget(context_length=8) == 40  # the option wins over what the context would leave
    assert tasks.get(name).prompt_budget(context_length=4096) == 4096 - short.max_new_tokens
    with pytest.raises(LengthError, match=rf"^{re.escape(name)}: max_prompt_tokens must be > 0, got -1$"):
        tasks.get(name, max_prompt_tokens=-1).prompt_budget(context_length=4096)
