"""Offline filler text and word lists for the synthetic tasks.

Three haystacks, all deterministic for a seed and generated without any download:

* ``noise``: RULER's repeated sentences ("The grass is green. The sky is blue. ...").
* ``essay``: essay-like prose built from the small word lists below (RULER uses Paul Graham essays;
  pass ``haystack_file`` to use a real text instead).
* a local text file, split into sentences and cycled as often as needed.

Units are single sentences, so a prompt can be fitted to a target length with sentence granularity and
needles are inserted between sentences.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Iterable, Sequence

from kvjax.tasks.base import DataError

NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

ADJECTIVES = tuple(
    """able ancient angry bitter black blue bold brave bright broad busy calm careful cheap clean clear
    clever cold cool crisp curious damp dark deep dense direct distant dry dull eager early easy empty
    equal exact faint fair famous fancy fast fierce firm flat fresh friendly gentle giant glad golden
    grand green grey happy hard harsh heavy hidden high hollow honest huge humble hungry icy idle keen kind
    large late lazy light little lively long loud lovely loyal lucky mellow mighty mild modern narrow neat
    nervous noble odd old orange pale patient plain polite poor proud purple quick quiet rapid rare raw
    ready red rich rough round royal rusty sacred safe salty sharp shiny short shy silent silver simple
    slim slow small smart smooth soft solid sour spicy steady steep sticky stiff strange strict strong
    sunny super sweet swift tall tame tender thick thin tidy tiny tired tough upset vast violet warm weak
    wet white whole wide wild wise witty wooden young""".split()
)

NOUNS = tuple(
    """acorn actor airport anchor animal apple archer arrow artist atlas badge baker balloon bamboo banana
    banjo barn basket battery beach beacon bean bear beaver bell bicycle bird blanket boat bonnet book
    bottle boulder bowl branch bread breeze brick bridge broom bucket bugle butter button cabin cactus
    camel camera candle canoe canyon captain carpet carrot castle cat cello chair channel cherry chimney
    circle cliff clock cloud clover coat comet compass cookie copper coral cottage cotton crab crayon
    cricket crown crystal cup curtain cushion daisy dancer desert diamond dolphin donkey dragon drum eagle
    easel elbow engine falcon feather fence fiddle finch flag flame flute forest fossil fountain fox frog
    garden garlic gate giraffe glacier glove goat goose grape guitar hammer harbor harp hat hawk helmet
    heron hill honey horse island jacket jaguar jar jewel kettle kite ladder lake lamp lantern lemon
    lighthouse lily lion lizard lobster magnet mango maple marble meadow melon mirror mitten monkey moon
    mountain mouse needle nest noodle oak ocean olive onion orchard otter owl paddle palace panda parrot
    peach pebble pelican pencil pepper piano pillow pine pirate planet plum pocket pony potato puddle
    pumpkin puzzle quilt rabbit radio raft rainbow raven ribbon river robin rocket rose saddle sailor
    salmon sandal scarf shell shovel silk sparrow spider spoon squirrel star statue stone stove
    strawberry sunflower swan sword table teapot tiger tomato tower tractor trumpet tulip turtle umbrella
    valley violin wagon walnut whale whistle willow window wizard wolf zebra""".split()
)

VERBS = tuple(
    """admired borrowed built carried chased cleaned collected copied crossed described discovered drew
    explored fixed followed found gathered guarded helped joined kept lifted measured mended moved noticed
    opened painted planted polished pulled pushed questioned reached repaired rescued saved searched shaped
    shared showed sold studied tested traded visited washed watched welcomed""".split()
)

PLACES = tuple(
    """in the morning|after the storm|near the old bridge|before the harvest|during the long winter|
    beside the river|on a quiet street|at the edge of town|under the tall trees|across the valley|
    in a small workshop|behind the market|along the coast|at the end of the season|in the early evening|
    over many years|without any warning|with great care|for the first time|once again""".replace("\n", "").split("|")
)

ADVERBS = tuple(
    """quietly slowly carefully happily eagerly patiently boldly gently quickly proudly calmly openly
    rarely often always seldom""".split()
)

_CONNECTIVES = (
    "Later,",
    "In fact,",
    "Meanwhile,",
    "As a result,",
    "Still,",
    "Of course,",
    "For a while,",
    "In the end,",
)


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _sentence(rng: random.Random) -> str:
    """One essay-like sentence (no digits, so needles with numbers stay unambiguous)."""
    adj, adj2 = rng.choice(ADJECTIVES), rng.choice(ADJECTIVES)
    noun, noun2 = rng.choice(NOUNS), rng.choice(NOUNS)
    verb, place, adv = rng.choice(VERBS), rng.choice(PLACES).strip(), rng.choice(ADVERBS)
    form = rng.randrange(6)
    if form == 0:
        s = f"the {adj} {noun} {verb} the {adj2} {noun2} {place}."
    elif form == 1:
        s = f"the {noun} {adv} {verb} {_a(noun2)} {place}."
    elif form == 2:
        s = f"nobody expected that the {noun} would be so {adj}, but it {verb} the {noun2} anyway."
    elif form == 3:
        s = f"every {noun} in the village {verb} the {adj} {noun2}, and the {noun} was {adj2} {place}."
    elif form == 4:
        s = f"people say {_a(adj)} {noun} is worth more than {_a(adj2)} {noun2}."
    else:
        s = f"the {adj} {noun} and the {adj2} {noun2} {verb} each other {place}."
    s = s[0].upper() + s[1:]
    if rng.random() < 0.2:
        s = f"{rng.choice(_CONNECTIVES)} {s[0].lower()}{s[1:]}"
    return s


_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+")


def file_sentences(path: str) -> list[str]:
    """Sentences of a local text file (split after ``.``, ``!`` or ``?`` followed by whitespace)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except OSError as e:
        raise DataError(f"cannot read haystack file {path}: {e.strerror or e}") from None
    sentences = [s.strip() for s in _SENTENCE_SPLIT.split(text) if s.strip()]
    if not sentences:
        raise DataError(f"haystack file {path} has no text")
    return sentences


class Filler:
    """An endless, deterministic sequence of haystack sentences.

    ``kind`` is ``"noise"``, ``"essay"`` or ``"file"`` (then ``path`` is the text file). ``units(n)``
    returns the first ``n`` sentences; the same seed always gives the same sequence.
    """

    def __init__(self, kind: str, *, seed: int | str = 0, path: str | None = None) -> None:
        if kind not in ("noise", "essay", "file"):
            raise ValueError(f"unknown haystack kind {kind!r}")
        self.kind = kind
        self._rng = random.Random(f"filler:{kind}:{seed}")
        self._cache: list[str] = []
        self._source: Sequence[str] = ()
        if kind == "file":
            if not path:
                raise DataError("haystack kind 'file' needs a haystack_file path")
            self._source = file_sentences(path)
        elif kind == "noise":
            self._source = NOISE_SENTENCES

    def units(self, n: int) -> list[str]:
        """The first ``n`` filler sentences."""
        if self.kind == "essay":
            while len(self._cache) < n:
                self._cache.append(_sentence(self._rng))
            return self._cache[:n]
        src = self._source
        reps, rest = divmod(n, len(src))
        return list(src) * reps + list(src[:rest])


def make_filler(kind: str, *, seed: int | str, haystack_file: str | None) -> Filler:
    """A ``Filler`` of ``kind``; a given ``haystack_file`` replaces the ``essay`` haystack."""
    if haystack_file and kind == "essay":
        return Filler("file", path=haystack_file)
    return Filler(kind, seed=seed)


def join_with_inserts(units: Sequence[str], inserts: Sequence[tuple[float, str]], sep: str = " ") -> str:
    """Join ``units`` with ``sep``, inserting each ``(depth, text)`` between units at ``depth`` in [0, 1].

    Depth 0 puts the text before the first unit, 1 after the last; inserts at the same position keep their
    given order.
    """
    n = len(units)
    slots: dict[int, list[str]] = {}
    for depth, text in inserts:
        pos = min(n, max(0, round(depth * n)))
        slots.setdefault(pos, []).append(text)
    out: list[str] = []
    for i in range(n + 1):
        out.extend(slots.get(i, ()))
        if i < n:
            out.append(units[i])
    return sep.join(out)


_CONSONANTS = "bcdfghjklmnprstvz"
_VOWELS = "aeiou"


def pseudo_word(rng: random.Random, syllables: int = 3) -> str:
    """A pronounceable nonsense word (consonant-vowel syllables)."""
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))


class WordPool:
    """An endless list of distinct words, deterministic for the ``rng`` it is built with.

    It starts with ``first`` (default: the built-in English words) in random order and continues with words
    from ``make(rng)`` (default: pseudo-words). ``take(n)`` returns the first ``n`` words.
    """

    def __init__(
        self,
        rng: random.Random,
        *,
        first: Sequence[str] | None = None,
        make: Callable[[random.Random], str] | None = None,
        exclude: Iterable[str] = (),
    ) -> None:
        self._rng = rng
        self._make = make or (lambda r: pseudo_word(r, r.choice((2, 3, 3, 4))))
        self._seen = set(exclude)
        base = list(dict.fromkeys(NOUNS + ADJECTIVES + VERBS)) if first is None else list(first)
        self.words = [w for w in base if w not in self._seen]
        rng.shuffle(self.words)
        self._seen.update(self.words)

    def take(self, n: int) -> list[str]:
        """The first ``n`` words of the pool."""
        while len(self.words) < n:
            w = self._make(self._rng)
            if w not in self._seen:
                self._seen.add(w)
                self.words.append(w)
        return self.words[:n]


def coded_word_pool(rng: random.Random, length: int, exclude: Iterable[str] = ()) -> WordPool:
    """A ``WordPool`` of random lowercase strings of ``length`` letters (RULER's coded words)."""

    def make(r: random.Random) -> str:
        return "".join(r.choice(string.ascii_lowercase) for _ in range(length))

    return WordPool(rng, first=(), make=make, exclude=exclude)


def random_key(rng: random.Random, used: set[str]) -> str:
    """A fresh ``adjective-noun`` key not in ``used`` (added to it)."""
    for _ in range(10_000):
        k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if k not in used:
            used.add(k)
            return k
    raise RuntimeError("ran out of distinct word keys")


def random_number(rng: random.Random, digits: int = 7) -> str:
    """A random number with exactly ``digits`` digits (no leading zero)."""
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def random_digits(rng: random.Random, digits: int) -> str:
    """A random digit string of length ``digits`` whose first digit is not zero."""
    return str(rng.randrange(1, 10)) + "".join(str(rng.randrange(10)) for _ in range(digits - 1))


def random_uuid(rng: random.Random) -> str:
    """A UUID4-formatted string drawn from ``rng`` (deterministic, unlike ``uuid.uuid4``)."""
    h = f"{rng.getrandbits(128):032x}"
    h = h[:12] + "4" + h[13:16] + "89ab"[rng.randrange(4)] + h[17:]
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
