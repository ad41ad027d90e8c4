"""Scoring functions of the benchmarks kvjax evaluates on.

Every function takes the model's prediction (a string) and returns a float in ``[0, 1]``; the reports
multiply means by 100 as the papers do. The definitions follow the benchmarks' published scoring rules and
are implemented here from those definitions:

* RULER: ``string_match_all`` (fraction of references contained in the prediction, case-insensitive) and
  ``string_match_part`` (1 if any reference is contained).
* LongBench: ``qa_f1`` (token F1 after SQuAD-style normalisation), ``rouge_l_longbench`` (the summary-level
  ROUGE-L F of the ``rouge`` package LongBench calls), ``classification_score``, ``retrieval_score``,
  ``count_score`` and ``code_sim_score`` (first code line, fuzzy ratio); the maximum over the reference
  answers is taken by the task (``max_over_answers``).
* Passkey: ``passkey_exact`` and ``passkey_partial`` (longest common prefix ratio).
* Generic: ``rouge_l`` (sentence-level LCS F-measure) and ``rouge_l_recall`` on lowercased words, punctuation
  ignored; ``indel_ratio`` (``2*LCS/(len a + len b)``), ``edit_similarity`` (``1 - levenshtein/max(len)``).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

__all__ = [
    "METRICS",
    "classification_score",
    "code_sim_score",
    "count_score",
    "edit_similarity",
    "exact_match",
    "first_digit_run",
    "fuzzy_ratio",
    "indel_ratio",
    "lcs_length",
    "levenshtein",
    "max_over_answers",
    "normalize_answer",
    "passkey_exact",
    "passkey_partial",
    "qa_f1",
    "retrieval_score",
    "rouge_l",
    "rouge_l_longbench",
    "rouge_tokens",
    "string_match_all",
    "string_match_part",
]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


# -------------------------------------------------------------------------------------------------
# Sequence primitives


def lcs_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common subsequence of two sequences (characters or tokens).

    Bit-parallel (Allison-Dix / Hyyro): one big-integer update per element of the longer sequence, so
    ``O(len(a) * len(b) / 64)`` machine-word operations.
    """
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return 0
    masks: dict[Hashable, int] = {}
    for i, x in enumerate(b):
        masks[x] = masks.get(x, 0) | (1 << i)
    full = (1 << len(b)) - 1
    v = full
    for y in a:
        m = masks.get(y)
        if m is None:
            continue
        u = v & m
        v = ((v + u) | (v - u)) & full
    return len(b) - v.bit_count()


def levenshtein(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Levenshtein distance (unit cost insertions, deletions and substitutions)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def indel_ratio(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """``2 * LCS / (len(a) + len(b))``: the similarity of the insert/delete-only edit distance.

    This is ``Levenshtein.ratio`` (substitution weight 2) and rapidfuzz's ``fuzz.ratio / 100``. Two empty
    sequences are identical (1.0).
    """
    total = len(a) + len(b)
    if total == 0:
        return 1.0
    return 2.0 * lcs_length(a, b) / total


def fuzzy_ratio(a: str, b: str) -> float:
    """fuzzywuzzy's ``fuzz.ratio(a, b) / 100`` as LongBench uses it for code.

    Equal strings score 1, a non-equal pair with an empty side scores 0, otherwise ``indel_ratio`` rounded
    to a whole percent (Python's round-half-to-even, as fuzzywuzzy's ``int(round(x))``). This matches
    fuzzywuzzy backed by python-Levenshtein; the pure-difflib fallback of fuzzywuzzy can differ slightly
    because difflib's matching blocks are not always a longest common subsequence.
    """
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    return round(100.0 * indel_ratio(a, b)) / 100.0


def edit_similarity(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """``1 - levenshtein(a, b) / max(len(a), len(b))`` (1.0 for two empty sequences).

    The "edit similarity" of CodeXGLUE / RepoBench; LongBench's code score is ``fuzzy_ratio`` instead.
    """
    longest = max(len(a), len(b))
    if longest == 0:
        return 1.0
    return 1.0 - levenshtein(a, b) / longest


# -------------------------------------------------------------------------------------------------
# RULER and passkey


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_all``: fraction of references found in the prediction (case-insensitive)."""
    if not references:
        return 0.0
    pred = prediction.lower()
    return sum(1.0 for r in references if r.lower() in pred) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_part``: 1 if any reference is in the prediction (case-insensitive)."""
    pred = prediction.lower()
    return 1.0 if any(r.lower() in pred for r in references) else 0.0


def exact_match(prediction: str, reference: str) -> float:
    """1 if the stripped prediction equals the stripped reference."""
    return 1.0 if prediction.strip() == reference.strip() else 0.0


def first_digit_run(text: str) -> str:
    """The first maximal run of ASCII digits in ``text`` ('' if none)."""
    m = re.search(r"[0-9]+", text)
    return m.group(0) if m else ""


def passkey_exact(prediction: str, passkey: str) -> float:
    """1 if the first run of digits in the prediction is exactly the passkey."""
    return 1.0 if first_digit_run(prediction) == passkey else 0.0


def passkey_partial(prediction: str, passkey: str) -> float:
    """Partial passkey match: ``len(common prefix(first digit run, passkey)) / len(passkey)``.

    The fraction of the passkey's leading digits the model reproduced before its first mistake (the
    "partial match" of the 64-digit passkey test). Digits after the first wrong one do not count.
    """
    if not passkey:
        return 0.0
    got = first_digit_run(prediction)
    n = 0
    for x, y in zip(got, passkey, strict=False):
        if x != y:
            break
        n += 1
    return n / len(passkey)


# -------------------------------------------------------------------------------------------------
# LongBench


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lowercase, drop punctuation, drop articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def qa_f1(prediction: str, ground_truth: str) -> float:
    """Token-level F1 between normalised prediction and answer (LongBench / SQuAD ``qa_f1_score``)."""
    pred = normalize_answer(prediction).split()
    gold = normalize_answer(ground_truth).split()
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision = same / len(pred)
    recall = same / len(gold)
    return 2.0 * precision * recall / (precision + recall)


def _lcs_table(x: Sequence[str], y: Sequence[str]) -> list[list[int]]:
    table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i in range(1, len(x) + 1):
        row, above = table[i], table[i - 1]
        xi = x[i - 1]
        for j in range(1, len(y) + 1):
            if xi == y[j - 1]:
                row[j] = above[j - 1] + 1
            else:
                row[j] = above[j] if above[j] >= row[j - 1] else row[j - 1]
    return table


def _lcs_words(ref: Sequence[str], hyp: Sequence[str]) -> set[str]:
    """The words of one longest common subsequence, walked back from the end (ties move left in ``hyp``)."""
    table = _lcs_table(ref, hyp)
    i, j = len(ref), len(hyp)
    out: set[str] = set()
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1]:
            out.add(ref[i - 1])
            i -= 1
            j -= 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out


def rouge_l_longbench(prediction: str, reference: str) -> float:
    """ROUGE-L F as LongBench computes it (the ``rouge`` package's summary-level ROUGE-L).

    Definition: both texts are split into "sentences" on ``.`` (empty pieces dropped, whitespace collapsed)
    and sentences into words on spaces. With *distinct*-word counts ``m`` (reference) and ``n``
    (prediction), ``U`` is the set of distinct words that occur in a longest common subsequence of some
    reference sentence and some predicted sentence; ``R = |U|/m``, ``P = |U|/n``, ``F = 2PR/(P+R+1e-8)``.
    Empty inputs score 0 (LongBench catches the package's error and returns 0).
    """
    hyp = [" ".join(s.split()) for s in prediction.split(".") if s]
    ref = [" ".join(s.split()) for s in reference.split(".") if s]
    if not hyp or not ref:
        return 0.0
    hyp_words = [s.split(" ") for s in hyp]
    ref_words = [s.split(" ") for s in ref]
    m = len({w for s in ref_words for w in s})
    n = len({w for s in hyp_words for w in s})
    union: set[str] = set()
    for r in ref_words:
        for h in hyp_words:
            union |= _lcs_words(r, h)
    recall = len(union) / m
    precision = len(union) / n
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)


_WORD = re.compile(r"\w+")


def rouge_tokens(text: str) -> list[str]:
    """ROUGE's word tokens: the lowercased runs of letters and digits, punctuation dropped (as ROUGE's own
    tokenizers do), so ``"day."`` and ``"Day"`` are the reference's ``"day"``."""
    return _WORD.findall(text.lower())


def rouge_l(prediction: str, reference: str) -> float:
    """Sentence-level ROUGE-L F1 on ``rouge_tokens``: ``2PR/(P+R)`` with ``P = LCS/len(pred)`` and
    ``R = LCS/len(ref)`` (0 when either side is empty)."""
    pred = rouge_tokens(prediction)
    ref = rouge_tokens(reference)
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(pred), lcs / len(ref)
    return 2.0 * p * r / (p + r)


def rouge_l_recall(prediction: str, reference: str) -> float:
    """``LCS / len(reference)`` on ``rouge_tokens``: how much of the reference was reproduced."""
    ref = rouge_tokens(reference)
    if not ref:
        return 0.0
    return lcs_length(rouge_tokens(prediction), ref) / len(ref)


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str]) -> float:
    """LongBench's classification score (TREC, LSHT).

    The class names found in the prediction are collected; those that are a strict substring of the ground
    truth are dropped; the score is ``1/len(found)`` if the ground truth is among the rest, else 0.
    LongBench drops them while iterating over the same list, so the name right after a dropped one is
    never examined (kept even if it too is a substring); that quirk is reproduced for identical scores.
    """
    found = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(found):
        term = found[i]
        i += 1
        if term in ground_truth and term != ground_truth:
            found.remove(term)  # shifts the list left: the next term is skipped, as upstream
    if ground_truth in found:
        return 1.0 / len(found)
    return 0.0


def retrieval_score(prediction: str, ground_truth: str) -> float:
    """LongBench's passage-retrieval score: the fraction of numbers in the prediction that equal the
    paragraph number of the answer ``"Paragraph <k>"`` (0 when the prediction has no number)."""
    m = re.findall(r"Paragraph (\d+)", ground_truth)
    if not m:
        return 0.0
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for x in numbers if x == m[0]) / len(numbers)


def count_score(prediction: str, ground_truth: str) -> float:
    """LongBench's passage-count score: the fraction of numbers in the prediction equal to the answer."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for x in numbers if x == str(ground_truth)) / len(numbers)


def code_sim_score(prediction: str, ground_truth: str) -> float:
    """LongBench's code score: the first line of the prediction (after leading newlines) that contains no
    backtick, ``#`` or ``//`` is compared with the answer by ``fuzzy_ratio`` (empty if no such line)."""
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzzy_ratio(line, ground_truth)


def max_over_answers(fn: Callable[..., float], prediction: str, answers: Sequence[str], **kwargs: object) -> float:
    """The maximum of ``fn(prediction, answer, **kwargs)`` over the reference answers (0 if none)."""
    return max((fn(prediction, a, **kwargs) for a in answers), default=0.0)


#: Metrics addressable by name. Per-answer LongBench metrics take one answer; list-style metrics (RULER's)
#: take all references at once. Tasks know which is which.
METRICS: dict[str, Callable[..., float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "rouge_l": rouge_l,
    "rouge_l_recall": rouge_l_recall,
    "rouge_l_longbench": rouge_l_longbench,
    "classification": classification_score,
    "retrieval": retrieval_score,
    "count": count_score,
    "code_sim": code_sim_score,
    "edit_similarity": edit_similarity,
    "passkey_exact": passkey_exact,
    "passkey_partial": passkey_partial,
}
