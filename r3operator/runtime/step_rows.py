"""How a step's figures become its `StepRecord` (runtime/step_record.py), and the gauges that go with them.

The step loop (runtime/loop.py) hands a run's `StepRows` what each step measured: `rollout` for what every step has,
trained or skipped (`rollout_record`, and `with_replay` for an R3 job's replay health); `trained` for a trained
step's engine/trainer fidelity, update statistics, canary and sync (`with_training`); `finish` for the step's
timings, then the row published (`publish`). Each sets the Prometheus series of what it measures, as it measures it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from r3operator.api.enums import ReplayMode
from r3operator.rollout.multiturn import agreement_by_turn
from r3operator.routing.agreement import routing_agreement
from r3operator.routing.sample import RolloutSample
from r3operator.runtime.config import RunSettings
from r3operator.runtime.evaluation import EvalResult
from r3operator.runtime.metrics import RuntimeMetrics, StatusPusher, progress_patch
from r3operator.runtime.nonfinite import NonFiniteTally
from r3operator.runtime.report import append_row
from r3operator.runtime.route_checks import StepRoutes, StepTally
from r3operator.runtime.step_record import StepRecord
from r3operator.trainer.base import OldPass, Trainer, UpdateStats
from r3operator.trainer.batch import TrainBatch
from r3operator.trainer.distributed import DistributedTrainer
from r3operator.weightsync.session import WeightSyncSession

if TYPE_CHECKING:  # pragma: no cover
    import torch


def masked_mean(values: torch.Tensor | None, mask: torch.Tensor) -> float:
    """The mean of `values` where `mask` is set; NaN when there are no values or no masked entries (tensors)."""
    if values is None:
        return float("nan")
    count = int(mask.sum())
    return float((values * mask).sum()) / count if count else float("nan")


def rollout_record(
    step: int,
    *,
    policy_version: int,
    mode: ReplayMode,
    samples: Sequence[RolloutSample],
    rewards: np.ndarray,
    dropped: int,
    rollout_seconds: float,
    multi_turn: bool,
) -> StepRecord:
    """The figures every step has, trained or skipped: what the rollout produced (StepRecord's defaults: skipped)."""
    tokens = sum(len(s.token_ids) for s in samples)
    record = StepRecord(
        step=step,
        policy_version=policy_version,
        replay_mode=mode.value,
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()),
        samples=len(samples),
        samples_dropped=dropped,
        tokens=tokens,
        tokens_per_second=tokens / max(rollout_seconds, 1e-9),
        prompt_tokens=sum(len(s.prompt_token_ids) for s in samples),
    )
    if multi_turn:  # model turns per conversation; the environment's tokens
        record = replace(
            record,
            turns_mean=float(np.mean([s.extra["turns"] for s in samples])),
            env_tokens=int(sum(s.extra["env_tokens"] for s in samples)),
        )
    return record


def with_replay(record: StepRecord, tally: StepTally, metrics: RuntimeMetrics) -> StepRecord:
    """R3: the replayed and fallback fractions and the route checks' count of the step (and their gauges)."""
    fractions = tally.fractions
    for name, value in (
        ("r3operator_replayed_rows_ratio", fractions.replayed),
        ("r3operator_replay_fallback_rows_ratio", fractions.fallback),
    ):
        if value == value:  # NaN: nothing to measure, the series keeps its last value
            metrics.set(name, value)
    return replace(
        record,
        replayed_fraction=fractions.replayed,
        fallback_fraction=fractions.fallback,
        route_check_failures=len(tally.failures),
        route_check_message=tally.message,
    )


def with_training(
    record: StepRecord,
    samples: Sequence[RolloutSample],
    batch: TrainBatch,
    old: OldPass,
    stats: UpdateStats,
    *,
    masks: tuple[Any, Any | None],
    sync: WeightSyncSession,
    canary_ok: bool,
    multi_turn: bool,
    metrics: RuntimeMetrics,
) -> StepRecord:
    """A trained step's figures: the engine/trainer fidelity over `masks` (the response tokens and route rows
    measured; None rows: every captured one), the update's statistics, the entropy of the old-logprob pass, and the
    step's sync and canary."""
    tokens, rows = masks
    # No token to measure (async: none the current version sampled): the cells stay empty and the gauges lose their
    # series, as NaN would read as a figure and blind avg_over_time() for its window.
    measured = bool(tokens.any())
    lp_mean: float | None = None
    lp_max: float | None = None
    kl: float | None = None
    extreme: float | None = None
    natural: float | None = None
    any_diff: float | None = None
    if measured:
        lp = metrics.r3.observe_logprobs(batch.rollout_logprobs, old.logprobs, tokens)
        lp_mean, lp_max, kl, extreme = lp.abs_diff_mean, lp.abs_diff_max, lp.kl_k3, lp.extreme_token_fraction
    else:
        metrics.r3.clear_fidelity()
    applied = float("nan")
    if batch.engine_routes is not None:
        assert batch.route_pad is not None
        mask = ~batch.route_pad
        # replay_applied: the hook handed the experts the engine's ids (a wiring check; blind to a misaligned
        # batch). The routers' own choice vs the engine is the alignment signal.
        applied = routing_agreement(old.used_ids, batch.engine_routes, mask).agreement_ratio
        fidelity_rows = mask if rows is None else mask & rows
        if measured and bool(fidelity_rows.any()):
            agreement = metrics.r3.observe_routing(old.natural_ids, batch.engine_routes, fidelity_rows)
            natural, any_diff = agreement.agreement_ratio, agreement.tokens_any_diff_ratio
        elif measured:
            metrics.r3.clear_fidelity(routing_only=True)
    elif measured:
        natural = any_diff = float("nan")
    return replace(
        record,
        routing_agreement_by_turn=by_turn(samples, batch, old, metrics) if multi_turn else None,
        logprob_abs_diff_mean=lp_mean,
        logprob_abs_diff_max=lp_max,
        kl_k3=kl,
        extreme_token_fraction=extreme,
        replay_applied=applied,
        routing_natural_agreement=natural,
        routing_tokens_any_diff=any_diff,
        loss=stats.loss,
        clip_fraction=stats.clip_fraction,
        grad_norm=stats.grad_norm,
        dual_clip_fraction=stats.dual_clip_fraction,
        entropy_mean=masked_mean(old.entropy, batch.response_mask),
        nonfinite_updates=stats.updates_skipped,
        skipped=0,
        canary_ok=int(canary_ok),
        canary_near_ties=sync.near_ties,
        sync_seconds=dict(sync.phases.seconds),
    )


def trainer_peak_gib(trainer: Trainer, device: str) -> float | None:
    """The largest peak GPU memory of any trainer rank so far (GiB); None on CPU, where the driver's resident set also
    holds the rollout and would say nothing about the trainer."""
    if not device.startswith("cuda"):
        return None
    if isinstance(trainer, DistributedTrainer):  # ranks in Ray actors
        return max(trainer.peak_memory_bytes()) / 2**30
    import torch

    return int(torch.cuda.max_memory_allocated()) / 2**30  # the trainer runs in this process


def publish(
    row: StepRecord,
    phases: Mapping[str, float],
    *,
    metrics: RuntimeMetrics,
    status: StatusPusher,
    metrics_csv: Path,
    total_steps: int,
    last_checkpoint_step: int | None,
    weight_sync: str,
    nonfinite: NonFiniteTally,
) -> None:
    """The finished step's row to the Prometheus step gauges, metrics.csv and the RLJob's status.progress."""
    metrics.observe_step(row, phases)
    append_row(metrics_csv, row.row())
    status.push(
        progress_patch(
            row,
            total_steps=total_steps,
            last_checkpoint_step=last_checkpoint_step,
            weight_sync=weight_sync,
            non_finite_steps=nonfinite.total,
            last_non_finite_step=nonfinite.last,
        )
    )


def by_turn(samples: Sequence[RolloutSample], batch: TrainBatch, old: OldPass, metrics: RuntimeMetrics) -> str:
    """The natural routing agreement per turn, "0.991;0.985;…" (turn 1 first; rollout/multiturn.py)."""
    if batch.engine_routes is None or batch.route_pad is None:
        return ""
    by_id = {s.sample_id: s for s in samples}
    kept = [by_id[sid] for sid in batch.sample_ids]
    turns = agreement_by_turn(old.natural_ids, batch.engine_routes, batch.route_pad, kept)
    for turn, ratio in enumerate(turns, start=1):
        if ratio == ratio:  # a turn no conversation reached this step is NaN: no sample, no series
            metrics.set("r3operator_routing_agreement_by_turn_ratio", float(ratio), turn=str(turn))
    return ";".join(f"{x:.4f}" for x in turns)


class StepRows:
    """One run's step rows: what a step measured, with what every row of the run shares (its replay mode, the shape
    of its rollouts, its trainer and weight sync), into the step's `StepRecord`, then published. Bound once per run
    (`GRPORun.setup`, once the trainer and the sync exist), so that the loop hands it only what the step measured."""

    def __init__(
        self,
        settings: RunSettings,
        mode: ReplayMode,
        metrics: RuntimeMetrics,
        status: StatusPusher,
        nonfinite: NonFiniteTally,
        *,
        trainer: Trainer,
        sync: WeightSyncSession,
    ) -> None:
        self.mode, self.metrics, self.status, self.nonfinite = mode, metrics, status, nonfinite
        self.trainer, self.sync = trainer, sync
        self.multi_turn = settings.job.spec.rollout.multi_turn
        self.device, self.total_steps = settings.device, settings.steps
        self.metrics_csv = settings.run_dir / "metrics.csv"

    def rollout(
        self,
        step: int,
        policy_version: int,
        samples: Sequence[RolloutSample],
        rewards: np.ndarray,
        routes: StepRoutes,
        *,
        rollout_seconds: float,
    ) -> StepRecord:
        """The figures every step has, trained or skipped: what the rollout produced, the samples phase 4 and the
        route checks dropped (`routes.dropped`), and under R3 the replay's health (`with_replay`)."""
        record = rollout_record(
            step,
            policy_version=policy_version,
            mode=self.mode,
            samples=samples,
            rewards=rewards,
            dropped=len(routes.dropped),
            rollout_seconds=rollout_seconds,
            multi_turn=self.multi_turn,
        )
        return record if routes.checks is None else with_replay(record, routes.checks.step, self.metrics)

    def trained(
        self,
        record: StepRecord,
        samples: Sequence[RolloutSample],
        batch: TrainBatch,
        old: OldPass,
        stats: UpdateStats,
        masks: tuple[Any, Any | None],
        *,
        canary_ok: bool,
    ) -> StepRecord:
        """`record` with a trained step's figures (`with_training`): the fidelity over `masks`, the update's
        statistics, the step's sync and canary."""
        return with_training(
            record,
            samples,
            batch,
            old,
            stats,
            masks=masks,
            sync=self.sync,
            canary_ok=canary_ok,
            multi_turn=self.multi_turn,
            metrics=self.metrics,
        )

    def finish(
        self,
        row: StepRecord,
        phases: Mapping[str, float],
        *,
        began: float,
        evaluation: EvalResult | None,
        last_checkpoint_step: int | None,
    ) -> StepRecord:
        """The finished step's row, published (`publish`): with every phase the step ran (metrics and checkpoint
        included), its wall time since `began`, the eval reward when `evaluation` is this step's, and the trainer's
        peak memory."""
        row = replace(
            row,
            eval_reward=evaluation.reward_mean if evaluation and evaluation.step == row.step else None,
            phase_seconds=dict(phases),
            step_seconds=time.perf_counter() - began,
            trainer_peak_memory_gib=trainer_peak_gib(self.trainer, self.device),
        )
        publish(
            row,
            phases,
            metrics=self.metrics,
            status=self.status,
            metrics_csv=self.metrics_csv,
            total_steps=self.total_steps,
            last_checkpoint_step=last_checkpoint_step,
            weight_sync=self.sync.described,
            nonfinite=self.nonfinite,
        )
        return row
