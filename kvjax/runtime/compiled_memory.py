"""Keeps a long-running process below the kernel's limit on memory mappings.

Every program XLA:CPU compiles (or loads from the persistent cache) is JIT-linked into a few fresh memory
mappings, and JAX keeps every compiled program alive in its caches. A process that compiles thousands of
programs -- a sweep of dozens of (method, budget) cells, or a test worker -- reaches Linux's
`vm.max_map_count` (65530 by default); LLVM's next `mmap` then fails ("Cannot allocate memory") and the
process dies with a segmentation fault. `release_if_needed` drops JAX's compiled-program caches (programs are
compiled again, or loaded from the persistent cache, when next called) once the process holds more than a
fraction of that limit. Outside Linux it does nothing.
"""

from __future__ import annotations

import gc
import logging

import jax

_MAPS = "/proc/self/maps"
_LIMIT = "/proc/sys/vm/max_map_count"
DEFAULT_FRACTION = 0.5
_log = logging.getLogger(__name__)


def mapping_count() -> int | None:
    """Memory mappings this process holds (None where /proc is not available)."""
    try:
        with open(_MAPS, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def mapping_limit() -> int | None:
    """The kernel's per-process limit on mappings (`vm.max_map_count`; None where unknown)."""
    try:
        with open(_LIMIT) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def release_if_needed(fraction: float = DEFAULT_FRACTION) -> bool:
    """Clears JAX's compiled-program caches when the process holds more than `fraction` of the mapping limit.

    Returns whether it cleared them. Cheap enough to call between cells or tests (one read of
    /proc/self/maps)."""
    limit = mapping_limit()
    if not limit:
        return False
    count = mapping_count()
    if count is None or count <= fraction * limit:
        return False
    jax.clear_caches()
    gc.collect()
    _log.info("released compiled programs: %d memory mappings of a %d limit -> %s", count, limit, mapping_count())
    return True
