"""vLLM's native transfer sent from the trainer rank that holds the weights, for a trainer over many ranks.

A one-process trainer hands its live tensors to `NativeInstall` in the driver. A trainer over ranks
(`trainer/distributed.py`) holds them sharded in its rank actors: reading them into the driver copies the
whole model to host memory and through Ray's object store at every sync (a3b on three FSDP ranks, H200s,
2026-11-27: 50 s a sync, 0.7 s with one rank). So the sync runs in the ranks (`RankNativeInstall`):

- every rank reads each tensor of the trainer's sync state dict in the same order (FSDP: `full_tensor`, a
  collective), cast to the engine's dtype; rank 0 keeps them on its GPU, the others let them go;
- rank 0 sends them with the same `NativeInstall` the driver would use (rendezvous, one bracket per engine,
  the receipt's fingerprints), kept in its process across syncs, where its NCCL group lives;
- the driver gets back the counts, the sent fingerprints (the canary compares them with the engines'
  receipts) and the phases, and adds them to its own records.

Every rank has finished its collectives before rank 0 sends anything, so a send that fails leaves no rank
waiting in one: the supervisor's retry finds them all free. The price is one copy of the weights in the
engine's dtype on rank 0's GPU while it sends (5 GB for a3b in bf16); when that would take more than
`COPY_HEADROOM` of its free GPU memory, the copy is kept in host memory instead and each tensor goes back to
the GPU as it is sent (slower; no out-of-memory error mid-step). Streaming them (each rank gathering in the
sender's order, bucket by bucket) would need neither.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from r3operator.api.weight_transfer import TransferMethod
from r3operator.rollout.base import Engine
from r3operator.rollout.engines import EngineGroup
from r3operator.weightsync.endpoints import SyncCounts
from r3operator.weightsync.sync import NativeInstall, master_address_for
from r3operator.wire.receipt import Fingerprint, FingerprintLog
from r3operator.wire.sync_messages import BeginNative
from r3operator.wire.sync_phases import SyncPhases
from r3operator.wire.weights import full_tensor

if TYPE_CHECKING:  # pragma: no cover
    import torch


class RankRunner(Protocol):
    """A trainer over ranks (`DistributedTrainer`): runs `fn(trainer, rank, *args)` on every rank."""

    world_size: int

    def on_every_rank(self, fn: Callable[..., Any], *args: Any) -> list[Any]: ...


class RankTrainer(Protocol):
    """One rank's trainer as a sync takes it: the tensors the engines get (trainer/base.py `Trainer` has it)."""

    def sync_state_dict(self) -> dict[str, Any]: ...


class NativeSyncLike(Protocol):
    """What rank 0 sends with: `NativeInstall` (made with its own receipt log), or a stand-in of the same
    shape in tests."""

    sent: FingerprintLog
    phases: SyncPhases
    bracket: BeginNative

    def __call__(self, engines: Sequence[Engine], tag: str) -> SyncCounts: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RankSyncRequest:
    """One sync, as every rank is handed it (pickled by Ray)."""

    install: str  # which `RankNativeInstall`: its sender in rank 0's process
    method: TransferMethod
    engines: tuple[Engine, ...]
    tag: str
    dtype: str | None  # the engine's, as torch names it ("bfloat16"); None: the trainer's own
    buffer_size_bytes: int
    bracket: BeginNative  # what every engine's bracket opens with (the session's layout)
    synchronize: bool = False  # the driver's phases wait for the device (profiling)
    make: Callable[..., NativeSyncLike] = NativeInstall


@dataclass(frozen=True)
class RankSyncResult:
    """What rank 0 sent, for the driver's records."""

    tensors: int
    bytes: int
    fingerprints: dict[str, Fingerprint]
    phase_seconds: dict[str, float]


def engines_key(engines: Sequence[Engine]) -> tuple[tuple[str, str], ...]:
    """The engines a rendezvous was made with, by what survives pickling: name and address."""
    return tuple((str(getattr(e, "name", "")), str(getattr(e, "base_url", "") or "")) for e in engines)


@dataclass
class _RankSender:
    """rank 0's sender of one install, kept across syncs in its process."""

    engines_key: tuple[tuple[str, str], ...]
    engines: list[Engine]
    sync: NativeSyncLike = field(init=False)  # made with this sender's `state_dict`
    weights: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return self.weights


_SENDERS: dict[str, _RankSender] = {}  # by install, in rank 0's process


def _sender_for(request: RankSyncRequest, dtype: torch.dtype | None) -> _RankSender:
    """The sender `request.install` made before, when it was for the same engines; else a new one (the old
    one's group closed). The engines kept from its first sync are the ones it sends to: the same objects, so
    `NativeInstall` keeps its rendezvous (it compares them by identity). An install's bracket is fixed when it is
    made, so a sender kept opens the request's."""
    key = engines_key(request.engines)
    sender = _SENDERS.get(request.install)
    if sender is not None and sender.engines_key == key:
        sender.sync.phases.synchronize = request.synchronize
        return sender
    if sender is not None:
        sender.sync.close()
    sender = _RankSender(key, list(request.engines))
    sender.sync = request.make(
        request.method,
        state_dict=sender.state_dict,
        dtype=dtype,
        buffer_size_bytes=request.buffer_size_bytes,
        # Where the engines reach this rank's NCCL store: its own address, not the driver's (another pod).
        master_address=master_address_for(EngineGroup(sender.engines)),
        phases=SyncPhases(synchronize=request.synchronize),
        bracket=request.bracket,
    )
    _SENDERS[request.install] = sender
    return sender


COPY_HEADROOM = 0.8
"""The share of rank 0's free GPU memory the copy of the weights may take; beyond it the copy goes to host memory."""


def copy_device(need_bytes: int, free_bytes: int | None) -> str | None:
    """Where rank 0 keeps the gathered weights: where they were gathered (None: its GPU, or the CPU of a CPU
    run) when they fit `COPY_HEADROOM` of its free GPU memory, else "cpu" (the sender moves each tensor back to
    the GPU as it sends it: slower, and no out-of-memory error in the middle of a step)."""
    if free_bytes is None or need_bytes <= COPY_HEADROOM * free_bytes:
        return None
    return "cpu"


def nbytes(state_dict: Mapping[str, Any], dtype: torch.dtype | None) -> int:
    """The bytes of every tensor of `state_dict` whole (an FSDP2 DTensor's shape is the global one) in `dtype`."""
    return sum(t.numel() * (dtype.itemsize if dtype is not None else t.element_size()) for t in state_dict.values())


def gather_weights(
    state_dict: Mapping[str, Any], *, dtype: torch.dtype | None, keep: bool, device: str | None = None
) -> dict[str, Any]:
    """Every tensor of `state_dict` whole, in its order (each an FSDP collective: every rank must call this),
    cast to `dtype` where it was gathered (the rank's GPU) and moved to `device` (None: left there); kept when
    `keep`, else let go at once (an empty dict). The sender moves a tensor on the host (a Megatron state dict,
    or a copy that did not fit the GPU) to its GPU as it sends it."""
    kept: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        whole = full_tensor(tensor, dtype=dtype if keep else None, device=device if keep else None)
        if keep:
            kept[name] = whole
    return kept


def _free_gpu_bytes() -> int | None:
    import torch

    return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None


def send_on_rank(trainer: RankTrainer, rank: int, request: RankSyncRequest) -> RankSyncResult | None:
    """A sync as one rank takes part in it (`DistributedTrainer.on_every_rank`): rank 0's result, None elsewhere."""
    import torch

    dtype = None if request.dtype is None else getattr(torch, request.dtype)
    gathered = SyncPhases(synchronize=request.synchronize)
    with gathered("gather"):
        state = trainer.sync_state_dict()
        device = copy_device(nbytes(state, dtype), _free_gpu_bytes()) if rank == 0 else None
        weights = gather_weights(state, dtype=dtype, keep=rank == 0, device=device)
        del state
    if rank != 0:
        return None
    sender = _sender_for(request, dtype)
    sender.sync.phases.reset()
    sender.weights = weights
    del weights
    try:
        counts = sender.sync(sender.engines, request.tag)
    finally:
        sender.weights = {}  # the copy goes back to the allocator before the next step's update
    with sender.sync.phases("fingerprint"):  # a kernel-layout sync leaves its fingerprints to the read: here
        fingerprints = sender.sync.sent.result()
    seconds = dict(sender.sync.phases.seconds)
    seconds["gather"] = seconds.get("gather", 0.0) + gathered.seconds["gather"]
    return RankSyncResult(counts.tensors, counts.bytes, fingerprints, seconds)


def close_on_rank(_trainer: RankTrainer, rank: int, install: str) -> None:
    """Close `install`'s sender (its NCCL group) where it lives."""
    sender = _SENDERS.pop(install, None) if rank == 0 else None
    if sender is not None:
        sender.sync.close()


class RankNativeInstall:
    """`NativeInstall`'s part in the supervisor (`EngineSupervisor.install`), for a trainer over ranks: the
    sync runs in the ranks, sent from rank 0 (see the module doc). Brackets, aborts on failure, the
    rendezvous kept across syncs and made again when the engines change: all as `NativeInstall` does them,
    there."""

    closes_open_brackets = True

    def __init__(
        self,
        method: TransferMethod,
        *,
        ranks: RankRunner,
        dtype: torch.dtype | None,
        buffer_size_bytes: int,
        sent: FingerprintLog,
        phases: SyncPhases,
        bracket: BeginNative = BeginNative(),
        make: Callable[..., NativeSyncLike] = NativeInstall,
    ) -> None:
        self.method, self.ranks, self.bracket = method, ranks, bracket
        self.dtype_name = None if dtype is None else str(dtype).removeprefix("torch.")
        self.buffer_size_bytes, self.sent, self.phases, self.make = buffer_size_bytes, sent, phases, make
        self.install = uuid.uuid4().hex

    def __call__(self, engines: Sequence[Engine], tag: str) -> SyncCounts:
        request = RankSyncRequest(
            install=self.install,
            method=self.method,
            engines=tuple(engines),
            tag=tag,
            dtype=self.dtype_name,
            buffer_size_bytes=self.buffer_size_bytes,
            bracket=self.bracket,
            synchronize=self.phases.synchronize,
            make=self.make,
        )
        result: RankSyncResult = self.ranks.on_every_rank(send_on_rank, request)[0]
        self.sent.clear()
        self.sent.merge(result.fingerprints)
        self.phases.merge(result.phase_seconds)
        return SyncCounts(tensors=result.tensors, bytes=result.bytes)

    def describe(self) -> str:
        """Where the sync is sent from, for the report and status.progress.weightSync."""
        return f"sent from trainer rank 0 of {self.ranks.world_size}"

    def close(self) -> None:
        self.ranks.on_every_rank(close_on_rank, self.install)
