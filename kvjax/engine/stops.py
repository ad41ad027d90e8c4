"""Stop strings: an answer ends with the first token whose text completes one of its request's stop strings.

The answer's tokens end with that token (as with a stop id); its text is cut where the stop string starts, the stop
string left out. Checked on the host after each decode call, on the tokenizer's decoding of the whole answer (so a
stop string split over several tokens, or produced by tokens that decode only together, is found).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: Stop strings a request may give.
MAX_STOP_STRINGS = 16


def stop_problem(stop: object) -> str | None:
    """What is wrong with a request's `stop` ("must be ..., got ..."), or None: a tuple of at most
    `MAX_STOP_STRINGS` non-empty strings."""
    ok = isinstance(stop, tuple) and len(stop) <= MAX_STOP_STRINGS and all(
        isinstance(s, str) and s for s in stop)
    return None if ok else f"must be at most {MAX_STOP_STRINGS} non-empty strings, got {stop!r}"


def earliest(text: str, stops: Sequence[str]) -> str | None:
    """The stop string that starts first in `text` (the longer of two starting together), or None."""
    hits = [(text.find(s), -len(s), s) for s in stops if s in text]
    return min(hits)[2] if hits else None


def first_stop(tokens: Sequence[int], stops: Sequence[str], decode: Callable[[Sequence[int]], str],
               checked: int = 0) -> tuple[int, str] | None:
    """(n, s): the fewest leading tokens n (more than `checked`, whose text is known to hold no stop string) whose
    text holds a stop string, and the one starting first there; None if the text of all `tokens` holds none."""
    if not stops or earliest(decode(tokens), stops) is None:
        return None
    for n in range(checked + 1, len(tokens) + 1):
        hit = earliest(decode(tokens[:n]), stops)
        if hit is not None:
            return n, hit
    return None  # a decoding that is not prefix-stable: the whole text holds it, no prefix does


def cut(text: str, stop: str | None) -> str:
    """An answer's text without its stop string and what follows it."""
    return text if stop is None or stop not in text else text[: text.find(stop)]
