"""Synthetic generators: target length within 2%, answers present, deterministic per seed."""

import os
import re

import pytest

from kvjax.errors import KvjaxError
from kvjax.eval import tasks
from kvjax.eval.tasks.base import LengthError, fit_length, full_prompt, truncate_middle

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "eval")
SYNTHETIC = [*tasks.GROUPS["ruler_synthetic"], "passkey", "passkey_64", "needle"]


def words(text: str) -> int:
    return len(text.split())


def bpe_like(text: str) -> int:
    """A non-additive count: about one token per 3 characters, plus one per word."""
    return len(text) // 3 + len(text.split())


COUNTERS = {"whitespace": (words, 2048), "chars": (len, 8192), "bpe_like": (bpe_like, 4096)}


@pytest.mark.parametrize("name", SYNTHETIC)
@pytest.mark.parametrize("counter", sorted(COUNTERS))
def test_length_within_two_percent_and_answer_present(name, counter):
    count, context_length = COUNTERS[counter]
    task = tasks.get(name)
    samples = task.samples(count_tokens=count, context_length=context_length, num_samples=2, seed=3, data_dir=None)
    assert len(samples) == 2
    for s in samples:
        target = context_length - s.max_new_tokens
        n = count(full_prompt(s))
        assert 0.98 * target <= n <= target, (name, n, target)
        assert s.metadata["num_tokens"] == n
        for answer in s.answers:
            assert answer in s.context, (name, answer)
        assert task.score(" ".join(s.answers), s)[s.metric] == 1.0


@pytest.mark.parametrize("name", SYNTHETIC)
def test_deterministic_per_seed(name):
    kw = dict(count_tokens=words, context_length=1024, num_samples=2, data_dir=None)
    a = tasks.get(name).samples(seed=0, **kw)
    b = tasks.get(name).samples(seed=0, **kw)
    c = tasks.get(name).samples(seed=1, **kw)
    assert [full_prompt(s) for s in a] == [full_prompt(s) for s in b]
    assert [s.answers for s in a] == [s.answers for s in b]
    assert [s.id for s in a] == [s.id for s in b]
    assert len({s.id for s in a}) == 2
    assert [full_prompt(s) for s in a] != [full_prompt(s) for s in c]


def test_prompt_split_query_agnostic_and_aware():
    s = tasks.get("ruler/niah_single_1").samples(
        count_tokens=words, context_length=512, num_samples=1, seed=0, data_dir=None
    )[0]
    ctx, q = tasks.build_prompt(s, question_in_context=False)
    assert ctx == s.prefix + s.context and q == s.question + s.answer_prefix
    assert "What are all the special magic numbers" in q and s.answers[0] in ctx
    ctx2, q2 = tasks.build_prompt(s, question_in_context=True)
    assert ctx2 + q2 == ctx + q == full_prompt(s)
    assert q2 == s.answer_prefix


def test_niah_structure():
    kw = dict(count_tokens=words, context_length=1024, num_samples=1, seed=0, data_dir=None)
    mk = tasks.get("ruler/niah_multikey_1").samples(**kw)[0]
    assert mk.context.count("One of the special magic numbers for") == 4 and len(mk.answers) == 1
    mv = tasks.get("ruler/niah_multivalue").samples(**kw)[0]
    assert len(mv.answers) == 4
    mq = tasks.get("ruler/niah_multiquery").samples(**kw)[0]
    assert len(mq.answers) == 4 and ", and " in mq.question
    uu = tasks.get("ruler/niah_multikey_3").samples(**kw)[0]
    assert len(uu.answers[0]) == 36 and uu.answers[0].count("-") == 4
    vt = tasks.get("ruler/vt").samples(**kw)[0]
    assert len(vt.answers) == 5
    cwe = tasks.get("ruler/cwe").samples(count_tokens=words, context_length=2048, num_samples=1, seed=0, data_dir=None)[
        0
    ]
    listed = cwe.context.split()  # "1. word 2. word ..."
    for word in cwe.answers:
        assert listed.count(word) == 30
    assert max(listed.count(w) for w in set(listed[1::2]) - set(cwe.answers)) == 3


@pytest.mark.parametrize("name", [n for n in SYNTHETIC if n.startswith("ruler/niah")])
def test_needle_answer_prefix_restates_the_queried_needle_and_changes_nothing_else(name):
    """`answer_prefix="needle"` ends the prompt with the opening of the queried key's needle sentence, whose
    continuation in the context is the answer; the needles, question and answers are RULER's, and the prompt is
    fitted to the same length (the haystack grows by what the shorter prefix leaves)."""
    kw = dict(count_tokens=words, context_length=1024, num_samples=2, seed=0, data_dir=None)
    ruler, needle = tasks.get(name).samples(**kw), tasks.get(name, answer_prefix="needle").samples(**kw)
    for a, b in zip(ruler, needle, strict=True):
        assert a.answer_prefix.endswith("mentioned in the provided text are")
        assert b.answer_prefix.startswith(" One of the special magic ") and b.answer_prefix.endswith(" is:")
        assert (b.id, b.prefix, b.question, b.answers) == (a.id, a.prefix, a.question, a.answers)
        ours, theirs = ({line for line in re.split(r"(?<=\.)[ \n]", s.context) if line.startswith("One of the special")}
                        for s in (b, a))
        assert ours and (ours <= theirs or theirs <= ours)  # niah_multikey_2/3's haystack is distractor needles
        assert 0.98 * 896 <= words(full_prompt(b)) <= 896
        if len(b.answers) == 1:  # one queried value: the context holds the prefix followed by the answer
            assert f"{b.answer_prefix.strip()} {b.answers[0]}." in b.context
    with pytest.raises(KvjaxError, match="answer_prefix must be one of .*'echo'"):
        tasks.get(name, answer_prefix="echo")
    with pytest.raises(KvjaxError, match="unknown option"):
        tasks.get("ruler/vt", answer_prefix="needle")
    assert tasks.takes_option(name, "answer_prefix") and not tasks.takes_option("ruler/vt", "answer_prefix")


def test_haystack_file_and_needle_grid():
    path = os.path.join(FIXTURES, "haystack.txt")
    task = tasks.get("needle", haystack_file=path, depths=[0, 50, 100], lengths=[256, 512])
    samples = task.samples(count_tokens=words, context_length=512, num_samples=0, seed=0, data_dir=None)
    assert len(samples) == 6
    assert {(s.metadata["length"], s.metadata["depth"]) for s in samples} == {
        (n, d) for n in (256, 512) for d in (0.0, 50.0, 100.0)
    }
    assert "fog" in samples[0].context
    first = samples[0]
    assert first.context.startswith("The best thing to do in San Francisco")
    last = samples[2]
    assert last.context.rstrip().endswith("sunny day.")
    records = [
        {
            "metric": s.metric,
            "scores": task.score(
                "eat a sandwich and sit in Dolores Park on a sunny day" if s.metadata["depth"] < 100 else "no idea", s
            ),
            "metadata": s.metadata,
        }
        for s in samples
    ]
    agg = task.aggregate(records)
    assert agg["grid"]["256"]["0"] == 100.0 and agg["grid"]["512"]["100"] == 0.0


def test_needle_grid_values_given_twice_are_refused():
    """Each grid cell is one sample id (`needle:<length>:<depth:g>:...`): depths or lengths given twice (or depths
    equal to 6 digits) made two samples of one id, and the second overwrote the first in the results."""
    path = os.path.join(FIXTURES, "haystack.txt")
    ids = [s.id for s in tasks.get("needle", haystack_file=path, depths=[0, 50, 100], lengths=[256, 512]).samples(
        count_tokens=words, context_length=512, num_samples=0, seed=0, data_dir=None)]
    assert len(set(ids)) == len(ids) == 6
    for depths in ([50, 50], [33.333331, 33.333332]):
        with pytest.raises(KvjaxError, match=r"needle: depths repeat \['(50|33.3333)'\]"):
            tasks.get("needle", haystack_file=path, depths=depths)
    with pytest.raises(KvjaxError, match=r"needle: lengths repeat \['256'\]"):
        tasks.get("needle", haystack_file=path, lengths=[256, 256]).samples(
            count_tokens=words, context_length=512, num_samples=0, seed=0, data_dir=None)


def test_passkey_with_haystack_file():
    path = os.path.join(FIXTURES, "haystack.txt")
    s = tasks.get("passkey_64", haystack_file=path).samples(
        count_tokens=words, context_length=1024, num_samples=1, seed=0, data_dir=None
    )[0]
    assert "fog" in s.context and s.answers[0] in s.context
    assert 0.98 * (1024 - s.max_new_tokens) <= words(full_prompt(s)) <= 1024 - s.max_new_tokens


def test_passkey_depths_and_scores():
    task = tasks.get("passkey_64", depths=[10, 90])
    samples = task.samples(count_tokens=words, context_length=1024, num_samples=2, seed=0, data_dir=None)
    assert [s.metadata["depth"] for s in samples] == [10.0, 90.0]
    key = samples[0].answers[0]
    assert len(key) == 64 and samples[0].metric == "partial"
    wrong = key[:16] + str((int(key[16]) + 1) % 10) + key[17:]
    scores = task.score(f"The pass key is {wrong}.", samples[0])
    assert scores["exact"] == 0.0 and scores["partial"] == pytest.approx(16 / 64)
    assert task.score(f"The pass key is {key}.", samples[0]) == {"exact": 1.0, "partial": 1.0}
    assert (
        tasks.get("passkey")
        .samples(count_tokens=words, context_length=512, num_samples=1, seed=0, data_dir=None)[0]
        .metric
        == "exact"
    )
    assert (
        len(
            tasks.get("passkey_12")
            .samples(count_tokens=words, context_length=512, num_samples=1, seed=0, data_dir=None)[0]
            .answers[0]
        )
        == 12
    )


def test_too_short_context_is_a_clear_error():
    with pytest.raises(LengthError, match="context_length"):
        tasks.get("ruler/cwe").samples(count_tokens=words, context_length=200, num_samples=1, seed=0, data_dir=None)
    with pytest.raises(LengthError):
        tasks.get("passkey").samples(count_tokens=words, context_length=0, num_samples=1, seed=0, data_dir=None)


def test_fit_length_measures_few_times():
    calls = []

    def count(text: str) -> int:
        calls.append(1)
        return len(text)

    n, text, tokens = fit_length(lambda k: "ab " * k, count, 100_000)
    assert 98_000 <= tokens <= 100_000 and len(calls) < 12


def test_truncate_middle_with_tokenizer_and_counter():
    class WordTokenizer:
        def __init__(self):
            self.vocab: dict[str, int] = {}
            self.inv: dict[int, str] = {}

        def encode(self, text, add_special_tokens=False):
            ids = []
            for w in text.split(" "):
                if w not in self.vocab:
                    self.vocab[w] = len(self.vocab)
                    self.inv[self.vocab[w]] = w
                ids.append(self.vocab[w])
            return ids

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(self.inv[i] for i in ids)

    text = " ".join(f"w{i}" for i in range(100))
    out = truncate_middle(text, 10, tokenizer=WordTokenizer())
    assert out == "w0 w1 w2 w3 w4" + "w95 w96 w97 w98 w99"
    assert truncate_middle(text, 1000, tokenizer=WordTokenizer()) == text
    cut = truncate_middle(text, 20, count_tokens=words)
    assert words(cut) <= 20 and cut.startswith("w0 ") and cut.endswith(" w99")
    assert len(truncate_middle("x" * 50, 10)) == 10


_DIGEST = r"""
import hashlib
from kvjax.eval import tasks
h = hashlib.sha1()
for name in tasks.GROUPS["ruler_synthetic"] + ("passkey", "needle"):
    for s in tasks.get(name).samples(count_tokens=lambda t: len(t.split()), context_length=2048,
                                     num_samples=1, seed=5, data_dir=None):
        h.update((s.id + tasks.full_prompt(s) + "|".join(s.answers)).encode())
print(h.hexdigest())
"""


def test_same_samples_in_every_process():
    """Hosts of a multi-host run must generate identical sample lists (no hash-seed dependence)."""
    import subprocess
    import sys

    def digest(hash_seed: str) -> str:
        env = {
            **os.environ,
            "PYTHONHASHSEED": hash_seed,
            "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        return subprocess.run(
            [sys.executable, "-c", _DIGEST], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()

    assert digest("1") == digest("2")


def test_fit_length_gives_up_on_filler_without_tokens():
    n, _, tokens = fit_length(lambda k: "x" * k, lambda t: 5, 100)
    assert tokens == 5
