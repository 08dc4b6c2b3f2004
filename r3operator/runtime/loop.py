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
                 then the next requests salted with the new policy (weightsync/session.py)
 8 canary        every engine worker's receipt of the sync == what the trainer sent (exact
                 fingerprints), then engine greedy decode of fixed prompts == trainer argmax at every
                 position (teacher-forced; ε and δ from the engine's dtype and device), else
                 CanaryMismatchError
   eval          spec.evaluation, every intervalSteps and at the last step: the held-out eval reward of the new
                 policy on the same engines (runtime/evaluation.py); never trained on
 9 metrics       Prometheus, metrics.csv, RLJob status.progress (runtime/step_rows.py builds the row)
10 checkpoint    sharded (one file per trainer rank), written in the background and committed
                 atomically once every rank has finished (runtime/checkpoint.py); the step waits
                 only for the state to be staged in memory
   export        spec.export, every intervalSteps and after the last step: a Hugging Face directory, staged
                 at the step boundary and published in the background (runtime/export.py)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from r3operator.api.enums import ReplayMode
from r3operator.rollout.engines import EngineGroup
from r3operator.routing.sample import RolloutSample
from r3operator.routing.store import RoutingStore
from r3operator.runtime import rollouts
from r3operator.runtime.config import RunSettings, resolve_model_dir
from r3operator.runtime.evaluation import EvalResult
from r3operator.runtime.export import build_exporter
from r3operator.runtime.metrics import RuntimeMetrics, StatusPusher, eval_progress_patch
from r3operator.runtime.nonfinite import NonFiniteTally
from r3operator.runtime.progress import StepTable
from r3operator.runtime.route_checks import StepRoutes, model_routing
from r3operator.runtime.route_record import RouteRecorder
from r3operator.runtime.setup import build_parts, build_session, check_run_spec, resume
from r3operator.runtime.sft import sft_warmup
from r3operator.runtime.step_record import StepRecord
from r3operator.runtime.step_rows import StepRows
from r3operator.tasks import toy as tasks
from r3operator.trainer.base import OldPass, UpdateStats
from r3operator.trainer.batch import TrainBatch
from r3operator.trainer.grpo.advantages import group_advantages
from r3operator.weightsync.canary import CanaryMismatchError
from r3operator.weightsync.session import SyncResult
from r3operator.wire.sync_phases import PhaseTimer

log = logging.getLogger("r3operator.runtime")

__all__ = ["CanaryMismatchError", "GRPORun"]


class GRPORun:
    def __init__(self, settings: RunSettings, *, engines: EngineGroup | None = None) -> None:
        self.s = settings
        spec = self.spec = settings.job.spec
        self.mode = ReplayMode(settings.replay_override) if settings.replay_override else spec.routing_replay.mode
        check_run_spec(spec)
        self.run_dir = settings.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.model_dir = resolve_model_dir(settings.job, settings.model_override, routing_dir=settings.routing_dir)
        self._given_engines = engines  # None: setup() starts them
        self.store = RoutingStore(self.run_dir / "routes", durable=False)
        self.recorder: RouteRecorder | None = None  # R3: the step's routes on the volume (setup())
        self.ckpt_root = self.run_dir / "checkpoints"
        self.metrics = RuntimeMetrics(
            settings.name, namespace=settings.job.metadata.namespace or "default", port=settings.metrics_port
        )
        self.status = StatusPusher()
        self.routes = StepRoutes(self.mode, self.metrics, self.status)  # phase 4; R3's route checks (setup())
        self.policy_version = 0
        self.start_step = 1
        self.rows: list[StepRecord] = []
        self.nonfinite = NonFiniteTally.for_run(spec.algorithm, self.metrics)  # the guard (runtime/nonfinite.py)
        self.step_eval: EvalResult | None = None  # the last evaluation
        self.exporter = build_exporter(settings, model_dir=self.model_dir)  # spec.export (runtime/export.py)

    # -- setup: what runtime/setup.py builds, then resume or warm up, sync, canary ---------------------
    def setup(self) -> None:
        parts = self.parts = build_parts(self.s, self.model_dir, engines=self._given_engines, ckpt_root=self.ckpt_root)
        self.num_experts, self.task, self.pool = parts.num_experts, parts.task, parts.task.pool
        self.trainer, self.checkpoints, self.engines = parts.trainer, parts.checkpoints, parts.engines
        self.vllm_version, self.weight_transfer = parts.vllm_version, parts.weight_transfer
        self.evaluation = parts.evaluation
        self.metrics.r3.set_replay_active(self.mode is ReplayMode.R3)  # a property of the job, not of a pass
        self.weight_sync = build_session(self.s, parts, self.metrics)
        self.supervisor = self.weight_sync.supervisor
        self.step_rows = StepRows(  # 9 (runtime/step_rows.py)
            self.s, self.mode, self.metrics, self.status, self.nonfinite, trainer=self.trainer, sync=self.weight_sync
        )
        self._start_recorder()
        if self.mode is ReplayMode.R3:
            self.routes.enable_checks(model_routing(self.model_dir), self.spec.routing_replay.on_route_check_failure)
        info = resume(self.s, self.checkpoints, self.nonfinite)  # also their committed step and non-finite count
        if info is not None:
            self.start_step, self.policy_version = info.step + 1, info.policy_version
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

    def _start_recorder(self) -> None:
        if self.mode is ReplayMode.R3 and self.recorder is None:
            self.recorder = RouteRecorder(
                self.store,
                num_experts=self.num_experts,
                retention_steps=self.spec.storage.retention_steps,
                on_failure=lambda what: self.metrics.inc("r3operator_route_record_failures_total", operation=what),
            )

    def sft_warmup(self, steps: int) -> list[float]:
        return sft_warmup(self.trainer, self.pool, steps=steps, seed=self.spec.seed)

    # -- the numbered phases ------------------------------------------------------------------------
    def rollout(self, step: int) -> tuple[list[RolloutSample], list[tasks.Problem]]:
        """1. Generate `groupSize` samples for `promptsPerStep` prompts (deterministic per seed, step)."""
        problems = list(self.task.batch(step, self.spec.rollout.prompts_per_step))
        if not self.spec.rollout.multi_turn:
            samples = rollouts.single_turn(self.spec, step, problems, engines=self.engines, supervisor=self.supervisor)
        else:
            samples = rollouts.multi_turn(
                self.spec,
                step,
                problems,
                engines=self.engines,
                supervisor=self.supervisor,
                vocab_size=self.parts.vocab_size,
                num_experts=self.num_experts,
            )
        self.metrics.r3.observe_rollout(samples)
        if self.recorder is not None:
            self.recorder.record(step, samples, policy_version=self.policy_version)
        return samples, problems

    def score(self, samples: Sequence[RolloutSample], problems: Sequence[tasks.Problem]) -> np.ndarray:
        """2. The task's reward of each sample against its prompt's answer (tasks/source.py)."""
        if self.spec.rollout.multi_turn:  # the environment scored the conversation when it ended
            return np.asarray([s.extra["reward"] for s in samples], dtype=np.float32)
        return self.task.score(samples, problems)

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        """3. GRPO advantages, normalised within each prompt's group."""
        return group_advantages(rewards, group_size=self.spec.rollout.group_size)

    def load_routes(self, step: int, samples: Sequence[RolloutSample], adv: np.ndarray) -> TrainBatch | None:
        """4. The batch; R3: each sample's routes from the engine's answer (runtime/route_checks.py `StepRoutes`)."""
        return self.routes.batch(samples, adv, self.trainer, temperature=self.spec.rollout.temperature)

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

    def sync_weights(self, *, new_version: bool = True) -> SyncResult:
        """7. The trainer's weights to every engine as the next policy version (weightsync/session.py)."""
        result = self.weight_sync.sync(self.policy_version + int(new_version))
        self.policy_version = result.policy_version
        return result

    def canary(self) -> bool:
        """8. Receipts, then greedy decode (weightsync/session.py); False when `weightSync.canary` is off."""
        return self.weight_sync.canary().ran

    # -- one step -----------------------------------------------------------------------------------
    def train_step(self, step: int) -> StepRecord:
        timer = PhaseTimer()
        self.routes.dropped = []  # the step's samples left out, with why (phase 4, the route checks, staleness)
        begin = time.perf_counter()
        with timer("rollout"):
            samples, problems = self.rollout(step)
        with timer("reward"):
            rewards = self.score(samples, problems)
        with timer("advantages"):
            adv = self.nonfinite.poison(step, self.advantages(rewards))
        self.routes.begin_step(samples)
        with timer("routes"):
            batch = self.load_routes(step, samples, adv)
        if self.routes.checks is not None and batch is not None:
            with timer("route_checks"):
                batch = self.routes.check(batch, samples)[0]
        if batch is None:
            return self._skip_step(step, samples, rewards, timer, begin)
        with timer("old_logprob"):
            old: OldPass | None = self.old_logprobs(batch)
        if self.routes.checks is not None:
            with timer("route_checks"):
                batch, old = self.routes.check(batch, samples, old)
            if batch is None or old is None:
                return self._skip_step(step, samples, rewards, timer, begin)
            self.routes.checks.tally(batch)
        assert old is not None
        with timer("update"):
            stats = self.update(batch, old)
        # The non-finite guard (runtime/nonfinite.py): an update that changed nothing is neither synced nor
        # checkpointed.
        changed = self.nonfinite.record(step, stats)
        if changed:
            canary_ok = self.sync_and_canary(timer, step)
        else:  # the engines keep the policy they have (no canary to run); a due evaluation still runs, on it
            self.weight_sync.skip()
            self.evaluate(step, timer)
            canary_ok = False
        with timer("metrics"):  # 9. the step's row (runtime/step_rows.py)
            record = self._rollout_columns(step, samples, rewards, timer)
            masks = self._fidelity_masks(samples, batch, old)
            row = self._update_columns(
                self.step_rows.trained(record, samples, batch, old, stats, masks, canary_ok=canary_ok), stats
            )
        if changed:
            with timer("checkpoint"):
                self.checkpoints.after_step(step, policy_version=self.policy_version)
        row = self._finish_step(row, timer, begin)
        self.nonfinite.check()
        return row

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
        return self.evaluation.on_engines(  # runtime/evaluation.py
            step, self.metrics, policy_version=self.policy_version, engines=self.engines, supervisor=self.supervisor
        )

    # -- 9. the step's row: what a driver adds to runtime/step_rows.py's ------------------------------
    def _fidelity_masks(self, samples: Sequence[RolloutSample], batch: TrainBatch, old: OldPass) -> tuple[Any, Any]:
        """The response tokens and route rows the engine/trainer fidelity metrics run over (None: every captured
        row): all of them here, where every token was sampled by the weights the old-logprob pass runs
        (async_loop.py narrows them to the current version's)."""
        return batch.response_mask, None

    def _rollout_columns(
        self, step: int, samples: Sequence[RolloutSample], rewards: np.ndarray, timer: PhaseTimer
    ) -> StepRecord:
        """The figures every step has, trained or skipped: what the rollout produced."""
        return self.step_rows.rollout(
            step, self.policy_version, samples, rewards, self.routes, rollout_seconds=timer.seconds["rollout"]
        )

    def _update_columns(self, row: StepRecord, stats: UpdateStats) -> StepRecord:
        """Figures a driver adds from the update's (none in the synchronous loop)."""
        return row

    def _finish_step(self, row: StepRecord, timer: PhaseTimer, begin: float) -> StepRecord:
        row = self.step_rows.finish(
            row, timer.seconds, began=begin, evaluation=self.step_eval, last_checkpoint_step=self.last_checkpoint_step
        )
        self.rows.append(row)
        return row

    def _skip_step(
        self, step: int, samples: Sequence[RolloutSample], rewards: np.ndarray, timer: PhaseTimer, begin: float
    ) -> StepRecord:
        """Every sample was dropped: no update, so the engines keep the current policy (no sync, no new
        policy version). The step is counted (`r3operator_steps_skipped_total`, `skipped` in metrics.csv, the
        progress line) and checkpointed like any other, so a resume does not repeat it."""
        self.routes.none_left(step, len(samples))
        self.evaluate(step, timer)  # a due evaluation still runs, on the unchanged policy
        with timer("metrics"):
            row = self._rollout_columns(step, samples, rewards, timer)  # StepRecord's defaults: a skipped step
        with timer("checkpoint"):
            self.checkpoints.after_step(step, policy_version=self.policy_version)
        return self._finish_step(row, timer, begin)

    # -- 10. checkpoint (runtime/checkpoint.py `StepCheckpoints`) --------------------------------------
    @property
    def last_checkpoint_step(self) -> int | None:
        """The step of the newest checkpoint committed (the resumed one's until this run commits one)."""
        return self.checkpoints.committed_step

    def finish_checkpoint(self) -> None:
        """Wait for the checkpoint in flight and commit it (the end of a run)."""
        self.checkpoints.finish_run()

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
            self.checkpoints.finish_failed_run()  # a checkpoint already staged is still worth committing
            raise
        finally:
            self.close()
        return self.rows

    def close(self) -> None:
        """Let go of what `setup` took: the weight sync first (over ranks, the sender lives on rank 0), the route
        recorder, then the trainer. A failure to release the sync is logged, never raised over the run's outcome."""
        try:
            self.weight_sync.close()
        except Exception as exc:  # the run's result, or its own error, matters more than the release
            log.warning("the weight sync did not close cleanly: %s: %s", type(exc).__name__, exc)
        if self.recorder is not None:
            self.recorder.close()
        self.trainer.close()
