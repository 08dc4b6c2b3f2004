"""The GRPO driver: one RL step = the numbered, individually timed phases below.

 1 rollout       vLLM engines generate group_size samples per prompt, with routed experts
                 (multiTurn: group_size conversations per prompt against an environment, each
                 turn asking only for the new rows, routes stitched per trajectory)
                 (routes cross the process boundary once, in the engine's answer; R3: the
                 step's routes are recorded on the volume in the background, never read back)
 2 reward        rule-based reward per sample
 3 advantages    GRPO, normalised within each prompt's group
 4 routes        R3: each sample's routes, validated when they arrived, into the batch; a sample
                 whose routes are missing or invalid fails the job or is dropped loudly and counted
                 (routingReplay.onRouteCheckFailure), never replayed
   route_checks  R3: shape, logical id range, uncaptured rows, replayed pad (before 5), then a constant
                 layer against the trainer's own routing and the replay hooks' counts (after 5, before 6):
                 runtime/route_checks.py; timed as one phase
 5 old_logprob   no-grad forward: R3 replays engine routes, R2 records natural routes, Disabled neither
 6 update        PPO-clip with the same replay (R3: engine routes, R2: recorded routes)
 7 weight_sync   trainer weights → every engine, chunked, inside ONE layerwise-reload bracket,
                 then the next requests salted with the new policy
 8 canary        every engine worker's receipt of the sync == what the trainer sent (exact
                 fingerprints), then engine greedy decode of fixed prompts == trainer argmax at every
                 position (teacher-forced; ε and δ from the engine's dtype and device), else
                 CanaryMismatchError
   eval          spec.evaluation, every intervalSteps and at the last step: the held-out eval reward of the new
                 policy on the same engines (runtime/evaluation.py); never trained on
 9 metrics       Prometheus, metrics.csv, RLJob status.progress
10 checkpoint    sharded (one file per trainer rank), written in the background and committed
                 atomically once every rank has finished (runtime/checkpoint.py); the step waits
                 only for the state to be staged in memory
   export        spec.export, every intervalSteps and after the last step: a Hugging Face directory, staged
                 at the step boundary and published in the background (runtime/export.py)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from r3operator.api.enums import ReplayMode, WeightSyncLayout
from r3operator.api.weight_transfer import TransferChoice, TransferMethod
from r3operator.rollout.base import Engine, Greedy
from r3operator.rollout.engines import EngineGroup
from r3operator.rollout.multiturn import Conversation, agreement_by_turn, roll_out_conversations
from r3operator.routing.agreement import routing_agreement
from r3operator.routing.checks import RouteCheckFailure
from r3operator.routing.codec import RoutedExperts
from r3operator.routing.store import RoutingStore
from r3operator.runtime import checkpoint as ckpt
from r3operator.runtime.config import RunSettings, resolve_model_dir
from r3operator.runtime.evaluation import EvalResult, Evaluation
from r3operator.runtime.export import build_exporter
from r3operator.runtime.metrics import RuntimeMetrics, StatusPusher, eval_progress_patch, progress_patch
from r3operator.runtime.nonfinite import NonFiniteTally, poison
from r3operator.runtime.progress import StepTable
from r3operator.runtime.report import append_row, keep_rows_through, read_rows
from r3operator.runtime.route_checks import RouteChecks, model_routing, select_old
from r3operator.runtime.route_record import RouteRecorder
from r3operator.runtime.setup import build_parts
from r3operator.runtime.sft import sft_warmup
from r3operator.runtime.step_record import StepRecord
from r3operator.tasks import envs
from r3operator.tasks import toy as tasks
from r3operator.tasks.source import TaskSource
from r3operator.trainer.base import OldPass, Trainer, UpdateStats
from r3operator.trainer.batch import TrainBatch, build_batch
from r3operator.trainer.distributed import DistributedTrainer
from r3operator.trainer.grpo.advantages import group_advantages
from r3operator.weightsync import sync as weight_sync
from r3operator.weightsync.canary import (
    CanaryMismatchError,
    CanaryTolerance,
    canary_forwards,
    check_engine_greedy,
    check_receipts,
    check_routing_agreement,
)
from r3operator.weightsync.faults import EngineSupervisor
from r3operator.weightsync.rank_sync import RankNativeInstall
from r3operator.wire.receipt import FingerprintLog
from r3operator.wire.sample import RolloutSample
from r3operator.wire.sync_phases import SyncPhases
from r3operator.wire.weights import PackedChunk

log = logging.getLogger("r3operator.runtime")


__all__ = ["CanaryMismatchError", "GRPORun"]


def _masked_mean(values: Any | None, mask: Any) -> float:
    """The mean of `values` where `mask` is set; NaN when there are no values or no masked entries."""
    if values is None:
        return float("nan")
    count = int(mask.sum())
    return float((values * mask).sum()) / count if count else float("nan")


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - begin


class GRPORun:
    def __init__(self, settings: RunSettings, *, engines: EngineGroup | None = None) -> None:
        self.s = settings
        spec = settings.job.spec
        self.spec = spec
        self.mode = ReplayMode(settings.replay_override) if settings.replay_override else spec.routing_replay.mode
        if spec.algorithm.use_kl_loss or spec.algorithm.kl_in_reward:
            raise ValueError("spec.algorithm.useKLLoss/klInReward: KL to a reference model is not in this runtime yet")
        self.run_dir = settings.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        multi_turn_task = spec.task.name in envs.ENVIRONMENTS
        if spec.rollout.multi_turn and not multi_turn_task:
            raise ValueError(
                f"spec.rollout.multiTurn: task {spec.task.name!r} has no multi-turn environment; "
                f"set spec.task.name to one of {sorted(envs.ENVIRONMENTS)}"
            )
        if multi_turn_task and not spec.rollout.multi_turn:
            raise ValueError(
                f"spec.task.name: {spec.task.name!r} is a multi-turn game; set spec.rollout.multiTurn: true"
            )
        self.model_dir = resolve_model_dir(settings.job, settings.model_override, routing_dir=settings.routing_dir)
        self._given_engines = engines  # None: setup() starts them
        self.store = RoutingStore(self.run_dir / "routes", durable=False)
        self.recorder: RouteRecorder | None = None  # R3: the step's routes on the volume (setup())
        self.route_checks: RouteChecks | None = None  # R3: the step's route checks (setup())
        self.ckpt_root = self.run_dir / "checkpoints"
        self.metrics = RuntimeMetrics(
            settings.name, namespace=settings.job.metadata.namespace or "default", port=settings.metrics_port
        )
        self.status = StatusPusher()
        self.policy_version = 0
        self.start_step = 1
        self.last_checkpoint_step: int | None = None
        self.rows: list[StepRecord] = []
        self.sent = FingerprintLog()  # what the last sync attempt sent, for the canary's receipt check
        self.sync_phases = SyncPhases()  # where the last sync spent its time (wire/sync_phases.py)
        self.nonfinite = NonFiniteTally(limit=spec.algorithm.max_non_finite_steps)
        self.metrics.inc("r3operator_nonfinite_steps_total", 0)  # a series from the start: increase() sees the first
        from r3operator.settings import runtime_settings

        self._fault_steps = frozenset(runtime_settings().fault_nonfinite_steps)
        self.evaluation: Evaluation | None = None  # spec.evaluation (setup())
        self.step_eval: EvalResult | None = None  # the last evaluation
        self.exporter = build_exporter(  # spec.export (runtime/export.py)
            settings.job,
            run_dir=self.run_dir,
            model_dir=self.model_dir,
            last_step=settings.steps,
            engine_dtype=settings.engine_dtype,
        )

    # -- setup --------------------------------------------------------------------------------------
    # What setup() puts in place (runtime/setup.py builds it): typed as present, since nothing of the
    # step loop runs before it.
    vocab_size: int
    num_experts: int
    task: TaskSource
    pool: Any
    canary_prompts: list[tuple[int, ...]]
    canary_tokens: int
    trainer: Trainer
    checkpoints: ckpt.AsyncCheckpoints
    engines: EngineGroup
    vllm_version: str
    weight_transfer: TransferChoice
    canary_tol: CanaryTolerance
    canary_near_ties: int
    supervisor: EngineSupervisor

    def setup(self) -> None:
        parts = build_parts(self.s, self.model_dir, engines=self._given_engines, ckpt_root=self.ckpt_root)
        self.vocab_size, self.num_experts = parts.vocab_size, parts.num_experts
        self.metrics.r3.set_replay_active(self.mode is ReplayMode.R3)  # a property of the job, not of a pass
        self.task = parts.task
        self.pool = self.task.pool
        self.canary_prompts = self.task.canary_prompts
        self.canary_tokens = self.task.canary_tokens
        self.trainer, self.checkpoints = parts.trainer, parts.checkpoints
        self.canary_tol = parts.canary_tol
        self.canary_near_ties = 0
        self.engines, self.vllm_version, self.weight_transfer = parts.engines, parts.vllm_version, parts.weight_transfer
        self.evaluation = parts.evaluation
        self.sync_layout = weight_sync.resolve_layout(self.spec, self.weight_transfer, self.vllm_version)
        install = self._native_install()
        # What the report and status.progress.weightSync say: the method, the layout, why, and where it is sent from.
        self.weight_sync_described = f"{self.weight_transfer.describe()}; {self.sync_layout.describe()}" + (
            f"; {install.describe()}" if isinstance(install, RankNativeInstall) else ""
        )
        self.supervisor = EngineSupervisor(
            self.engines,
            chunks=self._weight_chunks,
            canary=self._canary_engines,
            on_fault=lambda kind: self.metrics.inc("r3operator_engine_faults_total", kind=kind),
            install=install,
            phases=self.sync_phases,
        )
        self._start_recorder()
        if self.mode is ReplayMode.R3:
            policy = self.spec.routing_replay.on_route_check_failure
            self.route_checks = RouteChecks(model_routing(self.model_dir), policy, on_failure=self._route_check_failed)
        info = ckpt.find_latest(self.ckpt_root) if self.s.resume else None
        if info is None:  # a fresh start: rows of an earlier run in this directory must not mix in
            (self.run_dir / "metrics.csv").unlink(missing_ok=True)
        if info is not None:
            state = ckpt.load_checkpoint(info, self.trainer)
            ckpt.set_rng_state(state["rng"])
            self.start_step, self.policy_version = info.step + 1, info.policy_version
            self.last_checkpoint_step = info.step
            # Steps finished after this checkpoint run again: their rows must not appear twice.
            keep_rows_through(self.run_dir / "metrics.csv", info.step)
            self.nonfinite.resume(read_rows(self.run_dir / "metrics.csv"))
            log.info("resumed from %s (step %d, policy version %d)", info.path, info.step, info.policy_version)
        elif self.spec.algorithm.sft_warmup_steps:
            self.sft_warmup(self.spec.algorithm.sft_warmup_steps)
        if self.evaluation is not None:
            self.evaluation.start(resumed_through=None if info is None else info.step)
        # Engines may hold other weights (a fresh start, a previous run): sync once before step 1. On a
        # resume that sync installs the checkpoint's policy again; it is not a new policy version.
        self.sync_weights(new_version=info is None)
        self.canary()
        if info is None and self.evaluation is not None and self.evaluation.before_training:
            self.step_eval = self._run_evaluation(0)
            self.status.push(eval_progress_patch(0, self.step_eval.reward_mean))

    def sft_warmup(self, steps: int) -> list[float]:
        return sft_warmup(self.trainer, self.pool, steps=steps, seed=self.spec.seed)

    # -- the numbered phases ------------------------------------------------------------------------
    def rollout(self, step: int) -> tuple[list[RolloutSample], list[tasks.Problem]]:
        """1. Generate `groupSize` samples for `promptsPerStep` prompts (deterministic per seed, step)."""
        ro = self.spec.rollout
        problems = list(self.task.batch(step, ro.prompts_per_step))
        if ro.multi_turn:
            samples = self._multi_turn_rollout(step, problems)
        else:
            samples = self._single_turn_rollout(step, problems)
        self.metrics.r3.observe_rollout(samples)
        if self.recorder is not None:
            self.recorder.record(step, samples, policy_version=self.policy_version)
        return samples, problems

    def _start_recorder(self) -> None:
        if self.mode is ReplayMode.R3 and self.recorder is None:
            self.recorder = RouteRecorder(
                self.store,
                num_experts=self.num_experts,
                retention_steps=self.spec.storage.retention_steps,
                on_failure=lambda what: self.metrics.inc("r3operator_route_record_failures_total", operation=what),
            )

    def _single_turn_rollout(self, step: int, problems: Sequence[tasks.Problem]) -> list[RolloutSample]:
        ro = self.spec.rollout
        engines = self.engines
        return self.supervisor.on_policy(
            lambda: engines.generate(
                [p.prompt_ids for p in problems],
                max_tokens=ro.max_tokens,
                temperature=ro.temperature,
                seed=self.spec.seed * 1_000_003 + step * 10_007,
                n=ro.group_size,
            ),
            what=f"step {step} rollout",
        )

    def _multi_turn_rollout(self, step: int, problems: Sequence[tasks.Problem]) -> list[RolloutSample]:
        """`groupSize` conversations per prompt, each played against its own environment; one batched
        request per turn sends each open conversation whole, as token ids, and asks only for its new rows
        (rollout/multiturn.py). A turn is repeated like a rollout when an engine fails or turns stale."""
        ro = self.spec.rollout
        engines = self.engines
        conversations = [
            Conversation(
                prompt_index=i,
                choice_index=j,
                prompt=problem.prompt_ids,
                env=envs.environment(self.spec.task.name, problem, vocab_size=self.vocab_size),
            )
            for i, problem in enumerate(problems)
            for j in range(ro.group_size)
        ]

        def turn(prompts: list[list[int]], starts: list[int], turn_no: int) -> list[RolloutSample]:
            seed = self.spec.seed * 1_000_003 + step * 10_007 + turn_no * 100_003

            def call() -> list[RolloutSample]:
                return engines.generate(
                    prompts,
                    max_tokens=ro.max_tokens,
                    temperature=ro.temperature,
                    seed=seed,
                    n=1,
                    routed_experts_prompt_start=starts,
                )

            return self.supervisor.on_policy(call, what=f"step {step} rollout, turn {turn_no + 1}")

        return roll_out_conversations(conversations, turn, num_experts=self.num_experts)

    def score(self, samples: Sequence[RolloutSample], problems: Sequence[tasks.Problem]) -> np.ndarray:
        """2. The task's reward of each sample against its prompt's answer (tasks/source.py)."""
        if self.spec.rollout.multi_turn:  # the environment scored the conversation when it ended
            return np.asarray([s.extra["reward"] for s in samples], dtype=np.float32)
        return self.task.score(samples, problems)

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        """3. GRPO advantages, normalised within each prompt's group."""
        return group_advantages(rewards, group_size=self.spec.rollout.group_size)

    def load_routes(self, step: int, samples: Sequence[RolloutSample], adv: np.ndarray) -> TrainBatch | None:
        """4. Build the batch. R3: each sample's routes, in memory from the engine's answer; a sample
        without valid routes is dropped. None when no sample is left (the step is skipped)."""
        kept, kept_adv, routes = [], [], []
        for sample, a in zip(samples, adv, strict=True):
            sample_routes = sample.routes  # R2/Disabled: metrics only, never replayed
            if self.mode is ReplayMode.R3:
                sample_routes = self._read_routes(step, sample)
                if sample_routes is None:
                    continue
            kept.append(sample)
            kept_adv.append(a)
            routes.append(sample_routes)
        if not kept:
            return None
        present = [r for r in routes if r is not None]  # R3 kept only samples with routes: all or none
        return build_batch(
            kept,
            kept_adv,
            routes=present if len(present) == len(routes) else None,
            pad_id=self.trainer.pad_id,
            device=self.trainer.batch_device,
            temperature=self.spec.rollout.temperature,
        )

    def _read_routes(self, step: int, sample: RolloutSample) -> RoutedExperts | None:
        """The sample's routes as they arrived from the engine (`build_sample` validated ids and rows); a
        missing or invalid one fails the job or is dropped (routingReplay.onRouteCheckFailure)."""
        failure = RouteChecks.arrival_failure(sample)
        if failure is not None:
            if self.route_checks is not None:
                self.route_checks.failed(failure)  # raises under Fail
            self._drop(sample, sample.routes_status, sample.routes_error or "")
            return None
        return sample.routes

    def check_routes(
        self, batch: TrainBatch, samples: Sequence[RolloutSample], old: OldPass | None = None
    ) -> tuple[TrainBatch, OldPass | None] | None:
        """R3's route checks (runtime/route_checks.py) before the old-logprob pass (`old` None) or after it:
        the batch (and pass) without the samples that failed under SkipSample; None when none is left."""
        checker = self.route_checks
        assert checker is not None  # R3 only
        before = len(checker.step.failures)
        rows = checker.before_forward(batch, samples) if old is None else checker.after_forward(batch, old)
        for failure in checker.step.failures[before:]:  # SkipSample: Fail raised in `failed`
            self.metrics.inc("r3operator_samples_dropped_total", reason=failure.rule)
            self.dropped.append((str(failure.sample_id), failure.rule))
        if not rows:
            return None
        if len(rows) < batch.size:
            batch, old = batch.select(rows), (None if old is None else select_old(old, rows))
        return batch, old

    def _route_check_failed(self, failure: RouteCheckFailure, fatal: bool) -> None:
        """Count a route-check failure; before a fatal one stops the job, status.progress says why."""
        self.metrics.inc("r3operator_route_check_failures_total", rule=failure.rule)
        if fatal and self.route_checks is not None:
            failures = len(self.route_checks.step.failures)
            self.status.push(
                {"status": {"progress": {"routeCheckFailures": failures, "routeCheckMessage": str(failure)[:1024]}}}
            )

    def _drop(self, sample: RolloutSample, reason: str, detail: str) -> None:
        log.error("step sample %s dropped from training (routes %s): %s", sample.sample_id, reason, detail)
        self.metrics.inc("r3operator_samples_dropped_total", reason=reason)
        self.dropped.append((sample.sample_id, reason))

    def old_logprobs(self, batch: TrainBatch) -> OldPass:
        """5. Old-logprob forward under the mode's routing."""
        return self.trainer.old_logprobs(batch, self.mode)

    def update(self, batch: TrainBatch, old: OldPass) -> UpdateStats:
        """6. PPO-clip update with the same replay as the old-logprob pass."""
        alg = self.spec.algorithm
        return self.trainer.update(
            batch,
            old,
            mini_batches=alg.mini_batches,
            clip_low=alg.clip_ratio_low,
            clip_high=alg.clip_ratio_high,
            clip_ratio_c=alg.clip_ratio_c,
        )

    def sync_weights(self, *, new_version: bool = True) -> dict[str, int]:
        """7. Chunked weight sync to every engine, one layerwise-reload bracket each; a failed sync is
        aborted without finalising and repeated in full (weightsync/faults.py)."""
        begin = time.perf_counter()
        version = self.policy_version + int(new_version)
        self.sync_phases.reset()
        result = self.supervisor.sync(version)
        self.policy_version = version
        install = self.supervisor.install
        if isinstance(install, weight_sync.NativeInstall):
            self.weight_sync_described = f"{self.weight_transfer.describe()}; {install.described(self.sync_layout)}"
        self.metrics.set("r3operator_weight_sync_seconds", time.perf_counter() - begin)
        for phase, seconds in self.sync_phases.seconds.items():
            self.metrics.set("r3operator_weight_sync_phase_seconds", seconds, phase=phase)
        return result

    def _weight_chunks(self) -> Iterator[PackedChunk]:
        """The trainer's current weights as packed chunks, in the engine's dtype (the engine would cast
        anyway; a bf16 engine gets half the bytes)."""
        import torch

        mb = self.spec.weight_sync.chunk_size_mb
        wire_dtype = getattr(torch, self.s.engine_dtype, None)
        return self._record_sent(self.trainer.weight_chunks(chunk_size_mb=mb, dtype=wire_dtype))

    def _record_sent(self, chunks: Iterator[PackedChunk]) -> Iterator[PackedChunk]:
        """Pass the chunks on, keeping each one's fingerprints (computed where it was packed)."""
        self.sent.clear()
        for chunk in chunks:
            self.sent.merge(chunk.fingerprints)
            yield chunk

    def _native_install(self) -> weight_sync.NativeInstall | RankNativeInstall | None:
        """vLLM's native transfer when `self.weight_transfer` chose it; None: the packed chunks. The kernel
        layout exists only on the native path: on the packed one it is refused, naming the field. A trainer
        over ranks sends over NCCL from its rank 0 (weightsync/rank_sync.py), not through this process."""
        layout = self.sync_layout.layout
        if not self.weight_transfer.native:
            return None
        import torch

        dtype = getattr(torch, self.s.engine_dtype, None)
        buffer_size_bytes = self.spec.weight_sync.chunk_size_mb * 1024 * 1024
        if isinstance(self.trainer, DistributedTrainer) and self.weight_transfer.method is TransferMethod.NCCL:
            return RankNativeInstall(
                TransferMethod.NCCL,
                ranks=self.trainer,
                dtype=dtype,
                buffer_size_bytes=buffer_size_bytes,
                sent=self.sent,
                phases=self.sync_phases,
                layout=layout,
            )
        return weight_sync.NativeInstall(
            self.weight_transfer.method,
            state_dict=self.trainer.sync_state_dict,
            dtype=dtype,
            buffer_size_bytes=buffer_size_bytes,
            master_address=weight_sync.master_address_for(self.engines),
            sent=self.sent,
            phases=self.sync_phases,
            layout=layout,
            kernel_fallback=self.spec.weight_sync.layout is WeightSyncLayout.AUTO,
        )

    def canary(self) -> bool:
        """8. Each engine's receipt of the sync, then engine greedy decode == trainer argmax at every position
        (teacher-forced; near-ties within ε, logprobs within δ, see weightsync/canary.py); else
        CanaryMismatchError. False when `weightSync.canary` is off."""
        if not self.spec.weight_sync.canary:
            return False
        engines = self.engines
        names = [f"engine {i}" for i in range(len(engines.engines))]

        def receipts_then_decode() -> list[list[Greedy]]:
            self._check_receipts(engines.engines, names=names)
            return engines.greedy_all(self.canary_prompts, max_tokens=self.canary_tokens)

        outputs = self.supervisor.on_policy(receipts_then_decode, what="canary decode")
        self._check_canary(outputs, names=names)
        return True

    def _canary_engines(self, engines: Sequence[Engine]) -> None:
        """The canary on `engines` only: an engine re-synced after a fault passes it before any rollout."""
        if self.spec.weight_sync.canary:
            names = [engine.name for engine in engines]
            self._check_receipts(engines, names=names)
            outputs = [engine.greedy(self.canary_prompts, max_tokens=self.canary_tokens) for engine in engines]
            self._check_canary(outputs, names=names)

    def _where(self, engine_no: str) -> str:
        return f"weight-sync canary failed after policy version {self.policy_version}: {engine_no}"

    def _check_receipts(self, engines: Sequence[Engine], *, names: Sequence[str]) -> None:
        """Exact, before any decode: each engine worker received and applied every tensor the trainer sent
        in the last sync (wire/receipt.py); R3OPERATOR_SYNC_RECEIPT=false skips it."""
        from r3operator.settings import runtime_settings

        if not runtime_settings().sync_receipt:
            return
        sent = self.sent.result()
        for engine, engine_no in zip(engines, names, strict=True):
            try:
                check_receipts(sent, engine.sync_receipts(), where=self._where(engine_no))
            except CanaryMismatchError:
                self.metrics.set("r3operator_weight_sync_canary_ok", 0.0)
                raise

    def _check_canary(self, outputs: Sequence[Sequence[Greedy]], *, names: Sequence[str]) -> None:
        self.canary_near_ties = 0
        for engine_no, got in zip(names, outputs, strict=True):
            where = self._where(engine_no)
            try:
                forwards = canary_forwards(self.trainer, self.canary_prompts, got, compute=self.canary_tol.autocast)
                result = check_engine_greedy(
                    forwards.logits_fn,
                    self.canary_prompts,
                    [g.tokens for g in got],
                    engine_logprobs=[g.logprobs for g in got],
                    tolerance=self.canary_tol,
                    eos_id=self.trainer.eos_id,
                    max_tokens=self.canary_tokens,
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
                    self.canary_tol.epsilon,
                    "; ".join(result.details),
                )
            self.canary_near_ties += result.near_ties
        self.metrics.set("r3operator_weight_sync_canary_ok", 1.0)

    # -- one step -----------------------------------------------------------------------------------
    def train_step(self, step: int) -> StepRecord:
        timer = PhaseTimer()
        self.dropped: list[tuple[str, str]] = []
        begin = time.perf_counter()
        with timer("rollout"):
            samples, problems = self.rollout(step)
        with timer("reward"):
            rewards = self.score(samples, problems)
        with timer("advantages"):
            adv = poison(
                step, self.advantages(rewards), self._fault_steps, mini_batches=self.spec.algorithm.mini_batches
            )
        if self.route_checks is not None:
            self.route_checks.begin_step(samples)
        with timer("routes"):
            batch = self.load_routes(step, samples, adv)
        if self.route_checks is not None and batch is not None:
            with timer("route_checks"):
                checked = self.check_routes(batch, samples)
            batch = None if checked is None else checked[0]
        if batch is None:
            return self._skip_step(step, samples, rewards, timer, begin)
        with timer("old_logprob"):
            old = self.old_logprobs(batch)
        if self.route_checks is not None:
            with timer("route_checks"):
                checked = self.check_routes(batch, samples, old)
            if checked is None or checked[1] is None:
                return self._skip_step(step, samples, rewards, timer, begin)
            batch, old = checked[0], checked[1]
            self.route_checks.tally(batch)
        with timer("update"):
            stats = self.update(batch, old)
        # The non-finite guard (runtime/nonfinite.py): an update that changed nothing is neither synced nor
        # checkpointed.
        changed = self.nonfinite.record(step, stats)
        if stats.updates_skipped:
            self.metrics.inc("r3operator_nonfinite_steps_total")
        canary_ok = self.sync_and_canary(timer, step) if changed else self._no_sync(step, timer)
        with timer("metrics"):
            row = self._row(step, samples, rewards, batch, old, stats, canary_ok, timer)
            row.nonfinite_updates = stats.updates_skipped
            self._update_columns(row, stats)
        if changed:
            with timer("checkpoint"):
                self._checkpoint(step)
        row = self._finish_step(row, timer, begin)
        self.nonfinite.check()
        return row

    def _no_sync(self, step: int, timer: PhaseTimer) -> bool:
        """A step whose update was not applied: the engines keep the policy they have (no canary to run); a due
        held-out evaluation still runs, on that policy."""
        self.sync_phases.reset()
        self.canary_near_ties = 0
        self.evaluate(step, timer)
        return False

    def sync_and_canary(self, timer: PhaseTimer, step: int) -> bool:
        """7-8. Weight sync, then the canary, then the held-out evaluation when due (the asynchronous driver pauses
        the engines around all three)."""
        with timer("weight_sync"):
            self.sync_weights()
        with timer("canary"):
            canary_ok = self.canary()
        self.evaluate(step, timer)
        return canary_ok

    def evaluate(self, step: int, timer: PhaseTimer) -> None:
        """spec.evaluation, when due after `step`: the eval reward of the policy the engines hold (`eval` phase)."""
        if self.evaluation is not None and self.evaluation.due(step):
            with timer("eval"):
                self.step_eval = self._run_evaluation(step)

    def _run_evaluation(self, step: int) -> EvalResult:
        assert self.evaluation is not None
        result = self.evaluation.on_engines(
            step, policy_version=self.policy_version, engines=self.engines, supervisor=self.supervisor
        )
        self.metrics.observe_eval(step, result.reward_mean)
        log.info("%s", result.line())
        return result

    def _trainer_peak_gib(self) -> float | None:
        """The largest peak GPU memory of any trainer rank so far (GiB); None on CPU, where the driver's
        resident set also holds the rollout and would say nothing about the trainer."""
        if not self.s.device.startswith("cuda"):
            return None
        per_rank = getattr(self.trainer, "peak_memory_bytes", None)
        if per_rank is not None:  # ranks in Ray actors
            return max(per_rank()) / 2**30
        import torch

        return int(torch.cuda.max_memory_allocated()) / 2**30  # the trainer runs in this process

    def _update_columns(self, row: StepRecord, stats: UpdateStats) -> None:
        """Figures a driver adds from the update's (none in the synchronous loop)."""

    def _finish_step(self, row: StepRecord, timer: PhaseTimer, begin: float) -> StepRecord:
        if self.step_eval is not None and self.step_eval.step == row.step:
            row.eval_reward = self.step_eval.reward_mean
        row.phase_seconds = dict(timer.seconds)  # every phase the step ran, metrics and checkpoint included
        row.step_seconds = time.perf_counter() - begin
        row.trainer_peak_memory_gib = self._trainer_peak_gib()
        self.metrics.observe_step(row, timer.seconds)
        append_row(self.run_dir / "metrics.csv", row)
        self.status.push(
            progress_patch(
                row,
                total_steps=self.s.steps,
                last_checkpoint_step=self.last_checkpoint_step,
                weight_sync=self.weight_sync_described,
                non_finite_steps=self.nonfinite.total,
                last_non_finite_step=self.nonfinite.last,
            )
        )
        self.rows.append(row)
        return row

    def _skip_step(
        self, step: int, samples: Sequence[RolloutSample], rewards: np.ndarray, timer: PhaseTimer, begin: float
    ) -> StepRecord:
        """Every sample was dropped: no update, so the engines keep the current policy (no sync, no new
        policy version). The step is counted (`r3operator_steps_skipped_total`, `skipped` in metrics.csv, the
        progress line) and checkpointed like any other, so a resume does not repeat it."""
        log.error(
            "step %d skipped: all %d samples were dropped (%s)",
            step,
            len(samples),
            ", ".join(sorted({reason for _, reason in self.dropped})),
        )
        self.metrics.inc("r3operator_steps_skipped_total", reason="no_usable_samples")
        self.evaluate(step, timer)  # a due evaluation still runs, on the unchanged policy
        with timer("metrics"):
            row = self._rollout_columns(step, samples, rewards, timer)  # StepRecord's defaults: a skipped step
        with timer("checkpoint"):
            self._checkpoint(step)
        return self._finish_step(row, timer, begin)

    def _row(
        self,
        step: int,
        samples: Sequence[RolloutSample],
        rewards: np.ndarray,
        batch: TrainBatch,
        old: OldPass,
        stats: UpdateStats,
        canary_ok: bool,
        timer: PhaseTimer,
    ) -> StepRecord:
        tokens, rows = self._fidelity_masks(samples, batch, old)
        # No token to measure (async: none the current version sampled): the cells stay empty and the
        # gauges lose their series, as NaN would read as a figure and blind avg_over_time() for its window.
        measured = bool(tokens.any())
        lp_mean: float | None = None
        lp_max: float | None = None
        kl: float | None = None
        extreme: float | None = None
        natural: float | None = None
        if measured:
            lp = self.metrics.r3.observe_logprobs(batch.rollout_logprobs, old.logprobs, tokens)
            lp_mean, lp_max, kl, extreme = lp.abs_diff_mean, lp.abs_diff_max, lp.kl_k3, lp.extreme_token_fraction
        else:
            self.metrics.r3.clear_fidelity()
        applied = float("nan")
        if batch.engine_routes is not None:
            assert batch.route_pad is not None
            mask = ~batch.route_pad
            # replay_applied: the hook handed the experts the engine's ids (a wiring check; blind to a
            # misaligned batch). The routers' own choice vs the engine is the alignment signal.
            applied = routing_agreement(old.used_ids, batch.engine_routes, mask).agreement_ratio
            fidelity_rows = mask if rows is None else mask & rows
            if measured and bool(fidelity_rows.any()):
                natural = self.metrics.r3.observe_routing(
                    old.natural_ids, batch.engine_routes, fidelity_rows
                ).agreement_ratio
            elif measured:
                self.metrics.r3.clear_fidelity(routing_only=True)
        elif measured:
            natural = float("nan")
        row = self._rollout_columns(step, samples, rewards, timer)
        if self.spec.rollout.multi_turn:
            row.routing_agreement_by_turn = self._agreement_by_turn(samples, batch, old)
        row.logprob_abs_diff_mean, row.logprob_abs_diff_max, row.kl_k3 = lp_mean, lp_max, kl
        row.extreme_token_fraction = extreme
        row.replay_applied, row.routing_natural_agreement = applied, natural
        row.loss, row.clip_fraction, row.grad_norm = stats.loss, stats.clip_fraction, stats.grad_norm
        row.dual_clip_fraction = stats.dual_clip_fraction
        row.entropy_mean = _masked_mean(old.entropy, batch.response_mask)
        row.canary_ok, row.canary_near_ties, row.skipped = int(canary_ok), self.canary_near_ties, 0
        row.sync_seconds = dict(self.sync_phases.seconds)
        return row

    def _fidelity_masks(
        self, samples: Sequence[RolloutSample], batch: TrainBatch, old: OldPass
    ) -> tuple[Any, Any | None]:
        """The response tokens and route rows the engine/trainer fidelity metrics run over (None: every
        captured row): all of them here, where every token was sampled by the weights the old-logprob pass
        runs (async_loop.py narrows them to the current version's)."""
        return batch.response_mask, None

    def _rollout_columns(
        self, step: int, samples: Sequence[RolloutSample], rewards: np.ndarray, timer: PhaseTimer
    ) -> StepRecord:
        """The figures every step has, trained or skipped: what the rollout produced."""
        tokens = sum(len(s.token_ids) for s in samples)
        record = StepRecord(
            step=step,
            policy_version=self.policy_version,
            replay_mode=self.mode.value,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()),
            samples=len(samples),
            samples_dropped=len(self.dropped),
            tokens=tokens,
            tokens_per_second=tokens / max(timer.seconds["rollout"], 1e-9),
            prompt_tokens=sum(len(s.prompt_token_ids) for s in samples),
        )
        if self.route_checks is not None:
            self._replay_columns(record)
        if self.spec.rollout.multi_turn:  # model turns per conversation; the environment's tokens
            record.turns_mean = float(np.mean([s.extra["turns"] for s in samples]))
            record.env_tokens = int(sum(s.extra["env_tokens"] for s in samples))
        return record

    def _replay_columns(self, record: StepRecord) -> None:
        """R3: the replayed and fallback fractions and the route checks' count of the step (and their gauges)."""
        assert self.route_checks is not None
        tally = self.route_checks.step
        fractions = tally.fractions
        record.replayed_fraction, record.fallback_fraction = fractions.replayed, fractions.fallback
        record.route_check_failures, record.route_check_message = len(tally.failures), tally.message
        for name, value in (
            ("r3operator_replayed_rows_ratio", fractions.replayed),
            ("r3operator_replay_fallback_rows_ratio", fractions.fallback),
        ):
            if value == value:  # NaN: nothing to measure, the series keeps its last value
                self.metrics.set(name, value)

    def _agreement_by_turn(self, samples: Sequence[RolloutSample], batch: TrainBatch, old: OldPass) -> str:
        """The natural routing agreement per turn, "0.991;0.985;…" (turn 1 first; rollout/multiturn.py)."""
        if batch.engine_routes is None or batch.route_pad is None:
            return ""
        by_id = {s.sample_id: s for s in samples}
        kept = [by_id[sid] for sid in batch.sample_ids]
        by_turn = agreement_by_turn(old.natural_ids, batch.engine_routes, batch.route_pad, kept)
        for turn, ratio in enumerate(by_turn, start=1):
            if ratio == ratio:  # a turn no conversation reached this step is NaN: no sample, no series
                self.metrics.set("r3operator_routing_agreement_by_turn_ratio", float(ratio), turn=str(turn))
        return ";".join(f"{x:.4f}" for x in by_turn)

    def _checkpoint(self, step: int) -> None:
        cfg = self.spec.checkpoint
        if step % cfg.interval_steps and step != self.s.steps:
            return
        committed = self.checkpoints.start(step=step, policy_version=self.policy_version)
        if committed is not None:
            self.last_checkpoint_step = committed.step

    def finish_checkpoint(self) -> None:
        """Wait for the checkpoint in flight and commit it (the end of a run)."""
        committed = self.checkpoints.finish()
        if committed is not None:
            self.last_checkpoint_step = committed.step

    # -- the loop -----------------------------------------------------------------------------------
    def run(self, *, table: StepTable | None = None) -> list[StepRecord]:
        self.setup()
        if table is not None and self.step_eval is not None:  # the evaluation before training
            table.note(self.step_eval.line())
        try:
            for step in range(self.start_step, self.s.steps + 1):
                row = self.train_step(step)
                if table is not None:
                    table.add(row)
                if self.exporter is not None:  # at the step's checkpoint boundary, when due
                    self.exporter.after_step(
                        step, self.trainer, self.policy_version, evaluation=self.step_eval, push=self.status.push
                    )
            self.finish_checkpoint()
            if self.exporter is not None:
                self.exporter.finish(self.status.push)
        except BaseException:
            if self.exporter is not None:
                self.exporter.abandon()
            try:  # a checkpoint already staged is still worth committing
                self.finish_checkpoint()
            except Exception as exc:
                log.error("the checkpoint in flight could not be committed: %s", exc)
            raise
        finally:
            if self.recorder is not None:
                self.recorder.close()
            self.trainer.close()
        return self.rows
