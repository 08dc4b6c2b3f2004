"""The driver's weight sync and canary as one session: steps 7 and 8 of a GRPO step (runtime/loop.py).

Made once at set-up, from the transfer method this run uses (weightsync/sync.py `resolve`) and the job's
`spec.weightSync`. It resolves the layout (`auto` → kernel or checkpoint, saying why), chooses how a sync is sent
(vLLM's native transfer from this process or from trainer rank 0, else the packed chunks), and keeps the supervisor
that holds every engine on the current policy (weightsync/faults.py). Then, per step:

- `sync(version)`: the trainer's weights to every engine as policy `version`, chunked or native, inside one bracket
  per engine; a failed attempt is aborted unfinalised and repeated in full;
- `canary()`: each engine worker's receipt of that sync against what the trainer sent (exact), then the engines'
  greedy decode against the trainer's argmax at every position (weightsync/canary.py); `CanaryMismatchError` else.

The session reads the trainer through `SyncedTrainer` (what a sync and its canary take of it): the driver hands the
trainer in, and this package never imports the trainer's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from r3operator.api.enums import WeightSyncLayout
from r3operator.api.v1alpha1 import RLJobSpec
from r3operator.api.versions import reported_version
from r3operator.api.weight_transfer import LayoutChoice, TransferChoice, TransferMethod, resolve_layout
from r3operator.rollout.base import Engine, Greedy
from r3operator.rollout.engines import EngineGroup
from r3operator.weightsync.canary import (
    CanaryMismatchError,
    CanaryModel,
    CanaryTolerance,
    canary_forwards,
    check_engine_greedy,
    check_receipts,
    check_routing_agreement,
)
from r3operator.weightsync.endpoints import SyncCounts, endpoints
from r3operator.weightsync.faults import EngineSupervisor
from r3operator.weightsync.rank_sync import RankNativeInstall, RankRunner
from r3operator.weightsync.sync import NativeInstall, describe_ipc_path, master_address_for
from r3operator.wire.receipt import FingerprintLog
from r3operator.wire.sync_messages import BeginNative, BracketLayout
from r3operator.wire.sync_phases import SyncPhases
from r3operator.wire.weights import PackedChunk

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("r3operator.runtime")


class SyncedTrainer(CanaryModel, Protocol):
    """What a sync and its canary take of the trainer (trainer/base.py `Trainer` has it)."""

    def weight_chunks(self, *, chunk_size_mb: int, dtype: torch.dtype | None) -> Iterator[PackedChunk]: ...

    def sync_state_dict(self) -> dict[str, Any]: ...


class SyncMetrics(Protocol):
    """The driver's Prometheus series the session sets (runtime/metrics.py `RuntimeMetrics`)."""

    def set(self, name: str, value: float, **labels: str) -> None: ...

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None: ...


@dataclass
class CanaryPlan:
    """What the canary decodes after every sync (`spec.weightSync.canary`: on or off), and its tolerance."""

    enabled: bool
    prompts: list[tuple[int, ...]]
    tokens: int
    tolerance: CanaryTolerance


@dataclass(frozen=True)
class SyncResult:
    """One finished sync: the policy version every engine now serves, what went out, and where the time went."""

    policy_version: int
    counts: SyncCounts
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CanaryResult:
    """One canary: whether it ran (`weightSync.canary` off: no), and the near-tie positions it accepted."""

    ran: bool
    near_ties: int = 0


def bracket_for(chosen: LayoutChoice) -> BeginNative:
    """The bracket every engine opens for a sync in `chosen` (`auto` resolved already, api/weight_transfer.py): the
    layout travels in this message from here to the worker's branch (engine/worker.py), read by the sender alone."""
    return BeginNative(BracketLayout.KERNEL if chosen.layout is WeightSyncLayout.KERNEL else BracketLayout.CHECKPOINT)


def layout_now(chosen: LayoutChoice, kernel_refused: str | None) -> LayoutChoice:
    """The layout the syncs go in now: `chosen`, or its fallback in the same words once the kernel layout was refused at
    run time (`NativeInstall.kernel_refused`: its reference check against vLLM's own load_weights failed)."""
    return chosen.refused(kernel_refused) if kernel_refused else chosen


def kernel_refused_gauge(chosen: LayoutChoice, kernel_refused: str | None) -> float | None:
    """`r3operator_weight_sync_kernel_refused`: 1 once vLLM's loader refused the kernel plan, 0 while the kernel layout
    holds, None where the run chose the checkpoint layout (no series)."""
    if chosen.layout is not WeightSyncLayout.KERNEL:
        return None
    return 1.0 if kernel_refused else 0.0


class WeightSyncSession:
    """The sync and the canary of one run (see the module doc)."""

    def __init__(
        self,
        spec: RLJobSpec,
        *,
        engines: EngineGroup,
        trainer: SyncedTrainer,
        transfer: TransferChoice,
        engine_vllm: str,
        engine_dtype: str,
        canary: CanaryPlan,
        metrics: SyncMetrics,
        ranks: RankRunner | None = None,
    ) -> None:
        self.spec, self.engines, self.trainer, self.transfer = spec, engines, trainer, transfer
        self.engine_dtype, self.plan, self.metrics = engine_dtype, canary, metrics
        self.layout = resolve_layout(spec, transfer, reported_version(engine_vllm))
        self.sent = FingerprintLog()  # what the last sync attempt sent, for the canary's receipt check
        self.phases = SyncPhases()  # where the last sync spent its time (wire/sync_phases.py)
        self.near_ties = 0  # the last canary's accepted near-tie positions
        self.policy_version = 0  # the policy the engines were last synced to
        self.install = self._native_install(ranks)
        # What the report and status.progress.weightSync say: the method, the layout, why, and where it is sent from.
        self.described = f"{transfer.describe()}; {self.layout.describe()}" + (
            f"; {self.install.describe()}" if isinstance(self.install, RankNativeInstall) else ""
        )
        self.supervisor = EngineSupervisor(
            engines,
            chunks=self._weight_chunks,
            canary=self.canary_engines,
            on_fault=lambda kind: metrics.inc("r3operator_engine_faults_total", kind=kind),
            install=self.install,
            phases=self.phases,
        )

    # -- 7. the sync -----------------------------------------------------------------------------------------------
    def sync(self, version: int) -> SyncResult:
        """The trainer's weights to every engine as policy `version`, one bracket each; a failed attempt is aborted
        without finalising and repeated in full (weightsync/faults.py)."""
        begin = time.perf_counter()
        self.phases.reset()
        counts = self.supervisor.sync(version)
        self.policy_version = version
        if isinstance(self.install, NativeInstall):
            layout = layout_now(self.layout, self.install.kernel_refused)
            ipc = describe_ipc_path(self.install.ipc_path)
            self.described = "; ".join(part for part in (self.transfer.describe(), layout.describe(), ipc) if part)
            refused = kernel_refused_gauge(self.layout, self.install.kernel_refused)
            if refused is not None:
                self.metrics.set("r3operator_weight_sync_kernel_refused", refused)
        seconds = time.perf_counter() - begin
        self.metrics.set("r3operator_weight_sync_seconds", seconds)
        for phase, spent in self.phases.seconds.items():
            self.metrics.set("r3operator_weight_sync_phase_seconds", spent, phase=phase)
        return SyncResult(version, counts, seconds, dict(self.phases.seconds))

    def skip(self) -> None:
        """A step whose update was not applied: no sync, so no phases and no canary of it."""
        self.phases.reset()
        self.near_ties = 0

    def close(self) -> None:
        """Let go of the transfer at the end of a run: over IPC the trainer's mappings of the engines' parameters
        (an engine that exits while the trainer still maps its memory leaves PyTorch warning that shared CUDA
        tensors were not released), over NCCL the group. Engines that serve another run make a new rendezvous."""
        if self.install is not None:
            self.install.close()

    def _weight_chunks(self) -> Iterator[PackedChunk]:
        """The trainer's current weights as packed chunks, in the engine's dtype (the engine would cast anyway; a
        bf16 engine gets half the bytes)."""
        import torch

        mb = self.spec.weight_sync.chunk_size_mb
        wire_dtype = getattr(torch, self.engine_dtype, None)
        return self.record_sent(self.trainer.weight_chunks(chunk_size_mb=mb, dtype=wire_dtype))

    def record_sent(self, chunks: Iterator[PackedChunk]) -> Iterator[PackedChunk]:
        """Pass the chunks on, keeping each one's fingerprints (computed where it was packed)."""
        self.sent.clear()
        for chunk in chunks:
            self.sent.merge(chunk.fingerprints)
            yield chunk

    def _native_install(self, ranks: RankRunner | None) -> NativeInstall | RankNativeInstall | None:
        """vLLM's native transfer when the transfer chose it; None: the packed chunks. The kernel layout exists only
        on the native path: on the packed one it is refused, naming the field (`resolve_layout`). A trainer over
        ranks (`ranks`) sends over NCCL from its rank 0 (weightsync/rank_sync.py), not through this process."""
        if not self.transfer.native:
            return None
        import torch

        dtype = getattr(torch, self.engine_dtype, None)
        buffer_size_bytes = self.spec.weight_sync.chunk_size_mb * 1024 * 1024
        bracket = bracket_for(self.layout)
        if ranks is not None and self.transfer.method is TransferMethod.NCCL:
            return RankNativeInstall(
                TransferMethod.NCCL,
                ranks=ranks,
                dtype=dtype,
                buffer_size_bytes=buffer_size_bytes,
                sent=self.sent,
                phases=self.phases,
                bracket=bracket,
            )
        return NativeInstall(
            self.transfer.method,
            state_dict=self.trainer.sync_state_dict,
            dtype=dtype,
            buffer_size_bytes=buffer_size_bytes,
            master_address=master_address_for(self.engines),
            sent=self.sent,
            phases=self.phases,
            bracket=bracket,
            kernel_fallback=self.spec.weight_sync.layout is WeightSyncLayout.AUTO,
        )

    # -- 8. the canary -----------------------------------------------------------------------------------------------
    def canary(self) -> CanaryResult:
        """Each engine's receipt of the sync, then engine greedy decode == trainer argmax at every position
        (teacher-forced; near-ties within ε, logprobs within δ, see weightsync/canary.py); else CanaryMismatchError.
        Does not run when `weightSync.canary` is off."""
        if not self.plan.enabled:
            return CanaryResult(ran=False)
        engines = self.engines
        names = [f"engine {i}" for i in range(len(engines.engines))]

        def receipts_then_decode() -> list[list[Greedy]]:
            self.check_receipts(engines.engines, names=names)
            return engines.greedy_all(self.plan.prompts, max_tokens=self.plan.tokens)

        outputs = self.supervisor.on_policy(receipts_then_decode, what="canary decode")
        self._check_decode(outputs, names=names)
        return CanaryResult(ran=True, near_ties=self.near_ties)

    def canary_engines(self, engines: Sequence[Engine]) -> None:
        """The canary on `engines` only: an engine re-synced after a fault passes it before any rollout."""
        if self.plan.enabled:
            names = [engine.name for engine in engines]
            self.check_receipts(engines, names=names)
            outputs = [engine.greedy(self.plan.prompts, max_tokens=self.plan.tokens) for engine in engines]
            self._check_decode(outputs, names=names)

    def _where(self, engine_no: str) -> str:
        return f"weight-sync canary failed after policy version {self.policy_version}: {engine_no}"

    def check_receipts(self, engines: Sequence[Engine], *, names: Sequence[str]) -> None:
        """Exact, before any decode: each engine worker received and applied every tensor the trainer sent in the
        last sync (wire/receipt.py); R3OPERATOR_SYNC_RECEIPT=false skips it."""
        from r3operator.settings import runtime_settings

        if not runtime_settings().sync_receipt:
            return
        sent = self.sent.result()
        for endpoint, engine_no in zip(endpoints(engines), names, strict=True):
            try:
                check_receipts(sent, endpoint.sync_receipts(), where=self._where(engine_no))
            except CanaryMismatchError:
                self.metrics.set("r3operator_weight_sync_canary_ok", 0.0)
                raise

    def _check_decode(self, outputs: Sequence[Sequence[Greedy]], *, names: Sequence[str]) -> None:
        plan = self.plan
        self.near_ties = 0
        for engine_no, got in zip(names, outputs, strict=True):
            where = self._where(engine_no)
            try:
                forwards = canary_forwards(self.trainer, plan.prompts, got, compute=plan.tolerance.autocast)
                result = check_engine_greedy(
                    forwards.logits_fn,
                    plan.prompts,
                    [g.tokens for g in got],
                    engine_logprobs=[g.logprobs for g in got],
                    tolerance=plan.tolerance,
                    eos_id=self.trainer.eos_id,
                    max_tokens=plan.tokens,
                    where=where,
                )
                check_routing_agreement(forwards.routing_agreement, where=where)
            except CanaryMismatchError:
                self.metrics.set("r3operator_weight_sync_canary_ok", 0.0)
                raise
            if result.near_ties:
                log.info(
                    "canary: %d near-tie position(s) within ε=%g: %s",
                    result.near_ties,
                    plan.tolerance.epsilon,
                    "; ".join(result.details),
                )
            self.near_ties += result.near_ties
        self.metrics.set("r3operator_weight_sync_canary_ok", 1.0)
