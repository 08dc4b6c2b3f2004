"""The operator's own record of an image upgrade, and the canary's verdict, from where only trusted parties
write. Pure.

The RLJob's ``/status`` is output: the job's trainer pods may patch it (they report progress there) and
RBAC cannot narrow that patch to one field. So nothing the upgrade state machine acts on is read from it:

- the upgrade state (component, phase, attempt, from/to images, start, canary clock, verdict) lives in the
  annotation ``r3operator.io/upgrade-state`` of the engine StatefulSet (LeaderWorkerSet), an object the
  operator controls and the trainer's ServiceAccount cannot write. Whoever may edit that object can set
  its image directly anyway, so the record grants nothing beyond what its writer already has;
- the canary's verdict is the termination message of the canary Job's pod, which only the kubelet writes
  (``/dev/termination-log`` of the container, copied into the Pod's status); it counts only for a pod the
  canary Job controls (ownerReference by uid) of the attempt under way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from r3operator.api.canary_verdict import parse_verdict
from r3operator.api.v1alpha1 import UpgradeCanary, UpgradeStatus
from r3operator.operator import meta

log = logging.getLogger("r3operator.upgrade")

ANNOTATION_UPGRADE_STATE = f"{meta.PREFIX}/upgrade-state"
ATTEMPT_LABEL = f"{meta.PREFIX}/upgrade-attempt"


def record_annotation(upgrade: UpgradeStatus) -> str:
    """The annotation value for ``upgrade``, the verdict with its figures included (a few KiB at most)."""
    return json.dumps(
        upgrade.model_dump(mode="json", by_alias=True, exclude_none=True), separators=(",", ":"), sort_keys=True
    )


def read_record(engine_set: dict[str, Any] | None) -> UpgradeStatus | None:
    """The upgrade state the operator wrote on its engine StatefulSet (LeaderWorkerSet); None when there is
    none or it does not parse (then the next image change starts from what the engines run)."""
    annotations = ((engine_set or {}).get("metadata") or {}).get("annotations") or {}
    text = annotations.get(ANNOTATION_UPGRADE_STATE)
    if not text:
        return None
    try:
        return UpgradeStatus.model_validate_json(text)
    except ValidationError as exc:
        name = ((engine_set or {}).get("metadata") or {}).get("name")
        log.warning("%s: annotation %s is not an upgrade record, ignored: %s", name, ANNOTATION_UPGRADE_STATE, exc)
        return None


def _controlled_by(obj: dict[str, Any], uid: str | None) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return uid is not None and any(r.get("controller") and r.get("uid") == uid for r in refs)


def verdict_from_pods(
    pods: list[dict[str, Any]], canary_job: dict[str, Any] | None, *, container: str, attempt: str
) -> UpgradeCanary | None:
    """The verdict of ``attempt``: the termination message of ``container`` that exited 0 in a pod the
    canary Job controls, when the Job is of that attempt. None while there is none."""
    if canary_job is None:
        return None
    job_meta = canary_job.get("metadata") or {}
    if (job_meta.get("labels") or {}).get(ATTEMPT_LABEL) != attempt:
        return None
    for pod in pods:
        if not _controlled_by(pod, job_meta.get("uid")):
            continue
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (status.get("state") or {}).get("terminated") or {}
            if status.get("name") != container or terminated.get("exitCode") != 0:
                continue
            verdict = parse_verdict(str(terminated.get("message") or ""))
            if verdict is None:
                log.warning("pod %s: the canary's termination message is not a verdict", pod["metadata"]["name"])
            elif verdict.attempt == attempt:
                return verdict
    return None


def _labels(pod: dict[str, Any]) -> dict[str, str]:
    return (pod.get("metadata") or {}).get("labels") or {}


def canary_pods(pods: list[dict[str, Any]], attempt: str) -> list[dict[str, Any]]:
    """The upgrade canary's pods of ``attempt`` among a job's pods."""
    return [
        p
        for p in pods
        if _labels(p).get(meta.LABEL_ROLE) == meta.ROLE_UPGRADE_CANARY and _labels(p).get(ATTEMPT_LABEL) == attempt
    ]


def surge_pods(
    pods: list[dict[str, Any]], engine_name: str, replicas: int, *, role: str = meta.ROLE_ENGINE
) -> list[dict[str, Any]]:
    """The surge replica's pods: StatefulSet ordinal ``replicas`` (``<engine>-<replicas>``), or the
    LeaderWorkerSet group ``replicas`` (its leader of that name, its workers ``<engine>-<replicas>-<i>``).
    ``role``: the pods' role label (a disaggregated job's prefill engines are ``prefill``)."""
    surge = f"{engine_name}-{replicas}"
    return [
        p
        for p in pods
        if _labels(p).get(meta.LABEL_ROLE) == role
        and (p["metadata"]["name"] == surge or p["metadata"]["name"].startswith(f"{surge}-"))
    ]


@dataclass(frozen=True, slots=True)
class PodProgress:
    """Whether the pods a canary needs run yet, and the scheduler's reason when one cannot be placed."""

    running: bool
    unschedulable: str | None = None


def pod_progress(pods: list[dict[str, Any]]) -> PodProgress:
    """Every one of ``pods`` (at least one) is Running, and the first Unschedulable reason among them."""
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    running = bool(live) and all((p.get("status") or {}).get("phase") in ("Running", "Succeeded") for p in live)
    for pod in live:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (cond.get("type"), cond.get("status"), cond.get("reason")) == ("PodScheduled", "False", "Unschedulable"):
                reason = str(cond.get("message") or "no reason given")
                return PodProgress(running, f"pod {pod['metadata']['name']} cannot be scheduled: {reason}")
    return PodProgress(running)
