"""One RL step's figures, typed: `StepRecord`.

The step loop (runtime/loop.py, runtime/async_loop.py) fills one record per step; metrics.csv and report.md
(runtime/report.py), the Prometheus step gauges (runtime/metrics.py), the progress line (runtime/progress.py)
and the RLJob's `status.progress` (`api.v1alpha1.Progress`) all read it. Its column names are declared here
once (`COLUMNS`, metrics.csv's header, in order).

A record is frozen and read by attribute. `cells()` is the row as metrics.csv has it, the columns the step had:
the multi-turn and asynchronous ones only in such jobs, `t_<phase>` and `sync_<phase>` for the phases that ran.
Empty cells are None (nothing to measure: async without a current-version token); a skipped step's fidelity
figures are NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from r3operator.api.v1alpha1 import Progress
from r3operator.wire.sync_phases import SYNC_PHASES

NAN = math.nan

# The timed phases of a step (`t_<phase>` columns), in the order of metrics.csv; `eval` only on the steps that ran
# the held-out evaluation (runtime/evaluation.py); `pause` is the asynchronous driver's wait for the rollout
# segment in flight before a weight sync.
STEP_PHASES = (
    "rollout",
    "reward",
    "advantages",
    "routes",
    "route_checks",
    "old_logprob",
    "update",
    "weight_sync",
    "canary",
    "eval",
    "metrics",
    "checkpoint",
)
ASYNC_PHASES = ("pause",)

_EVERY_STEP = (
    "step",
    "policy_version",
    "replay_mode",
    "reward_mean",
    "reward_std",
    "samples",
    "samples_dropped",
    "tokens",
    "prompt_tokens",
    "tokens_per_second",
    "logprob_abs_diff_mean",
    "logprob_abs_diff_max",
    "kl_k3",
    "extreme_token_fraction",
    "replay_applied",
    "routing_natural_agreement",
    "routing_tokens_any_diff",
    "loss",
    "clip_fraction",
    "grad_norm",
    "entropy_mean",
    "dual_clip_fraction",
    "canary_ok",
    "canary_near_ties",
    "step_seconds",
)
_AFTER_PHASES = ("skipped", "trainer_peak_memory_gib", "nonfinite_updates")
_MULTI_TURN = ("turns_mean", "env_tokens")  # a multi-turn job's rollout
_BY_TURN = ("routing_agreement_by_turn",)  # a multi-turn job's trained step
_ASYNC_ROLLOUT = ("staleness_mean", "staleness_max", "partial_rollouts", "stale_dropped", "trainer_idle_seconds")
_ASYNC_UPDATE = ("importance_weight_mean", "importance_truncated_fraction")
# R3 jobs: how much of the step replayed, and what the route checks found (runtime/route_checks.py)
_REPLAY_HEALTH = (
    "replayed_fraction",
    "fallback_fraction",
    "route_check_failures",
    "route_check_message",
)
# async: logprob_abs_diff_* and routing_natural_agreement run over the current version's tokens of fresh
# trajectories (the mismatch; empty when the step trained none); the older tokens' |Δlogprob| (the staleness)
# is apart, also per lag ("0.0041;0.0812;-": lag 0 first, "-" where the lag had no token) with its token
# counts, and so are the current-version tokens of resumed (partial-rollout) trajectories.
_ASYNC_FIDELITY = (
    "current_version_tokens",
    "logprob_abs_diff_mean_stale",
    "logprob_abs_diff_by_lag",
    "tokens_by_lag",
    "logprob_abs_diff_mean_resumed",
)
_EVAL = ("eval_reward",)  # spec.evaluation: the held-out reward, on the steps that evaluated (runtime/evaluation.py)

COLUMNS: tuple[str, ...] = (
    *_EVERY_STEP,
    *(f"t_{phase}" for phase in STEP_PHASES),
    *_AFTER_PHASES,
    *_MULTI_TURN,
    *_BY_TURN,
    *_ASYNC_ROLLOUT,
    *_ASYNC_UPDATE,
    *(f"t_{phase}" for phase in ASYNC_PHASES),
    *_ASYNC_FIDELITY,
    *(f"sync_{phase}" for phase in SYNC_PHASES),  # the weight sync's phases (wire/sync_phases.py)
    *_REPLAY_HEALTH,
    *_EVAL,
)
"""metrics.csv's header, in order."""


@dataclass(frozen=True)
class StepRecord:
    """What one step measured. The defaults are a skipped step's: no update, so no fidelity figure (NaN)."""

    # -- every step, trained or skipped: what the rollout produced
    step: int
    policy_version: int
    replay_mode: str
    reward_mean: float
    reward_std: float
    samples: int
    samples_dropped: int
    tokens: int
    """Generated tokens of the step's samples."""
    tokens_per_second: float
    prompt_tokens: int = 0
    """Prompt tokens of the step's samples (each sample counts its prompt): with `tokens`, what the trainer reads."""
    # -- the old-logprob pass and the update (None: no token to measure, the cell stays empty)
    logprob_abs_diff_mean: float | None = NAN
    logprob_abs_diff_max: float | None = NAN
    kl_k3: float | None = NAN
    extreme_token_fraction: float | None = NAN
    """Response tokens whose trainer/rollout probability ratio is outside [0.5, 2] (trainer/metrics.py)."""
    replay_applied: float = NAN
    routing_natural_agreement: float | None = NAN
    routing_tokens_any_diff: float | None = NAN
    """Tokens with a captured route (prompt and response) whose trainer-chosen experts differ from the engine's in at
    least one MoE layer (the R3 paper reports 94 % for its models; `routing_natural_agreement` counts (token, layer)
    pairs over the same rows)."""
    loss: float = NAN
    clip_fraction: float = NAN
    grad_norm: float = NAN
    entropy_mean: float = NAN
    """Mean entropy (nats) of the policy's next-token distribution over the response tokens, old-logprob pass."""
    dual_clip_fraction: float = NAN
    canary_ok: int = 0
    canary_near_ties: int = 0
    skipped: int = 1
    step_seconds: float = 0.0
    trainer_peak_memory_gib: float | None = None  # GPU runs only
    # mini-batch updates whose loss or gradient was not finite, not applied (runtime/nonfinite.py)
    nonfinite_updates: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # t_<phase>
    sync_seconds: dict[str, float] = field(default_factory=dict)  # sync_<phase>: the step's weight sync
    # -- multi-turn jobs
    turns_mean: float | None = None
    env_tokens: int | None = None
    routing_agreement_by_turn: str | None = None
    # -- algorithm.mode async
    staleness_mean: float | None = None
    staleness_max: int | None = None
    partial_rollouts: int | None = None
    stale_dropped: int | None = None
    trainer_idle_seconds: float | None = None
    importance_weight_mean: float | None = None
    importance_truncated_fraction: float | None = None
    current_version_tokens: int | None = None
    logprob_abs_diff_mean_stale: float | None = None
    logprob_abs_diff_by_lag: str | None = None
    tokens_by_lag: str | None = None
    logprob_abs_diff_mean_resumed: float | None = None  # current-version tokens of resumed trajectories
    # -- R3 jobs
    replayed_fraction: float | None = None
    fallback_fraction: float | None = None
    route_check_failures: int | None = None
    route_check_message: str | None = None
    # -- spec.evaluation, on the steps that evaluated
    eval_reward: float | None = None

    def cells(self) -> dict[str, Any]:
        """The step's columns and values, in metrics.csv's order (a column the step did not have is absent)."""
        out: dict[str, Any] = {}
        groups: list[tuple[tuple[str, ...], bool]] = [
            (_EVERY_STEP, True),
            (_AFTER_PHASES, True),
            (_MULTI_TURN, self.turns_mean is not None),
            (_BY_TURN, self.routing_agreement_by_turn is not None),
            (_ASYNC_ROLLOUT, self.staleness_mean is not None),
            (_ASYNC_UPDATE + _ASYNC_FIDELITY, self.importance_weight_mean is not None),
            (_REPLAY_HEALTH, self.route_check_failures is not None),
            (_EVAL, self.eval_reward is not None),
        ]
        have = {name for names, present in groups if present for name in names}
        have.update(f"t_{phase}" for phase in self.phase_seconds)
        have.update(f"sync_{phase}" for phase in self.sync_seconds)
        for column in COLUMNS:
            if column in have:
                out[column] = self._value(column)
        return out

    def _value(self, column: str) -> Any:
        if column.startswith("t_"):
            return self.phase_seconds[column.removeprefix("t_")]
        if column.startswith("sync_"):
            return self.sync_seconds[column.removeprefix("sync_")]
        return getattr(self, column)

    def row(self) -> dict[str, Any]:
        """metrics.csv's row: every column, "" where the step had none (csv writes None as "")."""
        present = self.cells()
        return {column: present.get(column, "") for column in COLUMNS}


def _finite(value: Any) -> float | None:
    """A figure for the RLJob status: None for an empty cell, NaN or an infinity (JSON has neither)."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def step_progress(
    record: StepRecord,
    *,
    total_steps: int,
    last_checkpoint_step: int | None,
    updated_at: str,
    weight_sync: str | None = None,
    non_finite_steps: int | None = None,
    last_non_finite_step: int | None = None,
) -> Progress:
    """The RLJob's `status.progress` after the step `record`; `non_finite_steps` / `last_non_finite_step`: the
    run's count of non-finite steps and the last one; the eval figures only when the step evaluated (None
    otherwise: the status keeps the last evaluation's)."""
    eval_reward = _finite(record.eval_reward)
    return Progress(
        step=int(record.step),
        total_steps=int(total_steps),
        reward_mean=_finite(record.reward_mean),
        logprob_abs_diff_mean=_finite(record.logprob_abs_diff_mean),
        logprob_abs_diff_max=_finite(record.logprob_abs_diff_max),
        kl_k3=_finite(record.kl_k3),
        routing_agreement=_finite(record.routing_natural_agreement),
        last_checkpoint_step=last_checkpoint_step,
        non_finite_steps=non_finite_steps,
        last_non_finite_step=last_non_finite_step,
        eval_reward=eval_reward,
        eval_step=None if eval_reward is None else int(record.step),
        updated_at=updated_at,
        weight_sync=None if weight_sync is None else weight_sync[:512],
        replayed_fraction=_finite(record.replayed_fraction),
        fallback_fraction=_finite(record.fallback_fraction),
        extreme_token_fraction=_finite(record.extreme_token_fraction),
        route_check_failures=record.route_check_failures,
        route_check_message=record.route_check_message or None,
        weight_sync_seconds=_milliseconds(_finite(record.phase_seconds.get("weight_sync"))),
    )


def _milliseconds(seconds: float | None) -> float | None:
    """Seconds to the millisecond: what `kubectl get` shows of a sync, not 17 digits of timer noise."""
    return None if seconds is None else round(seconds, 3)
