"""Retrieval drills: one context, many question / answer rounds, every answer trained.

A RULER example trains a handful of answer tokens per several hundred context tokens, and a small model
fed only those learns to find *a* needle long before it learns to find the *queried* one (multi-key,
multi-value and multi-query errors copy the wrong needle; variable tracking never starts). A drill
packs the same skill densely: a context in the task's own wording with many needles (or many
variable chains), followed by questions about them in the task's question template, each with its
answer. Every answer is a target, so one drill teaches key matching several times over.

Drills are training mixture entries (`--tasks=drill/niah,drill/vt`) next to the tasks they train for;
they are never evaluated. An example is `(token ids, target spans)`: the ids at `start:end` of each
span are predicted from the token before.
"""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Callable
from typing import Any

from kvjax.tasks import haystack as hs

Example = tuple[list[int], list[tuple[int, int]]]

_NIAH_PREFIX = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
_VT_PREFIX = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"


def _join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _chain_statements(rng: random.Random, chains: list[tuple[str, list[str]]]) -> list[str]:
    """`VAR A = VALUE. VAR B = VAR A. ...` of each (value, names) chain, chains interleaved at random,
    each in its own order."""
    pending = [
        [f"VAR {n[0]} = {v}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(n)] for v, n in chains
    ]
    statements: list[str] = []
    while any(pending):
        statements.append(rng.choice([p for p in pending if p]).pop(0))
    return statements


def _vt_question(value: str, count: int) -> str:
    """RULER's vt question and answer prefix for the `count` variables assigned `value`."""
    return (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
        " Answer: According to the chain(s) of variable assignment in the text above, "
        f"{count} variables are assigned the value {value}, they are: "
    )


class Drill:
    """Shared assembly: prefix + context, then rounds of (question, answer) until `length` is full."""

    name = ""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def plan(self, rng: random.Random, length: int) -> tuple[str, Callable[[int], str], list[tuple[str, str]]]:
        """(prefix, context(n filler units), rounds of (question text, answer text)) of one drill."""
        raise NotImplementedError

    def example(self, rng: random.Random, length: int) -> Example:
        prefix, context, rounds = self.plan(rng, length)
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        encoded = [(self.encode(q), self.encode(" " + a)) for q, a in rounds]
        room = length - 1 - sum(len(q) + len(a) for q, a in encoded)  # the final </s> too
        head = self.encode(prefix + context(0))
        if len(head) + 1 > room:  # drop rounds from the end until the bare context fits
            while encoded and len(head) + 1 > room:
                q, a = encoded.pop()
                room += len(q) + len(a)
            if not encoded:
                raise ValueError(f"{self.name}: a drill does not fit {length} tokens")
        lo, hi = 0, 1
        while len(self.encode(prefix + context(hi))) + 1 <= room and hi < 100_000:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # the most filler that fits
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if len(self.encode(prefix + context(mid))) + 1 <= room else (lo, mid)
        ids = [bos] + self.encode(prefix + context(lo))
        spans = []
        for q, a in encoded:
            ids += q
            spans.append((len(ids), len(ids) + len(a)))
            ids += a
        ids.append(eos)
        spans[-1] = (spans[-1][0], len(ids))  # the last answer ends the text, as in the eval
        return ids, spans


class NiahDrill(Drill):
    """Needles `One of the special magic numbers for KEY is: VALUE.` in an essay or noise haystack; some keys
    have several values (niah_multivalue), rounds ask for one key (niah_multikey) or several
    (niah_multiquery), each in RULER's question and answer-prefix wording."""

    name = "drill/niah"

    def plan(self, rng: random.Random, length: int) -> tuple[str, Callable[[int], str], list[tuple[str, str]]]:
        needle = len(self.encode(" One of the special magic numbers for lucky-bell is: 1234567."))
        room = (length - len(self.encode(_NIAH_PREFIX))) / (2.4 * needle)  # a needle and its share of a round
        count = rng.randint(max(2, int(room) // 2), max(2, min(48, int(room))))
        used: set[str] = set()
        values: dict[str, list[str]] = {}
        while count > 0:
            n = min(count, rng.choice((1, 1, 1, 2, 3, 4)))
            values[hs.random_key(rng, used)] = [hs.random_number(rng, 7) for _ in range(n)]
            count -= n
        keys = list(values)
        needles = [f"One of the special magic numbers for {k} is: {v}." for k in keys for v in values[k]]
        rng.shuffle(needles)
        depths = sorted(rng.random() for _ in needles)
        asked = rng.sample(keys, rng.randint((3 * len(keys) + 3) // 4, len(keys)))  # the rest: distractors
        rounds = []
        while asked:
            group = [asked.pop() for _ in range(min(len(asked), rng.choice((1, 1, 2, 3, 4))))]
            query = _join_keys(group)
            answers = [v for k in group for v in rng.sample(values[k], len(values[k]))]
            question = (
                f"\nWhat are all the special magic numbers for {query} mentioned in the provided text?"
                f" The special magic numbers for {query} mentioned in the provided text are"
            )
            rounds.append((question, ", ".join(answers)))
        filler = hs.Filler(rng.choice(("essay", "noise")), seed=rng.getrandbits(32))

        def context(n: int) -> str:
            return hs.join_with_inserts(filler.units(n), list(zip(depths, needles, strict=True)))

        return _NIAH_PREFIX, context, rounds


class RecallDrill(Drill):
    """Needles, then each recalled in a random order; the values are the targets.

    The bootstrap for key matching. A model that finds *a* needle but not the queried one has no trace of
    a needle's key at its value, which is 3 tokens after the key (`KEY is: VALUE`); the eval's questions
    only reward that trace through a retrieval it does not do yet, so its gradient is a plateau. Here
    the recall repeats the needle's own text up to the value (`... for KEY is:`), a plain induction
    whose match is 3 tokens back, half the time; the other half uses RULER's answer prefix or its whole
    question and answer prefix (the key 7 tokens before the value), as the eval asks. One needle per
    key, as many needles as the recalls leave room for, and nearly every needle recalled: a value to
    retrieve every ~45 tokens.
    """

    name = "drill/recall"

    def plan(self, rng: random.Random, length: int) -> tuple[str, Callable[[int], str], list[tuple[str, str]]]:
        needle = len(self.encode(" One of the special magic numbers for lucky-bell is: 1234567."))
        room = (length - len(self.encode(_NIAH_PREFIX))) / (2.2 * needle)  # a needle and its recall
        count = rng.randint(max(2, int(0.7 * room)), max(2, min(64, int(room))))
        used: set[str] = set()
        values = {hs.random_key(rng, used): hs.random_number(rng, 7) for _ in range(count)}
        keys = list(values)
        needles = [f"One of the special magic numbers for {k} is: {values[k]}." for k in keys]
        depths = sorted(rng.random() for _ in needles)
        rounds = []
        for key in rng.sample(keys, rng.randint((3 * len(keys) + 3) // 4, len(keys))):
            form = rng.random()
            if form < 0.5:
                question = f"\nOne of the special magic numbers for {key} is:"
            elif form < 0.75:
                question = f"\nThe special magic numbers for {key} mentioned in the provided text are"
            else:
                question = (
                    f"\nWhat are all the special magic numbers for {key} mentioned in the provided text?"
                    f" The special magic numbers for {key} mentioned in the provided text are"
                )
            rounds.append((question, values[key]))
        filler = hs.Filler(rng.choice(("essay", "noise")), seed=rng.getrandbits(32))

        def context(n: int) -> str:
            return hs.join_with_inserts(filler.units(n), list(zip(depths, needles, strict=True)))

        return _NIAH_PREFIX, context, rounds


class VariableTrackingDrill(Drill):
    """Several `VAR X = VALUE. VAR Y = VAR X. ...` chains of 1-4 hops in noise; each round asks for the
    variables of one value (RULER's vt wording), so each answer walks one chain."""

    name = "drill/vt"

    @staticmethod
    def variable(rng: random.Random) -> str:
        return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))

    def plan(self, rng: random.Random, length: int) -> tuple[str, Callable[[int], str], list[tuple[str, str]]]:
        used: set[str] = set()
        chains: list[tuple[str, list[str]]] = []
        values: set[str] = set()
        unit = len(self.encode(" VAR ABCDE = VAR FGHIJ."))  # budget in statement-sized units
        budget = length / unit - 5
        while budget > 0 and len(chains) < 12:
            names = [self.variable(rng) for _ in range(rng.randint(2, 5))]
            value = hs.random_number(rng, 5)
            if value in values or used & set(names) or len(set(names)) < len(names):
                continue
            used |= set(names)
            values.add(value)
            chains.append((value, names))
            budget -= 9 + 1.25 * len(names)  # statements, their filler and the round
        if len(chains) > 1 and budget < 0:
            chains.pop()
        statements = _chain_statements(rng, chains)
        depths = sorted(rng.random() for _ in statements)
        rounds = [
            (_vt_question(value, len(names)), ", ".join(names)) for value, names in rng.sample(chains, len(chains))
        ]
        filler = hs.Filler("noise")

        def context(n: int) -> str:
            return hs.join_with_inserts(filler.units(n), list(zip(depths, statements, strict=True)))

        return _VT_PREFIX, context, rounds


class LookupDrill(Drill):
    """Variable assignments looked up from their right-hand side: the bootstrap for variable tracking.

    Every other task reads what follows its key (`KEY is: VALUE`); a vt answer is the name *before* the
    queried value (`VAR NAME = 12345.`), then the name before `= VAR NAME.`, and so on. A model that has
    never done that reverse lookup gets no gradient from a five-name vt answer it cannot start. Here
    chains are short (1-3 names) and nearly every assignment is looked up on its own, half the time in a
    short question (`The variable assigned 12345 is` / `The variable assigned VAR NAME is`), half the
    time as a whole chain in RULER's vt question and answer prefix: a lookup every ~40 tokens.
    """

    name = "drill/lookup"

    def plan(self, rng: random.Random, length: int) -> tuple[str, Callable[[int], str], list[tuple[str, str]]]:
        per_name = len(self.encode(" VAR ABCDE = VAR FGHIJ.\nThe variable assigned VAR FGHIJ is ABCDE"))
        names_left = max(2, int(0.8 * (length - len(self.encode(_VT_PREFIX)) - 20) / per_name))
        used: set[str] = set()
        chains: list[tuple[str, list[str]]] = []
        while names_left > 0:
            size = min(names_left, rng.randint(1, 3))
            names = []
            while len(names) < size:
                name = VariableTrackingDrill.variable(rng)
                if name not in used:
                    used.add(name)
                    names.append(name)
            value = hs.random_number(rng, 5)
            if any(value == v for v, _ in chains):
                continue
            chains.append((value, names))
            names_left -= size
        statements = _chain_statements(rng, chains)
        depths = sorted(rng.random() for _ in statements)
        rounds = []
        for value, names in rng.sample(chains, len(chains)):
            if rng.random() < 0.5:
                rounds.append((_vt_question(value, len(names)), ", ".join(names)))
            else:
                sources = [value] + [f"VAR {n}" for n in names[:-1]]
                rounds += [(f"\nThe variable assigned {s} is", n) for s, n in zip(sources, names, strict=True)]
        rng.shuffle(rounds)
        filler = hs.Filler("noise", seed=rng.getrandbits(32))

        def context(n: int) -> str:
            return hs.join_with_inserts(filler.units(n), list(zip(depths, statements, strict=True)))

        return _VT_PREFIX, context, rounds


DRILLS: dict[str, type[Drill]] = {
    d.name: d for d in (NiahDrill, RecallDrill, VariableTrackingDrill, LookupDrill)
}
