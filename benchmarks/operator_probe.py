"""Run ``python -m r3operator ...`` with a memory probe, for bench_operator's ``--memory-probe``.

On SIGUSR1 the process writes ``$R3_PROBE_OUT`` (JSON): its RSS; the objects the garbage collector tracks, by
type (count and shallow bytes); with ``$R3_PROBE_TRACEMALLOC`` set (frames, e.g. 1), the live Python heap and
where it was allocated (tracemalloc, top lines); and the RSS again after glibc's ``malloc_trim(0)`` returned the
free pages it holds. The two RSS figures tell a heap that is live (Python objects someone holds) from memory the
allocator keeps after a churn (freed, not given back to the system).

    python -m benchmarks.operator_probe operator -n NS --leader-elect ...
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import os
import runpy
import signal
import sys
import tracemalloc
from collections import Counter
from pathlib import Path
from types import FrameType

import psutil


def deep_mb(obj: object, seen: set[int]) -> float:
    """Bytes reachable from ``obj`` through dicts, lists, tuples, sets and object attributes, each object once
    (``seen`` is shared across calls so that what two structures share is counted for the first)."""
    total, stack = 0, [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, type | FrameType) or (callable(item) and not hasattr(item, "__dict__")):
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple | set | frozenset):
            stack += list(item)
        elif hasattr(item, "__dict__") and not isinstance(item, asyncio.AbstractEventLoop | asyncio.Future):
            stack.append(vars(item))
    return round(total / 2**20, 2)


def held() -> dict[str, object]:
    """What the operator's own structures and kopf's per-object memory hold (deep sizes, MB)."""
    result: dict[str, object] = {}
    handlers = sys.modules.get("r3operator.operator.handlers")
    reconciler = getattr(handlers, "_state", {}).get("reconciler") if handlers else None
    seen: set[int] = set()
    if reconciler is not None:
        for attr in ("_rendered", "_written", "_canaries", "_locks"):
            result[f"reconciler.{attr}"] = [len(getattr(reconciler, attr)), deep_mb(getattr(reconciler, attr), seen)]
        cache = reconciler.cache
        if cache is not None:
            for (kind, namespace), store in cache._stores.items():
                result[f"informer {kind} {namespace}"] = [len(store.objects), deep_mb(store.objects, seen)]
    bodies: list[object] = []
    for memories in (o for o in gc.get_objects() if type(o).__name__ == "ResourceMemories"):
        for memory in memories._items.values():
            body = memory.daemons_memory.live_fresh_body
            bodies.append(getattr(body, "_src", None))
    result["kopf live bodies"] = [len(bodies), deep_mb(bodies, seen)]
    protocols = [o for o in gc.get_objects() if type(o).__name__ == "SSLProtocol"]
    result["ssl connections"] = len(protocols)
    return result


def snapshot() -> dict[str, object]:
    gc.collect()
    process = psutil.Process()
    rss = process.memory_info().rss / 2**20
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    trimmed = process.memory_info().rss / 2**20
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for obj in gc.get_objects():
        name = type(obj).__name__
        counts[name] += 1
        sizes[name] += sys.getsizeof(obj)
    result: dict[str, object] = {
        "rss_mb": round(rss, 1),
        "rss_mb_after_malloc_trim": round(trimmed, 1),
        "held_mb": held(),
        "gc_objects": len(gc.get_objects()),
        "gc_types_by_shallow_mb": {n: [counts[n], round(b / 2**20, 2)] for n, b in sizes.most_common(15)},
    }
    if tracemalloc.is_tracing():
        traced, peak = tracemalloc.get_traced_memory()
        stats = tracemalloc.take_snapshot().statistics("lineno")
        result["tracemalloc_mb"] = {"live": round(traced / 2**20, 1), "peak": round(peak / 2**20, 1)}
        result["tracemalloc_top"] = [f"{s.size / 2**20:.2f} MB {s.count} {s.traceback}" for s in stats[:25]]
    return result


def _dump(_signum: int, _frame: FrameType | None) -> None:
    Path(os.environ["R3_PROBE_OUT"]).write_text(json.dumps(snapshot(), indent=2) + "\n")


def main() -> None:
    if frames := os.environ.get("R3_PROBE_TRACEMALLOC"):
        tracemalloc.start(int(frames))
    signal.signal(signal.SIGUSR1, _dump)
    sys.argv = ["r3operator", *sys.argv[1:]]
    runpy.run_module("r3operator", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
