"""Give back the CUDA memory a weight sync left cached, on the trainer and in every engine worker.

vLLM 0.22's packed NCCL sender and receiver take new side streams from torch's stream pool at every sync
and allocate each buffer (and, on the trainer, each cast tensor) under them. torch's caching allocator keeps a
freed block for the stream it was allocated on, and the pool hands out the next of its 32 streams at the next
sync, so no later sync reuses those blocks: in the 2026-11-27 verl comparison the engine's GPU grew ~4.5 GiB per
sync (42 → 132 GiB in 20 syncs) and the trainer's from 24 to 106 GiB against a torch peak of 46.7 GiB. Nothing
leaks (the blocks are free); but a GPU shared with other work, or an engine whose KV cache was sized at start,
cannot use them. Releasing them once enough sits cached bounds the growth.

The release costs `cudaFree` per cached segment (each waits for the device): ~30 ms of an `a3b` sync's finish on
an H200 (2026-11-27). So it runs only when at least `min_idle_bytes` sit cached and unused, by default an eighth
of the device's memory (at least 1 GiB): an `a3b` sync leaves ~6.7 GB, so on a 141 GB H200 every third sync pays
it, and the growth stays under ~18 GB instead of reaching the device's size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

MIN_IDLE_FLOOR_BYTES = 1 << 30
DEVICE_FRACTION = 8  # release once a 1/DEVICE_FRACTION of the device's memory sits cached and unused


@dataclass(frozen=True)
class Release:
    """What one release gave back: the cached bytes freed (0 when below the threshold) and its host seconds."""

    freed_bytes: int
    seconds: float


def default_min_idle_bytes(device_total_bytes: int) -> int:
    return max(MIN_IDLE_FLOOR_BYTES, device_total_bytes // DEVICE_FRACTION)


def release_cached_blocks(min_idle_bytes: int | None = None) -> Release:
    """Empty torch's CUDA cache of the current device when at least `min_idle_bytes` (default:
    `default_min_idle_bytes` of the device) are reserved but unused.

    A no-op (0 bytes) without CUDA, before this process has touched CUDA, and below the threshold."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return Release(0, 0.0)
    begin = time.perf_counter()
    if min_idle_bytes is None:
        min_idle_bytes = default_min_idle_bytes(
            torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        )
    reserved = torch.cuda.memory_reserved()
    if reserved - torch.cuda.memory_allocated() < min_idle_bytes:
        return Release(0, time.perf_counter() - begin)
    torch.cuda.empty_cache()
    return Release(max(0, reserved - torch.cuda.memory_reserved()), time.perf_counter() - begin)
