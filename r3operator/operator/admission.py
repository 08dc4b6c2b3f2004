"""Kueue admission of a queued RLJob: read the Workload's verdict, and play the job controller's part.

Kueue's job integrations (the jobframework) follow one protocol, which the operator follows for the
RLJob's Workload (builders/workload.py):

- a job runs only while its Workload is admitted (``Admitted=True``) and not evicted;
- on eviction (``Evicted=True``: preempted, queue stopped, ...) the job is stopped, and once nothing
  of it runs any more the controller clears the Workload's quota reservation (``QuotaReserved=False``,
  ``status.admission`` removed, ``Requeued`` set), so that Kueue queues it again;
- when the job ends, the controller marks the Workload ``Finished`` so that Kueue releases its quota.

``read_admission`` is pure; ``settle`` does the two status writes, as a merge patch that carries the
Workload's resourceVersion (a write that raced Kueue's is refused and retried by the next pass).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from r3operator.operator.kube import KINDS, KubeClient
from r3operator.operator.lifecycle import Finish, format_time


class AdmissionState(StrEnum):
    NOT_QUEUED = "NotQueued"
    """No spec.queueName: the job runs without Kueue."""
    PENDING = "Pending"
    """Queued, waiting for quota (or the Workload is not created yet)."""
    ADMITTED = "Admitted"
    EVICTED = "Evicted"
    """Kueue took the admission back (preemption, a stopped queue, ...): the job stops; once it has, the
    quota is released and the Workload is Pending again."""
    FINISHED = "Finished"


@dataclass(frozen=True, slots=True)
class Admission:
    state: AdmissionState
    message: str
    reason: str = ""
    """Kueue's reason (e.g. ``Preempted``, ``Pending``, ``Inadmissible``)."""
    cluster_queue: str | None = None

    @property
    def runs(self) -> bool:
        """The job's pods may run."""
        return self.state in (AdmissionState.NOT_QUEUED, AdmissionState.ADMITTED)


NOT_QUEUED = Admission(AdmissionState.NOT_QUEUED, "spec.queueName is not set: the job is not queued")


def _conditions(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(c.get("type")): c for c in (workload.get("status") or {}).get("conditions") or []}


def _true(cond: dict[str, Any] | None) -> bool:
    return cond is not None and cond.get("status") == "True"


def read_admission(queue: str | None, workload: dict[str, Any] | None) -> Admission:
    if queue is None:
        return NOT_QUEUED
    if workload is None:
        return Admission(AdmissionState.PENDING, f"the Workload for LocalQueue {queue} is not created yet", "Created")
    conds = _conditions(workload)
    admission = (workload.get("status") or {}).get("admission") or {}
    cluster_queue = admission.get("clusterQueue")
    if _true(conds.get("Finished")):
        return Admission(AdmissionState.FINISHED, str(conds["Finished"].get("message") or ""), "Finished")
    evicted = conds.get("Evicted")
    if _true(evicted) and has_quota_reservation(workload):
        assert evicted is not None
        return Admission(
            AdmissionState.EVICTED, str(evicted.get("message") or ""), str(evicted.get("reason") or ""), cluster_queue
        )
    if _true(conds.get("Admitted")):
        where = f"ClusterQueue {cluster_queue}" if cluster_queue else "its ClusterQueue"
        message = f"admitted by {where} (LocalQueue {queue})"
        return Admission(AdmissionState.ADMITTED, message, "Admitted", cluster_queue)
    reserved = conds.get("QuotaReserved")
    if reserved is not None:
        message = str(reserved.get("message") or "")
        if _true(evicted):  # evicted, stopped and released: queued again until Kueue resets Evicted on admission
            assert evicted is not None
            message = f"queued again after eviction ({evicted.get('reason')}): {message}"
        return Admission(AdmissionState.PENDING, message, str(reserved.get("reason") or "Pending"), cluster_queue)
    return Admission(AdmissionState.PENDING, f"queued in LocalQueue {queue}, not considered by Kueue yet", "Queued")


def has_quota_reservation(workload: dict[str, Any]) -> bool:
    return _true(_conditions(workload).get("QuotaReserved")) or bool((workload.get("status") or {}).get("admission"))


def _set(conditions: list[dict[str, Any]], new: dict[str, Any]) -> list[dict[str, Any]]:
    """metav1 SetStatusCondition: lastTransitionTime moves only when the status flips."""
    out, found = [], False
    for cond in conditions:
        if cond.get("type") == new["type"]:
            found = True
            same = cond.get("status") == new["status"]
            out.append({**new, "lastTransitionTime": cond["lastTransitionTime"] if same else new["lastTransitionTime"]})
        else:
            out.append(cond)
    return out if found else [*out, new]


def _condition(
    workload: dict[str, Any], ctype: str, status: bool, reason: str, message: str, now: str
) -> dict[str, Any]:
    return {
        "type": ctype,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": now,
        "observedGeneration": (workload.get("metadata") or {}).get("generation"),
    }


def release_patch(workload: dict[str, Any], now: dt.datetime) -> dict[str, Any] | None:
    """After an eviction, with the job stopped: the quota reservation cleared and the Workload requeued."""
    conds = _conditions(workload)
    evicted = conds.get("Evicted")
    if not _true(evicted) or not has_quota_reservation(workload):
        return None
    assert evicted is not None
    stamp = format_time(now)
    reason, message = str(evicted.get("reason") or "Evicted"), str(evicted.get("message") or "")
    requeue = reason in ("Preempted", "NodeFailures")  # the jobframework requeues only these at once
    conditions = list((workload.get("status") or {}).get("conditions") or [])
    conditions = _set(conditions, _condition(workload, "Requeued", requeue, reason, message, stamp))
    conditions = _set(conditions, _condition(workload, "QuotaReserved", False, "Pending", message, stamp))
    if "Admitted" in conds:
        conditions = _set(
            conditions,
            _condition(workload, "Admitted", False, "NoReservation", "The workload has no reservation", stamp),
        )
    return _status_patch(workload, {"conditions": conditions, "admission": None})


def finish_patch(workload: dict[str, Any], finish: Finish, now: dt.datetime) -> dict[str, Any] | None:
    """The job ended: Finished=True, so that Kueue releases the quota."""
    if _true(_conditions(workload).get("Finished")):
        return None
    reason = "Succeeded" if finish.succeeded else "Failed"
    conditions = list((workload.get("status") or {}).get("conditions") or [])
    conditions = _set(conditions, _condition(workload, "Finished", True, reason, finish.message, format_time(now)))
    return _status_patch(workload, {"conditions": conditions})


def _status_patch(workload: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    # Merge patches replace lists whole: the resourceVersion makes a write that raced Kueue's fail (409).
    return {"metadata": {"resourceVersion": (workload.get("metadata") or {}).get("resourceVersion")}, "status": status}


async def settle(
    client: KubeClient, workload: dict[str, Any] | None, *, active: bool, finish: Finish | None, now: dt.datetime
) -> str | None:
    """The one status write the Workload needs from its job controller now, if any; what was done, for status."""
    if workload is None:
        return None
    if finish is not None:
        patch = finish_patch(workload, finish, now)
        done = "marked the Workload Finished"
    elif not active:
        patch = release_patch(workload, now)
        done = "released the evicted Workload's quota reservation"
    else:
        patch = None
    if patch is None:
        return None
    metadata = workload["metadata"]
    await client.merge_patch(
        KINDS["Workload"], metadata.get("namespace"), metadata["name"], patch, subresource="status"
    )
    return done
