"""The end of a job, pure: the TTL counts from the RayJob's endTime or the operator's own
``r3operator.io/finished`` annotation, never from a completionTime someone wrote into the status."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from r3operator.api.load import load_rljob
from r3operator.api.v1alpha1 import RLJob, RLJobStatus
from r3operator.operator.lifecycle import (
    ANNOTATION_FINISHED,
    finish_annotation,
    observed_finish,
    recorded_end,
    ttl_expired,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"
SEEN = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _job(annotations: dict[str, str] | None = None, completion: str | None = None) -> RLJob:
    job = load_rljob(EXAMPLE)
    spec = job.spec.model_copy(
        update={"run_policy": job.spec.run_policy.model_copy(update={"ttl_seconds_after_finished": 60})}
    )
    metadata = job.metadata.model_copy(update={"annotations": annotations or {}})
    return job.model_copy(
        update={"spec": spec, "metadata": metadata, "status": RLJobStatus(completion_time=completion)}
    )


def _failed_without_end_time() -> Any:
    return observed_finish({"status": {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED"}})


def test_without_an_end_time_the_ttl_counts_from_the_operators_annotation_not_the_status() -> None:
    finish = _failed_without_end_time()
    assert finish is not None and finish.ended_at is None
    forged = _job(completion="2020-01-01T00:00:00Z")
    assert not ttl_expired(forged, finish, SEEN)  # no record yet: nothing expires
    recorded = _job({ANNOTATION_FINISHED: finish_annotation(finish, SEEN)}, completion="2020-01-01T00:00:00Z")
    assert recorded_end(recorded) == SEEN
    assert not ttl_expired(recorded, finish, SEEN + dt.timedelta(seconds=59))
    assert ttl_expired(recorded, finish, SEEN + dt.timedelta(seconds=60))


def test_the_record_names_the_outcome_and_the_rayjobs_end_time_when_there_is_one() -> None:
    ended = observed_finish(
        {"status": {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "endTime": "2025-12-31T23:00:00Z"}}
    )
    assert ended is not None and finish_annotation(ended, SEEN) == "Succeeded 2025-12-31T23:00:00Z"
    assert finish_annotation(_failed_without_end_time(), SEEN) == "Failed 2026-01-01T00:00:00Z"
    assert recorded_end(_job({ANNOTATION_FINISHED: "Failed garbage"})) is None
