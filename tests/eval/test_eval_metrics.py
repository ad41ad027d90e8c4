"""Metrics against hand-computed values."""

import random

import pytest

from kvjax.eval import metrics as M


def test_string_match_all_and_part():
    pred = "The numbers are 123 and 456."
    assert M.string_match_all(pred, ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert M.string_match_part(pred, ["123", "456", "789"]) == 1.0
    assert M.string_match_part(pred, ["789"]) == 0.0
    # Case-insensitive, as RULER.
    assert M.string_match_all("answer: ABC-def", ["abc-DEF"]) == 1.0
    assert M.string_match_all("x", []) == 0.0


def test_normalize_and_qa_f1():
    assert M.normalize_answer("The  Penn-Treebank, an archive!") == "penntreebank archive"
    assert M.qa_f1("The Penn Treebank!", "Penn Treebank") == 1.0
    # pred {cat, sat, on, mat} vs gold {cat, is, on, mat}: 3 common, P = R = 3/4.
    assert M.qa_f1("a cat sat on the mat", "the cat is on a mat") == pytest.approx(0.75)
    # pred 2 tokens, gold 4 tokens, 2 common: P = 1, R = 1/2, F1 = 2/3.
    assert M.qa_f1("red car", "a red car and bus") == pytest.approx(2 / 3)
    assert M.qa_f1("", "anything") == 0.0
    assert M.qa_f1("totally different", "answer") == 0.0


def test_rouge_l_longbench_hand_values():
    # One sentence each; distinct words m = n = 5 and the LCS "the cat on the mat" has 4 distinct
    # words: R = P = 4/5, F = 0.8.
    assert M.rouge_l_longbench("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-6)
    # Two sentences each: union of per-sentence LCS words = {a, c, e}; R = 3/4, P = 3/5, F = 2/3.
    assert M.rouge_l_longbench("a b c. d e", "a c. e f") == pytest.approx(2 / 3, abs=1e-6)
    assert M.rouge_l_longbench("", "reference") == 0.0
    assert M.rouge_l_longbench("...", "reference") == 0.0


def test_rouge_l_generic():
    # LCS = 5 tokens of 6 on both sides.
    assert M.rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    assert M.rouge_l_recall("eat a sandwich in the park", "eat a sandwich") == 1.0
    assert M.rouge_l_recall("sandwich", "eat a sandwich") == pytest.approx(1 / 3)
    assert M.rouge_l("", "x") == 0.0


def test_rouge_l_ignores_case_and_punctuation():
    # The needle sentence repeated word for word holds all 12 words of the reference answer: recall 1, and
    # P = 12/21 (its 21 words), F1 = 2P / (P + 1) = 24/33. Whitespace tokens would make "day." miss "day".
    reply = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    answer = "eat a sandwich and sit in Dolores Park on a sunny day"
    assert M.rouge_l_recall(reply, answer) == 1.0
    assert M.rouge_l(reply, answer) == pytest.approx(24 / 33)
    # "sandwich," and "day!" are the words "sandwich" and "day"; "sandwiches" is not: 11 of 12.
    assert M.rouge_l_recall("Eat a sandwich, and sit in Dolores Park on a sunny day!", answer) == 1.0
    assert M.rouge_l_recall("eat a sandwiches and sit in Dolores Park on a sunny day", answer) == pytest.approx(11 / 12)
    assert M.rouge_l_recall("...", answer) == 0.0


def test_lcs_and_levenshtein_against_dynamic_programming():
    def lcs_dp(a, b):
        t = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
        for i, x in enumerate(a):
            for j, y in enumerate(b):
                t[i + 1][j + 1] = t[i][j] + 1 if x == y else max(t[i][j + 1], t[i + 1][j])
        return t[-1][-1]

    rng = random.Random(0)
    for _ in range(200):
        a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 70)))
        b = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 70)))
        assert M.lcs_length(a, b) == lcs_dp(a, b)
    assert M.lcs_length(["x", "y", "z"], ["y", "z", "x"]) == 2
    assert M.levenshtein("kitten", "sitting") == 3
    assert M.levenshtein("", "abc") == 3


def test_edit_similarity_and_fuzzy_ratio():
    # 3 edits over max length 7.
    assert M.edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert M.edit_similarity("", "") == 1.0
    # LCS("kitten", "sitting") = 4: 2*4/13 = 0.615 -> fuzzywuzzy rounds to 62.
    assert M.indel_ratio("kitten", "sitting") == pytest.approx(8 / 13)
    assert M.fuzzy_ratio("kitten", "sitting") == 0.62
    assert M.fuzzy_ratio("", "") == 1.0
    assert M.fuzzy_ratio("", "x") == 0.0


def test_code_sim_uses_first_plain_line():
    pred = "```python\n    return total\n```"
    assert M.code_sim_score(pred, "    return total") == 1.0
    # A comment line is skipped; "x = 1" vs "x = 2": LCS 4 of 5+5 -> 0.8.
    assert M.code_sim_score("# comment\nx = 1", "x = 2") == 0.8
    assert M.code_sim_score("// only comments", "x") == 0.0


def test_classification_retrieval_count():
    classes = ["Individual", "Distance", "City", "Country", "Other location"]
    assert M.classification_score("City or maybe Country", "City", classes) == 0.5
    assert M.classification_score("City", "City", classes) == 1.0
    assert M.classification_score("Distance", "City", classes) == 0.0
    # "location" is a strict substring of the answer and is dropped before counting.
    assert M.classification_score("Other location", "Other location", ["location", "Other location"]) == 1.0
    # Upstream skips the name after each dropped one: "ab" survives, so 1/2 rather than 1.
    assert M.classification_score("abc", "abc", ["a", "ab", "abc"]) == 0.5
    assert M.classification_score("abc", "abc", ["a", "abc", "b"]) == 1.0  # "abc" skipped, "b" dropped
    assert M.retrieval_score("Paragraph 3, not Paragraph 4", "Paragraph 3") == 0.5
    assert M.retrieval_score("no number", "Paragraph 3") == 0.0
    assert M.count_score("There are 5 unique, maybe 6", "5") == 0.5
    assert M.count_score("5", "5") == 1.0


def test_passkey_exact_and_partial():
    assert M.passkey_exact("The pass key is 12345.", "12345") == 1.0
    assert M.passkey_exact("The pass key is 123456.", "12345") == 0.0
    # Longest common prefix "123" of 5 digits.
    assert M.passkey_partial("The pass key is 12399", "12345") == pytest.approx(0.6)
    assert M.passkey_partial("no digits", "12345") == 0.0
    key = "1234567890" * 6 + "1234"
    assert M.passkey_partial(key[:32] + "x", key) == pytest.approx(0.5)


def test_max_over_answers():
    assert M.max_over_answers(M.qa_f1, "Maida Vale", ["London", "Maida Vale"]) == 1.0
    assert M.max_over_answers(M.qa_f1, "x", []) == 0.0
