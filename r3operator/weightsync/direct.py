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

Here the wire is vLLM's unpacked NCCL layout (one broadcast per announced tensor, in the announced order, on
vLLM's communicator) followed by a commit flag, and the whole sync is ONE call per engine (`r3_direct_sync`,
engine/worker.py): the engine opens vLLM's bracket, receives each tensor straight into its parameter
(`receive_into_parameters`), then the flag, and closes the bracket and stamps the policy only when the flag says
every tensor went out; the driver's next requests carry the new policy as their prefix-cache salt. The bracket's
round trips (begin, update, finish) were a sync's fixed cost. On the trainer (`DirectKernelSend`):
- a tensor that already is the parameter (`as_parameter`: a ranked trainer's gathered copy, a bf16 trainer's
  own tensor) is broadcast as it is;
- one bigger than the fingerprint bucket is built (cast, experts fused, halves swapped: `build_parameter`) by
  `copy_` into one of two staging buffers kept across syncs; a smaller one into a tensor of its own;
- building runs on a copy stream, the broadcasts on a comm stream, ordered by events: the copy of tensor k+1 overlaps
  the broadcast of tensor k, and the host never waits inside the sync;
- the receipt's side is the trainer tensors each parameter is built of, fingerprinted when the receipt is read
  (wire/kernel_layout.py `add_parameter_pieces`): never what was built, so a build error fails the receipt, and the
  sync itself queues no fingerprint;
- a failure while building (the trainer's state dict) still sends every announced broadcast, zeros, and the flag
  0, so the engines' receive ends and each aborts its bracket (the tag stays None), instead of leaving every
  engine and the trainer inside a collective that never completes. The error is raised after the last broadcast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from r3operator.wire.kernel_layout import COMMIT_DTYPE, Source, add_parameter_pieces, as_parameter, build_parameter
from r3operator.wire.receipt import FingerprintLog
from r3operator.wire.streams import on_stream, recorded_event
from r3operator.wire.sync_phases import SyncPhases
from r3operator.wire.weights import announced_zeros, full_tensor, tensor_nbytes

# Any: torch is imported when a sync runs (weightsync/ loads it lazily) and vLLM's NCCL communicator ships no types we
# can name: tensors, CUDA streams and the communicator are Any here.


class Broadcaster(Protocol):
    """What the sender needs of vLLM's `PyNcclCommunicator` (a test gives a stand-in)."""

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None: ...


@dataclass
class _Built:
    """One parameter ready to go: the tensor, the staging slot it occupies (None: not staged), the event its build
    recorded on the copy stream (None: nothing built), and whether it is a tensor of its own made on that stream."""

    tensor: Any
    slot: int | None = None
    ready: Any = None
    own: bool = False


class DirectKernelSend:
    """The trainer side (see the module doc). One per rendezvous: its streams and staging buffers are kept
    across syncs and given back by `close`."""

    def __init__(self) -> None:
        self._staging: list[Any] = []  # two uint8 buffers, allocated at the first sync that needs them
        self._copy: Any = None  # CUDA streams, made at the first sync on CUDA
        self._comm: Any = None
        self.staged_bytes = 0  # the size of each staging buffer (0 until one is needed)
        self._slot = 0  # within one sync: the staging buffer the next staged parameter goes into,
        self._freed: list[Any] = [None, None]  # and per buffer the event of the broadcast that last read it
        self._verdicts: Any = None  # [0, 1]: the commit flags, made once on the device

    def send(
        self,
        group: Broadcaster,
        state_dict: Mapping[str, Any],
        plan: Sequence[Source],
        *,
        device: Any,
        sent: FingerprintLog,
        phases: SyncPhases,
    ) -> None:
        """Broadcast every parameter of `plan` from `state_dict` in the plan's order (what the engines were
        announced), in the dtype each engine parameter has, each left to `sent` (read with the receipt), then the
        commit flag (`COMMIT_DTYPE` [1]: 1, or 0 after a failure); returns once every broadcast is queued (the
        engines' call returns after their receive, which waits for them). A failure to build one stops the building:
        the rest of the plan goes out as zeros, the flag as 0, then it is raised."""
        import torch

        cuda = torch.device(device).type == "cuda"
        if cuda and self._copy is None:
            self._copy, self._comm = torch.cuda.Stream(), torch.cuda.Stream()
        if self._verdicts is None:  # made once, before the comm stream waits for the current one below
            self._verdicts = torch.tensor([0, 1], dtype=getattr(torch, COMMIT_DTYPE), device=device)
        current = torch.cuda.current_stream() if cuda else None
        if current is not None:
            self._copy.wait_stream(current)  # the trainer's last update wrote what the copies read
            self._comm.wait_stream(current)
        self._slot, self._freed = 0, [None, None]
        error, failed_at = None, len(plan)
        for index, source in enumerate(plan):
            try:
                built = self._build(source, state_dict, device=device, sent=sent, phases=phases)
            except Exception as exc:  # raised below, after the rest of the announced broadcasts
                error, failed_at = exc, index
                break
            if built.ready is not None:
                self._comm.wait_event(built.ready)
            if built.own and cuda:  # made on the copy stream: not reused before its broadcast is done
                built.tensor.record_stream(self._comm)
            group.broadcast(built.tensor, src=0, stream=self._comm)
            if built.slot is not None and cuda:
                self._freed[built.slot] = recorded_event(self._comm)
        rest = [(s.parameter.name, getattr(torch, s.parameter.dtype), s.parameter.shape) for s in plan[failed_at:]]
        for _, zeros in announced_zeros(rest, device):
            if cuda:  # made on the current stream, dropped before the broadcast is done
                zeros.record_stream(self._comm)
            group.broadcast(zeros, src=0, stream=self._comm)
        verdict = int(error is None)
        group.broadcast(self._verdicts[verdict : verdict + 1], src=0, stream=self._comm)  # the commit flag, last
        if current is not None:
            current.wait_stream(self._comm)  # the next update must not write what a broadcast still reads
            current.wait_stream(self._copy)
        if error is not None:
            raise error

    def _build(
        self,
        source: Source,
        state_dict: Mapping[str, Any],
        *,
        device: Any,
        sent: FingerprintLog,
        phases: SyncPhases,
    ) -> _Built:
        """`source`'s parameter, as it is or built on the copy stream (into the next staging slot when it is bigger
        than a fingerprint bucket, see the module doc). The receipt fingerprints the trainer tensors it is built of
        (`add_parameter_pieces`) when it is read: a build error fails it, and the sync queues no fingerprint."""
        import torch

        shape, dtype = source.parameter.shape, getattr(torch, source.parameter.dtype)
        with phases("gather"):
            parts = [full_tensor(state_dict[name]) for name in source.parts]
            built = _Built(as_parameter(source, parts, dtype=dtype, device=device))
            if built.tensor is None:
                with on_stream(self._copy):
                    nbytes = tensor_nbytes(shape, dtype)
                    if nbytes > sent.bucket_bytes:
                        built.slot, self._slot = self._slot, self._slot ^ 1
                        if self._freed[built.slot] is not None:
                            self._copy.wait_event(self._freed[built.slot])
                        out = self._stage(built.slot, nbytes, device).view(dtype).view(shape)
                    else:
                        out, built.own = torch.empty(shape, dtype=dtype, device=device), True
                    built.tensor = build_parameter(out, source, parts)
                    built.ready = recorded_event(self._copy) if self._copy is not None else None
        # The receipt's side of this parameter: the trainer tensors it is built of, not what was built (a build error
        # must fail the receipt), fingerprinted when the receipt is read, so the sync itself queues none of it.
        add_parameter_pieces(sent, source, parts, later=True)
        return built

    def close(self) -> None:
        """Give the staging buffers back (once the streams are done with them)."""
        if self._copy is not None:
            self._copy.synchronize()
            self._comm.synchronize()
        self._staging, self.staged_bytes = [], 0

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
