"""Where an RLJob is in its life. Pure.

The end of a job is read from the trainer RayJob the operator observes (KubeRay writes its status;
the trainer's ServiceAccount cannot), never from the RLJob's own status: that status is output, and
whoever may patch ``rljobs/status`` (the job's own trainer pods, an admin by mistake) could otherwise
make the operator stop engines or delete children and data. See "Security model" in docs/operator.md.

Once the RayJob is deleted (after ``ttlSecondsAfterFinished``), the record of the end is the RLJob's
annotation ``r3operator.io/finished`` ("Succeeded|Failed <time>"), which the operator writes when it
first sees the end: metadata, which a ``/status`` patch cannot change.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from r3operator.api.enums import ConditionStatus, ConditionType
from r3operator.api.v1alpha1 import RLJob

ANNOTATION_FINISHED = "r3operator.io/finished"


@dataclass(frozen=True, slots=True)
class Finish:
    """The trainer RayJob reached a terminal state, as KubeRay reports it."""

    succeeded: bool
    message: str
    ended_at: dt.datetime | None
    """RayJob ``status.endTime`` (None when KubeRay did not set it)."""


def observed_finish(ray_job: dict[str, Any] | None) -> Finish | None:
    status = (ray_job or {}).get("status") or {}
    deployment = str(status.get("jobDeploymentStatus") or "")
    job_status = str(status.get("jobStatus") or "")
    message = str(status.get("message") or "")
    ended_at = parse_time(status.get("endTime"))
    if job_status == "SUCCEEDED" and deployment in ("Complete", ""):
        return Finish(True, message or "the trainer RayJob succeeded", ended_at)
    if deployment == "Failed":
        return Finish(False, message or "the trainer RayJob failed", ended_at)
    return None


def condition_true(job: RLJob, ctype: ConditionType) -> bool:
    status = job.status
    if status is None:
        return False
    return any(c.type == ctype.value and c.status is ConditionStatus.TRUE for c in status.conditions)


def status_says_finished(job: RLJob) -> bool:
    """The RLJob's status shows an end (Succeeded or Failed True). Output, and forgeable by the trainer
    pods: reconcile.py consults it only for a job with neither a RayJob nor engines nor the finished
    annotation, i.e. one that ended and was cleaned up under an operator that kept no annotation."""
    return condition_true(job, ConditionType.SUCCEEDED) or condition_true(job, ConditionType.FAILED)


def finish_annotation(finish: Finish, now: dt.datetime) -> str:
    """The value of ANNOTATION_FINISHED for an end first seen ``now``."""
    return f"{'Succeeded' if finish.succeeded else 'Failed'} {format_time(finish.ended_at or now)}"


def recorded_end(job: RLJob) -> dt.datetime | None:
    """When the end the operator recorded in ANNOTATION_FINISHED happened; None without a (readable) record."""
    return recorded_end_in(job.metadata.annotations)


def recorded_end_in(annotations: Mapping[str, Any]) -> dt.datetime | None:
    """`recorded_end` from an RLJob's raw annotations (a body not parsed)."""
    return parse_time(str(annotations.get(ANNOTATION_FINISHED, "")).rpartition(" ")[2])


def is_suspended(job: RLJob) -> bool:
    return job.spec.run_policy.suspend


def parse_time(text: str | None) -> dt.datetime | None:
    """An RFC 3339 time as the API writes it; one without a zone (written by hand) is taken as UTC, so every
    result compares with ``now`` in UTC."""
    if not text:
        return None
    try:
        when = dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def format_time(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def finished_at(job: RLJob, finish: Finish) -> dt.datetime | None:
    """The RayJob's endTime; without one, the time the operator recorded when it first saw the end."""
    if finish.ended_at is not None:
        return finish.ended_at
    return recorded_end(job)


def ttl_expired(job: RLJob, finish: Finish | None, now: dt.datetime | None) -> bool:
    """``ttlSecondsAfterFinished`` elapsed since the observed end of the trainer RayJob."""
    ttl = job.spec.run_policy.ttl_seconds_after_finished
    if ttl is None or now is None or finish is None:
        return False
    ended = finished_at(job, finish)
    return ended is not None and (now - ended).total_seconds() >= ttl
