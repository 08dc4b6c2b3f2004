"""Two counters in shared host memory by which a trainer and a colocated engine hand a sync to each other.

A mapped kernel-layout sync (weightsync/mapped.py) has the trainer write the engine's parameters itself, while the
engine sits inside ONE call that holds its engine core between two forward steps, so that no step reads a
half-written parameter. The call and the writes are in two processes; they meet here:

- the engine, inside its call with vLLM's bracket open and its GPU idle, rings `opened` with the sync's number;
- the trainer, seeing it, writes every parameter, waits for its GPU, and rings `written` with the same number (or
  `failed`: minus that number, when it could not write them all);
- the engine, seeing `written`, closes the bracket and stamps the policy; seeing `failed`, or nothing within its
  timeout, it aborts the bracket.

The segment is the trainer's (POSIX shared memory, `multiprocessing.shared_memory`); each engine worker maps it by
name and uses its own pair of counters (`slot`). Each counter is one aligned 8-byte word written by one side only:
a plain store is seen whole by the other side. A wait spins for its first `SPIN_S` (a sync's hand-over is
milliseconds), then sleeps `POLL_S` between reads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from r3operator.wire.shared_buffer import SharedBufferError, attach_shm

# Any: the shared-memory mapping and its numpy view over a foreign buffer are Any here (multiprocessing's SharedMemory
# types its buffer as a memoryview of unknown layout).

SPIN_S = 0.02
POLL_S = 0.0002
_OPENED, _WRITTEN = 0, 1


class DoorbellTimeout(TimeoutError):
    """The other side did not ring within the wait's timeout."""


class Doorbell:
    """`slots` pairs of counters (opened, written), all 0 at first. `Doorbell(slots)` makes the segment (the trainer);
    `Doorbell.attach(description)` maps it (an engine worker)."""

    def __init__(self, slots: int = 1, *, _attached: Any = None) -> None:
        import numpy as np

        self._owner: Any = None
        self._mapping: Any = None
        if _attached is None:
            from multiprocessing import shared_memory

            if slots < 1:
                raise ValueError(f"a doorbell needs at least one slot, not {slots}")
            self._owner = shared_memory.SharedMemory(create=True, size=16 * slots)
            buffer = self._owner.buf
        else:
            self._mapping = buffer = _attached
        self._words: Any = np.frombuffer(buffer, dtype=np.int64)
        if _attached is None:
            self._words[:] = 0
        self.slots = len(self._words) // 2

    def description(self) -> dict[str, Any]:
        if self._owner is None:
            raise SharedBufferError("only the doorbell's owner describes it")
        return {"kind": "shm", "name": self._owner.name, "slots": self.slots}

    @classmethod
    def attach(cls, description: Mapping[str, Any]) -> Doorbell:
        if description.get("kind") != "shm" or not description.get("name"):
            raise SharedBufferError(f"doorbell description {dict(description)!r}: expected kind shm and a name")
        try:
            mapping = attach_shm(str(description["name"]))
        except FileNotFoundError as exc:
            raise SharedBufferError(f"doorbell segment {description['name']!r} does not exist") from exc
        return cls(_attached=mapping)

    def check(self, slot: int) -> None:
        """Raise `SharedBufferError` when `slot` is not one of this doorbell's."""
        if not 0 <= slot < self.slots:
            raise SharedBufferError(f"doorbell slot {slot} outside its {self.slots} slot(s)")

    def ring_opened(self, slot: int, number: int) -> None:
        self.check(slot)
        self._words[2 * slot + _OPENED] = number

    def ring_written(self, slot: int, number: int) -> None:
        self.check(slot)
        self._words[2 * slot + _WRITTEN] = number

    def ring_failed(self, slot: int, number: int) -> None:
        self.check(slot)
        self._words[2 * slot + _WRITTEN] = -number

    def opened(self, slot: int) -> int:
        self.check(slot)
        return int(self._words[2 * slot + _OPENED])

    def written(self, slot: int) -> int:
        self.check(slot)
        return int(self._words[2 * slot + _WRITTEN])

    def wait_opened(self, slot: int, number: int, *, timeout_s: float, give_up: Callable[[], bool]) -> None:
        """Until the engine of `slot` rings `opened` with `number`; `give_up()` True (its call ended: it raised)
        stops the wait with `DoorbellTimeout` at once."""
        _wait(
            lambda: self.opened(slot) == number,
            timeout_s,
            give_up,
            f"slot {slot}: the engine never opened sync {number}",
        )

    def wait_written(self, slot: int, number: int, *, timeout_s: float) -> bool:
        """Until the trainer rings `written` (True) or `failed` (False) for `number`."""
        _wait(
            lambda: abs(self.written(slot)) == number,
            timeout_s,
            lambda: False,
            f"the trainer never wrote sync {number}",
        )
        return self.written(slot) == number

    def __del__(self) -> None:  # a doorbell nobody closed (a sender dropped at exit): no BufferError from its segment
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        """The mapping goes; the owner also unlinks the segment."""
        self._words = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        if self._owner is not None:
            self._owner.close()
            self._owner.unlink()
            self._owner = None


def _wait(done: Callable[[], bool], timeout_s: float, give_up: Callable[[], bool], what: str) -> None:
    start = time.monotonic()
    while not done():
        waited = time.monotonic() - start
        if give_up():
            raise DoorbellTimeout(f"{what} (the other side stopped)")
        if waited > timeout_s:
            raise DoorbellTimeout(f"{what} within {timeout_s:g} s")
        time.sleep(0 if waited < SPIN_S else POLL_S)
