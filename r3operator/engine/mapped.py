"""The engine side of a mapped kernel-layout sync (weightsync/mapped.py): the trainer writes this worker's parameters.

`share_parameters` describes every parameter's memory once per rendezvous, so that the colocated trainer maps it:
- on a GPU each parameter's own CUDA allocation, as a CUDA IPC handle in plain JSON (wire/shared_buffer.py), named by
  the GPU's UUID;
- on the CPU, where ordinary memory cannot be shared after the fact, the parameters are first moved into ONE POSIX
  shared-memory segment that this worker owns (each `param.data` becomes a view of it): the same protocol without a
  GPU, which the CPU tests drive across two processes.

`take_mapped_sync` is one sync, inside the worker's one call (engine/worker.py `r3_mapped_sync`), with vLLM's bracket
open: it waits for the GPU (a forward step queued before the call must not read a half-written parameter), rings
`opened` and waits for the trainer's `written` (wire/doorbell.py). The receipt fingerprints the parameters when the
driver reads it (`SyncReceipt.finish_later`): the sync itself computes no fingerprint.

Nothing here trusts that a parameter is where it was mapped: every sync first checks that each parameter's data
pointer, dtype and shape are still the ones shared (`moved`); a parameter vLLM reallocated (a reload, a sleep and wake)
fails the sync before the bracket opens, and the trainer maps again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from r3operator.wire.doorbell import Doorbell
from r3operator.wire.shared_buffer import SharedBuffer, SharedBufferError, describe_cuda, staged_layout


@dataclass
class MappedParameters:
    """What a worker keeps between `share_parameters` and the syncs: its doorbell slot and each parameter as shared."""

    doorbell: Doorbell
    slot: int
    parameters: list[tuple[str, Any, int]]  # (name, param.data, data pointer when shared)
    owned: SharedBuffer | None = None  # the CPU segment the parameters were moved into

    def moved(self, model: Any) -> list[str]:
        """The parameters that are no longer at the memory shared (reallocated, replaced, resized)."""
        moved = []
        for name, data, pointer in self.parameters:
            try:
                param = model.get_parameter(name)
            except AttributeError:
                moved.append(name)
                continue
            if param.data_ptr() != pointer or param.dtype != data.dtype or param.shape != data.shape:
                moved.append(name)
        return moved

    def close(self) -> None:
        self.doorbell.close()
        self.parameters = []
        if self.owned is not None:
            self.owned.close()  # the parameters keep their views of the segment's mapping until they are reloaded
            self.owned = None


def share_parameters(named: Sequence[tuple[str, Any]]) -> tuple[dict[str, Any], SharedBuffer | None]:
    """({"buffers": [description], "entries": [[name, dtype, shape, offset, buffer]]}, the CPU segment or None) for
    `named` (name, parameter), every one contiguous. Raises `SharedBufferError` naming a parameter that cannot be
    shared (the trainer then takes the staging buffer)."""
    import torch

    if not named:
        raise SharedBufferError("no parameters to share")
    devices = {param.device.type for _, param in named}
    odd = [name for name, param in named if not param.is_contiguous()]
    if odd:
        raise SharedBufferError(f"parameter {odd[0]} is not contiguous: the trainer cannot write it as one block")
    if devices == {"cuda"}:
        buffers, entries = [], []
        for name, param in named:
            flat = param.data.view(-1).view(torch.uint8)
            buffers.append(describe_cuda(flat))
            entries.append([name, str(param.dtype).removeprefix("torch."), list(param.shape), 0, len(buffers) - 1])
        return {"buffers": buffers, "entries": entries}, None
    if devices == {"cpu"}:
        layout, size = staged_layout([(n, str(p.dtype).removeprefix("torch."), tuple(p.shape)) for n, p in named])
        owned = SharedBuffer(size, "cpu")
        for (_, param), entry in zip(named, layout, strict=True):
            view = owned.tensor[entry.offset : entry.offset + entry.nbytes].view(param.dtype).view(param.shape)
            view.copy_(param.data)
            param.data = view
        return {"buffers": [owned.description()], "entries": [[*e.as_json(), 0] for e in layout]}, owned
    raise SharedBufferError(
        f"parameters on {sorted(devices)}: a mapped sync needs them all on one CUDA device or the CPU"
    )


def map_parameters(
    named: Sequence[tuple[str, Any]], share: Mapping[str, Any], *, rank: int = 0
) -> tuple[MappedParameters, dict[str, Any]]:
    """What a worker keeps and what it answers the trainer ({"slot", "buffers", "entries"}) when the trainer asks to
    map its parameters `named` (`share`: {"doorbell": wire/doorbell description, "slot_base": int}); the worker's
    slot is `slot_base` + `rank`. Raises `SharedBufferError` when the parameters cannot be shared or the share is
    malformed."""
    if not isinstance(share, Mapping) or "doorbell" not in share:
        raise SharedBufferError("a mapping request is {'doorbell': ..., 'slot_base': int}")
    answer, owned = share_parameters(named)
    doorbell = Doorbell.attach(share["doorbell"])
    slot = int(share.get("slot_base") or 0) + rank
    try:
        doorbell.check(slot)
    except BaseException:
        doorbell.close()
        raise
    state = MappedParameters(doorbell, slot, [(name, param.data, param.data_ptr()) for name, param in named], owned)
    return state, {"slot": slot, **answer}


def take_mapped_sync(state: MappedParameters, number: int, *, timeout_s: float) -> None:
    """Sync `number` of `state` (see the module doc), with the bracket already open: returns once the trainer has rung
    `written`; raises `MappedSyncFailed` when it rang `failed`, and `DoorbellTimeout` when it rang nothing within
    `timeout_s`."""
    import torch

    if state.parameters and state.parameters[0][1].is_cuda:
        torch.cuda.current_stream(state.parameters[0][1].device).synchronize()
    state.doorbell.ring_opened(state.slot, number)
    if not state.doorbell.wait_written(state.slot, number, timeout_s=timeout_s):
        raise MappedSyncFailed(
            f"mapped weight sync {number}: the trainer failed while writing the parameters: the bracket is aborted and "
            "the engine serves no policy until the next complete sync"
        )


class MappedSyncFailed(RuntimeError):
    """The trainer rang `failed`: it could not write every parameter of this sync."""
