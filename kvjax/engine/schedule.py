"""Which waiting requests the engine prefills in an iteration (pure host-side policy).

Policy: requests are admitted in arrival order (the longest-waiting first, none ever passed over) into free slots.
By default every free slot is filled: a decode call costs the same whatever the number of live slots, so a job's
throughput is highest when each call runs as many as it can. A `prefill_tokens` bound (for latency: the stall that
live slots see between two decode calls) stops an iteration's admissions once its prompt tokens (each request
counted at its padded bucket) would pass it; the oldest waiting request is admitted whenever a slot is free (as
many as it has samples), even past that bound, so no request waits forever. A request of n samples is prefilled
once and takes n slots together. Between two iterations' prefills every active slot decodes `steps` tokens.
Admitted requests are grouped by prefill shape (bucket and question bucket) and prefilled `prefill_batch` at a
time (a group split into powers of two, so a job compiles a bounded set of prefill programs: one per bucket and power
of two up to `prefill_batch`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any


def admit(waiting: deque, free: int, prefill_tokens: int | None, cost: Callable[[Any], int],
          width: Callable[[Any], int] = lambda request: 1) -> list:
    """Pops and returns the requests to prefill now (see the module docstring); `prefill_tokens`: the bound (None:
    none); `cost(request)`: its prefill tokens; `width(request)`: the slots it takes (its samples), all at once."""
    taken: list = []
    spent = used = 0
    while waiting and used + width(waiting[0]) <= free:
        c = cost(waiting[0])
        if taken and prefill_tokens is not None and spent + c > prefill_tokens:
            break
        used += width(waiting[0])
        taken.append(waiting.popleft())
        spent += c
    return taken


def groups(admitted: list, shape: Callable[[Any], Any], prefill_batch: int) -> list[list]:
    """`admitted` in prefill batches: same `shape(request)`, arrival order kept, each batch a power of two of at
    most `prefill_batch` requests."""
    by_shape: dict[Any, list] = {}
    for request in admitted:
        by_shape.setdefault(shape(request), []).append(request)
    out = []
    for members in by_shape.values():
        while members:
            size = 1 << (min(len(members), prefill_batch).bit_length() - 1)
            out.append(members[:size])
            members = members[size:]
    return out
