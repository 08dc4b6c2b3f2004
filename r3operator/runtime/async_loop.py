"""The asynchronous GRPO driver (`algorithm.mode: async`): rollouts never stop for training.

A producer thread (rollout/producer.py) keeps the engines generating GRPO groups into a bounded queue; a
step of this driver is

    1 rollout       take `promptsPerStep` finished groups from the queue (the time spent waiting is the
                    trainer's idle time); a group with a sample more than `maxStaleness` policy versions old
                    is dropped and counted (`r3operator_samples_dropped_total{reason="stale"}`) and another taken
    2-5             reward, advantages, routes, old-logprob pass: as in the synchronous step (loop.py); the
                    old-logprob pass runs under the current weights, the policy the update starts from
    6 update        PPO-clip, every token weighted by its truncated importance weight
                    min(pi_old / pi_rollout, importanceWeightCap) (trainer/grpo/loss.py): the rollout
                    logprobs come from the (older) policies that sampled the tokens
    7 weight_sync   pause the producer at its next pause point (the segment in flight finishes), sync,
    8 canary        check the canary, run the held-out evaluation when due (spec.evaluation, on the new policy
                    while nothing else is on the engines), publish the new policy version, resume: unfinished
                    trajectories continue under the new weights keeping their tokens and routes (partial rollouts)
    9-10            metrics (staleness histogram, partial-rollout count), checkpoint

Under R3 the stitched routes of a partial rollout hold each token's rows from the weights that routed it,
and the replayed old-logprob pass reproduces the rollout logprobs up to the policy change, so the
importance weight measures staleness rather than a routing mismatch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from r3operator.rollout.engines import EngineGroup
from r3operator.rollout.partial import (
    abs_diff_by_lag,
    current_version_masks,
    format_by_lag,
    renumber,
    resumed,
    split_stale,
    staleness,
    token_lags,
)
from r3operator.rollout.producer import EngineGate, RolloutProducer
from r3operator.routing.sample import RolloutSample
from r3operator.runtime.config import RunSettings
from r3operator.runtime.loop import GRPORun
from r3operator.runtime.progress import StepTable
from r3operator.runtime.step_record import StepRecord
from r3operator.tasks import toy as tasks
from r3operator.trainer.base import OldPass, UpdateStats
from r3operator.trainer.batch import TrainBatch
from r3operator.wire.sync_phases import PhaseTimer

log = logging.getLogger("r3operator.runtime")
PROBLEM_SEED = 1_000_000  # problem draws of the producer: apart from the synchronous steps' draws


def segment_tokens(max_tokens: int, partial_rollout: bool, segment: int | None) -> int:
    """Tokens per request: with partial rollouts the configured segment (default maxTokens / 4, at least 1),
    else the whole response, so that a weight update waits for the requests in flight."""
    if not partial_rollout:
        return max_tokens
    return min(max_tokens, segment or max(1, max_tokens // 4))


class AsyncGRPORun(GRPORun):
    def __init__(self, settings: RunSettings, *, engines: EngineGroup | None = None) -> None:
        super().__init__(settings, engines=engines)
        if self.spec.algorithm.mode != "async":
            raise ValueError(f"AsyncGRPORun needs spec.algorithm.mode async, got {self.spec.algorithm.mode}")
        if self.spec.rollout.multi_turn:
            raise ValueError("spec.algorithm.mode async with spec.rollout.multiTurn is not in this runtime yet")
        self.producer: RolloutProducer | None = None
        self.problems: dict[int, tasks.Problem] = {}  # the producer's problem number -> problem
        self.gate = EngineGate()
        self.step_version = 0  # the policy version the step in progress trains from (set by rollout())
        self._tokens_seen = 0
        self._clock = time.perf_counter()

    # -- setup --------------------------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        ro, alg = self.spec.rollout, self.spec.algorithm
        self.gate.set_version(self.policy_version)
        engines = self.engines

        def generate(prompts: list[list[int]], starts: list[int], max_tokens: int, seed: int) -> list[RolloutSample]:
            def call() -> list[RolloutSample]:
                return engines.generate(
                    prompts,
                    max_tokens=max_tokens,
                    temperature=ro.temperature,
                    seed=seed,
                    n=1,
                    routed_experts_prompt_start=starts,
                )

            # Never re-syncs from this thread: a stale engine is recovered by the trainer thread (rollout()).
            return self.supervisor.current_only(call, what="asynchronous rollout segment")

        def next_prompt(problem_no: int) -> Sequence[int]:
            rng = np.random.default_rng([self.spec.seed, PROBLEM_SEED, self.start_step, problem_no])
            problem = tasks.sample_problems(self.pool, count=1, rng=rng)[0]
            self.problems[problem_no] = problem
            return problem.prompt_ids

        self.producer = RolloutProducer(
            generate=generate,
            next_prompt=next_prompt,
            gate=self.gate,
            group_size=ro.group_size,
            max_tokens=ro.max_tokens,
            segment_tokens=segment_tokens(ro.max_tokens, ro.partial_rollout, ro.partial_rollout_segment),
            groups_in_flight=ro.prompts_per_step,
            queue_groups=ro.prompts_per_step * max(1, alg.max_staleness),
            num_experts=self.num_experts,
            seed=self.spec.seed,
        )
        self._clock = time.perf_counter()
        self.producer.start()

    def shutdown(self) -> None:
        if self.producer is not None:
            self.producer.stop()

    # -- the numbered phases ------------------------------------------------------------------------
    def rollout(self, step: int) -> tuple[list[RolloutSample], list[tasks.Problem]]:
        """1. `promptsPerStep` groups from the queue, none more than `maxStaleness` versions old."""
        assert self.producer is not None
        pps, limit = self.spec.rollout.prompts_per_step, self.spec.algorithm.max_staleness
        kept: list[list[RolloutSample]] = []
        self.step_staleness: list[int] = []
        self.step_partial = 0
        self.step_stale_dropped = 0
        while len(kept) < pps:
            taken = self.producer.take(pps - len(kept), while_waiting=self.recover_engines)
            for sample in (s for group in taken for s in group):
                age = staleness(sample, current_version=self.policy_version)
                self.metrics.observe("r3operator_rollout_staleness", age)
                self.metrics.inc("r3operator_partial_rollouts_total", int(sample.extra["partial"]))
            fresh, stale = split_stale(taken, current_version=self.policy_version, max_staleness=limit)
            for group in stale:  # expected in this mode, so counted and summarised, not logged per sample
                self.metrics.inc("r3operator_samples_dropped_total", len(group), reason="stale")
                self.routes.dropped.extend((sample.sample_id, "stale") for sample in group)
                self.step_stale_dropped += len(group)
                self.problems.pop(group[0].prompt_index, None)
            kept.extend(fresh)
        if self.step_stale_dropped:
            log.info(
                "step %d: %d samples older than algorithm.maxStaleness=%d policy versions dropped",
                step,
                self.step_stale_dropped,
                limit,
            )
        for sample in (s for group in kept for s in group):  # the step's columns describe what it trains on
            self.step_staleness.append(staleness(sample, current_version=self.policy_version))
            self.step_partial += int(sample.extra["partial"])
        # The version this step trains from (the old-logprob pass runs its weights); the metrics phase
        # comes after the sync, when `policy_version` already names the next one.
        self.step_version = self.policy_version
        problems = [self.problems.pop(group[0].prompt_index) for group in kept]
        samples = renumber(kept)
        self.metrics.r3.observe_rollout(samples)
        if self.recorder is not None:  # R3: the step's routes on the volume, written in the background
            self.recorder.record(step, samples, policy_version=self.policy_version)
        return samples, problems

    def recover_engines(self) -> None:
        """Re-sync and canary the engines the producer found stale, on this (the trainer's) thread, with the
        engines paused, while the weights are those of the published version (no update is in progress
        during the rollout phase): the re-synced engine serves exactly the version its tokens are stamped
        with."""
        self.gate.recover(self.supervisor.ensure_current)

    def update(self, batch: TrainBatch, old: OldPass) -> UpdateStats:
        """6. PPO-clip with truncated importance weights pi_old / pi_rollout per token."""
        alg = self.spec.algorithm
        return self.trainer.update(
            batch,
            old,
            mini_batches=alg.mini_batches,
            clip_low=alg.clip_ratio_low,
            clip_high=alg.clip_ratio_high,
            importance_cap=alg.importance_weight_cap,
            clip_ratio_c=alg.clip_ratio_c,
        )

    def sync_and_canary(self, timer: PhaseTimer, step: int) -> bool:
        """7-8. With the engines paused: sync, canary, the held-out evaluation when due (on the new policy, with no
        rollout segment beside it), then publish the new version and resume. `pause` is the wait for the segment
        in flight (the sync, the canary and the evaluation are timed on their own)."""
        with timer("pause"), self.gate.paused():
            with timer("weight_sync"):
                self.sync_weights()
            with timer("canary"):
                canary_ok = self.canary()
            super().evaluate(step, timer)
            self.gate.set_version(self.policy_version)
            self.gate.recovered()  # the sync installed the new version on every engine
        timer.seconds["pause"] -= (
            timer.seconds["weight_sync"] + timer.seconds["canary"] + timer.seconds.get("eval", 0.0)
        )
        return canary_ok

    def evaluate(self, step: int, timer: PhaseTimer) -> None:
        """A skipped step's due evaluation: the producer pauses for it as for a weight sync."""
        if self.evaluation is not None and self.evaluation.due(step):
            with self.gate.paused():
                super().evaluate(step, timer)

    def _fidelity_masks(
        self, samples: Sequence[RolloutSample], batch: TrainBatch, old: OldPass
    ) -> tuple[Any, Any | None]:
        """Only the tokens and route rows of the current policy version in trajectories it sampled alone (fresh
        ones): the old-logprob pass runs under its weights, so there engine vs trainer is the mismatch alone. A
        step with none of them has no mismatch figure (empty cells, no Prometheus series: loop.py). A resumed
        trajectory's current-version tokens go apart (`logprob_abs_diff_mean_resumed`): the engine sampled them
        after re-reading the earlier tokens under the new weights, while the trainer replays those tokens' old
        routes (rollout/partial.py, `resumed`). The gap per staleness lag, every trajectory's tokens, goes apart
        too (`logprob_abs_diff_by_lag`, `tokens_by_lag`): lag 0 adds the resumed trajectories' current-version
        tokens to the mismatch, lag L > 0 adds what L updates moved the policy, which the importance weights
        correct and a weight sync did not cause."""
        import torch

        by_id = {s.sample_id: s for s in samples}
        rows_in_batch = [by_id[sid] for sid in batch.sample_ids]
        width = int(batch.input_ids.shape[1])
        tokens, rows = current_version_masks(rows_in_batch, width=width, version=self.step_version)
        interrupted = resumed(rows_in_batch)[:, None]
        resumed_tokens = tokens & interrupted & batch.response_mask.cpu().numpy()
        tokens, rows = tokens & ~interrupted, rows & ~interrupted
        lags = token_lags(rows_in_batch, width=width, version=self.step_version)
        lags[~batch.response_mask.cpu().numpy()] = -1
        max_lag = max(self.spec.algorithm.max_staleness, int(lags.max(initial=0)))
        engine, trainer = batch.rollout_logprobs.float().cpu().numpy(), old.logprobs.float().cpu().numpy()
        self.step_resumed_diff = (
            float(np.abs(engine[resumed_tokens].astype(np.float64) - trainer[resumed_tokens]).mean())
            if resumed_tokens.any()
            else None
        )
        gaps = abs_diff_by_lag(engine, trainer, lags, max_lag=max_lag)
        self.step_by_lag = format_by_lag(gaps)
        self.metrics.observe_lags(gaps, max_staleness=self.spec.algorithm.max_staleness)
        stale = [g for g in gaps if g.lag > 0 and g.tokens]
        self.step_stale_diff = (
            (sum(g.tokens * (g.abs_diff_mean or 0.0) for g in stale) / sum(g.tokens for g in stale)) if stale else None
        )
        device = batch.response_mask.device
        current = batch.response_mask & torch.from_numpy(tokens).to(device)
        self.step_current_tokens = int(current.sum())
        return current, torch.from_numpy(rows).to(device)

    def _update_columns(self, row: StepRecord, stats: UpdateStats) -> StepRecord:
        self.metrics.set("r3operator_importance_weight_mean", stats.importance_weight_mean)
        by_lag, tokens_by_lag = self.step_by_lag
        return replace(
            row,
            importance_weight_mean=stats.importance_weight_mean,
            importance_truncated_fraction=stats.importance_truncated_fraction,
            current_version_tokens=self.step_current_tokens,
            logprob_abs_diff_mean_stale=self.step_stale_diff,
            logprob_abs_diff_mean_resumed=self.step_resumed_diff,
            logprob_abs_diff_by_lag=by_lag,
            tokens_by_lag=tokens_by_lag,
        )

    def _rollout_columns(
        self, step: int, samples: Sequence[RolloutSample], rewards: np.ndarray, timer: PhaseTimer
    ) -> StepRecord:
        """The synchronous columns, with throughput from the producer (the rollout phase here is the time the
        trainer waited for it) and the asynchronous ones: staleness, partial rollouts, stale drops."""
        record = super()._rollout_columns(step, samples, rewards, timer)
        assert self.producer is not None
        now, produced = time.perf_counter(), self.producer.tokens_generated
        tokens_per_second = (produced - self._tokens_seen) / max(now - self._clock, 1e-9)
        self._tokens_seen, self._clock = produced, now
        ages = np.asarray(self.step_staleness or [0])
        return replace(
            record,
            tokens_per_second=tokens_per_second,
            staleness_mean=float(ages.mean()),
            staleness_max=int(ages.max()),
            partial_rollouts=self.step_partial,
            stale_dropped=self.step_stale_dropped,
            trainer_idle_seconds=timer.seconds["rollout"],
        )

    # -- the loop -----------------------------------------------------------------------------------
    def run(self, *, table: StepTable | None = None) -> list[StepRecord]:
        try:
            return super().run(table=table)
        finally:
            self.shutdown()
