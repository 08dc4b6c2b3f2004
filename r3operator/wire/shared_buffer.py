"""One flat byte buffer shared between the trainer and a colocated engine, opened once, reused at every sync.

A colocated kernel-layout sync (weightsync/staged.py) writes every engine parameter into ONE trainer-owned buffer
and the engine copies from it: the buffer is shared once per rendezvous, so a sync pays neither a CUDA IPC handle
opened per tensor (vLLM's unpacked IPC receiver opens one per tensor at every sync and drops it after) nor a
`cudaMalloc`/`cudaFree` of the sync's bytes.

How the buffer is shared, in a JSON-safe description (it goes over vLLM's `/collective_rpc` as plain JSON: no
pickle crosses the wire):
- "cuda_ipc": torch's CUDA IPC handle of the buffer's allocation (`torch.multiprocessing.reductions`, what vLLM's
  IPC backend sends too), named by the GPU's UUID so that an engine on another GPU refuses it by name;
- "shm": a POSIX shared-memory segment by name (`multiprocessing.shared_memory`), for a buffer on the CPU: the same
  protocol without a GPU, which the CPU tests drive end to end across two processes.

The layout of the buffer is a list of `StagedEntry` (engine parameter name, dtype, shape, byte offset), each entry
aligned to `ALIGN` bytes.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from r3operator.wire.weights import tensor_nbytes

# Any: wire/ loads no framework at import: the shared tensors, their device and the shared-memory segment are Any
# here.

ALIGN = 256
"""Each entry starts at a multiple of this many bytes: a copy from an aligned address runs at full width."""


class SharedBufferError(RuntimeError):
    """A shared buffer's description cannot be opened here (another GPU, a bad field, a segment gone)."""


@dataclass(frozen=True)
class StagedEntry:
    """One engine parameter's place in the shared buffer."""

    name: str
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]
    offset: int  # bytes from the buffer's start

    @property
    def nbytes(self) -> int:
        import torch

        return tensor_nbytes(self.shape, getattr(torch, self.dtype))

    def as_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.offset]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> StagedEntry:
        try:
            name, dtype, shape, offset = value
            return cls(str(name), str(dtype), tuple(int(d) for d in shape), int(offset))
        except (TypeError, ValueError) as exc:
            raise SharedBufferError(f"staged entry {value!r}: expected [name, dtype, shape, offset]") from exc


def staged_layout(parameters: Sequence[tuple[str, str, tuple[int, ...]]]) -> tuple[list[StagedEntry], int]:
    """Entries for (name, dtype name, shape) in order, each at the next `ALIGN`ed offset, and the buffer's size."""
    entries, offset = [], 0
    for name, dtype, shape in parameters:
        entry = StagedEntry(name, dtype, tuple(shape), offset)
        entries.append(entry)
        offset += -(-entry.nbytes // ALIGN) * ALIGN
    return entries, offset


def entry_views(buffer: Any, entries: Sequence[StagedEntry]) -> list[Any]:
    """Each entry's tensor: a view of `buffer` (flat uint8), its dtype and shape."""
    import torch

    views = []
    for entry in entries:
        end = entry.offset + entry.nbytes
        if entry.offset < 0 or end > buffer.numel():
            raise SharedBufferError(
                f"staged entry {entry.name}: bytes {entry.offset}..{end} lie outside the {buffer.numel()}-byte buffer"
            )
        views.append(buffer[entry.offset : end].view(getattr(torch, entry.dtype)).view(entry.shape))
    return views


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def _unb64(value: Any, field: str) -> bytes | None:
    if value is None:
        return None
    try:
        return base64.b64decode(str(value), validate=True)
    except ValueError as exc:
        raise SharedBufferError(f"shared buffer field {field!r} is not base64") from exc


class SharedBuffer:
    """A flat uint8 buffer of `nbytes` on `device` that another process can open from `description()`.
    The owner keeps it alive (and so the memory it shares) until `close`."""

    def __init__(self, nbytes: int, device: Any) -> None:
        import torch

        self.device = torch.device(device)
        self.nbytes = int(nbytes)
        self._shm: Any = None
        self.tensor: Any
        if self.device.type == "cuda":
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        elif self.device.type == "cpu":
            from multiprocessing import shared_memory

            self._shm = shared_memory.SharedMemory(create=True, size=max(self.nbytes, 1))
            self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=self.nbytes)
        else:
            raise SharedBufferError(f"a shared staging buffer needs a CUDA or CPU device, not {self.device}")

    def description(self) -> dict[str, Any]:
        """What `open_shared` needs to map this buffer in another process (JSON-safe)."""
        if self._shm is not None:
            return {"kind": "shm", "name": self._shm.name, "nbytes": self.nbytes}
        return describe_cuda(self.tensor)

    def close(self) -> None:
        """Drop the owner's reference (a CUDA allocation an engine still maps is freed by torch once that engine
        lets go and `torch.cuda.ipc_collect` runs); a shared-memory segment is unlinked."""
        self.tensor = None
        if self._shm is not None:
            with contextlib.suppress(BufferError):  # a view of it is still alive: the mapping goes with the last one
                self._shm.close()
            self._shm.unlink()
            self._shm = None


def describe_cuda(tensor: Any) -> dict[str, Any]:
    """The JSON-safe CUDA IPC description (`open_shared`) of `tensor`, a flat contiguous uint8 CUDA tensor (a view
    of a bigger allocation is described as that view). The caller keeps `tensor` alive while it is mapped."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    if tensor.device.type != "cuda" or tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise SharedBufferError(
            f"describe_cuda takes a flat contiguous uint8 CUDA tensor, not {tensor.dtype} on {tensor.device}"
        )
    _, args = reduce_tensor(tensor)
    size, stride, offset = args[1:4]
    handle, storage_bytes, storage_offset = args[7:10]
    counter, counter_offset, event, sync = args[11:15]
    return {
        "kind": "cuda_ipc",
        "gpu_uuid": str(torch.cuda.get_device_properties(tensor.device).uuid),
        "nbytes": int(tensor.numel()),
        "tensor_offset": int(offset),
        "handle": _b64(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "ref_counter_handle": _b64(counter),
        "ref_counter_offset": int(counter_offset),
        "event_handle": _b64(event),
        "event_sync_required": bool(sync),
        "shape": list(size),
        "stride": list(stride),
    }


class OpenedBuffer:
    """The engine's mapping of a `SharedBuffer` (`open_shared`): `tensor` (flat uint8) until `close`."""

    def __init__(self, tensor: Any, shm: Any = None) -> None:
        self.tensor = tensor
        self._shm = shm

    def close(self) -> None:
        self.tensor = None
        if self._shm is not None:
            with contextlib.suppress(BufferError):  # a view of it is still alive: the mapping goes with the last one
                self._shm.close()
            self._shm = None


def open_shared(description: Mapping[str, Any]) -> OpenedBuffer:
    """Map the buffer `description` names (`SharedBuffer.description`) into this process. A CUDA buffer must be
    on this process's current GPU (compared by UUID: device indices differ between processes)."""
    kind = description.get("kind")
    try:
        nbytes = int(description["nbytes"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SharedBufferError(f"shared buffer description has no byte count: {dict(description)!r}") from exc
    if kind == "shm":
        import torch

        try:
            shm = attach_shm(str(description["name"]))
        except FileNotFoundError as exc:
            raise SharedBufferError(f"shared memory segment {description.get('name')!r} does not exist") from exc
        return OpenedBuffer(torch.frombuffer(shm, dtype=torch.uint8, count=nbytes), shm)
    if kind == "cuda_ipc":
        return OpenedBuffer(_open_cuda(description, nbytes))
    raise SharedBufferError(f"shared buffer kind {kind!r}: expected cuda_ipc or shm")


def attach_shm(name: str) -> Any:
    """An existing segment mapped without `multiprocessing.shared_memory`, whose attach (before Python 3.13)
    registers the segment with this process's resource tracker: that would unlink the owner's segment when this
    process exits, or unregister the owner's own record when both ends are one process."""
    import mmap
    import os

    fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def _open_cuda(description: Mapping[str, Any], nbytes: int) -> Any:
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise SharedBufferError("a CUDA IPC staging buffer was offered to a process without CUDA")
    device = torch.cuda.current_device()
    here = str(torch.cuda.get_device_properties(device).uuid)
    if description.get("gpu_uuid") != here:
        raise SharedBufferError(
            f"the staging buffer is on GPU {description.get('gpu_uuid')}, this engine worker on GPU {here}: "
            "CUDA IPC staging needs the engine on the trainer's GPU"
        )
    try:
        tensor = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(description["shape"]),
            tuple(description["stride"]),
            int(description["tensor_offset"]),
            torch.storage.TypedStorage,
            torch.uint8,
            device,
            _unb64(description["handle"], "handle"),
            int(description["storage_bytes"]),
            int(description["storage_offset"]),
            False,
            _unb64(description["ref_counter_handle"], "ref_counter_handle"),
            int(description["ref_counter_offset"]),
            _unb64(description.get("event_handle"), "event_handle"),
            bool(description["event_sync_required"]),
        )
    except KeyError as exc:
        raise SharedBufferError(f"CUDA IPC staging buffer description lacks {exc.args[0]!r}") from exc
    if tensor.numel() != nbytes:
        raise SharedBufferError(f"the staging buffer maps {tensor.numel()} bytes, its description says {nbytes}")
    return tensor
