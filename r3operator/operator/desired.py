"""desired(job) → the children an RLJob should have right now. Pure: same input, same output.

Level-based reconciliation compares this list with what exists. The output depends on the spec,
on the RLJob's own status (terminal conditions, completionTime) and on a few outside facts passed in
:class:`Facts` (is the PodMonitor CRD installed, what time is it) — never on the children themselves.

Lifecycle:
- running: PVC, ConfigMap, engine Service + StatefulSet, trainer ServiceAccount + RoleBinding, RayJob,
  PodMonitor;
- suspended: same children, engines at 0 replicas, RayJob ``suspend: true``;
- finished (Succeeded/Failed): engines at 0 replicas (free the GPUs now), the RayJob is kept;
- finished and ``ttlSecondsAfterFinished`` elapsed: only a Retain PVC remains desired; the
  reconciler deletes every other child it owns (the RLJob itself stays).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from r3operator.api.enums import RetainPolicy
from r3operator.api.v1alpha1 import RLJob
from r3operator.operator.builders.config import build_config_map
from r3operator.operator.builders.engine import build_engine_service, build_engine_statefulset
from r3operator.operator.builders.monitoring import build_pod_monitor, wants_pod_monitor
from r3operator.operator.builders.storage import build_routing_claim
from r3operator.operator.builders.trainer import build_ray_job
from r3operator.operator.builders.trainer_rbac import build_trainer_role_binding, build_trainer_service_account
from r3operator.operator.lifecycle import is_suspended, is_terminal, ttl_expired
from r3operator.settings import DEFAULT_TRAINER_CLUSTER_ROLE


@dataclass(frozen=True, slots=True)
class Facts:
    """Outside facts desired() depends on."""

    pod_monitor_crd: bool = True
    """monitoring.coreos.com/v1 PodMonitor is served (Prometheus Operator installed)."""
    now: dt.datetime | None = None
    """For ttlSecondsAfterFinished; None never expires anything."""
    trainer_cluster_role: str = DEFAULT_TRAINER_CLUSTER_ROLE
    """The ClusterRole the trainer's RoleBinding refers to (R3OPERATOR_TRAINER_CLUSTER_ROLE)."""


def desired(job: RLJob, facts: Facts | None = None) -> list[dict[str, Any]]:
    facts = facts or Facts()
    claim = build_routing_claim(job)
    if ttl_expired(job, facts.now):
        keep = claim is not None and job.spec.storage.retain_policy is RetainPolicy.RETAIN
        return [claim] if keep and claim is not None else []
    stopped = is_suspended(job) or is_terminal(job)
    children: list[dict[str, Any]] = []
    if claim is not None:
        children.append(claim)
    children.append(build_config_map(job))
    children.append(build_engine_service(job))
    children.append(build_engine_statefulset(job, replicas=0 if stopped else job.spec.inference.replicas))
    children.append(build_trainer_service_account(job))
    children.append(build_trainer_role_binding(job, facts.trainer_cluster_role))
    children.append(build_ray_job(job, suspend=is_suspended(job)))
    if facts.pod_monitor_crd and wants_pod_monitor(job):
        children.append(build_pod_monitor(job))
    return children
