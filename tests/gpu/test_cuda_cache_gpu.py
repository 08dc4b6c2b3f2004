"""On CUDA, what wire/cuda_cache.py is for: a buffer allocated under a pool side stream (as vLLM 0.22's packed
NCCL sender and receiver do at every sync) stays cached after it is freed, and the release gives it back to the
device, measured by torch's own reserve and by the device's free memory."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from r3operator.wire.cuda_cache import release_cached_blocks  # noqa: E402

pytestmark = pytest.mark.gpu

GIB = 1 << 30


def test_a_freed_side_stream_buffer_stays_cached_until_the_release() -> None:
    torch.cuda.init()
    torch.cuda.empty_cache()
    base_reserved = torch.cuda.memory_reserved()
    for _ in range(3):  # three "syncs", each on new pool streams, as vLLM's producer takes them
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            buffer = torch.empty(GIB, dtype=torch.uint8, device="cuda")
            buffer.fill_(1)
        stream.synchronize()
        del buffer
    cached = torch.cuda.memory_reserved() - base_reserved
    assert cached >= GIB  # freed, yet still held by the caching allocator
    free_before, _ = torch.cuda.mem_get_info()
    released = release_cached_blocks(min_idle_bytes=GIB)
    free_after, _ = torch.cuda.mem_get_info()
    assert released.freed_bytes >= cached
    assert torch.cuda.memory_reserved() == base_reserved
    assert free_after - free_before >= cached  # the device has it back, not only torch's books


def test_below_the_threshold_the_cache_is_kept() -> None:
    torch.cuda.init()
    torch.cuda.empty_cache()
    small = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    del small
    reserved = torch.cuda.memory_reserved()
    assert release_cached_blocks(min_idle_bytes=GIB).freed_bytes == 0
    assert torch.cuda.memory_reserved() == reserved
