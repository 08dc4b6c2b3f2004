"""The kernel layout to a colocated engine: every parameter built into ONE buffer the engine maps once.

vLLM 0.22's IPC sender shares memory per sync: unpacked, it shares every tensor it is handed, and its receiver
opens one CUDA IPC handle per tensor and closes it after the load, so each sync pays the opens, the trainer's
`cudaMalloc` of the built tensors and their `cudaFree` when the cache is given back; packed, it copies into one
buffer per chunk with an engine round trip per chunk (issue 24: the `a3b` kernel sync over IPC ran at 0.042x the
device copy). Here (`StagedKernelSend`):

- the trainer owns one flat buffer with a slot per engine parameter (wire/shared_buffer.py), shared with the
  engines once per rendezvous (`attach`: the buffer's handle and the slots, checked by each engine against its
  parameters by name, dtype and shape before any sync);
- a sync builds every parameter into its slot (`build_parameter`: one casting `copy_` per part), on a copy stream,
  leaves to the receipt the trainer tensors each slot is built of (fingerprinted when it is read; never the slots: a
  build error must fail the receipt, wire/kernel_layout.py `add_parameter_pieces`), waits for the builds, and asks
  every engine ONCE (`r3_staged_sync`, engine/worker.py): the engine opens vLLM's bracket, copies each slot into its
  parameter, fingerprints the parameters, closes the bracket and stamps the policy, all inside one RPC, which vLLM's
  engine core runs between two forward steps; the driver's next requests carry the new policy as their prefix-cache
  salt.

What a failure leaves: one while building is before any engine is asked, so every engine still serves the whole
previous policy under its tag; one inside the engine's copies aborts its bracket there (the tag stays None until
a complete sync, as on every kernel-layout path).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from r3operator.wire.kernel_layout import Source, add_parameter_pieces, build_parameter
from r3operator.wire.receipt import FingerprintLog
from r3operator.wire.shared_buffer import SharedBuffer, StagedEntry, entry_views, staged_layout
from r3operator.wire.streams import on_stream, recorded_event
from r3operator.wire.sync_phases import SyncPhases
from r3operator.wire.weights import full_tensor


def _slots(plan: Sequence[Source]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(s.parameter.name, s.parameter.dtype, tuple(s.parameter.shape)) for s in plan]


class StagedKernelSend:
    """The trainer side (see the module doc). One per sender: the buffer is kept across syncs, made again when the
    plan changes, and given back by `close`."""

    def __init__(self) -> None:
        self._buffer: SharedBuffer | None = None
        self._entries: list[StagedEntry] = []
        self._views: list[Any] = []
        self._copy: Any = None  # the CUDA stream the builds run on, made at the first sync on CUDA
        self.attached = False  # whether the engines of this rendezvous map the current buffer

    @property
    def staged_bytes(self) -> int:
        return self._buffer.nbytes if self._buffer is not None else 0

    def attachment(self, plan: Sequence[Source], *, device: Any) -> dict[str, Any] | None:
        """What the engines must map before this sync ({"buffer", "entries"}, JSON-safe), or None when they already
        map it. The buffer is made (again) when there is none or `plan`'s parameters differ from its slots."""
        wanted = _slots(plan)
        if self._buffer is None or [(e.name, e.dtype, e.shape) for e in self._entries] != wanted:
            self.close()
            self._entries, size = staged_layout(wanted)
            self._buffer = SharedBuffer(size, device)
            self._views = entry_views(self._buffer.tensor, self._entries)
        if self.attached:
            return None
        return {"buffer": self._buffer.description(), "entries": [e.as_json() for e in self._entries]}

    def fill(
        self,
        state_dict: Mapping[str, Any],
        plan: Sequence[Source],
        *,
        sent: FingerprintLog,
        phases: SyncPhases,
    ) -> None:
        """Build every parameter of `plan` into its slot and leave to `sent` (fingerprinted when the receipt is read)
        the trainer tensors each is built of (`add_parameter_pieces`); returns once every slot is written (the engines
        read them as soon as they are asked). `attachment` must have been called for this plan."""
        import torch

        if self._buffer is None or len(self._views) != len(plan):
            raise RuntimeError("StagedKernelSend.fill before attachment() for this plan")
        cuda = self._buffer.device.type == "cuda"
        if cuda and self._copy is None:
            self._copy = torch.cuda.Stream(self._buffer.device)
        current = torch.cuda.current_stream(self._buffer.device) if cuda else None
        if current is not None:
            self._copy.wait_stream(current)  # the trainer's last update wrote what the builds read
        with phases("gather"), on_stream(self._copy):
            parts = [[full_tensor(state_dict[name]) for name in source.parts] for source in plan]
            for source, view, built_from in zip(plan, self._views, parts, strict=True):
                build_parameter(view, source, built_from)
            built = recorded_event(self._copy) if cuda else None
        # The receipt's side: the trainer tensors each slot is built of, not the slots (a build error must fail the
        # receipt), fingerprinted when the receipt is read.
        for source, built_from in zip(plan, parts, strict=True):
            add_parameter_pieces(sent, source, built_from, later=True)
        if current is not None:
            current.wait_stream(self._copy)  # the next update must not write what a build reads
        if built is not None:
            with phases("gather"):
                built.synchronize()

    def close(self) -> None:
        """Give the buffer back (once the builds are done; an engine still mapping it keeps the memory until it lets
        go and the trainer's `torch.cuda.ipc_collect` runs)."""
        if self._copy is not None:
            self._copy.synchronize()
        if self._buffer is not None:
            self._views = []
            self._buffer.close()
        self._buffer, self._entries, self.attached = None, [], False
