"""Stop strings: an answer ends with the first token whose text completes one of its request's stop strings.

The answer's tokens end with that token (as with a stop id); its text is cut where the stop string starts, the stop
string left out. Checked on the host after each decode call, on the tokenizer's decoding of the answer's tail: the
new tokens and the `lookback` tokens before them (4 per character of the longest stop string, as a byte-level
tokenizer may spend 4 tokens on one character, plus 8), so a stop string split over tokens, or produced by tokens
that decode only together, is found, and a check costs the same however long the answer is. A stop string whose
characters span more tokens than that (special tokens between them, which decode to nothing) is not seen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: Stop strings a request may give.
MAX_STOP_STRINGS = 16


def stop_problem(stop: object, name: str = "stop") -> str | None:
    """What is wrong with a request's `stop` (a sentence naming it as `name`), or None: a tuple of at most
    `MAX_STOP_STRINGS` non-empty strings."""
    if not isinstance(stop, tuple):
        return f"{name} must be a tuple of strings, got {type(stop).__name__} {stop!r}"
    if len(stop) > MAX_STOP_STRINGS:
        return f"{name} holds {len(stop)} strings; at most {MAX_STOP_STRINGS}"
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            return f"{name}[{i}] must be a non-empty string, got {s!r}"
    return None


def special_problem(stop: Sequence[str], tokenizer: Any) -> str | None:
    """A stop string that is, or holds, one of the tokenizer's special tokens never matches (answers are decoded
    without them): what to say about it, or None. Special tokens of one character or of whitespace alone are not
    looked for inside a string (they would be found in ordinary text)."""
    special = [t for t in getattr(tokenizer, "all_special_tokens", ()) or () if isinstance(t, str) and t]
    for s in stop:
        if s in special:
            return (f"stop string {s!r} is a special token, which answers are decoded without; give its id in "
                    "stop_ids")
        inside = [t for t in special if len(t) > 1 and t.strip() and t in s]
        if inside:
            return (f"stop string {s!r} holds the special token {max(inside, key=len)!r}, which answers are decoded "
                    "without, so it never matches; give the token's id in stop_ids (and the text before it as a "
                    "stop string)")
    return None


def lookback(stops: Sequence[str]) -> int:
    """Tokens before the new ones that a check decodes with them."""
    return 4 * max(map(len, stops)) + 8


def earliest(text: str, stops: Sequence[str]) -> str | None:
    """The stop string that starts first in `text` (the longer of two starting together), or None."""
    hits = [(text.find(s), -len(s), s) for s in stops if s in text]
    return min(hits)[2] if hits else None


def first_stop(tokens: Sequence[int], stops: Sequence[str], decode: Callable[[Sequence[int]], str],
               checked: int = 0) -> tuple[int, str] | None:
    """(n, s): the fewest leading tokens n (more than `checked`: the tokens already checked) whose text holds a stop
    string, and the one starting first there; None if none does. Decodes from `lookback` tokens before `checked`."""
    if not stops or checked >= len(tokens):
        return None
    start = max(0, checked - lookback(stops))
    if earliest(decode(tokens[start:]), stops) is None:
        return None
    for n in range(checked + 1, len(tokens) + 1):
        hit = earliest(decode(tokens[start:n]), stops)
        if hit is not None:
            return n, hit
    return None  # unreachable for a decoding whose text grows with its tokens (n = len(tokens) was found above)


def cut(text: str, stop: str | None) -> str:
    """An answer's text without its stop string and what follows it."""
    return text if stop is None or stop not in text else text[: text.find(stop)]
