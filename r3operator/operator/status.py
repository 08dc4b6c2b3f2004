"""compute_status(job, observed, now) → RLJobStatus, and status_changed(old, new). Pure.

Conditions follow metav1: positive polarity, ``observedGeneration`` in each, ``lastTransitionTime``
only on status flips. ``Succeeded``/``Failed`` are sticky. ``Ready`` is rolled up in a fixed order
and carries the first failing reason. ``progress`` is the trainer's report as the operator took it
(operator/progress.py). Every field is the operator's: it is written whole, so what anyone else wrote
there is gone with the next write.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from r3operator.api import names
from r3operator.api.disaggregation import role_replicas, roles
from r3operator.api.engine_layout import engine_layout
from r3operator.api.enums import ConditionStatus as S
from r3operator.api.enums import ConditionType as T
from r3operator.api.enums import EngineRole, ReplayMode
from r3operator.api.plan import plan
from r3operator.api.v1alpha1 import Condition, Progress, RLJob, RLJobStatus, WorkloadCounts
from r3operator.operator import meta
from r3operator.operator.admission import AdmissionState
from r3operator.operator.builders.model_cache import model_cache_claim_name
from r3operator.operator.conditions import Desired, Reason, merge
from r3operator.operator.export_status import exported
from r3operator.operator.hashing import engine_spec_hash
from r3operator.operator.lifecycle import format_time, is_suspended, recorded_end
from r3operator.operator.observed import Observed
from r3operator.operator.replay_health import replay_healthy

_REFUSED_WRITE = (Reason.API_ERROR, Reason.NAMESPACE_TERMINATING)

CONDITION_ORDER = (
    T.READY,
    T.VALID,
    T.ADMITTED,
    T.ENGINES_READY,
    T.TRAINER_READY,
    T.ROUTING_REPLAY_ACTIVE,
    T.PROGRESSING,
    T.SUSPENDED,
    T.SUCCEEDED,
    T.FAILED,
    T.UPGRADE_BLOCKED,
    T.REPLAY_HEALTHY,
    T.EXPORTED,
)

_UPGRADE_REASONS = {
    "Canary": Reason.UPGRADE_CANARY,
    "Rolling": Reason.UPGRADE_ROLLING,
    "Complete": Reason.UPGRADE_COMPLETE,
    "Cancelled": Reason.UPGRADE_CANCELLED,
}


def _upgrade_blocked(obs: Observed) -> Desired:
    """True (CanaryFailed) while an engine image change is held back by its canary; the message carries
    the figures and what to do. False otherwise, with the upgrade's phase as the reason."""
    upgrade = obs.upgrade
    if upgrade is None:
        return Desired(T.UPGRADE_BLOCKED, S.FALSE, Reason.NO_UPGRADE, "no engine image change so far")
    if upgrade.phase == "Blocked":
        return Desired(T.UPGRADE_BLOCKED, S.TRUE, Reason.CANARY_FAILED, upgrade.message)
    if obs.upgrade_unschedulable is not None:
        return Desired(T.UPGRADE_BLOCKED, S.TRUE, Reason.CANARY_UNSCHEDULABLE, upgrade.message)
    what = f"{upgrade.from_image} → {upgrade.to}: {upgrade.message}"
    return Desired(T.UPGRADE_BLOCKED, S.FALSE, _UPGRADE_REASONS[upgrade.phase], what)


def _old(job: RLJob) -> dict[str, Condition]:
    return {c.type: c for c in job.status.conditions} if job.status else {}


def _valid(job: RLJob, obs: Observed) -> Desired:
    if obs.rule_errors:
        text = "; ".join(f"{f.rule}: {f.message}" for f in obs.rule_errors)
        return Desired(T.VALID, S.FALSE, Reason.INCOMPATIBLE_SETTINGS, text)
    if not obs.kuberay_installed:
        return Desired(
            T.VALID,
            S.FALSE,
            Reason.KUBERAY_MISSING,
            "the RayJob CRD (rayjobs.ray.io, version v1) is not installed: install the KubeRay operator",
        )
    if obs.name_conflict is not None:
        return Desired(
            T.VALID,
            S.FALSE,
            Reason.NAME_CONFLICT,
            f"{obs.name_conflict}; nothing was changed: rename the RLJob or remove those objects (one that is "
            "terminating goes by itself)",
        )
    if obs.missing_claims:
        claims = ", ".join(f"PersistentVolumeClaim/{c}" for c in obs.missing_claims)
        return Desired(
            T.VALID,
            S.FALSE,
            Reason.CLAIM_NOT_FOUND,
            f"{claims} not found in namespace {job.metadata.namespace}: create it or fix the spec",
        )
    if not obs.kueue_installed:
        return Desired(
            T.VALID,
            S.FALSE,
            Reason.KUEUE_MISSING,
            "spec.queueName is set but the Kueue Workload API (workloads.kueue.x-k8s.io, v1beta1) is not served: "
            "install Kueue or remove spec.queueName",
        )
    if obs.borrowed_identities:
        return Desired(
            T.VALID,
            S.FALSE,
            Reason.FOREIGN_SERVICE_ACCOUNT,
            f"{'; '.join(obs.borrowed_identities)}; name another ServiceAccount, or none (then the job gets its own); "
            "nothing was created",
        )
    if obs.missing_references:
        return Desired(
            T.VALID,
            S.FALSE,
            Reason.REFERENCE_NOT_FOUND,
            f"{'; '.join(obs.missing_references)} (namespace {job.metadata.namespace}): create them or fix the "
            "spec; nothing was created",
        )
    return Desired(T.VALID, S.TRUE, Reason.SPEC_VALID, "all compatibility rules passed")


_ADMITTED: dict[AdmissionState, tuple[S, Reason]] = {
    AdmissionState.NOT_QUEUED: (S.TRUE, Reason.NOT_QUEUED),
    AdmissionState.ADMITTED: (S.TRUE, Reason.ADMITTED),
    AdmissionState.PENDING: (S.FALSE, Reason.WAITING_FOR_ADMISSION),
    AdmissionState.EVICTED: (S.FALSE, Reason.EVICTED),
    AdmissionState.FINISHED: (S.FALSE, Reason.QUOTA_RELEASED),
}


def _admitted(obs: Observed) -> Desired:
    admission = obs.admission
    if not obs.kueue_installed and admission.state is not AdmissionState.NOT_QUEUED:
        # Nothing can admit it, and nothing was created to hold back: not "waiting", not "suspended".
        return Desired(T.ADMITTED, S.FALSE, Reason.KUEUE_MISSING, "no Kueue is installed to admit spec.queueName")
    status, reason = _ADMITTED[admission.state]
    message = admission.message
    if admission.state is AdmissionState.PENDING:
        message = f"waiting for Kueue to admit engines and trainer as one workload: {message}"
    elif admission.state is AdmissionState.EVICTED:
        message = f"evicted by Kueue ({admission.reason}): {message}; suspended and queued again"
    return Desired(T.ADMITTED, status, reason, message)


def _blocked(obs: Observed) -> Desired | None:
    """The API server refuses what this pass must write (Progressing=False, Ready=False)."""
    if obs.namespace_terminating:
        return Desired(
            T.PROGRESSING,
            S.FALSE,
            Reason.NAMESPACE_TERMINATING,
            "the namespace is being deleted: no child can be created in it",
        )
    if obs.api_error is not None:
        return Desired(T.PROGRESSING, S.FALSE, Reason.API_ERROR, obs.api_error)
    return None


def engine_counts(job: RLJob, sts: dict[str, Any] | None) -> WorkloadCounts:
    """Engine *replicas* (vLLM servers): StatefulSet pods, or LeaderWorkerSet groups (ready when all their
    pods are), one per replica either way."""
    desired = 0 if sts is None else int(sts.get("spec", {}).get("replicas") or 0)
    st = (sts or {}).get("status") or {}
    return WorkloadCounts(
        replicas=desired,
        ready_replicas=int(st.get("readyReplicas") or 0),
        updated_replicas=int(st.get("updatedReplicas") or 0),
    )


def _engines(job: RLJob, obs: Observed, stopped: Desired | None) -> Desired:
    if stopped is not None:
        return Desired(T.ENGINES_READY, S.FALSE, stopped.reason, stopped.message)
    if not roles(job.spec):
        return _engine_group(
            job, obs, obs.engine_set, job.spec.inference.replicas, role=meta.ROLE_ENGINE, what="engine"
        )
    # A disaggregated job: both roles must be ready; the first that is not says why, naming its role.
    parts = (
        (obs.prefill_set, role_replicas(job.spec, EngineRole.PREFILL), names.ROLE_PREFILL, "prefill engine"),
        (obs.engine_set, role_replicas(job.spec, EngineRole.DECODE), meta.ROLE_ENGINE, "decode engine"),
    )
    for sts, want, role, what in parts:
        group = _engine_group(job, obs, sts, want, role=role, what=what)
        if group.status is not S.TRUE:
            return group
    ready = ", ".join(f"{what} replicas {want}/{want} ready" for _, want, _, what in parts)
    return Desired(T.ENGINES_READY, S.TRUE, Reason.ALL_REPLICAS_READY, ready)


def _engine_group(job: RLJob, obs: Observed, sts: dict[str, Any] | None, want: int, *, role: str, what: str) -> Desired:
    """One engine group's readiness: every engine, or one role of a disaggregated job."""
    if sts is None:
        kind = "LeaderWorkerSet" if role == meta.ROLE_ENGINE and engine_layout(job.spec).multi_pod else "StatefulSet"
        return Desired(T.ENGINES_READY, S.FALSE, Reason.NOT_CREATED, f"the {what} {kind} does not exist yet")
    if want == 0:
        return Desired(T.ENGINES_READY, S.TRUE, Reason.NO_REPLICAS, "inference.replicas is 0")
    counts = engine_counts(job, sts)
    generation = (sts.get("metadata") or {}).get("generation")
    seen = ((sts.get("status") or {}).get("observedGeneration")) or 0
    if sts.get("kind") == "LeaderWorkerSet":
        seen = generation or 0  # its status has no observedGeneration: updatedReplicas alone tells a rollout
    # During an upgrade's canary the partition keeps the regular replicas on the old revision on purpose.
    held = obs.upgrade is not None and obs.upgrade.phase == "Canary"
    if (generation is not None and seen < generation) or (counts.updated_replicas < want and not held):
        return Desired(
            T.ENGINES_READY, S.FALSE, Reason.UPDATING, f"{counts.updated_replicas}/{want} {what} replicas updated"
        )
    if counts.ready_replicas < want and role in obs.unschedulable:
        why = obs.unschedulable[role]
        return Desired(T.ENGINES_READY, S.FALSE, Reason.UNSCHEDULABLE, f"{what} pods cannot be scheduled: {why}")
    if counts.ready_replicas < want and role in obs.config_errors:
        why = obs.config_errors[role]
        return Desired(T.ENGINES_READY, S.FALSE, Reason.REFERENCE_NOT_FOUND, f"{what} pods cannot start: {why}")
    if counts.ready_replicas < want:
        return Desired(
            T.ENGINES_READY, S.FALSE, Reason.PODS_NOT_READY, f"{counts.ready_replicas}/{want} {what} replicas ready"
        )
    return Desired(T.ENGINES_READY, S.TRUE, Reason.ALL_REPLICAS_READY, f"{want}/{want} {what} replicas ready")


def _ray_status(obs: Observed) -> tuple[str, str, str]:
    st = (obs.ray_job or {}).get("status") or {}
    return str(st.get("jobDeploymentStatus") or ""), str(st.get("jobStatus") or ""), str(st.get("message") or "")


_STARTING = ("", "New", "Initializing")
"""KubeRay's jobDeploymentStatus on the way to Running (RayCluster coming up, then the submitter)."""
_STARTING_MESSAGE = "the RayJob is starting (its Ray cluster, then the submitter): jobDeploymentStatus is on the RayJob"


def _trainer(obs: Observed, stopped: Desired | None) -> Desired:
    if stopped is not None:
        return Desired(T.TRAINER_READY, S.FALSE, stopped.reason, stopped.message)
    if obs.ray_job is None:
        return Desired(T.TRAINER_READY, S.FALSE, Reason.NOT_CREATED, "the trainer RayJob does not exist yet")
    deployment, job_status, message = _ray_status(obs)
    if deployment == "Running":
        detail = f"jobStatus {job_status}" if job_status else "the Ray job has reported no jobStatus yet"
        return Desired(T.TRAINER_READY, S.TRUE, Reason.TRAINER_RUNNING, f"RayJob running ({detail})")
    if deployment in ("Failed", "ValidationFailed"):
        return Desired(T.TRAINER_READY, S.FALSE, Reason.TRAINER_FAILED, message or f"RayJob {deployment}")
    if meta.ROLE_TRAINER in obs.unschedulable:
        why = obs.unschedulable[meta.ROLE_TRAINER]
        return Desired(T.TRAINER_READY, S.FALSE, Reason.UNSCHEDULABLE, f"trainer pods cannot be scheduled: {why}")
    if meta.ROLE_TRAINER in obs.config_errors:
        why = obs.config_errors[meta.ROLE_TRAINER]
        return Desired(T.TRAINER_READY, S.FALSE, Reason.REFERENCE_NOT_FOUND, f"trainer pods cannot start: {why}")
    if deployment in _STARTING:
        # One message for KubeRay's way up (unset → Initializing, seconds apart): each step would be a status
        # write, and the RayJob shows it.
        return Desired(T.TRAINER_READY, S.FALSE, Reason.TRAINER_STARTING, _STARTING_MESSAGE)
    return Desired(T.TRAINER_READY, S.FALSE, Reason.TRAINER_STARTING, f"RayJob jobDeploymentStatus {deployment}")


def _replay(job: RLJob, obs: Observed, engines: Desired) -> Desired:
    mode = job.spec.routing_replay.mode
    if mode is ReplayMode.DISABLED:
        return Desired(T.ROUTING_REPLAY_ACTIVE, S.FALSE, Reason.REPLAY_DISABLED, "routingReplay.mode is Disabled")
    if mode is ReplayMode.R2:
        return Desired(
            T.ROUTING_REPLAY_ACTIVE,
            S.FALSE,
            Reason.TRAINER_SIDE_REPLAY,
            "R2 replays the trainer's own routing; engines do not return routes",
        )
    canary = obs.canary
    if canary is not None and canary.engine_hash == engine_spec_hash(job.spec):
        if canary.ok:
            return Desired(T.ROUTING_REPLAY_ACTIVE, S.TRUE, Reason.CANARY_PASSED, canary.message)
        return Desired(T.ROUTING_REPLAY_ACTIVE, S.FALSE, Reason.CANARY_FAILED, canary.message)
    if engines.status is not S.TRUE:
        return Desired(
            T.ROUTING_REPLAY_ACTIVE,
            S.UNKNOWN,
            Reason.ENGINES_NOT_READY,
            "the routed-experts canary runs once the engines are ready",
        )
    return Desired(T.ROUTING_REPLAY_ACTIVE, S.UNKNOWN, Reason.CANARY_PENDING, "waiting for the routed-experts canary")


def _terminal(old: dict[str, Condition], obs: Observed) -> tuple[Desired, Desired]:
    succeeded = Desired(T.SUCCEEDED, S.FALSE, Reason.NOT_FINISHED)
    failed = Desired(T.FAILED, S.FALSE, Reason.NOT_FINISHED)
    finish = obs.finish
    if finish is not None and finish.succeeded:
        succeeded = Desired(T.SUCCEEDED, S.TRUE, Reason.TRAINER_SUCCEEDED, finish.message)
    elif finish is not None:
        failed = Desired(T.FAILED, S.TRUE, Reason.TRAINER_FAILED, finish.message)
    if not obs.finish_recorded:
        # The RayJob is there and decides: a terminal condition someone wrote into the status while
        # it runs is overwritten.
        return succeeded, failed
    # The RayJob is gone after its end: keep the end this status recorded (sticky).
    for ctype in (T.SUCCEEDED, T.FAILED):
        previous = old.get(ctype.value)
        if previous is not None and previous.status is S.TRUE:
            kept = Desired(ctype, S.TRUE, previous.reason, previous.message)
            succeeded, failed = (kept, failed) if ctype is T.SUCCEEDED else (succeeded, kept)
    return succeeded, failed


def _model_fetch(job: RLJob, obs: Observed) -> Desired:
    fetch = meta.child_name(job, meta.ROLE_MODEL_FETCH)
    if obs.model_cache_holder is not None:
        return Desired(
            T.PROGRESSING,
            S.FALSE,
            Reason.MODEL_CACHE_HELD,
            f"the kept model cache PersistentVolumeClaim/{model_cache_claim_name(job)} is ReadWriteOnce and "
            f"mounted by RLJob/{obs.model_cache_holder}; this job fetches nothing and starts when that RLJob is "
            "deleted or finishes",
        )
    if obs.model_fetch_failed:
        return Desired(
            T.PROGRESSING,
            S.FALSE,
            Reason.MODEL_FETCH_FAILED,
            f"Job/{fetch} failed ({obs.model_fetch}): `kubectl logs job/{fetch}` says why; fix the source, its "
            f"credentials or the cache claim, then `kubectl delete job/{fetch}` to fetch again",
        )
    if meta.ROLE_MODEL_FETCH in obs.config_errors:
        why = obs.config_errors[meta.ROLE_MODEL_FETCH]
        return Desired(T.PROGRESSING, S.FALSE, Reason.REFERENCE_NOT_FOUND, f"Job/{fetch} cannot start its pod: {why}")
    if meta.ROLE_MODEL_FETCH in obs.unschedulable:
        why = obs.unschedulable[meta.ROLE_MODEL_FETCH]
        return Desired(T.PROGRESSING, S.FALSE, Reason.UNSCHEDULABLE, f"Job/{fetch}'s pod cannot be scheduled: {why}")
    return Desired(
        T.PROGRESSING,
        S.TRUE,
        Reason.FETCHING_MODEL,
        f"Job/{fetch} is filling the model cache; engines and trainer start when it completes",
    )


def _suspended(job: RLJob, obs: Observed, admitted: Desired) -> Desired:
    held = admitted.reason in (Reason.WAITING_FOR_ADMISSION, Reason.EVICTED)
    if not is_suspended(job) and not held:
        return Desired(T.SUSPENDED, S.FALSE, Reason.ACTIVE, "runPolicy.suspend is false")
    sts_pods = int(((obs.engine_set or {}).get("status") or {}).get("replicas") or 0)
    sts_spec = int(((obs.engine_set or {}).get("spec") or {}).get("replicas") or 0)
    ray_suspended = obs.ray_job is None or bool((obs.ray_job.get("spec") or {}).get("suspend"))
    if sts_spec == 0 and sts_pods == 0 and ray_suspended:
        if not is_suspended(job):
            message = f"engines at 0 and the RayJob suspended: {admitted.message}"
            return Desired(T.SUSPENDED, S.TRUE, admitted.reason, message)
        return Desired(T.SUSPENDED, S.TRUE, Reason.SUSPENDED, "engines scaled to 0 and the RayJob suspended")
    return Desired(T.SUSPENDED, S.FALSE, Reason.SUSPENDING, f"{sts_pods} engine pods still running")


def _progressing(obs: Observed, valid: Desired, stopped: Desired | None, others: list[Desired]) -> Desired:
    if valid.status is not S.TRUE:
        return Desired(T.PROGRESSING, S.FALSE, Reason.INVALID_SPEC, "no child is changed while the spec is invalid")
    blocked = _blocked(obs)
    if blocked is not None:
        return blocked
    if stopped is not None:
        return Desired(T.PROGRESSING, stopped.status, stopped.reason, stopped.message)
    if obs.written:
        return Desired(T.PROGRESSING, S.TRUE, Reason.CHILDREN_UPDATED, "applied " + ", ".join(obs.written))
    waiting = [d for d in others if d.status is not S.TRUE]
    if waiting:
        return Desired(T.PROGRESSING, S.TRUE, Reason.WAITING_FOR_WORKLOADS, f"{waiting[0].type}: {waiting[0].message}")
    return Desired(T.PROGRESSING, S.TRUE, Reason.TRAINING, "engines and trainer are running")


def _ready(job: RLJob, by_type: dict[T, Desired]) -> Desired:
    checks: list[tuple[T, S]] = [
        (T.FAILED, S.FALSE),
        (T.SUCCEEDED, S.FALSE),
        (T.VALID, S.TRUE),
        (T.PROGRESSING, S.TRUE),
        (T.ADMITTED, S.TRUE),
        (T.SUSPENDED, S.FALSE),
        (T.ENGINES_READY, S.TRUE),
        (T.TRAINER_READY, S.TRUE),
    ]
    if job.spec.routing_replay.mode is ReplayMode.R3:
        checks.append((T.ROUTING_REPLAY_ACTIVE, S.TRUE))
    for ctype, wanted in checks:
        cond = by_type[ctype]
        if ctype is T.PROGRESSING and cond.reason not in _REFUSED_WRITE:
            continue  # only a refused write rolls up from Progressing; the other reasons have their own
        if cond.status is not wanted:
            reason = cond.reason if ctype is not T.SUSPENDED else Reason.SUSPENDED
            return Desired(T.READY, S.FALSE, reason, f"{ctype.value}: {cond.message}")
    return Desired(T.READY, S.TRUE, Reason.READY, "engines, trainer and routing replay are ready")


def compute_conditions(job: RLJob, obs: Observed) -> dict[T, Desired]:
    old = _old(job)
    valid = _valid(job, obs)
    admitted = _admitted(obs)
    succeeded, failed = _terminal(old, obs)
    stopped: Desired | None = None
    if succeeded.status is S.TRUE or failed.status is S.TRUE:
        reason = Reason.WORKLOADS_DELETED if obs.workloads_deleted else Reason.JOB_FINISHED
        stopped = Desired(T.PROGRESSING, S.FALSE, reason, "the job finished")
    elif is_suspended(job):
        stopped = Desired(T.PROGRESSING, S.FALSE, Reason.SUSPENDED, "runPolicy.suspend is true")
    elif valid.status is S.TRUE and admitted.status is not S.TRUE and admitted.reason is not Reason.QUOTA_RELEASED:
        stopped = Desired(T.PROGRESSING, S.FALSE, admitted.reason, admitted.message)
    elif valid.status is not S.TRUE and obs.engine_set is None and obs.ray_job is None:
        stopped = Desired(T.PROGRESSING, S.FALSE, valid.reason, "no workload is created while the spec is invalid")
    elif obs.model_fetch is not None:
        stopped = _model_fetch(job, obs)
    engines = _engines(job, obs, stopped)
    trainer = _trainer(obs, stopped)
    replay = _replay(job, obs, engines)
    suspended = _suspended(job, obs, admitted)
    progressing = _progressing(obs, valid, stopped, [engines, trainer, replay])
    by_type = {
        T.VALID: valid,
        T.ADMITTED: admitted,
        T.ENGINES_READY: engines,
        T.TRAINER_READY: trainer,
        T.ROUTING_REPLAY_ACTIVE: replay,
        T.PROGRESSING: progressing,
        T.SUSPENDED: suspended,
        T.SUCCEEDED: succeeded,
        T.FAILED: failed,
        T.UPGRADE_BLOCKED: _upgrade_blocked(obs),
        T.REPLAY_HEALTHY: replay_healthy(job, _progress(job.status or RLJobStatus(), obs)),
    }
    if (export := exported(job, _progress(job.status or RLJobStatus(), obs))) is not None:
        by_type[T.EXPORTED] = export  # spec.export only
    by_type[T.READY] = _ready(job, by_type)
    return by_type


def compute_status(job: RLJob, observed: Observed, now: dt.datetime) -> RLJobStatus:
    stamp = format_time(now)
    old_status = job.status or RLJobStatus()
    old = _old(job)
    by_type = compute_conditions(job, observed)
    generation = job.metadata.generation
    conditions = [
        merge(old.get(t.value), by_type[t], generation=generation, now=stamp) for t in CONDITION_ORDER if t in by_type
    ]
    engines = engine_counts(job, observed.engine_set)
    terminal = any(by_type[t].status is S.TRUE for t in (T.SUCCEEDED, T.FAILED))
    completion = _completion_time(job, observed, stamp) if terminal else None
    ray_job = observed.ray_job or {}
    trainer_ready = 1 if by_type[T.TRAINER_READY].status is S.TRUE else 0
    return RLJobStatus(
        observed_generation=generation,
        conditions=conditions,
        resolved=plan(job).to_resolved(),
        engines=engines,
        trainer=WorkloadCounts(replicas=1 if ray_job else 0, ready_replicas=trainer_ready, updated_replicas=0),
        # An upgrade's canary replica is not one of the job's engines: at most desired/desired.
        engines_ready=_engines_ready(job, engines, observed.prefill_set),
        prefill_engines=engine_counts(job, observed.prefill_set) if roles(job.spec) else None,
        progress=_progress(old_status, observed),
        start_time=old_status.start_time or (stamp if by_type[T.VALID].status is S.TRUE else None),
        completion_time=completion,
        upgrade=observed.upgrade,
    )


def _engines_ready(job: RLJob, engines: WorkloadCounts, prefill_set: dict[str, Any] | None) -> str:
    """The ENGINES column: ready/desired replicas; a disaggregated job's per role (``P 1/1 D 2/2``)."""

    def ready(counts: WorkloadCounts, want: int) -> str:
        return f"{min(counts.ready_replicas, want)}/{want}"

    if not roles(job.spec):
        return ready(engines, job.spec.inference.replicas)
    prefill = ready(engine_counts(job, prefill_set), role_replicas(job.spec, EngineRole.PREFILL))
    return f"P {prefill} D {ready(engines, role_replicas(job.spec, EngineRole.DECODE))}"


def _completion_time(job: RLJob, obs: Observed, now: str) -> str:
    """The RayJob's endTime when KubeRay reports one; otherwise when the operator first saw the end (its
    r3operator.io/finished annotation), never what the status said before."""
    if obs.finish is not None and obs.finish.ended_at is not None:
        return format_time(obs.finish.ended_at)
    recorded = recorded_end(job)
    return format_time(recorded) if recorded is not None else now


def _progress(old: RLJobStatus, obs: Observed) -> Progress | None:
    """The trainer's report when this pass read one it takes; otherwise what the status had (a refused report, an
    invalid spec: nothing was read)."""
    report = obs.progress
    return report.progress if report is not None and not report.refused else old.progress


def _comparable(status: RLJobStatus | None) -> dict[str, Any]:
    data = (status or RLJobStatus()).model_dump(mode="json", by_alias=True)
    for cond in data.get("conditions", []):
        cond.pop("lastTransitionTime", None)
    return data


def status_changed(old: RLJobStatus | None, new: RLJobStatus) -> bool:
    """True when anything but the conditions' transition times differs."""
    return _comparable(old) != _comparable(new)


def status_digest(status: RLJobStatus | Mapping[str, Any] | None) -> str:
    """What ``status_changed`` compares, as a digest: of a status as computed, or as a watch event carries it
    (one that does not parse has a digest of its own, so it differs from any the operator wrote)."""
    if status is not None and not isinstance(status, RLJobStatus):
        try:
            status = RLJobStatus.model_validate(dict(status))
        except ValidationError:
            return "unparsable"
    text = json.dumps(_comparable(status), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def status_patch(status: RLJobStatus) -> dict[str, Any]:
    """The /status merge patch: the whole status, every field the operator does not set as null, so that nothing
    another writer put there (a forged startTime, a condition, an upgrade, progress) survives the patch. Lists
    (conditions) are replaced whole by a merge patch."""
    data = status.model_dump(mode="json", by_alias=True)
    data["conditions"] = [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in status.conditions]
    return {"status": data}


def transitions(old: RLJobStatus | None, new: RLJobStatus) -> list[Condition]:
    """Conditions whose status flipped (absent counts as Unknown): one Event each.

    Exported sends none (its Events are per export: operator/export_status.py). Absent → Unknown is not a
    transition; absent → False is one only for Valid (so an invalid RLJob
    gets exactly one IncompatibleSettings event), for a refused write (APIError, NamespaceTerminating
    on Progressing) and for a job that starts out waiting for a model cache another holds (ModelCacheHeld);
    absent → True always is.
    """
    before = {c.type: c.status for c in (old.conditions if old else [])}
    out = []
    for cond in new.conditions:
        if cond.type == T.EXPORTED.value:  # an Event per export and per failure instead (operator/export_status.py)
            continue
        prev = before.get(cond.type)
        if prev is None:
            reported = cond.type == T.VALID.value or (
                cond.type == T.PROGRESSING.value and cond.reason in (*_REFUSED_WRITE, Reason.MODEL_CACHE_HELD)
            )
            if cond.status is S.TRUE or (reported and cond.status is S.FALSE):
                out.append(cond)
        elif prev is not cond.status:
            out.append(cond)
    return out


def nonfinite_warning(job: RLJob, progress: Progress | None, seen: int | None) -> tuple[int | None, str | None]:
    """What the pass says about `progress.nonFiniteSteps` (the trainer's count of steps whose update had a
    non-finite loss or gradient and was not applied; `progress`: the status this pass writes): (the count to
    remember, a Warning event's message or None). `seen`: the count this operator saw last, None since it
    started; a first sight warns only when the latest reported step is the non-finite one, so an operator
    restart does not repeat old warnings."""
    count = progress.non_finite_steps if progress is not None else None
    if progress is None or count is None:
        return seen, None
    # Not seen since this operator started: news only if the latest step is the non-finite one.
    rose = count > seen if seen is not None else count > 0 and progress.last_non_finite_step == progress.step
    if not rose:
        return count, None
    last = progress.last_non_finite_step
    return count, (
        f"step {last}: an update had a non-finite loss or gradient and was not applied (no optimizer step; the "
        f"engines and checkpoints keep the last applied weights); {count} such step(s) so far, "
        f"spec.algorithm.maxNonFiniteSteps {job.spec.algorithm.max_non_finite_steps} in a row fail the job"
    )
