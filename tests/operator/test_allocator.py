"""operator/allocator.py: the periodic malloc_trim that returns a burst's free pages to the system."""

from __future__ import annotations

import asyncio
import platform

import pytest

from r3operator.operator import allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_calls_glibcs_malloc_trim():
    assert allocator.trim() is True


def test_trim_periodically_trims_at_start_and_every_interval_until_cancelled():
    calls: list[float] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(allocator.trim_periodically(0.02, lambda: calls.append(loop.time()) is None))
        await asyncio.sleep(0.11)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        count = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == count  # nothing after the cancel

    asyncio.run(scenario())
    assert 4 <= len(calls) <= 7, calls  # at 0, 0.02, 0.04, ... within 0.11 s


def test_without_malloc_trim_the_task_ends_at_once():
    async def scenario() -> None:
        await asyncio.wait_for(allocator.trim_periodically(0.01, lambda: False), timeout=1)

    asyncio.run(scenario())
