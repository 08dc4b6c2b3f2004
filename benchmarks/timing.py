"""Timing shared by the micro-benchmarks: a warm-up run, then the median of `repeats`, the device synchronised so a run
is charged for the kernels it queued and for no other's."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(run: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    run()  # warm-up: allocator, kernel selection, lazy imports
    sync()
    seconds = []
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        sync()
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds)
