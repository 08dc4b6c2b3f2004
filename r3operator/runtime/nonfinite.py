"""The driver's side of the non-finite guard: which steps had an update the trainer refused to apply, and
when a run of them ends the job.

The trainer skips every optimizer step whose loss or gradient is not finite on some rank
(trainer/nonfinite.py). A step with such an update is a *non-finite step*: counted (`nonfinite_updates` in
metrics.csv, `r3operator_nonfinite_steps_total`, `status.progress.nonFiniteSteps`); when none of its
mini-batches was applied the weights did not change, so the step is neither synced to the engines (no new
policy version) nor checkpointed. `algorithm.maxNonFiniteSteps` of them in a row fail the run with
`NonFiniteStepsError`, naming the steps: the cause (a reward that is NaN, a model that diverged) is not one
a retry of the same data fixes, and the last checkpoint holds the last weights that were applied.

Fault injection (R3OPERATOR_FAULT_NONFINITE_STEPS) makes such steps on purpose, for the tests and the GPU acceptance
run: `NonFiniteTally.poison` turns a listed step's advantages into NaN.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3operator.api.v1alpha1 import AlgorithmSpec
from r3operator.runtime.metrics import RuntimeMetrics
from r3operator.settings import runtime_settings
from r3operator.trainer.base import UpdateStats

log = logging.getLogger("r3operator.runtime")


class NonFiniteStepsError(RuntimeError):
    """`algorithm.maxNonFiniteSteps` steps in a row had updates with a non-finite loss or gradient."""


def nonfinite_updates(row: Mapping[str, Any]) -> int:
    """A metrics.csv row's `nonfinite_updates` (0 where the cell is empty: a row of an older image)."""
    try:
        return int(row.get("nonfinite_updates") or 0)
    except (TypeError, ValueError):
        return 0


@dataclass
class NonFiniteTally:
    """The run's non-finite steps: how many (`r3operator_nonfinite_steps_total` in `metrics`), the last, and the
    current run of them; and the steps fault injection makes non-finite (`poison`)."""

    limit: int  # algorithm.maxNonFiniteSteps
    metrics: RuntimeMetrics
    fault_steps: frozenset[int] = frozenset()  # R3OPERATOR_FAULT_NONFINITE_STEPS
    mini_batches: int = 1  # algorithm.miniBatches: one NaN advantage in each poisons every update of a step
    total: int = 0
    last: int | None = None
    streak: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.metrics.inc("r3operator_nonfinite_steps_total", 0)  # a series from the start: increase() sees the first

    @classmethod
    def for_run(cls, algorithm: AlgorithmSpec, metrics: RuntimeMetrics) -> NonFiniteTally:
        """The tally of a run of `algorithm`, with the fault steps of this process's settings."""
        return cls(
            limit=algorithm.max_non_finite_steps,
            metrics=metrics,
            fault_steps=frozenset(runtime_settings().fault_nonfinite_steps),
            mini_batches=algorithm.mini_batches,
        )

    def poison(self, step: int, advantages: np.ndarray) -> np.ndarray:
        """`advantages`, made NaN when fault injection lists `step` (module `poison`)."""
        return poison(step, advantages, self.fault_steps, mini_batches=self.mini_batches)

    def resume(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Take the count back from the metrics.csv rows a resume keeps (steps up to its checkpoint)."""
        for row in rows:
            step = int(row["step"])
            if nonfinite_updates(row):
                self.total, self.last = self.total + 1, step
                self.streak.append(step)
            elif str(row.get("skipped")) not in ("1", "True"):
                self.streak = []

    def record(self, step: int, stats: UpdateStats) -> bool:
        """Count `step`'s update (and, when some of it was not applied, `r3operator_nonfinite_steps_total`); True when
        it changed the weights (some mini-batch was applied)."""
        if not stats.updates_skipped:
            self.streak = []
            return True
        self.total, self.last = self.total + 1, step
        self.streak.append(step)
        applied = stats.applied_any
        log.error(
            "step %d: %d of %d optimizer step(s) had a non-finite loss or gradient and were not applied%s "
            "(%d such step(s) in a row, algorithm.maxNonFiniteSteps %d)",
            step,
            stats.updates_skipped,
            stats.updates,
            "" if applied else "; the weights did not change: no sync, no checkpoint",
            len(self.streak),
            self.limit,
        )
        self.metrics.inc("r3operator_nonfinite_steps_total")
        return applied

    def check(self) -> None:
        """Raise NonFiniteStepsError once the current run of non-finite steps reaches the limit."""
        if len(self.streak) >= self.limit:
            steps = ", ".join(str(s) for s in self.streak)
            raise NonFiniteStepsError(
                f"steps {steps}: {len(self.streak)} steps in a row had a non-finite loss or gradient "
                f"(spec.algorithm.maxNonFiniteSteps {self.limit}); their updates were not applied, and no "
                f"non-finite value reached an engine or a checkpoint. Look for a reward or advantage that is "
                f"NaN and at the steps' loss and grad_norm in metrics.csv"
            )


def poison(step: int, advantages: np.ndarray, fault_steps: frozenset[int], *, mini_batches: int) -> np.ndarray:
    """Fault injection (R3OPERATOR_FAULT_NONFINITE_STEPS): on a listed step, the first `mini_batches` samples'
    advantages become NaN, one in each mini-batch (they are strided, `trainer.base.mini_batch_rows`), so no
    update of the step is finite. Each NaN row lands on one rank (the first of its mini-batch's share): the
    other ranks learn of it through the gradient reduction and the guard's flag."""
    if step not in fault_steps:
        return advantages
    count = min(mini_batches, len(advantages))
    log.warning(
        "fault injection (R3OPERATOR_FAULT_NONFINITE_STEPS): step %d's first %d advantage(s) are NaN", step, count
    )
    poisoned = np.array(advantages, dtype=np.float32, copy=True)
    poisoned[:count] = np.nan
    return poisoned
