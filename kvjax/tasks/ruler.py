"""RULER's synthetic tasks, generated locally at a target length measured with the model's tokenizer.

Task definitions follow the RULER benchmark (Hsieh et al., 2024):

======================  ==========  =========  ===========  ======================================
task                    haystack    keys       values       needles
======================  ==========  =========  ===========  ======================================
niah_single_1           noise       words      numbers      1
niah_single_2           essay       words      numbers      1
niah_single_3           essay       words      uuids        1
niah_multikey_1         essay       words      numbers      4 keys, 1 queried
niah_multikey_2         needles     words      numbers      haystack made of distractor needles
niah_multikey_3         needles     uuids      uuids        haystack made of distractor needles
niah_multivalue         essay       words      numbers      1 key with 4 values
niah_multiquery         essay       words      numbers      4 keys, all queried
vt                      noise       --         5 digits     1 chain of 4 hops (5 variables)
cwe                     word list   --         --           10 words x30 among words x3
fwe                     coded text  --         --           Zipf(alpha=2) word counts, top 3
qa_1 / qa_2             documents   --         --           SQuAD v2 / HotpotQA from local files
======================  ==========  =========  ===========  ======================================

Lengths: the whole prompt (``prefix + context + question + answer_prefix``) is fitted to
``context_length - max_new_tokens`` tokens (the prompt plus the answer fit the model's window, as in
RULER), within 2% from below, by growing the filler. Metrics: ``string_match_all`` for every task but
qa (``string_match_part``). Our filler and word lists are generated offline, so texts differ from the
official RULER data while the task structure, templates and metrics are RULER's.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Sequence
from typing import Any

from kvjax.errors import KvjaxError
from kvjax.tasks import haystack as hs
from kvjax.tasks import metrics
from kvjax.tasks.base import (
    BaseTask,
    CountTokens,
    DataError,
    LengthError,
    Sample,
    check_length,
    fit_sample,
    read_json,
    require_file,
)

__all__ = ["ANSWER_PREFIXES", "RULER_TASKS", "RulerCWE", "RulerFWE", "RulerNiah", "RulerQA", "RulerVT", "postprocess"]

#: The NIAH tasks' answer prefixes: RULER's own, or the needle sentence's opening (``RulerNiah``).
ANSWER_PREFIXES = ("task", "needle")

#: RULER's insertion depths for multiple needles: 40 evenly spaced points in [0, 1].
DEPTHS = tuple(i / 39 for i in range(40))

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's prediction clean-up: control characters become newlines, then strip."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


class _RulerBase(BaseTask):
    """Fitting loop shared by the RULER tasks; subclasses return a ``render(n) -> Sample`` per index."""

    max_new_tokens = 128
    metric = "string_match_all"

    def _renderer(self, rng: random.Random, sid: str, data: Any) -> tuple[Callable[[int], Sample], int]:
        """``(render, max_units)`` for one sample."""
        raise NotImplementedError

    def _load(self, data_dir: str | None) -> Any:
        return None

    def samples(
        self,
        *,
        count_tokens: CountTokens,
        context_length: int,
        num_samples: int,
        seed: int,
        data_dir: str | None = None,
    ) -> list[Sample]:
        check_length(context_length, num_samples)
        target = self.prompt_budget(context_length)
        data = self._load(data_dir)
        out = []
        for i in range(num_samples):
            sid = f"{self.name}:{context_length}:{seed}:{i}"
            rng = random.Random(f"{self.name}:{seed}:{i}")
            render, max_units = self._renderer(rng, sid, data)
            n, sample, tokens = fit_sample(
                render, count_tokens, target, task=self.name, max_units=max_units,
                index=i, seed=seed, context_length=context_length,
            )
            if n >= max_units and tokens < 0.98 * target:
                raise LengthError(
                    f"{self.name}: only {tokens} of {target} tokens could be filled (not enough filler "
                    "data for this context length)"
                )
            sample.metadata["filler_units"] = n
            out.append(sample)
        return out

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        pred = postprocess(prediction)
        return {
            "string_match_all": metrics.string_match_all(pred, sample.answers),
            "string_match_part": metrics.string_match_part(pred, sample.answers),
        }


# -------------------------------------------------------------------------------------------------
# Needle in a haystack variants


def _join_query(keys: Sequence[str]) -> str:
    if len(keys) == 1:
        return keys[0]
    return ", ".join(keys[:-1]) + ", and " + keys[-1]


class RulerNiah(_RulerBase):
    """RULER's needle-in-a-haystack family (see the module table).

    Option ``answer_prefix``: ``"task"`` (RULER's own, "The special magic numbers for <key> mentioned in the
    provided text are") or ``"needle"``: the needle sentence's own opening, "One of the special magic numbers for
    <key> is:", which a base model completes by copying the needle where it does not follow RULER's paraphrase.
    """

    max_new_tokens = 128
    options = {"answer_prefix": "task"}

    def __init__(
        self,
        name: str,
        *,
        haystack: str,
        key_type: str = "words",
        value_type: str = "numbers",
        num_keys: int = 1,
        num_values: int = 1,
        num_queries: int = 1,
        **kw: Any,
    ) -> None:
        super().__init__(name, **kw)
        if self.opts["answer_prefix"] not in ANSWER_PREFIXES:
            raise KvjaxError(f"task {self.name!r}: answer_prefix must be one of {list(ANSWER_PREFIXES)}, got "
                             f"{self.opts['answer_prefix']!r}")
        self.haystack = haystack
        self.key_type = key_type
        self.value_type = value_type
        self.num_keys = max(num_keys, num_queries)
        self.num_values = num_values
        self.num_queries = num_queries

    def _key(self, rng: random.Random, used: set[str]) -> str:
        if self.key_type == "uuids":
            k = hs.random_uuid(rng)
            used.add(k)
            return k
        return hs.random_key(rng, used)

    def _value(self, rng: random.Random) -> str:
        return hs.random_uuid(rng) if self.value_type == "uuids" else hs.random_number(rng, 7)

    def _renderer(self, rng: random.Random, sid: str, data: Any) -> tuple[Callable[[int], Sample], int]:
        tv = self.value_type  # "numbers" or "uuids"
        used: set[str] = set()
        keys = [self._key(rng, used) for _ in range(self.num_keys)]
        values = {k: [self._value(rng) for _ in range(self.num_values)] for k in keys}
        needles = [f"One of the special magic {tv} for {k} is: {v}." for k in keys for v in values[k]]
        rng.shuffle(needles)
        if len(needles) <= len(DEPTHS):
            depths = sorted(rng.sample(DEPTHS, len(needles)))
        else:
            depths = sorted(rng.random() for _ in needles)
        queries = rng.sample(keys, self.num_queries)
        answers = tuple(v for q in queries for v in values[q])
        query = _join_query(queries)
        prefix = (
            f"Some special magic {tv} are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {tv} afterwards.\n"
        )
        question = f"\nWhat are all the special magic {tv} for {query} mentioned in the provided text?"
        answer_prefix = f" The special magic {tv} for {query} mentioned in the provided text are"
        if self.opts["answer_prefix"] == "needle":
            answer_prefix = f" One of the special magic {tv} for {query} is:"
        inserts = list(zip(depths, needles, strict=True))

        if self.haystack == "needle":
            drng = random.Random(f"{sid}:distractors")
            cache: list[str] = []

            def units(n: int) -> list[str]:
                while len(cache) < n:
                    k = self._key(drng, used)
                    cache.append(f"One of the special magic {tv} for {k} is: {self._value(drng)}.")
                return cache[:n]

            sep = "\n"
        else:
            filler = hs.make_filler(self.haystack, seed=sid, haystack_file=self.haystack_file)
            units = filler.units
            sep = " "

        def render(n: int) -> Sample:
            return Sample(
                id=sid,
                prefix=prefix,
                context=hs.join_with_inserts(units(n), inserts, sep=sep),
                question=question,
                answer_prefix=answer_prefix,
                answers=answers,
                max_new_tokens=self.max_new_tokens,
                metric=self.metric,
                metadata={"depths": list(depths), "query": query},
            )

        return render, 50_000_000


# -------------------------------------------------------------------------------------------------
# Variable tracking


class RulerVT(_RulerBase):
    """Variable tracking: follow ``VAR X = VAR Y`` chains back to a value (1 chain, 4 hops, 1 example)."""

    max_new_tokens = 30
    options = {"num_chains": 1, "num_hops": 4, "icl": True}

    @staticmethod
    def _var(rng: random.Random, used: set[str]) -> str:
        while True:
            v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if v not in used:
                used.add(v)
                return v

    def _chains(self, rng: random.Random) -> tuple[list[list[str]], list[str], list[str]]:
        """(chain statements, first chain's variables, values) with distinct 5-digit values."""
        used: set[str] = set()
        chains, vals = [], []
        first_vars: list[str] = []
        for c in range(self.opts["num_chains"]):
            names = [self._var(rng, used) for _ in range(self.opts["num_hops"] + 1)]
            while True:
                value = hs.random_number(rng, 5)
                if value not in vals:
                    break
            vals.append(value)
            stmts = [f"VAR {names[0]} = {value}."] + [
                f"VAR {names[j + 1]} = VAR {names[j]}." for j in range(len(names) - 1)
            ]
            chains.append(stmts)
            if c == 0:
                first_vars = names
        return chains, first_vars, vals

    def _parts(self, query: str) -> tuple[str, str, str]:
        n = self.opts["num_hops"] + 1
        instr = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        question = f"\nQuestion: Find all variables that are assigned the value {query} in the text above."
        ans = (
            " Answer: According to the chain(s) of variable assignment in the text above, "
            f"{n} variables are assigned the value {query}, they are: "
        )
        return instr, question, ans

    def _renderer(self, rng: random.Random, sid: str, data: Any) -> tuple[Callable[[int], Sample], int]:
        example = ""
        if self.opts["icl"]:
            erng = random.Random(f"{sid}:example")
            chains, names, vals = self._chains(erng)
            stmts = [(erng.random(), s) for chain in chains for s in chain]
            depths = sorted(d for d, _ in stmts)
            inserts = list(zip(depths, [s for _, s in stmts], strict=True))
            ctx = hs.join_with_inserts(hs.Filler("noise").units(10), inserts)
            instr, question, ans = self._parts(vals[0])
            example = instr + ctx + question + ans + " ".join(names) + "\n\n"
        chains, names, vals = self._chains(rng)
        # Chain statements keep their order: sorted depths, chains interleaved at random.
        stmts: list[str] = []
        pending = [list(c) for c in chains]
        while any(pending):
            c = rng.choice([p for p in pending if p])
            stmts.append(c.pop(0))
        depths = sorted(rng.random() for _ in stmts)
        inserts = list(zip(depths, stmts, strict=True))
        instr, question, ans = self._parts(vals[0])
        filler = hs.Filler("noise")

        def render(n: int) -> Sample:
            return Sample(
                id=sid,
                prefix=example + instr,
                context=hs.join_with_inserts(filler.units(n), inserts),
                question=question,
                answer_prefix=ans,
                answers=tuple(names),
                max_new_tokens=self.max_new_tokens,
                metric=self.metric,
                metadata={"query": vals[0], "depths": depths},
            )

        return render, 50_000_000


# -------------------------------------------------------------------------------------------------
# Common / frequent words extraction


class RulerCWE(_RulerBase):
    """Common words extraction: a numbered word list where ``num_common`` words appear ``freq_common``
    times and every other word ``freq_uncommon`` times; answer the common ones (after one short example
    with 3x / 1x frequencies)."""

    max_new_tokens = 120
    options = {"num_common": 10, "freq_common": 30, "freq_uncommon": 3, "icl": True}

    def _parts(self) -> tuple[str, str, str]:
        k = self.opts["num_common"]
        instr = (
            "Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n"
        )
        question = f"\nQuestion: What are the {k} most common words in the above list?"
        ans = f" Answer: The top {k} words that appear most often in the list are:"
        return instr, question, ans

    @staticmethod
    def _listing(common: Sequence[str], fc: int, uncommon: Sequence[str], fu: int, seed: str) -> str:
        words = [w for w in common for _ in range(fc)] + [w for w in uncommon for _ in range(fu)]
        random.Random(seed).shuffle(words)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))

    def _renderer(self, rng: random.Random, sid: str, data: Any) -> tuple[Callable[[int], Sample], int]:
        k, fc, fu = self.opts["num_common"], self.opts["freq_common"], self.opts["freq_uncommon"]
        if fc <= fu:
            raise ValueError("freq_common must exceed freq_uncommon")
        instr, question, ans = self._parts()
        pool = hs.WordPool(rng)
        common = pool.take(k)
        example = ""
        if self.opts["icl"]:
            # Pseudo-words only, so the example never shares a word with the real list.
            epool = hs.WordPool(random.Random(f"{sid}:example"), first=())
            ewords = epool.take(k + 10)
            ectx = self._listing(ewords[:k], 3, ewords[k:], 1, f"{sid}:example-order")
            example = instr + ectx + question + ans + " " + " ".join(ewords[:k]) + "\n\n"

        def render(n: int) -> Sample:
            uncommon = pool.take(k + n)[k:]
            return Sample(
                id=sid,
                prefix=example + instr,
                context=self._listing(common, fc, uncommon, fu, f"{sid}:order:{n}"),
                question=question,
                answer_prefix=ans,
                answers=tuple(common),
                max_new_tokens=self.max_new_tokens,
                metric=self.metric,
                metadata={},
            )

        return render, 10_000_000


class RulerFWE(_RulerBase):
    """Frequent words extraction: coded (random ``word_length``-letter) words whose counts follow
    ``c_r = round(N r^-alpha / H)`` for rank ``r`` (``H`` normalises the counts to about ``N`` words);
    answer the three most frequent. Dots ``....`` follow about one word in ten as noise (the prompt tells
    the model to ignore them). One short example precedes the task."""

    max_new_tokens = 50
    options = {"alpha": 2.0, "word_length": 6, "icl": True}

    def _parts(self) -> tuple[str, str, str]:
        instr = (
            "Read the following coded text and track the frequency of each coded word. Find the three "
            "most frequently appeared coded words. "
        )
        question = (
            "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the "
            "three most frequently appeared words in the above coded text?"
        )
        ans = " Answer: According to the coded text above, the three most frequently appeared words are:"
        return instr, question, ans

    def _counts(self, n: int) -> list[int]:
        alpha = float(self.opts["alpha"])
        weights: list[float] = []
        r = 1
        while True:
            w = r**-alpha
            if n * w < 0.5 and r > 4:
                break
            weights.append(w)
            r += 1
        h = sum(weights)
        counts = [max(1, round(n * w / h)) for w in weights]
        if not counts[0] > counts[1] > counts[2] > counts[3]:
            raise LengthError(f"{self.name}: {n} words are too few for a unique top 3 with alpha={alpha}")
        return counts

    def _text(self, pool: hs.WordPool, n: int, seed: str) -> str:
        counts = self._counts(n)
        vocab = pool.take(len(counts))
        words = [vocab[i] for i, c in enumerate(counts) for _ in range(c)]
        rng = random.Random(seed)
        rng.shuffle(words)
        out = []
        for w in words:
            out.append(w)
            if rng.random() < 0.1:
                out.append("....")
        return " ".join(out)

    def _renderer(self, rng: random.Random, sid: str, data: Any) -> tuple[Callable[[int], Sample], int]:
        length = int(self.opts["word_length"])
        pool = hs.coded_word_pool(rng, length)
        answers = tuple(pool.take(3))
        instr, question, ans = self._parts()
        example = ""
        if self.opts["icl"]:
            epool = hs.coded_word_pool(random.Random(f"{sid}:example"), length, exclude=answers)
            etext = self._text(epool, 40, f"{sid}:example-order")
            example = instr + etext + question + ans + " " + " ".join(epool.take(3)) + "\n\n"

        def render(n: int) -> Sample:
            return Sample(
                id=sid,
                prefix=example + instr,
                context=self._text(pool, max(n, 40), f"{sid}:order:{n}"),
                question=question,
                answer_prefix=ans,
                answers=answers,
                max_new_tokens=self.max_new_tokens,
                metric=self.metric,
                metadata={},
            )

        return render, 10_000_000


# -------------------------------------------------------------------------------------------------
# QA over documents


def _read_squad(path: str) -> tuple[list[str], list[tuple[str, tuple[str, ...], list[int]]]]:
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise DataError(f"{path}: expected SQuAD JSON with a top-level 'data' list")
    docs: list[str] = []
    index: dict[str, int] = {}
    qas = []
    for i, article in enumerate(data["data"]):
        where = f"{path}: article {i}"
        for j, para in enumerate(_squad_list(article, "paragraphs", where)):
            ctx = para.get("context") if isinstance(para, dict) else None
            if not isinstance(ctx, str):
                raise DataError(f"{where}, paragraph {j} has no 'context' text")
            if ctx not in index:
                index[ctx] = len(docs)
                docs.append(ctx)
            for k, qa in enumerate(_squad_list(para, "qas", f"{where}, paragraph {j}")):
                q_where = f"{where}, paragraph {j}, question {k}"
                if not isinstance(qa, dict) or not isinstance(qa.get("question"), str):
                    raise DataError(f"{q_where} has no 'question' text")
                found = _squad_list(qa, "answers", q_where)
                if any(not isinstance(a, dict) or not isinstance(a.get("text", ""), str) for a in found):
                    raise DataError(f"{q_where}: each answer must be an object with a 'text' string")
                answers = tuple(a["text"] for a in found if a.get("text"))
                if qa.get("is_impossible") or not answers:
                    continue
                qas.append((qa["question"], answers, [index[ctx]]))
    return docs, qas


def _squad_list(obj: Any, key: str, where: str) -> list[Any]:
    """``obj[key]`` of a SQuAD file, a list (an absent key: none); a DataError naming ``where`` otherwise."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected an object, got {type(obj).__name__}")
    value = obj.get(key, [])
    if not isinstance(value, list):
        raise DataError(f"{where}: {key!r} must be a list, got {type(value).__name__}")
    return value


def _read_hotpotqa(path: str) -> tuple[list[str], list[tuple[str, tuple[str, ...], list[int]]]]:
    data = read_json(path)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected HotpotQA JSON (a list of questions)")
    docs: list[str] = []
    index: dict[str, int] = {}
    qas = []
    for i, item in enumerate(data):
        try:
            paras = [f"{title}\n{''.join(sents)}" for title, sents in item["context"]]
            question, answer = str(item["question"]), str(item["answer"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{path}: item {i} lacks HotpotQA 'question'/'answer'/'context'") from None
        ids = []
        for p in paras:
            if p not in index:
                index[p] = len(docs)
                docs.append(p)
            ids.append(index[p])
        qas.append((question, (answer,), ids))
    return docs, qas


class RulerQA(_RulerBase):
    """Question answering over the golden documents plus distractor documents drawn from the dataset,
    up to the target length (SQuAD v2 for ``qa_1``, HotpotQA distractor set for ``qa_2``).

    As in RULER, every question's own paragraphs are golden (all ten for HotpotQA); distractors are the
    other paragraphs in a random order. The last distractor is cut at a word so the prompt can reach the
    target length; golden documents sit at random depths. Documents are rendered
    ``"Document <k>:\n<text>"`` and separated by blank lines. Questions are taken in a seeded random order.
    """

    max_new_tokens = 32
    metric = "string_match_part"
    reads_data = True
    FILES = {
        "squad": ("squad.json", "dev-v2.0.json", "train-v2.0.json", "dev-v1.1.json"),
        "hotpotqa": ("hotpotqa.json", "hotpot_dev_distractor_v1.json", "hotpot_dev_fullwiki_v1.json"),
    }

    def __init__(self, name: str, *, dataset: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.dataset = dataset

    def _load(self, data_dir: str | None) -> Any:
        path = require_file(data_dir, self.FILES[self.dataset], self.name)
        docs, qas = (_read_squad if self.dataset == "squad" else _read_hotpotqa)(path)
        if not qas:
            raise DataError(f"{path}: no answerable questions")
        return {"docs": docs, "qas": qas, "words": [d.split(" ") for d in docs], "orders": {}}

    def _renderer(self, rng: random.Random, sid: str, data: Any) -> tuple[Callable[[int], Sample], int]:
        docs, qas, doc_words = data["docs"], data["qas"], data["words"]
        run, index = sid.rsplit(":", 1)
        order = data["orders"].get(run)
        if order is None:
            order = list(range(len(qas)))
            random.Random(f"{run}:order").shuffle(order)
            data["orders"][run] = order
        question, answers, golden = qas[order[int(index) % len(qas)]]
        golden_set = set(golden)
        distractors = [j for j in range(len(docs)) if j not in golden_set]
        rng.shuffle(distractors)
        total = sum(len(doc_words[j]) for j in distractors)
        golden_docs = [docs[j] for j in golden]
        depths = [rng.random() for _ in golden_docs]
        instr = (
            "Answer the question based on the given documents. Only give me the answer and do not "
            "output any other words.\n\nThe following are given documents.\n\n"
        )
        question_part = (
            "\n\nAnswer the question based on the given documents. Only give me the answer and do not "
            f"output any other words.\n\nQuestion: {question}"
        )

        def render(n: int) -> Sample:
            chosen: list[str] = []
            left = n
            for j in distractors:
                if left <= 0:
                    break
                w = doc_words[j]
                chosen.append(docs[j] if len(w) <= left else " ".join(w[:left]))
                left -= len(w)
            slots: dict[int, list[str]] = {}
            for d, g in zip(depths, golden_docs, strict=True):
                slots.setdefault(round(d * len(chosen)), []).append(g)
            ordered: list[str] = []
            for k in range(len(chosen) + 1):
                ordered.extend(slots.get(k, ()))
                if k < len(chosen):
                    ordered.append(chosen[k])
            context = "\n\n".join(f"Document {k + 1}:\n{doc}" for k, doc in enumerate(ordered))
            return Sample(
                id=sid,
                prefix=instr,
                context=context,
                question=question_part,
                answer_prefix=" Answer:",
                answers=answers,
                max_new_tokens=self.max_new_tokens,
                metric=self.metric,
                metadata={"query": question, "num_documents": len(ordered)},
            )

        return render, total


def _niah(name: str, **cfg: Any) -> Callable[..., RulerNiah]:
    def make(**kw: Any) -> RulerNiah:
        return RulerNiah(name, **cfg, **kw)

    return make


#: Registry entries: task name -> factory(**options).
RULER_TASKS: dict[str, Callable[..., BaseTask]] = {
    "ruler/niah_single_1": _niah("ruler/niah_single_1", haystack="noise"),
    "ruler/niah_single_2": _niah("ruler/niah_single_2", haystack="essay"),
    "ruler/niah_single_3": _niah("ruler/niah_single_3", haystack="essay", value_type="uuids"),
    "ruler/niah_multikey_1": _niah("ruler/niah_multikey_1", haystack="essay", num_keys=4),
    "ruler/niah_multikey_2": _niah("ruler/niah_multikey_2", haystack="needle"),
    "ruler/niah_multikey_3": _niah("ruler/niah_multikey_3", haystack="needle", key_type="uuids", value_type="uuids"),
    "ruler/niah_multivalue": _niah("ruler/niah_multivalue", haystack="essay", num_values=4),
    "ruler/niah_multiquery": _niah("ruler/niah_multiquery", haystack="essay", num_queries=4),
    "ruler/vt": lambda **kw: RulerVT("ruler/vt", **kw),
    "ruler/cwe": lambda **kw: RulerCWE("ruler/cwe", **kw),
    "ruler/fwe": lambda **kw: RulerFWE("ruler/fwe", **kw),
    "ruler/qa_1": lambda **kw: RulerQA("ruler/qa_1", dataset="squad", **kw),
    "ruler/qa_2": lambda **kw: RulerQA("ruler/qa_2", dataset="hotpotqa", **kw),
}
