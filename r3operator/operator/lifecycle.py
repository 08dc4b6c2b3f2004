"""Where an RLJob is in its life, read from its spec and its (previous) status. Pure."""

from __future__ import annotations

import datetime as dt

from r3operator.api.enums import ConditionStatus, ConditionType
from r3operator.api.v1alpha1 import RLJob


def condition_true(job: RLJob, ctype: ConditionType) -> bool:
    status = job.status
    if status is None:
        return False
    return any(c.type == ctype.value and c.status is ConditionStatus.TRUE for c in status.conditions)


def is_terminal(job: RLJob) -> bool:
    """Succeeded or Failed is True: sticky, no child recreation can undo it."""
    return condition_true(job, ConditionType.SUCCEEDED) or condition_true(job, ConditionType.FAILED)


def is_suspended(job: RLJob) -> bool:
    return job.spec.run_policy.suspend


def parse_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def format_time(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def ttl_expired(job: RLJob, now: dt.datetime | None) -> bool:
    """``ttlSecondsAfterFinished`` elapsed since ``status.completionTime``."""
    ttl = job.spec.run_policy.ttl_seconds_after_finished
    if ttl is None or now is None or not is_terminal(job) or job.status is None:
        return False
    finished = parse_time(job.status.completion_time)
    return finished is not None and (now - finished).total_seconds() >= ttl
