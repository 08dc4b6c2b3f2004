"""The operator's per-RLJob series that RLJobNoProgress compares: its threshold and the last progress time."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from r3operator.api import load_rljob
from r3operator.api.v1alpha1 import Condition, Progress, RLJobStatus
from r3operator.operator import metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-r3-fsdp.yaml"


def _unix(stamp: str) -> float:
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()


def _status(ready_at: str | None, stepped_at: str | None) -> RLJobStatus:
    ready = Condition(type="Ready", status="True", reason="Running", last_transition_time=ready_at or "")
    conditions = [ready] if ready_at else []
    progress = Progress(step=3, updated_at=stepped_at) if stepped_at else None
    return RLJobStatus(conditions=conditions, progress=progress)


def test_last_progress_is_the_later_of_the_last_step_and_becoming_ready() -> None:
    early, late = "2026-01-01T00:00:00Z", "2026-01-01T01:00:00Z"
    assert metrics.last_progress_time(_status(early, late)) == _unix(late)
    # resumed after a suspend: Ready again later than the last step of the earlier run
    assert metrics.last_progress_time(_status(late, early)) == _unix(late)
    assert metrics.last_progress_time(_status(early, None)) == _unix(early)  # Ready, no step yet
    assert metrics.last_progress_time(_status(None, None)) is None


def _sample(name: str, job_name: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, {"namespace": "rl", "rljob": job_name})


def test_each_job_exports_its_own_no_progress_threshold_and_forgets_it_when_deleted() -> None:
    base = load_rljob(EXAMPLE)
    job = base.model_copy(
        update={
            "metadata": base.metadata.model_copy(update={"namespace": "rl", "name": "slow-30b"}),
            "spec": base.spec.model_copy(
                update={"monitoring": base.spec.monitoring.model_copy(update={"no_progress_seconds": 3600})}
            ),
        }
    )
    metrics.observe_job(job, _status("2026-01-01T00:00:00Z", "2026-01-01T00:30:00Z"))
    assert _sample("r3operator_rljob_no_progress_threshold_seconds", "slow-30b") == 3600
    assert _sample("r3operator_rljob_last_progress_timestamp_seconds", "slow-30b") == _unix("2026-01-01T00:30:00Z")
    metrics.forget_job("rl", "slow-30b")
    assert _sample("r3operator_rljob_no_progress_threshold_seconds", "slow-30b") is None
    assert _sample("r3operator_rljob_last_progress_timestamp_seconds", "slow-30b") is None
