"""Where one weight sync spends its time, phase by phase (the run's metrics, metrics.csv, bench_weight_sync).

Phases (seconds, summed over the sync's chunks; `SYNC_PHASES` is the order reports use):

- gather      the trainer's state dict (FSDP full tensors, the Megatron TP/EP gather), the cast to the
              engine's dtype and the checkpoint name/layout mapping (experts unfused)
- pack        copying each chunk's tensors into one buffer (packed path; vLLM's senders pack inside
              `transfer`)
- fingerprint the sent tensors' fingerprints for the receipt (wire/receipt.py)
- begin       opening every engine's bracket (an HTTP/RPC round trip each)
- transfer    moving the bytes: the packed path's staging and load RPCs (which include the engine's
              `load_weights` of each chunk over HTTP), or vLLM's NCCL / IPC sender
- finish      closing every bracket: the chunks still loading, the engine's layerwise post-processing
              (kernel layouts), the receipt, the prefix-cache reset, the HTTP/RPC round trips, and giving
              the buffers the sync left cached back to the device (wire/cuda_cache.py), on both sides

On a GPU, work is asynchronous: a phase's seconds are the host's, and GPU work lands in the phase that waits
for it, unless the clock synchronizes at every phase boundary (`synchronize=True`, bench_weight_sync
`--phase-sync`), which itself costs a little. Where GPU time goes inside a phase is a profiler's question:
`label` (e.g. `torch.profiler.record_function`, set by bench_weight_sync `--profile`) names each phase's span in
the trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

T = TypeVar("T")

SYNC_PHASES = ("gather", "pack", "fingerprint", "begin", "transfer", "finish")


class PhaseTimer:
    """Host seconds per named phase, summed over every time it ran: a GRPO step's phases (runtime/loop.py) and, with
    the device clock and profiler spans of `SyncPhases`, a weight sync's."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def _span(self, phase: str) -> AbstractContextManager[Any]:
        return nullcontext()

    def _sync(self) -> None:
        return None

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def merge(self, seconds: Mapping[str, float]) -> None:
        for phase, value in seconds.items():
            self.add(phase, value)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self._sync()
        begin = time.perf_counter()
        try:
            with self._span(phase):
                yield
        finally:
            self._sync()
            self.add(phase, time.perf_counter() - begin)

    def timed(self, phase: str, items: Iterable[T]) -> Iterator[T]:
        """`items`, with the time spent producing each one counted to `phase`."""
        iterator = iter(items)
        while True:
            self._sync()
            begin = time.perf_counter()
            try:
                with self._span(phase):
                    item = next(iterator)
            except StopIteration:
                self.add(phase, time.perf_counter() - begin)
                return
            self._sync()
            self.add(phase, time.perf_counter() - begin)
            yield item


class SyncPhases(PhaseTimer):
    """Seconds per phase of the current sync (`reset` before each)."""

    def __init__(self, *, synchronize: bool = False) -> None:
        super().__init__()
        self.synchronize = synchronize
        self.label: Callable[[str], AbstractContextManager[Any]] | None = None  # a span per phase (profiling)

    def _span(self, phase: str) -> AbstractContextManager[Any]:
        return self.label(phase) if self.label is not None else nullcontext()

    def reset(self) -> None:
        self.seconds = {}

    def _sync(self) -> None:
        if self.synchronize:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()


def chunk_seconds(chunk: Any) -> Mapping[str, float]:
    """The trainer-side phases a packed chunk measured where it was built (wire/weights.py)."""
    return dict(getattr(chunk, "seconds", None) or {})
