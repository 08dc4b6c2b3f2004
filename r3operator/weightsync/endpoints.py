"""The weight sync's verbs on one engine, each one typed message (`wire/sync_messages.py`) through the engine
handle's one transport call (`Engine.send`, rollout/base.py).

`NativeEndpoint` is what the native senders talk to (vLLM's sender protocol and our kernel-layout senders,
weightsync/transfer.py); `EngineEndpoint` implements it, and the packed path's and the supervisor's verbs, once for
every kind of engine handle: a Ray actor, `vllm serve` over HTTP, or a stand-in in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from r3operator.rollout.base import Engine
from r3operator.wire.receipt import Fingerprint
from r3operator.wire.sync_messages import (
    AbortNative,
    AbortPacked,
    BeginNative,
    BeginPacked,
    DeviceUUIDs,
    DirectSync,
    DirectUpdate,
    FinishNative,
    FinishPacked,
    InitTransfer,
    LoadPacked,
    MappedAttach,
    MappedSync,
    PackedCounts,
    ParameterFingerprints,
    ParameterMetadata,
    PolicyTag,
    Receipts,
    StagedAttach,
    StagedSync,
    UpdateWeights,
    WeightsDigest,
    WorldSize,
)
from r3operator.wire.weights import PackedChunk


@dataclass(frozen=True)
class SyncCounts:
    """What one sync sent to every engine: tensors and bytes (and, on the packed path, chunks)."""

    tensors: int
    bytes: int
    chunks: int = 0


class NativeEndpoint(Protocol):
    """One engine's native weight-transfer control plane (weightsync/transfer.py, weightsync/sync.py)."""

    @property
    def name(self) -> str: ...

    def native_world_size(self) -> int: ...

    def native_init(self, init_info: dict[str, Any]) -> None: ...

    def native_start(self, bracket: BeginNative) -> None:
        """Open `bracket` (in the kernel layout: vLLM 0.22's is_checkpoint_format=False, or our own on >= 0.30)."""
        ...

    def native_parameters(self) -> dict[str, Any]:
        """The engine model's parameters and whether it refuses the kernel layout (`r3_parameter_metadata`)."""
        ...

    def native_parameter_fingerprints(self) -> list[dict[str, Fingerprint]]:
        """Every worker's fingerprint of every parameter it holds now (`r3_parameter_fingerprints`): the kernel
        layout's reference check compares them with what it would send (weightsync/transfer.py)."""
        ...

    def native_update(self, update_info: dict[str, Any]) -> None: ...

    def native_finish(self, policy_tag: str | None) -> None: ...

    def native_abort(self) -> None: ...

    def native_direct_sync(self, update: DirectUpdate, policy_tag: str | None) -> None:
        """One kernel-format NCCL sync (weightsync/direct.py) in one call: bracket, receive, commit flag, tag; the next
        requests are salted with the new policy (rollout/client.py `salted`)."""
        ...

    def native_staged_attach(self, share: dict[str, Any]) -> None:
        """Map the trainer's staging buffer (weightsync/staged.py) on every worker, checked against its parameters."""
        ...

    def native_staged_sync(self, policy_tag: str | None) -> None:
        """One kernel-format sync from the mapped staging buffer (bracket, copies, receipt, tag in one call); the next
        requests are salted with the new policy."""
        ...

    def native_mapped_attach(self, share: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker shares its parameters' memory with the trainer (weightsync/mapped.py); one answer per worker."""
        ...

    def native_mapped_sync(self, number: int, policy_tag: str | None, timeout_s: float) -> None:
        """Mapped sync `number` in one call, which returns once the trainer has written the parameters (bracket, wait,
        tag); the next requests are salted with the new policy."""
        ...

    def policy_tag(self) -> str | None: ...


class EngineEndpoint:
    """The sync's verbs on `engine`: one message each through `engine.send`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def name(self) -> str:
        return self.engine.name

    # -- the packed path ----------
    def begin_weight_update(self) -> None:
        self.engine.send(BeginPacked())

    def load_packed(self, chunk: PackedChunk) -> None:
        self.engine.send(LoadPacked(chunk))

    def finish_weight_update(self, policy_tag: str | None = None) -> PackedCounts:
        return self.engine.send(FinishPacked(policy_tag))

    def abort_weight_update(self) -> None:
        self.engine.send(AbortPacked())

    # -- vLLM's native transfer ----------
    def native_world_size(self) -> int:
        return self.engine.send(WorldSize())

    def native_init(self, init_info: dict[str, Any]) -> None:
        self.engine.send(InitTransfer(init_info))

    def native_start(self, bracket: BeginNative) -> None:
        self.engine.send(bracket)

    def native_parameters(self) -> dict[str, Any]:
        return self.engine.send(ParameterMetadata())

    def native_parameter_fingerprints(self) -> list[dict[str, Fingerprint]]:
        return self.engine.send(ParameterFingerprints())

    def native_update(self, update_info: dict[str, Any]) -> None:
        self.engine.send(UpdateWeights(update_info))

    def native_finish(self, policy_tag: str | None) -> None:
        self.engine.send(FinishNative(policy_tag))

    def native_abort(self) -> None:
        self.engine.send(AbortNative())

    def native_direct_sync(self, update: DirectUpdate, policy_tag: str | None) -> None:
        self.engine.send(DirectSync(update, policy_tag))

    def native_staged_attach(self, share: dict[str, Any]) -> None:
        self.engine.send(StagedAttach(share))

    def native_staged_sync(self, policy_tag: str | None) -> None:
        self.engine.send(StagedSync(policy_tag))

    def native_mapped_attach(self, share: dict[str, Any]) -> list[dict[str, Any]]:
        return self.engine.send(MappedAttach(share))

    def native_mapped_sync(self, number: int, policy_tag: str | None, timeout_s: float) -> None:
        self.engine.send(MappedSync(number, policy_tag, timeout_s))

    # -- queries ----------
    def policy_tag(self) -> str | None:
        return self.engine.send(PolicyTag())

    def sync_receipts(self) -> list[dict[str, Any]]:
        """Each worker's receipt of the last finished sync (wire/receipt.py)."""
        return self.engine.send(Receipts())

    def device_uuids(self) -> list[str | None]:
        return self.engine.send(DeviceUUIDs())

    def weights_digest(self) -> str:
        return self.engine.send(WeightsDigest())


def endpoints(engines: Sequence[Engine]) -> list[EngineEndpoint]:
    """Each engine's verbs."""
    return [EngineEndpoint(engine) for engine in engines]
