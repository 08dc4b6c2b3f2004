"""spec.export in the status: the `Exported` condition and an Event per export, from the trainer's progress report.

The driver writes the exports (runtime/export.py) and reports them in `status.progress` (`exports`,
`lastExportStep`, `exportFailure`); this module says what they mean to a user. Pure.

- `Exported=True` (ExportWritten): the latest export is complete, the message says which step and where;
- `Exported=False` with the failure's reason (StoreUnreachable, AccessDenied, NoSpace, NonFiniteWeights,
  WriteFailed): an export attempt failed, being retried or given up; the message says which, why, and where the
  last complete export is (never touched by a failure);
- `Exported=Unknown` (NoExportYet): nothing exported yet.

Events: a Normal `Exported` per new complete export, a Warning `ExportFailed` per new failure (a step's first
failed attempt, and its end when it is given up). The condition's own flips send none (they would repeat these).
"""

from __future__ import annotations

from dataclasses import dataclass

from r3operator.api.enums import ConditionStatus as S
from r3operator.api.enums import ConditionType as T
from r3operator.api.v1alpha1 import ExportFailure, ExportRecord, Progress, RLJob
from r3operator.operator.conditions import Desired, Reason


def exported(job: RLJob, progress: Progress | None) -> Desired | None:
    """The Exported condition (None without spec.export)."""
    export = job.spec.export
    if export is None:
        return None
    records = (progress.exports if progress is not None else None) or []
    failure = progress.export_failure if progress is not None else None
    last = records[-1] if records else None
    if failure is not None and (last is None or failure.step >= last.step):
        return Desired(T.EXPORTED, S.FALSE, failure.reason, describe_failure(failure, last))
    if last is not None:
        return Desired(T.EXPORTED, S.TRUE, Reason.EXPORT_WRITTEN, f"step {last.step} exported to {last.uri}")
    due = f"every {export.interval_steps} steps" if export.interval_steps is not None else "after the last step"
    if export.interval_steps is not None and export.at_end:
        due += " and after the last step"
    return Desired(
        T.EXPORTED, S.UNKNOWN, Reason.NO_EXPORT_YET, f"no export yet; exports go to {export.destination} {due}"
    )


def describe_failure(failure: ExportFailure, last: ExportRecord | None) -> str:
    """The failure, and where the last complete export is (a failure never touches it)."""
    state = (
        f"attempt {failure.attempts} failed, retrying"
        if failure.retrying
        else f"given up after {failure.attempts} attempt(s)"
    )
    kept = (
        f"the last complete export, step {last.step} at {last.uri}, is untouched"
        if last is not None
        else "no export is complete yet"
    )
    return f"export of step {failure.step} ({state}): {failure.message}; {kept}"


@dataclass(frozen=True, slots=True)
class ExportSeen:
    """What the operator last said about a job's exports: the latest export's step, the last failure's key."""

    last_step: int | None
    failure: tuple[int, str, bool] | None


def export_events(
    job: RLJob, progress: Progress | None, seen: ExportSeen | None
) -> tuple[ExportSeen | None, list[tuple[str, str, str]]]:
    """(what to remember, the Events to send as (type, reason, message)) for `progress`, the status this pass
    writes. `seen`: the last pass's memory, None since this operator started: then nothing already reported is
    sent again (a restarted operator would repeat every export's Event)."""
    if job.spec.export is None:
        return seen, []
    if progress is None:  # no report yet: whatever comes first is news
        return seen or ExportSeen(None, None), []
    records = progress.exports or []
    failure = progress.export_failure
    now = ExportSeen(
        last_step=records[-1].step if records else None,
        failure=(failure.step, failure.reason, failure.retrying) if failure is not None else None,
    )
    if seen is None:
        return now, []
    events: list[tuple[str, str, str]] = []
    for record in records:
        if seen.last_step is None or record.step > seen.last_step:
            reward = f", eval reward {record.eval_reward:.4g}" if record.eval_reward is not None else ""
            events.append(("Normal", Reason.EXPORTED, f"step {record.step} exported to {record.uri}{reward}"))
    if failure is not None and now.failure != seen.failure:
        last = records[-1] if records else None
        events.append(("Warning", Reason.EXPORT_FAILED, describe_failure(failure, last)[:1024]))
    return now, events
