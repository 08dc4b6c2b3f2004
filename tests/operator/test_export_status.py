"""spec.export in the operator: the Exported condition and an Event per export from the trainer's progress report
(operator/export_status.py), what the trainer's head pod gets (the claim, the store's credentials under names of their
own), and what is checked before any pod exists (the claim, the Secret's keys)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from operator_harness import example

from r3operator.api.load import parse_rljob
from r3operator.api.v1alpha1 import ExportFailure, ExportRecord, Progress, RLJob
from r3operator.operator.builders.trainer import build_ray_job
from r3operator.operator.export_status import ExportSeen, export_events, exported
from r3operator.operator.hashing import trainer_hash_input, trainer_spec_hash
from r3operator.operator.observed import Observed
from r3operator.operator.progress import ProgressReport
from r3operator.operator.references import references
from r3operator.operator.status import compute_status, transitions

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
S3 = {"credentialsSecret": "export-store", "endpointURL": "http://minio.storage:9000"}


def _job(**export: Any) -> RLJob:
    edits = {"export": export} if export else {}
    doc = example("job", "rl", **edits)
    doc["metadata"].update(uid="job-uid", generation=1)
    return parse_rljob(doc)


def _record(step: int, reward: float | None = None) -> ExportRecord:
    return ExportRecord(step=step, uri=f"s3://models/rl/step-{step:06d}", eval_reward=reward)


def test_no_export_section_no_condition_and_no_events() -> None:
    job = _job()
    assert exported(job, Progress(step=3)) is None
    assert export_events(job, Progress(step=3, exports=[_record(2)]), None) == (None, [])
    status = compute_status(job, Observed(kuberay_installed=True), NOW)
    assert "Exported" not in {c.type for c in status.conditions}


def test_the_exported_condition_follows_the_report() -> None:
    job = _job(destination="s3://models/rl", s3=S3, intervalSteps=50)
    waiting = exported(job, Progress(step=3))
    assert waiting is not None and (waiting.status.value, waiting.reason) == ("Unknown", "NoExportYet")
    assert waiting.message == "no export yet; exports go to s3://models/rl every 50 steps and after the last step"

    done = exported(job, Progress(step=51, exports=[_record(50)], last_export_step=50))
    assert done is not None and (done.status.value, done.reason) == ("True", "ExportWritten")
    assert done.message == "step 50 exported to s3://models/rl/step-000050"

    failure = ExportFailure(step=100, reason="StoreUnreachable", message="Could not connect", attempts=2, retrying=True)
    failing = exported(job, Progress(step=101, exports=[_record(50)], export_failure=failure))
    assert failing is not None and (failing.status.value, failing.reason) == ("False", "StoreUnreachable")
    assert failing.message == (
        "export of step 100 (attempt 2 failed, retrying): Could not connect; the last complete export, step 50 at "
        "s3://models/rl/step-000050, is untouched"
    )
    given_up = failure.model_copy(update={"attempts": 5, "retrying": False, "reason": "AccessDenied"})
    first = exported(job, Progress(step=101, export_failure=given_up))
    assert first is not None and first.reason == "AccessDenied"
    assert first.message.endswith("(given up after 5 attempt(s)): Could not connect; no export is complete yet")
    # A failure of an earlier step than the latest export is history (a newer export gave it up).
    old = failure.model_copy(update={"step": 40})
    later = exported(job, Progress(step=101, exports=[_record(50)], export_failure=old))
    assert later is not None and later.reason == "ExportWritten"


def test_one_event_per_export_and_per_new_failure_none_repeated_after_a_restart() -> None:
    job = _job(destination="pvc://models/rl", intervalSteps=2)
    seen, events = export_events(job, None, None)  # the job's first pass: no report yet
    assert seen == ExportSeen(None, None) and events == []
    seen, events = export_events(job, Progress(step=2, exports=[_record(2, 0.25)]), seen)
    assert events == [("Normal", "Exported", "step 2 exported to s3://models/rl/step-000002, eval reward 0.25")]
    seen, events = export_events(job, Progress(step=3, exports=[_record(2, 0.25)]), seen)
    assert events == []
    # Two exports between passes: one Event each.
    both = [_record(2), _record(4), _record(6)]
    seen, events = export_events(job, Progress(step=6, exports=both), seen)
    assert [e[2] for e in events] == [
        "step 4 exported to s3://models/rl/step-000004",
        "step 6 exported to s3://models/rl/step-000006",
    ]
    failure = ExportFailure(step=8, reason="NoSpace", message="[Errno 28] No space left on device", retrying=True)
    seen, events = export_events(job, Progress(step=8, exports=both, export_failure=failure), seen)
    assert events == [
        (
            "Warning",
            "ExportFailed",
            "export of step 8 (attempt 1 failed, retrying): [Errno 28] No space left on device; the last complete "
            "export, step 6 at s3://models/rl/step-000006, is untouched",
        )
    ]
    retried = failure.model_copy(update={"attempts": 3})
    seen, events = export_events(job, Progress(step=8, exports=both, export_failure=retried), seen)
    assert events == []  # still retrying: the same failure
    given_up = failure.model_copy(update={"attempts": 5, "retrying": False})
    seen, events = export_events(job, Progress(step=9, exports=both, export_failure=given_up), seen)
    assert [e[:2] for e in events] == [("Warning", "ExportFailed")] and "given up after 5" in events[0][2]
    # An operator that starts now remembers, and sends nothing of what was already reported.
    assert export_events(job, Progress(step=9, exports=both, export_failure=given_up), None)[1] == []


def test_the_status_carries_the_condition_and_its_flips_send_no_events_of_their_own() -> None:
    job = _job(destination="pvc://models/rl")
    report = ProgressReport(Progress(step=5, exports=[_record(5)], last_export_step=5))
    status = compute_status(job, Observed(kuberay_installed=True, progress=report), NOW)
    condition = next(c for c in status.conditions if c.type == "Exported")
    assert (condition.status.value, condition.reason) == ("True", "ExportWritten")
    assert status.progress is not None and status.progress.last_export_step == 5
    assert "Exported" not in {c.type for c in transitions(None, status)}


def test_the_head_pod_mounts_the_claim_and_gets_the_store_credentials_under_their_own_names() -> None:
    claim = build_ray_job(_job(destination="pvc://models/rl/qwen3"), suspend=False)["spec"]["rayClusterSpec"]
    head = claim["headGroupSpec"]["template"]["spec"]
    [volume] = [v for v in head["volumes"] if v["name"] == "export"]
    assert volume == {"name": "export", "persistentVolumeClaim": {"claimName": "models"}}
    assert {"name": "export", "mountPath": "/mnt/export"} in head["containers"][0]["volumeMounts"]
    worker = claim["workerGroupSpecs"][0]["template"]["spec"]
    assert not [v for v in worker["volumes"] if v["name"] == "export"]  # only the driver exports

    s3 = build_ray_job(_job(destination="s3://models/rl", s3=S3), suspend=False)["spec"]["rayClusterSpec"]
    env = {e["name"]: e for e in s3["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["R3OPERATOR_EXPORT_AWS_ACCESS_KEY_ID"]["valueFrom"] == {
        "secretKeyRef": {"name": "export-store", "key": "AWS_ACCESS_KEY_ID"}
    }
    assert env["R3OPERATOR_EXPORT_AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert "AWS_ACCESS_KEY_ID" not in env  # never mixed with AWS_* a pod template may set for something else
    workers = s3["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    assert not [e for e in workers if e["name"].startswith("R3OPERATOR_EXPORT_")]


def test_the_secret_is_checked_before_any_pod_and_an_export_change_restarts_the_trainer() -> None:
    job = _job(destination="s3://models/rl", s3=S3)
    found = [(r.kind, r.name, r.key, r.where) for r in references(job) if r.name == "export-store"]
    assert found == [
        ("Secret", "export-store", "AWS_ACCESS_KEY_ID", "export.s3.credentialsSecret"),
        ("Secret", "export-store", "AWS_SECRET_ACCESS_KEY", "export.s3.credentialsSecret"),
    ]
    # The driver reads spec.export when it starts: a new destination is a new trainer (resumed from its checkpoint);
    # a job without an export keeps the hash it had before exports existed.
    assert trainer_spec_hash(job.spec) != trainer_spec_hash(_job(destination="s3://models/other", s3=S3).spec)
    assert "export" not in trainer_hash_input(_job().spec)
