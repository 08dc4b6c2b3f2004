"""Engine image upgrades: one canary replica first, a fidelity canary against the trainer, then roll on
or roll back. Pure: `plan_upgrade` maps what the reconciler read to what the engines should run.

A new vLLM can pass every compatibility rule and still move the numbers R3 depends on (a different
MoE kernel shifts the natural routing mismatch, a capture regression returns routes of the wrong shape,
a sampler change shifts logprobs). So an image change does not roll every replica at once:

    Canary   the StatefulSet grows by one replica (surge ordinal) carrying the new image; a partition
             keeps every existing pod on the old one (a LeaderWorkerSet the same way, in groups: one
             surge group, rolloutStrategy partition), and the trainer never sends it a rollout (its
             engine list names only the regular replicas). The canary Job (trainer image,
             `r3operator upgrade-canary`) scores an old and the new replica with the trainer's current
             weights, with and without replay, and ends with its verdict as the termination message.
             upgradePolicy.timeoutSeconds counts from when the surge replica and the canary pod run;
             one that cannot be scheduled is reported at once (UpgradeBlocked=True CanaryUnschedulable)
             and rolled back after upgradePolicy.startTimeoutSeconds, releasing its GPUs.
    Rolling  passed (or forced, or no canary wanted): the surge replica goes, the partition drops to 0
             and the StatefulSet (LeaderWorkerSet) controller rolls the rest, one replica at a time.
    Complete every pod runs the new revision.
    Blocked  failed or timed out: the template goes back to the old image (the surge pod goes, nobody
             else moved), condition UpgradeBlocked carries the figures; the spec keeps the new image until
             the user changes it. `kubectl annotate rlj NAME r3operator.io/upgrade=force` rolls it anyway.

A disaggregated job (`inference.disaggregation`) moves both roles alike: a surge replica each on the new image, each
role's partition its replicas; the canary scores the new prefill → decode pair against an old pair; Rolling lifts
both partitions and Complete waits for both StatefulSets. While the two roll, the trainer pairs a prefill engine
only with a decode engine of its own image (rollout/disaggregated.py), so no rollout crosses images.

The state (from, to, phase, attempt, clocks, verdict) is the operator's own record on the engine
StatefulSet (operator/upgrade_record.py), never read from the RLJob's status, so an operator restarted
mid-upgrade resumes in the same phase; a spec image change during an upgrade starts a new attempt from the
last image that is known good. What the engines and the trainer are known good on is the operator's record too,
never the image a live object carries: the annotation ``r3operator.io/verified-image`` on the engine StatefulSet
(LeaderWorkerSet) and on the RayJob, the image the operator rendered there for the regular replicas (the spec's,
one a canary passed on, or the one a blocked canary went back to). An image edited by hand into either object
is no upgrade "from" anything: it differs from the render and is taken back (apply.py). `allowed_images` is the
last word before rendering: no image that is neither in the spec nor in that record nor verified.

`r3operator.io/upgrade=force` is one-shot: the pass that finds it removes it (reconcile.py), having used it for
the upgrade it starts or finds in Canary or Blocked (``UpgradePlan.forced``), or for nothing.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace
from typing import Any

from r3operator.api.disaggregation import engine_replicas, role_replicas, roles
from r3operator.api.enums import EngineRole
from r3operator.api.v1alpha1 import RLJob, UpgradeCanary, UpgradeStatus
from r3operator.operator import meta
from r3operator.operator.builders.engine_lws import leader_worker_templates
from r3operator.operator.builders.upgrade_canary import CanaryTarget
from r3operator.operator.lifecycle import format_time, parse_time
from r3operator.operator.upgrade_record import PodProgress

ANNOTATION_UPGRADE = "r3operator.io/upgrade"
FORCE = "force"
ENGINE_CONTAINER = "vllm"
ANNOTATION_VERIFIED_IMAGE = meta.ANNOTATION_VERIFIED_IMAGE


@dataclass(frozen=True, slots=True)
class EngineRollout:
    """How the engine StatefulSet is rendered while an upgrade is under way."""

    image: str
    """The image the pod template carries."""
    surge_replicas: int = 0
    """Engine replicas beyond spec.inference.replicas (the canary replica)."""
    partition: int = 0
    """Replicas with a lower index stay on the current revision (StatefulSet rollingUpdate.partition over
    ordinals, LeaderWorkerSet rollingUpdateConfiguration.partition over groups: one replica each)."""
    regular_image: str | None = None
    """During a canary, the image the partition keeps the regular replicas on (None: ``image``)."""

    @property
    def verified(self) -> str:
        """The image the regular replicas are known good on once this rollout is rendered."""
        return self.regular_image or self.image


@dataclass(frozen=True, slots=True)
class UpgradePlan:
    status: UpgradeStatus | None
    rollout: EngineRollout | None = None
    """None: render the spec as it is."""
    canary: CanaryTarget | None = None
    """Not None: the canary Job must exist for this attempt."""
    blocked_message: str | None = None
    trainer_image: str | None = None
    """Not None: render the RayJob with this trainer image (the old one, while its successor is canaried)."""
    unschedulable: str | None = None
    """The canary's surge replica or pod cannot be scheduled (the scheduler's reason): UpgradeBlocked now."""
    forced: bool = False
    """The r3operator.io/upgrade=force annotation decided this plan (the canary skipped or a block lifted)."""


@dataclass(frozen=True, slots=True)
class CanaryInputs:
    """What the reconciler read of a canary under way, from objects only trusted parties write."""

    job: dict[str, Any] | None = None
    """The canary Job this RLJob controls (its Failed condition: no verdict will come)."""
    verdict: UpgradeCanary | None = None
    """The canary pod's termination message for this attempt (upgrade_record.verdict_from_pods)."""
    pods: PodProgress = field(default_factory=lambda: PodProgress(running=False))
    """The surge replica's pods (engine upgrade) and the canary pod: do they run yet."""


def template_image(statefulset: dict[str, Any] | None) -> str | None:
    """The engine image of the StatefulSet's (or LeaderWorkerSet leader's) pod template as the cluster has it."""
    if statefulset is None:
        return None
    spec = statefulset.get("spec") or {}
    template = spec.get("template") or leader_worker_templates(statefulset)[0]
    containers = (template.get("spec") or {}).get("containers") or []
    for container in containers:
        if container.get("name") == ENGINE_CONTAINER:
            return str(container.get("image") or "") or None
    return None


def _verified_annotation(obj: dict[str, Any] | None) -> str | None:
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(ANNOTATION_VERIFIED_IMAGE) or "") or None


def verified_engine_image(statefulset: dict[str, Any] | None, prev: UpgradeStatus | None) -> str | None:
    """The image the engines are known good on: the operator's annotation; for engines made by an operator before
    it, its upgrade record (``to`` once a canary passed, else ``from``), else the template's image. None: no
    engines yet."""
    if statefulset is None:
        return None
    if (annotated := _verified_annotation(statefulset)) is not None:
        return annotated
    if prev is not None and prev.component == "engine":
        return prev.to if prev.phase in ("Rolling", "Complete") else prev.from_image
    return template_image(statefulset)


def verified_trainer_image(ray_job: dict[str, Any] | None) -> str | None:
    """The image the trainer is known good on: the operator's annotation on the RayJob; for a RayJob made by an
    operator before it, its head image. None: no RayJob."""
    if ray_job is None:
        return None
    return _verified_annotation(ray_job) or trainer_image(ray_job)


def rolled_out(statefulset: dict[str, Any] | None, *, pods: int) -> tuple[bool, int]:
    """(every replica on the update revision, replicas updated so far) from the StatefulSet's status
    (``pods``: one per replica) or the LeaderWorkerSet's (``pods``: groups)."""
    if statefulset is None:
        return False, 0
    if statefulset.get("kind") == "LeaderWorkerSet":
        return _groups_rolled_out(statefulset, groups=pods)
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


def _groups_rolled_out(lws: dict[str, Any], *, groups: int) -> tuple[bool, int]:
    """A LeaderWorkerSet's status has no revisions nor observedGeneration: done is every group updated and
    ready, no surge group left (the canary's) and no UpdateInProgress condition. The surge group keeps
    status.replicas above ``groups`` until the controller has seen the partition lifted."""
    status = lws.get("status") or {}
    updated = int(status.get("updatedReplicas") or 0)
    updating = any(
        c.get("type") == "UpdateInProgress" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    done = (
        not updating
        and int(status.get("replicas") or 0) == groups
        and updated >= groups
        and int(status.get("readyReplicas") or 0) >= groups
    )
    return done, updated


def canary_job_failed(canary_job: dict[str, Any] | None) -> str | None:
    """The reason a canary Job ended without a verdict (Failed condition), else None."""
    for cond in ((canary_job or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Failed" and cond.get("status") == "True":
            return f"the canary Job failed ({cond.get('reason') or 'no reason'}: {cond.get('message') or ''})"
    return None


ACTIVE = ("Canary", "Rolling", "Blocked")


def trainer_image(ray_job: dict[str, Any] | None) -> str | None:
    """The trainer image of the RayJob's head as the cluster has it."""
    head = (((ray_job or {}).get("spec") or {}).get("rayClusterSpec") or {}).get("headGroupSpec") or {}
    containers = ((head.get("template") or {}).get("spec") or {}).get("containers") or []
    return str(containers[0].get("image") or "") or None if containers else None


def plan_upgrade(
    job: RLJob,
    statefulset: dict[str, Any] | None,
    *,
    prev: UpgradeStatus | None = None,
    canary: CanaryInputs | None = None,
    ray_job: dict[str, Any] | None = None,
    stopped: bool = False,
    now: dt.datetime,
    prefill_set: dict[str, Any] | None = None,
) -> UpgradePlan:
    """What the engines and the trainer should run, given the spec, what the cluster runs and the
    operator's record of the upgrade (``prev``, upgrade_record.read_record). One upgrade at a time: an
    engine image change waits for a trainer upgrade under way (the engines stay on what they run) and a
    trainer image change waits for an engine upgrade."""
    canary = canary or CanaryInputs()
    if prev is not None and prev.component == "trainer" and prev.phase in ACTIVE:
        plan = _plan_trainer(job, prev, ray_job, canary, stopped, now)
        verified = verified_engine_image(statefulset, None)
        if verified is not None and verified != job.spec.inference.image:
            plan = replace(plan, rollout=EngineRollout(image=verified))  # the engine change waits its turn
        return plan
    engine_prev = prev if prev is None or prev.component == "engine" else None
    engines = _plan_engines(
        job, statefulset, engine_prev, canary=canary, stopped=stopped, now=now, prefill_set=prefill_set
    )
    if engines.status is not None and engines.status.phase in ACTIVE:
        return engines
    running_trainer = verified_trainer_image(ray_job)
    if not stopped and running_trainer is not None and running_trainer != job.spec.trainer.image:
        return _trainer_attempt(job, running_trainer, now)
    return engines if engines.status is not None else UpgradePlan(prev)


def _plan_engines(
    job: RLJob,
    statefulset: dict[str, Any] | None,
    prev: UpgradeStatus | None,
    *,
    canary: CanaryInputs,
    stopped: bool,
    now: dt.datetime,
    prefill_set: dict[str, Any] | None = None,
) -> UpgradePlan:
    spec_image = job.spec.inference.image
    policy = job.spec.upgrade_policy
    replicas = engine_replicas(job.spec)
    running = verified_engine_image(statefulset, prev)  # never an image edited into the template by hand
    force = job.metadata.annotations.get(ANNOTATION_UPGRADE) == FORCE
    active = prev is not None and prev.phase in ("Canary", "Rolling", "Blocked")

    if active and prev is not None and prev.to == spec_image:
        return _continue(job, prev, statefulset, canary, force, stopped, now, prefill_set)
    if active and prev is not None and prev.phase in ("Canary", "Blocked") and spec_image == prev.from_image:
        # The user went back to the image that is running: nothing to roll, the attempt is over.
        cancelled = prev.model_copy(
            update={
                "phase": "Cancelled",
                "message": f"spec.inference.image is {spec_image} again; the upgrade to {prev.to} was abandoned",
            }
        )
        return UpgradePlan(cancelled)
    if running is None or (running == spec_image and not active):
        return UpgradePlan(prev)  # first creation, or nothing changed
    # A new attempt. Its "from" is the last image known good: the one every regular pod runs.
    good = prev.from_image if active and prev is not None and prev.phase != "Rolling" else running
    if active and prev is not None and prev.phase == "Rolling":
        good = prev.to  # it passed its canary; pods not rolled yet still run the one before
    attempt = f"{job.metadata.generation or 0}"
    status = UpgradeStatus.model_validate(
        {
            "from": good,
            "to": spec_image,
            "phase": "Canary",
            "attempt": attempt,
            "startedAt": format_time(now),
        }
    )
    if force or not policy.canary or replicas == 0 or stopped:
        why = (
            "forced by the r3operator.io/upgrade=force annotation"
            if force
            else "upgradePolicy.canary is false"
            if not policy.canary
            else "no engine replica runs"
        )
        status = status.model_copy(update={"phase": "Rolling", "message": f"rolling every replica: {why}"})
        return UpgradePlan(status, EngineRollout(image=spec_image), forced=force)
    return _canary(status, replicas, _prefill_replicas(job))


def _prefill_replicas(job: RLJob) -> int | None:
    return role_replicas(job.spec, EngineRole.PREFILL) if roles(job.spec) else None


def _canary(status: UpgradeStatus, replicas: int, prefill: int | None = None) -> UpgradePlan:
    status = status.model_copy(
        update={
            "message": f"canary: one extra replica on {status.to} is scored against one on {status.from_image}",
        }
    )
    rollout = EngineRollout(image=status.to, surge_replicas=1, partition=replicas, regular_image=status.from_image)
    target = CanaryTarget(
        attempt=status.attempt,
        old_image=status.from_image,
        new_image=status.to,
        old_replica=0,
        new_replica=replicas,
        prefill=None if prefill is None else (0, prefill),  # the prefill role's surge ordinal is its replicas
    )
    return UpgradePlan(status, rollout, target)


def _continue(
    job: RLJob,
    prev: UpgradeStatus,
    statefulset: dict[str, Any] | None,
    canary: CanaryInputs,
    force: bool,
    stopped: bool,
    now: dt.datetime,
    prefill_set: dict[str, Any] | None = None,
) -> UpgradePlan:
    replicas = engine_replicas(job.spec)
    pods = 0 if stopped else replicas  # StatefulSet pods or LeaderWorkerSet groups: one per replica
    if prev.phase == "Canary":
        if force or stopped:
            why = "forced by the r3operator.io/upgrade=force annotation" if force else "the job stopped"
            return replace(_rolling(prev, f"canary skipped: {why}"), forced=force)
        passed, why = canary_outcome(job, prev, canary, now)
        judged = prev.model_copy(update={"canary": canary.verdict}) if canary.verdict is not None else prev
        if passed is True:
            return _rolling(judged, why)
        if passed is False:
            return _blocked(judged, why)
        return _waiting(job, _canary(prev, replicas, _prefill_replicas(job)), canary, now)
    if prev.phase == "Blocked":
        if force:
            plan = _rolling(prev, "forced by the r3operator.io/upgrade=force annotation after a failed canary")
            return replace(plan, forced=True)
        return UpgradePlan(prev, EngineRollout(image=prev.from_image), blocked_message=prev.message)
    done, replicas_updated = rolled_out(statefulset, pods=pods)
    if (prefill := _prefill_replicas(job)) is not None:  # Complete once both roles run the new image
        done = done and rolled_out(prefill_set, pods=0 if stopped else prefill)[0]
    if done:
        status = prev.model_copy(
            update={"phase": "Complete", "replicas_updated": replicas, "message": f"every replica runs {prev.to}"}
        )
        return UpgradePlan(status)
    status = prev.model_copy(update={"replicas_updated": min(replicas_updated, replicas)})
    return UpgradePlan(status, EngineRollout(image=prev.to))


def canary_outcome(job: RLJob, prev: UpgradeStatus, canary: CanaryInputs, now: dt.datetime) -> tuple[bool | None, str]:
    """(True, why) passed; (False, why) failed, timed out, never started or the Job failed; (None, "")
    still waiting. The verdict clock runs from when the canary's pods ran (``canaryStartedAt``), not from
    the image change: pulling a new image and loading a model may take long, waiting for a GPU longer."""
    verdict = canary.verdict if canary.verdict is not None and canary.verdict.attempt == prev.attempt else None
    if verdict is not None:
        return verdict.passed, f"canary {'passed' if verdict.passed else 'failed'}: {verdict.message}"
    if (reason := canary_job_failed(canary.job)) is not None:
        return False, reason
    policy = job.spec.upgrade_policy
    ran = parse_time(prev.canary_started_at)
    if ran is not None and (now - ran).total_seconds() > policy.timeout_seconds:
        return False, (
            f"canary timed out: no verdict {policy.timeout_seconds} s after its pods ran (upgradePolicy.timeoutSeconds)"
        )
    started = parse_time(prev.started_at)
    waited = (now - started).total_seconds() if started is not None else 0.0
    if ran is None and not canary.pods.running and waited > policy.start_timeout_seconds:
        why = canary.pods.unschedulable or "its pods are not running (image pull, crash or no node)"
        return False, (
            f"the canary did not start within {policy.start_timeout_seconds} s "
            f"(upgradePolicy.startTimeoutSeconds): {why}"
        )
    return None, ""


def _waiting(job: RLJob, plan: UpgradePlan, canary: CanaryInputs, now: dt.datetime) -> UpgradePlan:
    """A canary without a verdict yet: its clock starts once its pods run; one that cannot be scheduled
    is reported now (UpgradeBlocked) and rolled back by canary_outcome after startTimeoutSeconds."""
    assert plan.status is not None
    status = plan.status
    if status.canary_started_at is None and canary.pods.running:
        status = status.model_copy(update={"canary_started_at": format_time(now)})
    reason = canary.pods.unschedulable
    if reason is not None and status.canary_started_at is None:
        limit = job.spec.upgrade_policy.start_timeout_seconds
        message = f"{reason}; the canary is rolled back if it does not run within {limit} s of the upgrade's start"
        status = status.model_copy(update={"message": message[:2048]})
    return replace(plan, status=status, unschedulable=reason if status.canary_started_at is None else None)


# ------------------------------------------------------------------------------------- trainer image


def _trainer_attempt(job: RLJob, good: str, now: dt.datetime) -> UpgradePlan:
    """A new trainer image: the RayJob keeps `good` while the canary Job scores one engine replica with
    both images; without a canary (not wanted, forced, no engine to score) the RayJob is replaced now."""
    to = job.spec.trainer.image
    status = UpgradeStatus.model_validate(
        {
            "component": "trainer",
            "from": good,
            "to": to,
            "phase": "Canary",
            "attempt": f"{job.metadata.generation or 0}",
            "startedAt": format_time(now),
        }
    )
    force = job.metadata.annotations.get(ANNOTATION_UPGRADE) == FORCE
    if force or not job.spec.upgrade_policy.canary or engine_replicas(job.spec) == 0:
        why = (
            "forced by the r3operator.io/upgrade=force annotation"
            if force
            else "upgradePolicy.canary is false"
            if job.spec.upgrade_policy.canary is False
            else "no engine replica to score"
        )
        rolling = status.model_copy(update={"phase": "Rolling", "message": f"replacing the RayJob: {why}"})
        return UpgradePlan(rolling, forced=force)
    return _trainer_canary(status)


def _trainer_canary(status: UpgradeStatus) -> UpgradePlan:
    status = status.model_copy(
        update={
            "message": f"canary: trainer images {status.to} and {status.from_image} score the same engine replica",
        }
    )
    target = CanaryTarget(
        attempt=status.attempt,
        old_image=status.from_image,
        new_image=status.to,
        old_replica=0,
        new_replica=0,
        component="trainer",
    )
    return UpgradePlan(status, canary=target, trainer_image=status.from_image)


def _plan_trainer(
    job: RLJob,
    prev: UpgradeStatus,
    ray_job: dict[str, Any] | None,
    canary: CanaryInputs,
    stopped: bool,
    now: dt.datetime,
) -> UpgradePlan:
    spec_image = job.spec.trainer.image
    force = job.metadata.annotations.get(ANNOTATION_UPGRADE) == FORCE
    if prev.to != spec_image:
        if prev.phase in ("Canary", "Blocked") and spec_image == prev.from_image:
            message = f"spec.trainer.image is {spec_image} again; the upgrade to {prev.to} was abandoned"
            return UpgradePlan(prev.model_copy(update={"phase": "Cancelled", "message": message}))
        return _trainer_attempt(job, prev.to if prev.phase == "Rolling" else prev.from_image, now)
    if prev.phase == "Rolling":
        if verified_trainer_image(ray_job) == prev.to:
            return UpgradePlan(prev.model_copy(update={"phase": "Complete", "message": f"the trainer runs {prev.to}"}))
        return UpgradePlan(prev)  # the RayJob is being replaced
    if prev.phase == "Blocked":
        if force:
            message = "forced by the r3operator.io/upgrade=force annotation after a failed canary"
            return UpgradePlan(prev.model_copy(update={"phase": "Rolling", "message": message}), forced=True)
        return UpgradePlan(prev, trainer_image=prev.from_image, blocked_message=prev.message)
    if force or stopped:
        why = "forced by the r3operator.io/upgrade=force annotation" if force else "the job stopped"
        skipped = prev.model_copy(update={"phase": "Rolling", "message": f"canary skipped: {why}"})
        return UpgradePlan(skipped, forced=force)
    passed, why = canary_outcome(job, prev, canary, now)
    judged = prev.model_copy(update={"canary": canary.verdict}) if canary.verdict is not None else prev
    if passed is True:
        return UpgradePlan(judged.model_copy(update={"phase": "Rolling", "message": why}))
    if passed is False:
        message = (
            f"{why}. The trainer stays on {prev.from_image}; spec.trainer.image still says {prev.to}: change "
            f"it to retry with another image, or annotate the RLJob {ANNOTATION_UPGRADE}={FORCE} to roll anyway"
        )
        blocked = judged.model_copy(update={"phase": "Blocked", "message": message[:2048]})
        return UpgradePlan(blocked, trainer_image=prev.from_image, blocked_message=blocked.message)
    return _waiting(job, _trainer_canary(prev), canary, now)


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


# ------------------------------------------------------------------------------ the last word on images


def allowed_images(
    job: RLJob, prev: UpgradeStatus | None, statefulset: dict[str, Any] | None, ray_job: dict[str, Any] | None
) -> dict[str, set[str]]:
    """Per component, the only images the operator may render: the spec's, the one verified last, and the
    from/to of its own record of the upgrade (which came from earlier specs and verified images). Not what a
    live object carries: an image edited in by hand is no approval."""
    allowed = {"engine": {job.spec.inference.image}, "trainer": {job.spec.trainer.image}}
    engine_prev = prev if prev is not None and prev.component == "engine" else None
    for component, verified in (
        ("engine", verified_engine_image(statefulset, engine_prev)),
        ("trainer", verified_trainer_image(ray_job)),
    ):
        if verified is not None:
            allowed[component].add(verified)
    if prev is not None:
        allowed[prev.component] |= {prev.from_image, prev.to}
    return allowed


def refuse_unknown_images(plan: UpgradePlan, allowed: dict[str, set[str]]) -> UpgradePlan:
    """``plan`` when every image it renders is allowed; otherwise a plan that renders the spec as it is,
    no canary, and says which image was refused. A bug or a forged record must not run an image nobody
    approved."""
    wanted = []
    if plan.rollout is not None:
        wanted.append(("engine", plan.rollout.image))
    if plan.trainer_image is not None:
        wanted.append(("trainer", plan.trainer_image))
    if plan.canary is not None:
        wanted += [(plan.canary.component, plan.canary.old_image), (plan.canary.component, plan.canary.new_image)]
    refused = [(c, image) for c, image in wanted if image not in allowed[c]]
    if not refused:
        return plan
    component, image = refused[0]
    message = (
        f"refused to render {component} image {image}: it is neither in the spec nor in the operator's "
        "record of the previous spec nor running; the spec is rendered as it is"
    )
    status = plan.status.model_copy(update={"phase": "Blocked", "message": message}) if plan.status else None
    return UpgradePlan(status, blocked_message=message)
