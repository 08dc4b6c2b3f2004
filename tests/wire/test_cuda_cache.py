"""wire/cuda_cache.py's rule, with torch.cuda's allocator figures driven: the cache is emptied exactly when the
reserved-but-unused bytes reach the threshold, and the freed bytes are what the reserve went down by. The real
allocator (side streams, a freed buffer kept cached) is tests/gpu/test_cuda_cache_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from r3operator.wire.cuda_cache import Release, release_cached_blocks

GIB = 1 << 30


class Allocator:
    def __init__(self, *, reserved: int, allocated: int) -> None:
        self.reserved, self.allocated, self.emptied = reserved, allocated, 0

    def empty_cache(self) -> None:
        self.emptied += 1
        self.reserved = self.allocated  # every unused block goes back


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(*, reserved: int, allocated: int) -> Allocator:
        fake = Allocator(reserved=reserved, allocated=allocated)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: fake.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: fake.allocated)
        monkeypatch.setattr(torch.cuda, "empty_cache", fake.empty_cache)
        return fake

    return install


def test_a_sync_that_left_more_than_the_threshold_cached_gives_it_back(allocator: Any) -> None:
    fake = allocator(reserved=90 * GIB, allocated=42 * GIB)
    released = release_cached_blocks(min_idle_bytes=GIB)
    assert fake.emptied == 1
    assert released.freed_bytes == 48 * GIB and released.seconds >= 0


def test_below_the_threshold_nothing_is_emptied(allocator: Any) -> None:
    fake = allocator(reserved=42 * GIB + GIB - 1, allocated=42 * GIB)
    assert release_cached_blocks(min_idle_bytes=GIB).freed_bytes == 0
    assert fake.emptied == 0 and fake.reserved == 42 * GIB + GIB - 1


@pytest.mark.parametrize(
    ("device_gib", "threshold_gib"),
    [(141, 141 / 8), (80, 10), (4, 1)],  # an eighth of the device, and never under 1 GiB
)
def test_the_default_threshold_is_an_eighth_of_the_device(
    allocator: Any, monkeypatch: pytest.MonkeyPatch, device_gib: int, threshold_gib: float
) -> None:
    class Properties:
        total_memory = device_gib * GIB

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    threshold = int(threshold_gib * GIB)
    fake = allocator(reserved=40 * GIB + threshold - 1, allocated=40 * GIB)
    assert release_cached_blocks().freed_bytes == 0 and fake.emptied == 0  # one byte short
    fake.reserved += 1
    assert release_cached_blocks().freed_bytes == threshold and fake.emptied == 1


def test_a_process_that_never_touched_cuda_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: pytest.fail("read an uninitialised device"))
    assert release_cached_blocks() == Release(0, 0.0)
