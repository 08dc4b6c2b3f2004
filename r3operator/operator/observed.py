"""What one reconcile pass saw in the cluster (input of compute_status)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from r3operator.api.rules import Finding
from r3operator.api.v1alpha1 import UpgradeStatus
from r3operator.operator.admission import NOT_QUEUED, Admission
from r3operator.operator.canary import CanaryResult
from r3operator.operator.lifecycle import Finish
from r3operator.operator.progress import ProgressReport


@dataclass(frozen=True, slots=True)
class Observed:
    rule_errors: tuple[Finding, ...] = ()
    kuberay_installed: bool = True
    engine_set: dict[str, Any] | None = None
    """The engine StatefulSet, or LeaderWorkerSet, as read back (None when absent); a disaggregated job's decode
    engines."""
    prefill_set: dict[str, Any] | None = None
    """A disaggregated job's prefill StatefulSet as read back (None when absent or not disaggregated)."""
    ray_job: dict[str, Any] | None = None
    """The trainer RayJob as read back (None when absent)."""
    finish: Finish | None = None
    """The RayJob's terminal state (lifecycle.observed_finish)."""
    finish_recorded: bool = False
    """No RayJob, and this RLJob's status records an end: the RayJob was deleted after it finished."""
    canary: CanaryResult | None = None
    """The latest canary for the current engine spec hash (None when none ran)."""
    written: tuple[str, ...] = ()
    """``Kind/name`` of children created, updated or deleted in this pass."""
    unschedulable: dict[str, str] = field(default_factory=dict)
    """Role (``engine``, ``trainer``) -> the scheduler's reason for that role's pods that cannot be placed."""
    config_errors: dict[str, str] = field(default_factory=dict)
    """Role (``engine``, ``trainer``, ``model-fetch``) -> the kubelet's CreateContainerConfigError of that role's
    pods (a Secret or ConfigMap an env var names is missing or lacks the key)."""
    workloads_deleted: bool = False
    """ttlSecondsAfterFinished elapsed and the workloads are gone."""
    name_conflict: str | None = None
    """``Kind/name …`` of every child name held by an object this RLJob does not control, ``; ``-separated."""
    missing_claims: tuple[str, ...] = ()
    """PVCs the spec names (existingClaim, pvc:// model) that do not exist."""
    missing_references: tuple[str, ...] = ()
    """Secrets, ConfigMaps, claims, ServiceAccounts, PriorityClasses the pod templates name that do not exist."""
    borrowed_identities: tuple[str, ...] = ()
    """ServiceAccounts the pod templates name that are another's identity (operator/references.py)."""
    progress: ProgressReport | None = None
    """The trainer's progress report as this pass read it (None: not read, status.progress stays as it was)."""
    kueue_installed: bool = True
    """The Kueue Workload API is served (checked only for a job with spec.queueName)."""
    admission: Admission = NOT_QUEUED
    """Kueue's verdict on the job's Workload."""
    model_fetch: str | None = None
    """While the model cache is not filled: ``"running"``, or the failed model-fetch Job's message."""
    model_fetch_failed: bool = False
    model_cache_holder: str | None = None
    """Another live RLJob that holds this job's kept ReadWriteOnce model cache (operator/model_cache_hold.py)."""
    namespace_terminating: bool = False
    upgrade: UpgradeStatus | None = None
    """The engine image upgrade as operator/upgrade.py planned it this pass (None: never upgraded)."""
    upgrade_unschedulable: str | None = None
    """The upgrade's canary replica or pod cannot be scheduled (the scheduler's reason)."""
    api_error: str | None = None
    """A write the API server refused, reported once it persists (reconcile.py decides)."""
