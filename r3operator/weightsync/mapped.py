"""The kernel layout to a colocated engine, written by the trainer straight into the engine's parameters.

The staging buffer (weightsync/staged.py) costs two passes over a sync's bytes on the one GPU both processes share:
the trainer builds every parameter into its buffer, then the engine copies each slot into its parameter, and both
fingerprint what they hold (an a3b-x16l sync on an H200, 2026-11-27: 79 ms, 0.12x the device copy). Here the engine
shares its parameters' memory once per rendezvous (engine/mapped.py) and the trainer builds each parameter in place:
one pass. `MappedKernelSend`:

- `attach`: a doorbell (wire/doorbell.py) with a pair of counters per engine worker; every worker answers with its
  parameters' memory (CUDA IPC handles, or a shared segment on the CPU), mapped here and checked against the plan by
  name, dtype and shape before any sync;
- `sync`: every engine is asked ONCE (`r3_mapped_sync`); inside that call the engine opens vLLM's bracket, waits for
  its GPU and rings `opened`, so that no forward step runs while the trainer writes; the trainer builds every
  parameter into each worker's memory (`build_parameter`: one casting `copy_` per part), waits for its GPU and rings
  `written`; the engine closes the bracket and stamps the policy. Both sides fingerprint when the driver checks the
  receipt, off the sync's path: the trainer the tensors it wrote from, in its own memory, each parameter composed from
  its pieces (`add_parameter_pieces`, `FingerprintLog.add_part_later`: never through the mapping, which reads the
  engine's memory and would agree with an engine whose writes never landed); the engine its own parameters
  (`SyncReceipt.finish_later`). Neither changes before then: the trainer's next update and the next sync come after.

What a failure leaves: an engine that cannot open its bracket (or whose parameters moved since they were mapped)
fails its call before the trainer writes anything, so it keeps the whole previous policy under its tag; a trainer that
fails while writing rings `failed`, and every engine aborts its bracket (the tag stays None until a complete sync, as
on the NCCL kernel path: some parameters hold the new policy). An engine that hears nothing within `timeout_s` aborts
too. Any failure drops the mapping; the next sync maps again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from r3operator.wire.doorbell import Doorbell, DoorbellTimeout
from r3operator.wire.kernel_layout import Source, add_parameter_pieces, build_parameter
from r3operator.wire.receipt import FingerprintLog
from r3operator.wire.shared_buffer import OpenedBuffer, SharedBufferError, StagedEntry, entry_views, open_shared
from r3operator.wire.streams import on_stream
from r3operator.wire.sync_phases import SyncPhases
from r3operator.wire.weights import full_tensor

log = logging.getLogger(__name__)

SLOTS_PER_ENGINE = 8
"""Doorbell slots kept for each engine: one per worker (a colocated engine has one per GPU it shares with us)."""

WAIT_S = 300.0
"""How long either side waits for the other's ring (the trainer's writes of one sync take milliseconds to seconds)."""


@dataclass
class _Worker:
    """One engine worker's parameters as mapped here, in the plan's order."""

    slot: int
    views: list[Any]
    opened: list[OpenedBuffer] = field(default_factory=list)


AttachFn = Callable[[int, dict[str, Any]], list[dict[str, Any]]]
"""(engine index, {"doorbell", "slot_base"}) → that engine's workers' answers (`r3_mapped_attach`)."""

SyncFn = Callable[[int, str | None, float], list[Callable[[], None]]]
"""(sync number, policy tag, timeout) → one call per engine, its `r3_mapped_sync`, for `sync` to send."""


class MappedKernelSend:
    """The trainer side (see the module doc). One per sender; `close` lets go of every mapping."""

    def __init__(self) -> None:
        self._doorbell: Doorbell | None = None
        self._workers: list[_Worker] = []
        self._number = 0
        self._copy: Any = None  # the CUDA stream the builds run on, made at the first sync
        self._calls: ThreadPoolExecutor | None = None  # the engines' calls, answered only once the trainer wrote
        self.attached = False

    def attach(self, engines: int, ask: AttachFn, plan: Sequence[Source]) -> None:
        """Map every worker of `engines` engines (`ask` each), checked against `plan`. Raises `SharedBufferError`
        naming the first parameter that does not match (then nothing stays mapped)."""
        self.close()
        self._doorbell = Doorbell(SLOTS_PER_ENGINE * engines)
        try:
            for engine in range(engines):
                share = {"doorbell": self._doorbell.description(), "slot_base": engine * SLOTS_PER_ENGINE}
                for answer in ask(engine, share):
                    self._workers.append(_map_worker(answer, plan))
            if not self._workers:
                raise SharedBufferError("no engine worker answered the mapping")
        except BaseException:
            self.close()
            raise
        self.attached = True

    def sync(
        self,
        state_dict: Mapping[str, Any],
        plan: Sequence[Source],
        *,
        start: SyncFn,
        policy_tag: str | None,
        sent: FingerprintLog,
        phases: SyncPhases,
        timeout_s: float = WAIT_S,
    ) -> None:
        """One sync (the module doc). Raises the engines' first error, or the trainer's own when it failed to write;
        either way the mapping is dropped (`attached` False)."""
        if not self.attached or self._doorbell is None:
            raise RuntimeError("MappedKernelSend.sync before attach()")
        doorbell = self._doorbell
        self._number += 1
        number = self._number
        engine_calls = start(number, policy_tag, timeout_s)
        if self._calls is None:
            self._calls = ThreadPoolExecutor(max_workers=len(engine_calls), thread_name_prefix="r3-mapped-sync")
        calls = [self._calls.submit(call) for call in engine_calls]
        try:
            with phases("begin"):
                for worker in self._workers:
                    doorbell.wait_opened(
                        worker.slot, number, timeout_s=timeout_s, give_up=lambda: any(c.done() for c in calls)
                    )
            try:
                self._write(state_dict, plan, phases)
            except BaseException:
                for worker in self._workers:
                    doorbell.ring_failed(worker.slot, number)
                _wait_all(calls, quiet=True)
                raise
            for worker in self._workers:
                doorbell.ring_written(worker.slot, number)
            # What was sent is what the trainer holds, never what the mapping reads back (the engine's own memory: an
            # engine whose writes never landed would agree with itself): the trainer tensors each parameter is built
            # of, fingerprinted when the receipt is read (they stay as they are until the trainer's next update).
            for source in plan:
                parts = [full_tensor(state_dict[name]) for name in source.parts]
                add_parameter_pieces(sent, source, parts, later=True)
            with phases("finish"):
                _wait_all(calls)
        except DoorbellTimeout as exc:
            for worker in self._workers:
                doorbell.ring_failed(worker.slot, number)
            _wait_all(calls)  # an engine's own error says more than our wait
            self.close()
            raise RuntimeError(f"mapped weight sync {number}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def _write(self, state_dict: Mapping[str, Any], plan: Sequence[Source], phases: SyncPhases) -> None:
        import torch

        first: Any = self._workers[0].views[0] if self._workers[0].views else None
        cuda = first is not None and first.is_cuda
        if cuda and self._copy is None:
            self._copy = torch.cuda.Stream(first.device)
        current = torch.cuda.current_stream(first.device) if cuda else None
        if current is not None:
            self._copy.wait_stream(current)  # the trainer's last update wrote what the builds read
        with phases("gather"), on_stream(self._copy if cuda else None):
            for index, source in enumerate(plan):
                parts = [full_tensor(state_dict[name]) for name in source.parts]
                for worker in self._workers:
                    build_parameter(worker.views[index], source, parts)
            if cuda:
                self._copy.synchronize()  # written before the engine is told so
        if current is not None:
            current.wait_stream(self._copy)  # the next update must not write what a build read

    def close(self) -> None:
        """Let go of every mapping and the doorbell (an engine still inside a call hears nothing and times out)."""
        if self._copy is not None:
            self._copy.synchronize()
        for worker in self._workers:
            worker.views = []
            for opened in worker.opened:
                opened.close()
        self._workers = []
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None
        if self._calls is not None:
            self._calls.shutdown(wait=False)  # a call still waiting ends at its engine's own timeout
            self._calls = None
        self.attached = False


def _map_worker(answer: Mapping[str, Any], plan: Sequence[Source]) -> _Worker:
    """One worker's answer (`r3_mapped_attach`) mapped: its buffers opened once each, its entries checked against the
    plan's parameters by name, dtype and shape."""
    try:
        buffers = list(answer["buffers"])
        rows = list(answer["entries"])
        slot = int(answer["slot"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SharedBufferError(f"an engine's mapping answer lacks {exc}: expected slot, buffers and entries") from exc
    opened = [open_shared(description) for description in buffers]
    try:
        by_name: dict[str, Any] = {}
        for row in rows:
            entry, index = StagedEntry.from_json(row[:4]), int(row[4])
            by_name[entry.name] = entry_views(opened[index].tensor, [entry])[0]
        views, wrong = [], []
        for source in plan:
            param = source.parameter
            view = by_name.get(param.name)
            if (
                view is None
                or str(view.dtype).removeprefix("torch.") != param.dtype
                or tuple(view.shape) != param.shape
            ):
                held = "nothing" if view is None else f"{str(view.dtype).removeprefix('torch.')} {list(view.shape)}"
                wrong.append(f"{param.name} (planned {param.dtype} {list(param.shape)}, shared {held})")
            views.append(view)
        if wrong:
            raise SharedBufferError(
                f"mapped parameters: {len(wrong)} of the plan's parameters are not shared as planned, e.g. {wrong[0]}"
            )
    except BaseException:
        for buffer in opened:
            buffer.close()
        raise
    return _Worker(slot, views, opened)


def _wait_all(calls: Sequence[Future[None]], *, quiet: bool = False) -> None:
    """Every engine's call answered; the first error is raised (`quiet`: logged, for a sync the trainer failed)."""
    first: BaseException | None = None
    for call in calls:
        try:
            call.result()
        except BaseException as exc:
            if quiet:
                log.info("an engine refused the mapped sync the trainer failed: %s", exc)
            elif first is None:
                first = exc
    if first is not None:
        raise first
