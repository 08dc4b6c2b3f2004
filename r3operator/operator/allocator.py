"""Give back to the system the memory the C allocator keeps after a burst of work.

A burst of RLJobs (hundreds of first passes, their watch events, their writes) allocates and frees a great many
objects; glibc's malloc keeps the freed pages in its heaps for reuse, so the operator's RSS stays at the
burst's high-water mark long after it (benchmarks/operator_probe.py measures RSS before and after a trim).
``malloc_trim(0)`` returns the free pages; the operator calls it every ``TRIM_INTERVAL_S`` while it runs.
Elsewhere than glibc (musl, macOS) there is no such call and nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable
from typing import Final

log = logging.getLogger("r3operator.allocator")

TRIM_INTERVAL_S: Final = 60.0
"""A trim walks the heap (milliseconds at a few hundred MB): once a minute costs nothing and bounds how long a
burst's free pages stay counted against the operator's memory limit."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


def trim() -> bool:
    """Return the allocator's free pages to the system; False where the C library has no ``malloc_trim``."""
    function = _malloc_trim()
    if function is None:
        return False
    function(0)
    return True


async def trim_periodically(interval_s: float = TRIM_INTERVAL_S, trim_once: Callable[[], bool] = trim) -> None:
    """Until cancelled (the operator's cleanup): a trim every ``interval_s``."""
    if not trim_once():
        log.debug("no malloc_trim in this C library: the allocator keeps its free pages")
        return
    while True:
        await asyncio.sleep(interval_s)
        trim_once()
