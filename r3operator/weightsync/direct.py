"""The kernel layout over NCCL: one broadcast per engine parameter, received straight into it.

vLLM 0.22's packed producer is the sender of every other native sync. For the kernel layout (a few big tensors,
each an engine parameter) it does more than the bytes need (issue 24, docs/runtime.md "Weight sync"):
- it casts each tensor into a new one, then copies it again into a bucket (`torch.cat`): two passes over every
  byte where one `copy_` into the bucket does both, and the fused expert blocks are built in a third;
- it takes new side streams and new buckets at every sync, which torch's allocator cannot hand to the next
  sync (the cache grows until `wire/cuda_cache.py` releases it, each release a `cudaFree` wait);
- the host waits for the bucket two back before it packs the next;
and on the engine the packed receiver broadcasts into a fresh bucket and copies each tensor into its parameter:
a second pass over every byte, and new buckets again.

Here the wire is vLLM's own unpacked NCCL protocol (`packed=False`: one broadcast per announced tensor, in the
announced order), which vLLM's receiver decodes as it is; the worker extension receives each tensor straight
into its parameter (engine/worker.py, `receive_into_parameters`). On the trainer (`DirectKernelSend`):
- a tensor that already is the parameter (`as_parameter`: a ranked trainer's gathered copy, a bf16 trainer's
  own tensor) is broadcast as it is;
- one bigger than the fingerprint bucket is built (cast, experts fused, halves swapped: `build_parameter`) by
  `copy_` into one of two staging buffers kept across syncs; a smaller one into a tensor of its own;
- building and fingerprinting run on a copy stream, the broadcasts on a comm stream, ordered by events: the
  copy of tensor k+1 overlaps the broadcast of tensor k, and the host never waits inside the sync;
- a failure while building (the trainer's state dict) still sends every announced broadcast, zeros, so the
  engines' receive ends and the caller can abort their brackets, instead of leaving every engine and the
  trainer inside a collective that never completes. The error is raised after the last broadcast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from r3operator.wire.kernel_layout import Source, as_parameter, build_parameter
from r3operator.wire.receipt import FingerprintLog
from r3operator.wire.sync_phases import SyncPhases
from r3operator.wire.weights import full_tensor


class Broadcaster(Protocol):
    """What the sender needs of vLLM's `PyNcclCommunicator` (a test gives a stand-in)."""

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None: ...


class DirectKernelSend:
    """The trainer side (see the module doc). One per rendezvous: its streams and staging buffers are kept
    across syncs and given back by `close`."""

    def __init__(self) -> None:
        self._staging: list[Any] = []  # two uint8 buffers, allocated at the first sync that needs them
        self._copy: Any = None  # CUDA streams, made at the first sync on CUDA
        self._comm: Any = None
        self.staged_bytes = 0  # the size of each staging buffer (0 until one is needed)
        self._filler: Any = None  # zeros sent in place of what a failed sync could not build

    def send(
        self,
        group: Broadcaster,
        state_dict: Mapping[str, Any],
        plan: Sequence[Source],
        *,
        dtype: Any,
        device: Any,
        sent: FingerprintLog,
        phases: SyncPhases,
    ) -> None:
        """Broadcast every parameter of `plan` from `state_dict` in the plan's order (what the engines were
        announced), each fingerprinted into `sent`; returns once every broadcast is queued (the caller's
        `finish` is after the engines' receive, which waits for them). Raises the first building error after
        the last broadcast."""
        import torch

        cuda = torch.device(device).type == "cuda"
        if cuda:
            self._make_streams()
            current = torch.cuda.current_stream()
            self._copy.wait_stream(current)  # the trainer's last update wrote what the copies read
            self._comm.wait_stream(current)
        freed: list[Any] = [None, None]  # per staging slot: the broadcast that last read it
        slot, error = 0, None
        for source in plan:
            shape, wanted = source.parameter.shape, _dtype(source.parameter.dtype, dtype)
            tensor, staged, ready, fresh = None, None, None, False
            if error is None:
                try:
                    with phases("gather"):
                        parts = [full_tensor(state_dict[name]) for name in source.parts]
                        tensor = as_parameter(source, parts, dtype=wanted, device=device)
                        with self._on(self._copy):
                            if tensor is None:
                                nbytes = _nbytes(shape, wanted)
                                if nbytes > sent.bucket_bytes:  # see the module doc: small ones get their own
                                    staged = slot
                                    if freed[slot] is not None:
                                        self._copy.wait_event(freed[slot])
                                    out = self._stage(slot, nbytes, device).view(wanted).view(shape)
                                    slot ^= 1
                                else:
                                    out, fresh = torch.empty(shape, dtype=wanted, device=device), True
                                tensor = build_parameter(out, source, parts)
                                ready = _event(self._copy) if cuda else None  # the broadcast waits for the build
                    with phases("fingerprint"), self._on(self._copy):
                        sent.add(source.parameter.name, tensor)
                except Exception as exc:  # re-raised after the last broadcast (see the module doc)
                    error, tensor = exc, None
            if tensor is None:  # after a failure: the announced bytes, zeros
                tensor = self._zeros(plan, dtype, device)[: _nbytes(shape, wanted)].view(wanted).view(shape)
                staged, fresh = None, False
            if cuda:
                if ready is not None:
                    self._comm.wait_event(ready)
                if fresh:  # made on the copy stream: its memory must not be reused before the broadcast is done
                    tensor.record_stream(self._comm)
            group.broadcast(tensor, src=0, stream=self._comm)
            if cuda and staged is not None:
                freed[staged] = _event(self._comm)
        if cuda:
            current.wait_stream(self._comm)  # the next update must not write what a broadcast still reads
            current.wait_stream(self._copy)
        if error is not None:
            raise error

    def close(self) -> None:
        """Give the staging buffers back (once the streams are done with them)."""
        if self._copy is not None:
            self._copy.synchronize()
            self._comm.synchronize()
        self._staging, self.staged_bytes, self._filler = [], 0, None

    # -- helpers ----------------------------------------------------------------------------------
    def _make_streams(self) -> None:
        import torch

        if self._copy is None:
            self._copy, self._comm = torch.cuda.Stream(), torch.cuda.Stream()

    def _on(self, stream: Any) -> AbstractContextManager[Any]:
        import torch

        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _stage(self, slot: int, nbytes: int, device: Any) -> Any:
        """Staging buffer `slot`, at least `nbytes`; made again (both) when a bigger tensor comes."""
        import torch

        if nbytes > self.staged_bytes:
            if self._copy is not None:
                self._copy.synchronize()  # once per rendezvous: the old buffers may still be read
                self._comm.synchronize()
            self._staging = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
            self.staged_bytes = nbytes
        return self._staging[slot][:nbytes]

    def _zeros(self, plan: Sequence[Source], dtype: Any, device: Any) -> Any:
        """A zero buffer as big as the plan's largest tensor, made at the first failure of a sync."""
        import torch

        largest = max(_nbytes(s.parameter.shape, _dtype(s.parameter.dtype, dtype)) for s in plan)
        if self._filler is None or self._filler.numel() < largest:
            self._filler = torch.zeros(largest, dtype=torch.uint8, device=device)
        return self._filler


def _dtype(name: str, fallback: Any) -> Any:
    """The engine parameter's dtype (the plan checked it is the sync's), as a torch dtype."""
    import torch

    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else fallback


def _nbytes(shape: Sequence[int], dtype: Any) -> int:
    import torch

    count = 1
    for dim in shape:
        count *= int(dim)
    return count * torch.empty((), dtype=dtype).element_size()


def _event(stream: Any) -> Any:
    import torch

    event = torch.cuda.Event()
    event.record(stream)
    return event
