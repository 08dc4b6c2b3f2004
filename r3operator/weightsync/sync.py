"""Which weight-sync transport this run uses, checked against what the engines and the trainer really offer.

The wanted method comes from the topology (`api/weight_transfer.py`): the operator's runtime config names it
for engines reached over HTTP (`runtime.weightTransfer.method`, rendered with the engines'
`--weight-transfer-config`); engines this driver starts itself share its GPU (IPC) or run on CPU (packed).
Then every precondition of the native path is checked here, and a missing one falls back to the packed
path with the reason (logged as a warning, pushed to `status.progress.weightSync`, written to the report):

- the trainer on a CUDA device (vLLM's senders share or broadcast CUDA tensors);
- vLLM importable in the trainer process (the sender is vLLM's code) with a sender API we drive;
- the engine's vLLM having the backend and the start/finish bracket (the feature matrix);
- for engines over HTTP, the engine's vLLM release equal to the trainer's (the update-info wire format
  changed between releases; both sides must encode and decode it alike).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from r3operator.api.versions import reported_version
from r3operator.api.weight_transfer import (
    Topology,
    TransferChoice,
    TransferMethod,
    choose_transfer,
)
from r3operator.rollout.base import Engine
from r3operator.rollout.engines import EngineGroup
from r3operator.weightsync.endpoints import EngineEndpoint, SyncCounts, endpoints
from r3operator.weightsync.transfer import FanOutClient, NativeSender, local_address_towards, trainer_vllm_api
from r3operator.wire.kernel_layout import Source
from r3operator.wire.receipt import FingerprintLog
from r3operator.wire.sync_messages import BeginNative
from r3operator.wire.sync_phases import SyncPhases

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("r3operator.runtime")


def local_topology(device: str) -> Topology:
    """Engines this driver starts run in Ray actors on its own device."""
    return Topology.SHARED_GPU if device.startswith("cuda") else Topology.CPU


def local_engine_backend(device: str) -> str | None:
    """The `weight_transfer_config` backend for an engine this driver starts (same vLLM as the driver's):
    "ipc" on a GPU whose vLLM has it, else None (the packed path needs no native engine)."""
    choice = choose_transfer(local_topology(device), reported_version(trainer_vllm_version()))
    return choice.method.value if choice.native and trainer_vllm_api() is not None else None


def _release(version: Version) -> tuple[int, int, int]:
    return version.major, version.minor, version.micro


def check_runtime(
    wanted: TransferChoice,
    *,
    device: str,
    engine_vllm: str | None,
    trainer_vllm: str | None,
    trainer_api: str | None,
    over_http: bool,
    engine_on_trainer_gpu: bool = False,
) -> TransferChoice:
    """`wanted` if every precondition of its native method holds here, else the packed fallback saying which
    one failed. A packed `wanted` is returned as it is."""
    if not wanted.native:
        return wanted

    def fallback(reason: str) -> TransferChoice:
        return TransferChoice(TransferMethod.PACKED, reason, fallback=True)

    method = wanted.method.value
    if not device.startswith("cuda"):
        return fallback(f"native {method} transfer needs the trainer on CUDA, it runs on {device}")
    if trainer_api is None:
        return fallback(
            f"native {method} transfer sends with vLLM's trainer-side code, and the trainer's "
            "environment has no vLLM weight-transfer sender (install the engine's vLLM release "
            "there)"
        )
    if wanted.method is TransferMethod.NCCL and engine_on_trainer_gpu:
        return fallback(
            "an engine runs on the trainer's GPU: NCCL cannot join two ranks on one GPU, and the "
            "engine was started for nccl, not ipc"
        )
    engine = reported_version(engine_vllm)
    topology = Topology.SEPARATE_GPUS if wanted.method is TransferMethod.NCCL else Topology.SHARED_GPU
    by_engine = choose_transfer(topology, engine)
    if not by_engine.native:
        return fallback(f"the engine answers as vLLM {engine_vllm or 'unknown'}: {by_engine.reason}")
    trainer = reported_version(trainer_vllm)
    if over_http and (
        trainer.version is None or engine.version is None or _release(trainer.version) != _release(engine.version)
    ):
        return fallback(
            f"native {method} transfer needs the trainer's vLLM release to be the engine's "
            f"(trainer {trainer_vllm}, engine {engine_vllm}): the update-info format changed between "
            "releases"
        )
    return TransferChoice(wanted.method, f"vLLM {engine_vllm} native {method} weight transfer")


def trainer_vllm_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "")) or None


class NativeInstall:
    """`EngineSupervisor.install` over vLLM's native transfer: ONE bracket per engine per sync (vLLM's
    start/finish), aborted unfinalised on any failure (`r3_abort_native_weight_update`), the policy tag
    stamped only by a finished sync, so the canary and the supervisor see an aborted engine as stale.

    The rendezvous is made again when the set of engines changes, after a failed attempt, and when an
    engine no longer reports the last policy this sender installed (it restarted and lost its group).

    Brackets left open are closed (`native_abort`, a round trip or two per engine) only where one can be
    open: before a rendezvous. When every engine reports the tag this sender stamped last, no bracket was
    opened since (opening one clears the tag), so the abort is skipped; R3OPERATOR_SYNC_PRE_ABORT=always
    restores it before every sync. The supervisor leaves the pre-sync abort to this install
    (`closes_open_brackets`).
    """

    closes_open_brackets = True

    def __init__(
        self,
        method: TransferMethod,
        *,
        state_dict: Callable[[], Mapping[str, Any]],
        dtype: torch.dtype | None,
        buffer_size_bytes: int,
        master_address: str = "127.0.0.1",
        sent: FingerprintLog | None = None,
        phases: SyncPhases | None = None,
        bracket: BeginNative = BeginNative(),
        kernel_fallback: bool = False,
    ) -> None:
        self.method, self.bracket = method, bracket  # what every engine's bracket opens with (the session's layout)
        self.kernel_fallback = kernel_fallback  # `auto`: a kernel plan the engines refuse takes the checkpoint layout
        self.sent = sent if sent is not None else FingerprintLog()
        self.phases = phases if phases is not None else SyncPhases()
        self.state_dict, self.dtype, self.buffer_size_bytes = state_dict, dtype, buffer_size_bytes
        self.master_address = master_address
        self._sender: NativeSender | None = None
        self._engines: tuple[int, ...] = ()
        self._last_tag: str | None = None
        # Why `weightSync.layout: kernel` is not used: its reference check against vLLM's own load_weights failed
        # (weightsync/transfer.py `_reference_sync`). Kept across rendezvous: later senders sync in the checkpoint
        # layout from their first sync, and the report and status say so.
        self.kernel_refused: str | None = None
        # The kernel plan that check confirmed, kept across rendezvous (a restarted engine runs the same vLLM and
        # model: the same plan needs no second reference; another plan gets one).
        self.checked_plan: list[Source] | None = None
        self.reference_seconds: float | None = None  # the last reference sync's seconds, its check included

    def _needs_rendezvous(self, engines: Sequence[Engine], verbs: Sequence[EngineEndpoint]) -> bool:
        if self._sender is None or self._engines != tuple(id(e) for e in engines):
            return True
        return any(endpoint.policy_tag() != self._last_tag for endpoint in verbs)

    def __call__(self, engines: Sequence[Engine], tag: str) -> SyncCounts:
        from r3operator.settings import runtime_settings

        verbs = endpoints(engines)
        rendezvous = self._needs_rendezvous(engines, verbs)
        if rendezvous or runtime_settings().sync_pre_abort == "always":
            for endpoint in verbs:  # a native bracket left open by a driver that died mid-sync
                endpoint.native_abort()
        if rendezvous:
            self.close()
            bracket = BeginNative() if self.kernel_refused else self.bracket  # refused: the checkpoint layout
            client = FanOutClient(verbs, phases=self.phases, bracket=bracket)
            self._sender = NativeSender(
                self.method,
                client,
                self.state_dict,
                dtype=self.dtype,
                buffer_size_bytes=self.buffer_size_bytes,
                master_address=self.master_address,
                sent=self.sent,
                kernel_fallback=self.kernel_fallback,
            )
            self._sender.checked_plan = self.checked_plan
            self._engines = tuple(id(e) for e in engines)
        sender = self._sender
        assert sender is not None  # set just above
        try:
            stats = sender.send(tag)
        except BaseException:
            sender.client.abort()
            self.close()  # the next attempt makes the rendezvous again
            raise
        finally:
            self.kernel_refused = self.kernel_refused or sender.kernel_refused
            self.checked_plan = sender.checked_plan
            self.reference_seconds = sender.reference_seconds or self.reference_seconds
        self._last_tag = tag
        return SyncCounts(tensors=stats.tensors, bytes=stats.bytes)

    @property
    def ipc_path(self) -> dict[str, str | None]:
        """How the last IPC sync went ("mapped", "staged", "packed"; None otherwise), and why not a faster way."""
        sender = self._sender
        if sender is None:
            return {"path": None, "mapping_refused": None, "staging_refused": None}
        return {
            "path": sender.ipc_path,
            "mapping_refused": sender.mapping_refused,
            "staging_refused": sender.staging_refused,
        }

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._sender = None


def describe_ipc_path(path: Mapping[str, str | None]) -> str | None:
    """What the report says of how the last IPC sync went (`NativeInstall.ipc_path`), with the reason a faster way
    was not taken; None when no sync went over IPC."""
    how, unmapped, unstaged = path.get("path"), path.get("mapping_refused"), path.get("staging_refused")
    if how == "mapped":
        return "kernel layout over IPC: the trainer writes the engine's parameters in place"
    if how == "staged":
        return (
            f"kernel layout over IPC through a staging buffer (the engine's parameters could not be mapped: {unmapped})"
        )
    if how == "packed":
        why = [reason for reason in (unmapped, unstaged) if reason]
        return "over IPC through vLLM's packed buffers" + (f" ({'; '.join(why)})" if why else "")
    return None


def reached_by_url(engines: EngineGroup) -> bool:
    """Some engine is a separate `vllm serve` process reached over HTTP (`HTTPEngine.base_url`), with a vLLM
    of its own; an engine in a Ray actor of this driver shares the driver's environment."""
    return any(getattr(engine, "base_url", None) for engine in engines.engines)


def engine_on_gpu_of(device: str, engines: EngineGroup) -> bool:
    """Some engine worker runs on the trainer's physical GPU (compared by UUID, whatever the device masks)."""
    import torch

    index = torch.device(device).index
    mine = str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)
    return any(mine in endpoint.device_uuids() for endpoint in endpoints(engines.engines))


def master_address_for(engines: EngineGroup) -> str:
    """Where the engines reach the trainer's NCCL store: our address on the route to the first engine."""
    from urllib.parse import urlparse

    for engine in engines.engines:
        if host := urlparse(getattr(engine, "base_url", None) or "").hostname:
            return local_address_towards(host)
    return "127.0.0.1"


def resolve(
    *,
    device: str,
    engines: EngineGroup,
    configured: TransferChoice | None,
    engine_vllm: str | None,
) -> TransferChoice:
    """The method this run uses (see the module doc); logs a fallback as a warning."""
    over_http = reached_by_url(engines)
    if configured is not None:
        wanted = configured
    elif over_http:  # engines named by URL without the operator's choice: assume the cluster shape
        wanted = choose_transfer(
            Topology.SEPARATE_GPUS if device.startswith("cuda") else Topology.CPU, reported_version(engine_vllm)
        )
    else:
        wanted = choose_transfer(local_topology(device), reported_version(engine_vllm))
    if not over_http and wanted.method is TransferMethod.IPC:
        started = {getattr(e, "weight_transfer_backend", None) for e in engines.engines}
        if started != {"ipc"}:
            wanted = TransferChoice(
                TransferMethod.PACKED, "the engines were started without the ipc backend", fallback=True
            )
    shared = wanted.method is TransferMethod.NCCL and device.startswith("cuda") and engine_on_gpu_of(device, engines)
    choice = check_runtime(
        wanted,
        device=device,
        engine_vllm=engine_vllm,
        trainer_vllm=trainer_vllm_version(),
        trainer_api=trainer_vllm_api(),
        over_http=over_http,
        engine_on_trainer_gpu=shared,
    )
    if choice.fallback:
        log.warning("weight sync: %s", choice.describe())
    else:
        log.info("weight sync: %s", choice.describe())
    return choice
