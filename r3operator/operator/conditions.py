"""Condition reasons (CamelCase machine tokens) and the metav1 merge rule."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from r3operator.api.enums import ConditionStatus, ConditionType
from r3operator.api.v1alpha1 import Condition


class Reason(StrEnum):
    # Valid
    SPEC_VALID = "SpecValid"
    INCOMPATIBLE_SETTINGS = "IncompatibleSettings"
    """A compatibility rule (api.rules) failed; the message lists rule ids and messages."""
    KUBERAY_MISSING = "KubeRayMissing"
    """The RayJob CRD (rayjobs.ray.io, v1) is not served: KubeRay is a prerequisite."""
    NAME_CONFLICT = "NameConflict"
    """A child's name is taken by an object this RLJob does not control; the message names it."""
    CLAIM_NOT_FOUND = "ClaimNotFound"
    """storage.existingClaim (or the pvc:// model claim) does not exist in the namespace."""
    KUEUE_MISSING = "KueueMissing"
    """spec.queueName is set but the Kueue Workload API (workloads.kueue.x-k8s.io/v1beta1) is not served."""
    REFERENCE_NOT_FOUND = "ReferenceNotFound"
    """A Secret, ConfigMap, claim, ServiceAccount or PriorityClass the spec names does not exist (Valid=False,
    nothing created), or, where Secrets cannot be read, the pods' CreateContainerConfigError says so."""
    PARSE_ERROR = "ParseError"
    FOREIGN_SERVICE_ACCOUNT = "ForeignServiceAccount"
    """A pod template names a ServiceAccount that is another's identity (another RLJob's, the operator's own)."""
    """The RLJob does not parse (a field the CRD schema let through); the message names the fields."""
    # Progressing / Ready: the operator cannot write
    NAMESPACE_TERMINATING = "NamespaceTerminating"
    """The namespace is being deleted: the API server refuses new objects in it."""
    API_ERROR = "APIError"
    """A write the API server keeps refusing; the message has the object, HTTP status and reason."""
    # Admitted (Kueue)
    NOT_QUEUED = "NotQueued"
    WAITING_FOR_ADMISSION = "WaitingForAdmission"
    """Queued: Kueue has not admitted the Workload (the message is Kueue's, e.g. insufficient quota)."""
    ADMITTED = "Admitted"
    EVICTED = "Evicted"
    """Kueue took the admission back (preemption, ...): the job is suspended and queued again."""
    QUOTA_RELEASED = "QuotaReleased"
    # Workloads
    NOT_CREATED = "NotCreated"
    PODS_NOT_READY = "PodsNotReady"
    UNSCHEDULABLE = "Unschedulable"
    UPDATING = "Updating"
    ALL_REPLICAS_READY = "AllReplicasReady"
    NO_REPLICAS = "NoReplicasRequested"
    TRAINER_RUNNING = "Running"
    TRAINER_STARTING = "TrainerStarting"
    TRAINER_FAILED = "TrainerFailed"
    TRAINER_SUCCEEDED = "TrainerSucceeded"
    INVALID_SPEC = "InvalidSpec"
    SUSPENDED = "Suspended"
    SUSPENDING = "Suspending"
    ACTIVE = "Active"
    JOB_FINISHED = "JobFinished"
    FETCHING_MODEL = "FetchingModel"
    """The model-fetch Job is filling the model cache; engines and trainer wait for it."""
    MODEL_FETCH_FAILED = "ModelFetchFailed"
    """The model-fetch Job failed (its backoffLimit is spent); its pod's log says why."""
    MODEL_CACHE_HELD = "ModelCacheHeld"
    """The kept ReadWriteOnce model cache is mounted by another live RLJob; this one starts when it is free."""
    MODEL_CACHE_TAKEN_OVER = "ModelCacheTakenOver"
    """Event: this RLJob now holds a kept ReadWriteOnce model cache another RLJob held before."""
    WORKLOADS_DELETED = "WorkloadsDeleted"
    NON_FINITE_STEP = "NonFiniteStep"
    """Warning event: status.progress.nonFiniteSteps rose (the trainer did not apply a non-finite update)."""
    # RoutingReplayActive
    REPLAY_DISABLED = "ReplayDisabled"
    TRAINER_SIDE_REPLAY = "TrainerSideReplay"
    ENGINES_NOT_READY = "EnginesNotReady"
    CANARY_PENDING = "CanaryPending"
    CANARY_PASSED = "CanaryPassed"
    CANARY_FAILED = "CanaryFailed"
    # ReplayHealthy (operator/replay_health.py)
    NO_STEP_YET = "NoStepYet"
    ROUTES_REPLAYED = "RoutesReplayed"
    ROUTE_CHECK_FAILED = "RouteCheckFailed"
    """A sample's routes failed a route check (docs/rules.md, "Silent failures"); the message names it."""
    REPLAYED_FRACTION_LOW = "ReplayedFractionLow"
    FALLBACK_HIGH = "FallbackHigh"
    NATURAL_AGREEMENT_LOW = "NaturalAgreementLow"
    EXTREME_TOKENS = "ExtremeTokens"
    # Exported (operator/export_status.py); False carries the trainer's reason, api.v1alpha1.ExportFailureReason
    NO_EXPORT_YET = "NoExportYet"
    EXPORT_WRITTEN = "ExportWritten"
    # UpgradeBlocked (False while no engine upgrade is blocked, with the upgrade's phase as reason)
    NO_UPGRADE = "NoUpgrade"
    UPGRADE_CANARY = "CanaryRunning"
    UPGRADE_ROLLING = "Rolling"
    UPGRADE_COMPLETE = "UpgradeComplete"
    UPGRADE_CANCELLED = "UpgradeCancelled"
    CANARY_UNSCHEDULABLE = "CanaryUnschedulable"
    """True: the canary's surge replica or pod cannot be scheduled; rolled back after startTimeoutSeconds."""
    # Progressing
    CHILDREN_UPDATED = "ChildrenUpdated"
    WAITING_FOR_WORKLOADS = "WaitingForWorkloads"
    TRAINING = "Training"
    # Terminal
    NOT_FINISHED = "NotFinished"
    # Ready
    READY = "Ready"
    # Events
    PROGRESS_REJECTED = "ProgressRejected"
    """Event: the trainer's progress report was refused (not JSON, a non-finite number, a value status.progress
    cannot hold); status.progress keeps the last report taken (operator/progress.py)."""
    PROGRESS_TRIMMED = "ProgressTrimmed"
    """Event: keys of the trainer's progress report that status.progress does not know were left out."""
    EXPORTED = "Exported"
    """Event: an export is complete (its manifest written); the message has the step and where."""
    EXPORT_FAILED = "ExportFailed"
    """Warning event: an export attempt failed (being retried, or given up); the message says why."""
    UPGRADE_FORCED = "UpgradeForced"
    """Event: the one-shot r3operator.io/upgrade=force annotation was used (or found nothing to force) and removed."""


@dataclass(frozen=True, slots=True)
class Desired:
    """A condition as computed this pass, before the metav1 merge with the previous one."""

    type: ConditionType
    status: ConditionStatus
    reason: str
    message: str = ""


def merge(old: Condition | None, new: Desired, *, generation: int | None, now: str) -> Condition:
    """lastTransitionTime changes only when the status flips (metav1)."""
    flipped = old is None or old.status is not new.status
    return Condition(
        type=new.type.value,
        status=new.status,
        reason=new.reason,
        message=new.message[:32768],
        last_transition_time=now if flipped or old is None else old.last_transition_time,
        observed_generation=generation,
    )
