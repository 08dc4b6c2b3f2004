"""Kueue's verdict read from a Workload, and the job controller's status writes (operator/admission.py).

The Workload statuses are the shapes Kueue v0.15 writes (tests/operator/test_kueue.py sees them live)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from r3operator.operator.admission import AdmissionState, finish_patch, read_admission, release_patch
from r3operator.operator.lifecycle import Finish

NOW = dt.datetime(2026, 11, 23, 15, 0, tzinfo=dt.UTC)
EARLIER = "2026-11-23T14:00:00Z"


def _cond(ctype: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": EARLIER}


def _workload(*conditions: dict[str, Any], admission: dict[str, Any] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": list(conditions)}
    if admission is not None:
        status["admission"] = admission
    return {
        "metadata": {"name": "j-workload", "namespace": "rl", "generation": 1, "resourceVersion": "42"},
        "status": status,
    }


ADMISSION = {"clusterQueue": "gpus", "podSetAssignments": [{"name": "engine", "count": 4}]}
PREEMPTED = _cond("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: x) due to prioritization")


def test_no_queue_runs_and_a_missing_workload_waits():
    assert read_admission(None, None).state is AdmissionState.NOT_QUEUED and read_admission(None, None).runs
    pending = read_admission("q", None)
    assert pending.state is AdmissionState.PENDING and not pending.runs


def test_pending_carries_kueues_reason_and_admitted_names_the_cluster_queue():
    why = "couldn't assign flavors to pod set engine: insufficient unused quota for nvidia.com/gpu in flavor h100"
    pending = read_admission("q", _workload(_cond("QuotaReserved", "False", "Pending", why)))
    assert (pending.state, pending.message, pending.runs) == (AdmissionState.PENDING, why, False)
    admitted = read_admission(
        "q",
        _workload(
            _cond("QuotaReserved", "True", "QuotaReserved"), _cond("Admitted", "True", "Admitted"), admission=ADMISSION
        ),
    )
    assert admitted.state is AdmissionState.ADMITTED and admitted.runs
    assert admitted.message == "admitted by ClusterQueue gpus (LocalQueue q)"


def test_evicted_stops_the_job_until_released_then_it_waits_again():
    held = _workload(
        _cond("QuotaReserved", "True", "QuotaReserved"),
        _cond("Admitted", "True", "Admitted"),
        PREEMPTED,
        admission=ADMISSION,
    )
    evicted = read_admission("q", held)
    assert (evicted.state, evicted.reason, evicted.runs) == (AdmissionState.EVICTED, "Preempted", False)

    patch = release_patch(held, NOW)
    assert patch is not None and patch["metadata"] == {"resourceVersion": "42"}
    assert patch["status"]["admission"] is None
    conditions = {c["type"]: c for c in patch["status"]["conditions"]}
    assert (conditions["QuotaReserved"]["status"], conditions["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert conditions["Admitted"]["status"] == "False"
    assert (conditions["Requeued"]["status"], conditions["Requeued"]["reason"]) == ("True", "Preempted")
    assert conditions["Evicted"] == PREEMPTED  # Kueue resets it when it admits again
    assert conditions["QuotaReserved"]["lastTransitionTime"] == "2026-11-23T15:00:00Z"

    released = _workload(*patch["status"]["conditions"])
    again = read_admission("q", released)
    assert again.state is AdmissionState.PENDING and again.message.startswith("queued again after eviction (Preempted)")
    assert release_patch(released, NOW) is None  # nothing left to release


def test_a_workload_that_is_not_evicted_is_never_released():
    admitted = _workload(
        _cond("QuotaReserved", "True", "QuotaReserved"), _cond("Admitted", "True", "Admitted"), admission=ADMISSION
    )
    assert release_patch(admitted, NOW) is None


def test_the_end_of_the_job_marks_the_workload_finished_once():
    admitted = _workload(
        _cond("QuotaReserved", "True", "QuotaReserved"), _cond("Admitted", "True", "Admitted"), admission=ADMISSION
    )
    patch = finish_patch(admitted, Finish(False, "the trainer RayJob failed", None), NOW)
    assert patch is not None
    [finished] = [c for c in patch["status"]["conditions"] if c["type"] == "Finished"]
    assert (finished["status"], finished["reason"]) == ("True", "Failed")
    assert finished["message"] == "the trainer RayJob failed"
    done = _workload(*patch["status"]["conditions"], admission=ADMISSION)
    assert read_admission("q", done).state is AdmissionState.FINISHED
    assert finish_patch(done, Finish(True, "ok", None), NOW) is None
