"""Engine image upgrades: one canary replica first, a fidelity canary against the trainer, then roll on
or roll back. Pure: `plan_upgrade` maps what the reconciler read to what the engines should run.

A new vLLM can pass every compatibility rule and still move the numbers R3 depends on (a different
MoE kernel shifts the natural routing mismatch, a capture regression returns routes of the wrong shape,
a sampler change shifts logprobs). So an image change does not roll every replica at once:

    Canary   the StatefulSet grows by one replica (surge ordinals) carrying the new image; a partition
             keeps every existing pod on the old one, and the trainer never sends it a rollout (its
             engine list names only the regular replicas). The canary Job (trainer image,
             `r3operator upgrade-canary`) scores an old and the new replica with the trainer's current
             weights, with and without replay, and writes its verdict to status.upgrade.canary.
    Rolling  passed (or forced, or no canary wanted): the surge replica goes, the partition drops to 0
             and the StatefulSet controller rolls the rest, one pod at a time.
    Complete every pod runs the new revision.
    Blocked  failed or timed out: the template goes back to the old image (the surge pod goes, nobody
             else moved), condition UpgradeBlocked carries the figures; the spec keeps the new image until
             the user changes it. `kubectl annotate rlj NAME r3operator.io/upgrade=force` skips the canary.

All state lives in status.upgrade (from, to, phase, attempt), so an operator restarted mid-upgrade
resumes in the same phase; a spec image change during an upgrade starts a new attempt from the last
image that is known good.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from r3operator.api.v1alpha1 import RLJob, UpgradeStatus
from r3operator.operator.lifecycle import format_time, parse_time

ANNOTATION_UPGRADE = "r3operator.io/upgrade"
FORCE = "force"
ENGINE_CONTAINER = "vllm"


@dataclass(frozen=True, slots=True)
class EngineRollout:
    """How the engine StatefulSet is rendered while an upgrade is under way."""

    image: str
    """The image the pod template carries."""
    surge_replicas: int = 0
    """Engine replicas beyond spec.inference.replicas (the canary replica)."""
    partition: int = 0
    """Pods with a lower ordinal stay on the current revision (StatefulSet rollingUpdate.partition)."""


@dataclass(frozen=True, slots=True)
class CanaryTarget:
    """The canary Job's inputs: which replica is old, which is new, and the attempt it answers."""

    attempt: str
    old_image: str
    new_image: str
    old_replica: int
    new_replica: int


@dataclass(frozen=True, slots=True)
class UpgradePlan:
    status: UpgradeStatus | None
    rollout: EngineRollout | None = None
    """None: render the spec as it is."""
    canary: CanaryTarget | None = None
    """Not None: the canary Job must exist for this attempt."""
    blocked_message: str | None = None


def template_image(statefulset: dict[str, Any] | None) -> str | None:
    """The engine image of the StatefulSet's pod template as the cluster has it."""
    if statefulset is None:
        return None
    containers = (((statefulset.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    for container in containers:
        if container.get("name") == ENGINE_CONTAINER:
            return str(container.get("image") or "") or None
    return None


def rolled_out(statefulset: dict[str, Any] | None, *, pods: int) -> tuple[bool, int]:
    """(every pod on the update revision, pods updated so far) from the StatefulSet's status."""
    if statefulset is None:
        return False, 0
    status = statefulset.get("status") or {}
    generation = (statefulset.get("metadata") or {}).get("generation")
    updated = int(status.get("updatedReplicas") or 0)
    current = status.get("currentRevision")
    done = (
        status.get("observedGeneration") == generation
        and updated >= pods
        and int(status.get("replicas") or 0) == pods
        and current is not None
        and current == status.get("updateRevision")
    )
    return done, updated


def canary_job_failed(canary_job: dict[str, Any] | None) -> str | None:
    """The reason a canary Job ended without a verdict (Failed condition), else None."""
    for cond in ((canary_job or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Failed" and cond.get("status") == "True":
            return f"the canary Job failed ({cond.get('reason') or 'no reason'}: {cond.get('message') or ''})"
    return None


def plan_upgrade(
    job: RLJob,
    statefulset: dict[str, Any] | None,
    *,
    pods_per_replica: int,
    canary_job: dict[str, Any] | None = None,
    stopped: bool = False,
    now: dt.datetime,
) -> UpgradePlan:
    """What the engines should run given the spec, the StatefulSet as read and status.upgrade."""
    spec_image = job.spec.inference.image
    policy = job.spec.inference.upgrade_policy
    replicas = job.spec.inference.replicas
    prev = job.status.upgrade if job.status else None
    running = template_image(statefulset)
    force = job.metadata.annotations.get(ANNOTATION_UPGRADE) == FORCE
    active = prev is not None and prev.phase in ("Canary", "Rolling", "Blocked")

    if active and prev is not None and prev.to == spec_image:
        return _continue(job, prev, statefulset, canary_job, pods_per_replica, force, stopped, now)
    if active and prev is not None and prev.phase in ("Canary", "Blocked") and spec_image == prev.from_image:
        # The user went back to the image that is running: nothing to roll, the attempt is over.
        cancelled = prev.model_copy(update={"phase": "Cancelled", "message": f"spec.inference.image is "
                                            f"{spec_image} again; the upgrade to {prev.to} was abandoned"})  # fmt: skip
        return UpgradePlan(cancelled)
    if running is None or (running == spec_image and not active):
        return UpgradePlan(prev)  # first creation, or nothing changed
    # A new attempt. Its "from" is the last image known good: the one every regular pod runs.
    good = prev.from_image if active and prev is not None and prev.phase != "Rolling" else running
    if active and prev is not None and prev.phase == "Rolling":
        good = prev.to  # it passed its canary; pods not rolled yet still run the one before
    attempt = f"{job.metadata.generation or 0}"
    status = UpgradeStatus.model_validate({
        "from": good, "to": spec_image, "phase": "Canary", "attempt": attempt, "startedAt": format_time(now),
    })  # fmt: skip
    if force or not policy.canary or replicas == 0 or stopped:
        why = ("forced by the r3operator.io/upgrade=force annotation" if force
               else "upgradePolicy.canary is false" if not policy.canary else "no engine replica runs")  # fmt: skip
        status = status.model_copy(update={"phase": "Rolling", "message": f"rolling every replica: {why}"})
        return UpgradePlan(status, EngineRollout(image=spec_image))
    return _canary(status, replicas, pods_per_replica)


def _canary(status: UpgradeStatus, replicas: int, pods_per_replica: int) -> UpgradePlan:
    status = status.model_copy(update={
        "message": f"canary: one extra replica on {status.to} is scored against one on {status.from_image}",
    })  # fmt: skip
    rollout = EngineRollout(image=status.to, surge_replicas=1, partition=replicas * pods_per_replica)
    target = CanaryTarget(
        attempt=status.attempt, old_image=status.from_image, new_image=status.to, old_replica=0, new_replica=replicas
    )
    return UpgradePlan(status, rollout, target)


def _continue(
    job: RLJob,
    prev: UpgradeStatus,
    statefulset: dict[str, Any] | None,
    canary_job: dict[str, Any] | None,
    pods_per_replica: int,
    force: bool,
    stopped: bool,
    now: dt.datetime,
) -> UpgradePlan:
    replicas = job.spec.inference.replicas
    pods = 0 if stopped else replicas * pods_per_replica
    if prev.phase == "Canary":
        verdict = prev.canary if prev.canary is not None and prev.canary.attempt == prev.attempt else None
        if force or stopped:
            why = "forced by the r3operator.io/upgrade=force annotation" if force else "the job stopped"
            return _rolling(prev, f"canary skipped: {why}")
        if verdict is not None and verdict.passed:
            return _rolling(prev, f"canary passed: {verdict.message}")
        failure = None
        if verdict is not None:
            failure = f"canary failed: {verdict.message}"
        elif (reason := canary_job_failed(canary_job)) is not None:
            failure = reason
        else:
            started = parse_time(prev.started_at)
            limit = job.spec.inference.upgrade_policy.timeout_seconds
            if started is not None and (now - started).total_seconds() > limit:
                failure = f"canary timed out: no verdict after {limit} s (upgradePolicy.timeoutSeconds)"
        if failure is not None:
            return _blocked(prev, failure)
        return _canary(prev, replicas, pods_per_replica)
    if prev.phase == "Blocked":
        if force:
            return _rolling(prev, "forced by the r3operator.io/upgrade=force annotation after a failed canary")
        return UpgradePlan(prev, EngineRollout(image=prev.from_image), blocked_message=prev.message)
    done, updated = rolled_out(statefulset, pods=pods)
    replicas_updated = updated // max(1, pods_per_replica)
    if done:
        status = prev.model_copy(update={"phase": "Complete", "replicas_updated": replicas,
                                         "message": f"every replica runs {prev.to}"})  # fmt: skip
        return UpgradePlan(status)
    status = prev.model_copy(update={"replicas_updated": min(replicas_updated, replicas)})
    return UpgradePlan(status, EngineRollout(image=prev.to))


def _rolling(prev: UpgradeStatus, message: str) -> UpgradePlan:
    status = prev.model_copy(update={"phase": "Rolling", "message": message, "replicas_updated": 0})
    return UpgradePlan(status, EngineRollout(image=prev.to))


def _blocked(prev: UpgradeStatus, failure: str) -> UpgradePlan:
    message = (
        f"{failure}. The engines are back on {prev.from_image}; spec.inference.image still says {prev.to}: "
        f"change it to retry with another image, or annotate the RLJob {ANNOTATION_UPGRADE}={FORCE} to roll anyway"
    )
    status = prev.model_copy(update={"phase": "Blocked", "message": message[:2048]})
    return UpgradePlan(status, EngineRollout(image=prev.from_image), blocked_message=status.message)
